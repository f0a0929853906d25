"""The trainer side of vLLM's CUDA IPC weight transfer: a server on the trainer's own GPU reads each bucket in place.

Two processes on one GPU cannot form an NCCL group (NCCL refuses two ranks on one device), so a server that
shares the trainer's GPU receives through CUDA IPC: the trainer fills a bucket (``bucket_stream.send_buckets``:
cast, FSDP2 gather, one flat byte buffer), shares the buffer's device memory as an IPC handle, and posts the
handle with the bucket's names, dtypes, shapes and byte sizes to ``/update_weights``. The server's IPC engine
opens the handle, copies the tensors out and loads them before it answers, so the buffer is free for the next
bucket when the request returns. Nothing leaves the GPU; the host carries only the handle.

The wire format is vLLM's packed IPC update (the server's weight-transfer configuration names backend ``ipc``):
``names``, ``dtype_names``, ``shapes``, ``tensor_sizes``, ``packed=true`` and ``ipc_handles_pickled``, the
base64 of a pickled ``{gpu uuid: rebuild arguments}``. The server unpickles it only with
``VLLM_ALLOW_INSECURE_SERIALIZATION=1``, which the launch sets for this backend: like every weight-transfer
route, it must be reachable by the trainer alone (docs/gpus.md, "Keeping the weight-transfer routes private").

``share`` is how a buffer becomes rebuild arguments; the default is PyTorch's CUDA IPC reduction. Tests pass a
stand-in that hands the buffer itself over, so the framing runs on the CPU (tests/test_ipc_sync.py).
"""

from __future__ import annotations

import base64
import pickle
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Self

import torch

from grpo_core.sync.send.bucket_stream import TransferStats, local_tensors, send_buckets, source_device
from grpo_core.sync.wire.buckets import Bucket, plan_buckets
from grpo_core.vllm_types import TrainerInitInfo, TrainerWeightTransferEngine, VLLMWeightSyncClient, WeightSource

IPC_BACKEND = "ipc"
"""The name of vLLM's CUDA IPC engine in the server's weight-transfer configuration."""

Share = Callable[[torch.Tensor], dict[str, tuple]]
"""A device buffer as ``{gpu uuid: the arguments that rebuild it in another process}``."""


def cuda_ipc_share(buffer: torch.Tensor) -> dict[str, tuple]:
    """PyTorch's CUDA IPC handle of ``buffer`` (a view keeps its offset), keyed by its GPU's UUID: the server
    finds its own device by UUID, whatever index each process's ``CUDA_VISIBLE_DEVICES`` gives it."""
    from torch.multiprocessing.reductions import reduce_tensor

    _, args = reduce_tensor(buffer)
    return {str(torch.cuda.get_device_properties(buffer.device).uuid): args}


def bucket_update(bucket: Bucket, handle: dict[str, tuple]) -> dict[str, Any]:
    """One bucket's ``/update_weights`` body: its tensors' metadata and the handle of its flat buffer."""
    return {
        "names": [slot.name for slot in bucket.slots],
        "dtype_names": [str(slot.dtype).removeprefix("torch.") for slot in bucket.slots],
        "shapes": [list(slot.shape) for slot in bucket.slots],
        "tensor_sizes": [slot.nbytes for slot in bucket.slots],
        "packed": True,
        "ipc_handles_pickled": base64.b64encode(pickle.dumps(handle)).decode("ascii"),
    }


@dataclass
class IPCTrainerInitInfo(TrainerInitInfo):
    """The IPC sender's set-up: no rendezvous, only the bucket size."""

    backend: ClassVar[str] = IPC_BACKEND
    bucket_bytes: int = 256 * 2**20


class IPCTrainerWeightTransferEngine(TrainerWeightTransferEngine[IPCTrainerInitInfo]):
    """Sends every bucket of the source through a CUDA IPC handle (see the module docstring)."""

    init_info_cls = IPCTrainerInitInfo

    def __init__(self, *, client: VLLMWeightSyncClient, source: WeightSource, is_sender: bool = True,
                 bucket_bytes: int, share: Share = cuda_ipc_share):
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.bucket_bytes = bucket_bytes
        self.share = share
        self.next_weight_version: str | None = None
        self.last_stats: TransferStats | None = None

    @classmethod
    def trainer_init(cls, init_info: IPCTrainerInitInfo, *, client: VLLMWeightSyncClient,
                     source: WeightSource | None = None, share: Share = cuda_ipc_share) -> Self:
        if source is None:
            raise ValueError("the IPC weight transfer needs a WeightSource")
        engine = cls(client=client, source=source, is_sender=init_info.is_sender,
                     bucket_bytes=init_info.bucket_bytes, share=share)
        if engine.is_sender:
            client.init_weight_transfer_engine({})  # the IPC engine takes no rendezvous
        return engine

    def send_weights(self) -> None:
        """One push: start, one ``/update_weights`` per bucket (each returns once the server loaded it), finish."""
        assert self.source is not None
        plan = plan_buckets(self.source.metadata(), self.bucket_bytes)
        device = source_device(self.source)
        if not self.is_sender:
            self.last_stats = send_buckets(plan, local_tensors(self.source), None, device)
            return
        self.client.start_weight_update()
        buckets = iter(plan)

        def post(buffer: torch.Tensor) -> None:
            bucket = next(buckets)
            if buffer.device.type == "cuda":
                # The server reads the buffer from another process: the gather that filled it must be done.
                torch.cuda.current_stream(buffer.device).synchronize()
            self.client.update_weights(bucket_update(bucket, self.share(buffer)))

        self.last_stats = send_buckets(plan, local_tensors(self.source), post, device)
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()
            torch.cuda.ipc_collect()  # release the handles the server has closed
        self.client.finish_weight_update(self.next_weight_version)

"""Full-weight sync through vLLM's weight-transfer protocol: pause → start → update → finish → resume.

The transport is picked by name: ``gloo`` (this package's backend, CPU servers) or ``nccl`` (vLLM's,
GPUs). The server is paused with ``mode=keep`` so in-flight rollouts are frozen rather than aborted,
and with ``clear_cache=true`` so neither their KV nor the prefix cache keeps values computed with
the old weights; tokens generated after the swap carry the new version in ``weight_versions``.
"""

from __future__ import annotations

import time

from vllm.distributed.weight_transfer.base import WeightSource
from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

from grpo_core.rollout.client import VLLMControlClient
from grpo_core.server import free_port
from grpo_core.sync.base import SyncStats, WeightSync
from grpo_core.sync.vllm_plugin import GLOO_BACKEND, register


def _trainer_init_info(backend: str, rank: int, address: str, port: int, world_size: int):
    if backend == GLOO_BACKEND:
        from grpo_core.sync.gloo_engine import GlooTrainerInitInfo

        return GlooTrainerInitInfo(rank=rank, master_address=address, master_port=port, world_size=world_size)
    if backend == "nccl":
        from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

        return NCCLTrainerInitInfo(rank=rank, master_address=address, master_port=port, world_size=world_size)
    raise ValueError(f"weight_transfer_backend={backend!r} is not supported; use 'gloo' (CPU) or 'nccl' (GPU)")


class ProtocolWeightSync(WeightSync):
    """Pushes every weight of ``source`` over the named backend; call on every trainer rank."""

    def __init__(
        self,
        control: VLLMControlClient | None,
        source: WeightSource,
        backend: str,
        rank: int = 0,
        master_address: str = "127.0.0.1",
        mode: str = "full",
    ):
        register()  # the trainer process needs the gloo trainer engine in vLLM's factory too
        if rank == 0 and control is None:
            raise ValueError("trainer rank 0 needs a VLLMControlClient to drive the weight transfer")
        self.control = control if rank == 0 else None
        self.backend = backend
        self.mode = mode
        self.source = source
        world_size = 1 + control.world_size() if self.control is not None else 0
        port = free_port(master_address) if self.control is not None else 0
        info = _trainer_init_info(backend, rank, master_address, port, world_size)
        self.engine = WeightTransferTrainerFactory.trainer_init(info, client=self.control, source=source)
        self.bytes_per_push = sum(m.dtype.itemsize * _numel(m.shape) for m in source.metadata())

    def push(self, version: int) -> SyncStats:
        start = time.perf_counter()
        if self.control is not None:
            self.control.pause(mode="keep", clear_cache=True)
        try:
            if hasattr(self.engine, "next_weight_version"):
                self.engine.next_weight_version = str(version)
            self.engine.send_weights()
            if self.control is not None and not hasattr(self.engine, "next_weight_version"):
                # vLLM's NCCL engine finishes without a version; set it before resuming.
                self.control.update_weight_version(str(version))
        finally:
            if self.control is not None:
                self.control.resume()
        return SyncStats(mode=self.mode, bytes=self.bytes_per_push, seconds=time.perf_counter() - start)

    def close(self) -> None:
        self.engine.shutdown()


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n

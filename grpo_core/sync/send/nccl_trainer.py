"""Trainer side of vLLM's dense NCCL weight transfer, sent in gathered buckets at link speed.

vLLM's own trainer engine materialises one parameter at a time (a ``full_tensor()`` gather per
parameter on FSDP2), then concatenates them into packed chunks. This engine keeps vLLM's wire format
and changes only how the bytes are produced:

* wire format, unchanged: the init handshake carries ``packed=True``, ``packed_buffer_size_bytes``
  (the bucket threshold) and ``packed_num_buffers`` (the receiver's own buffering); each sync's ``/update_weights`` carries
  ``{names, dtype_names, shapes}``; then one NCCL broadcast per bucket, cut as vLLM's packed receiver
  cuts (``buckets.plan_buckets``). An unmodified vLLM GPU server receives it with its own
  ``NCCLWeightTransferEngine``;
* production: each bucket is gathered with one collective across FSDP2 ranks, cast to the wire dtype
  on the GPU, and broadcast from a side stream while the next bucket is gathered
  (``bucket_stream.send_buckets``, driven by ``packed_send.send_packed``); nothing passes through
  host memory.

The communicator is vLLM's (``PyNcclCommunicator`` over a ``StatelessProcessGroup`` rendezvous),
the same object the server's workers build, opened by trainer rank 0 only; the other trainer ranks
take part in the gathers. ``send_weights`` is called on every trainer rank.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any, Self

from vllm.distributed.weight_transfer.nccl_common import NCCLWeightTransferInitInfo, worker_init_payload
from vllm.distributed.weight_transfer.nccl_common import trainer_init as open_trainer_endpoint
from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

from grpo_core.sync.send.bucket_stream import TransferStats
from grpo_core.sync.send.packed_send import send_packed
from grpo_core.vllm_types import TrainerWeightTransferEngine, VLLMWeightSyncClient, WeightSource


class BucketedNCCLTrainerEngine(TrainerWeightTransferEngine[NCCLTrainerInitInfo]):
    """Sends the source's weights over vLLM's packed NCCL protocol, bucket by bucket (see module doc)."""

    init_info_cls = NCCLTrainerInitInfo

    def __init__(
        self,
        *,
        client: VLLMWeightSyncClient,
        source: WeightSource,
        is_sender: bool = True,
        bucket_bytes: int,
    ):
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.bucket_bytes = bucket_bytes
        self.comm: Any = None
        self.next_weight_version: str | None = None
        self.last_stats: TransferStats | None = None

    @classmethod
    def trainer_init(
        cls,
        init_info: NCCLTrainerInitInfo,
        *,
        client: VLLMWeightSyncClient,
        source: WeightSource | None = None,
    ) -> Self:
        if source is None:
            raise ValueError("the NCCL weight transfer needs a WeightSource")
        if not init_info.packed:
            raise ValueError("the bucketed NCCL sender speaks vLLM's packed format only (packed=True)")
        engine = cls(
            client=client,
            source=source,
            is_sender=init_info.is_sender,
            bucket_bytes=init_info.packed_buffer_size_bytes,
        )
        if not engine.is_sender:
            return engine
        worker_info = NCCLWeightTransferInitInfo(
            master_address=init_info.master_address,
            master_port=init_info.master_port,
            rank_offset=1,  # the trainer's sender is rank 0; workers follow
            world_size=init_info.world_size,
            packed=True,
            packed_buffer_size_bytes=init_info.packed_buffer_size_bytes,
            packed_num_buffers=init_info.packed_num_buffers,
        )
        # The workers block inside /init_weight_transfer_engine until the rendezvous completes, so
        # the request runs on a thread while this process hosts the store as rank 0.
        with ThreadPoolExecutor(max_workers=1) as pool:
            pending = pool.submit(client.init_weight_transfer_engine, worker_init_payload(worker_info))
            engine.comm = open_trainer_endpoint(init_info)
            pending.result()
        if getattr(engine.comm, "disabled", False):
            # vLLM's communicator turns itself off when it cannot load NCCL; its broadcasts would
            # then return at once and send nothing.
            raise RuntimeError("vLLM's PyNcclCommunicator is disabled in the trainer: it could not load NCCL "
                               "(set VLLM_NCCL_SO_PATH to the libnccl.so.2 the server uses)")
        return engine

    def send_weights(self) -> None:
        assert self.source is not None
        self.last_stats = send_packed(
            self.client if self.is_sender else None,
            self.source,
            self.comm if self.is_sender else None,
            self.bucket_bytes,
            self.next_weight_version,
        )

    def shutdown(self) -> None:
        if self.comm is not None:
            self.comm.destroy()
            self.comm = None

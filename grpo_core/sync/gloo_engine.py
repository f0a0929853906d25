"""A gloo weight-transfer backend for vLLM's weight-transfer protocol (CPU servers and tests).

vLLM ships NCCL and CUDA-IPC transports only; both need a GPU. This module implements the same
four-phase protocol (init → start → update → finish) over a gloo process group, so a CPU vLLM
server receives weights exactly as a GPU server does over NCCL. Both halves live here:

* ``GlooWeightTransferEngine`` runs inside each vLLM worker (registered by ``vllm_plugin``);
* ``GlooTrainerWeightTransferEngine`` runs in the trainer; only trainer rank 0 talks to vLLM.

Wire format: one ``/update_weights`` call per sync carries every parameter's name, dtype and shape
plus ``group_sizes``, the number of parameters in each broadcast. The sender cuts the model into
buckets of about ``bucket_bytes`` (``buckets.plan_buckets``, the rule vLLM's packed NCCL format
uses), fills each bucket's flat uint8 buffer with one gather across FSDP2 ranks
(``bucket_stream.send_buckets``, shared with the NCCL sender) and broadcasts it; the receiver splits
it back. The sender's extra memory is one bucket plus the gather scratch.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from typing import Any, ClassVar, Self

import torch
from vllm.distributed.weight_transfer.base import (
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    VLLMWeightSyncClient,
    WeightSource,
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from grpo_core.sync.bucket_stream import TransferStats, local_tensors, send_buckets, source_device
from grpo_core.sync.buckets import DEFAULT_BUCKET_BYTES, plan_buckets, update_info

logger = logging.getLogger(__name__)

_RENDEZVOUS_TIMEOUT = timedelta(seconds=300)


@dataclass
class GlooWeightTransferInitInfo(WeightTransferInitInfo):
    """Worker-side rendezvous: the trainer (rank 0) hosts the TCP store."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    secret: str = ""  # presented at the trainer's gate (``gated_store``); fresh per rendezvous


@dataclass
class GlooWeightTransferUpdateInfo(WeightTransferUpdateInfo):
    """One sync: every parameter's metadata, and how many parameters each broadcast carries."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    group_sizes: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        n = len(self.names)
        if len(self.dtype_names) != n or len(self.shapes) != n:
            raise ValueError("update_info names, dtype_names and shapes must have equal lengths")
        if not self.group_sizes:
            self.group_sizes = [n]
        if sum(self.group_sizes) != n:
            raise ValueError(f"group_sizes sum to {sum(self.group_sizes)}, expected {n}")


def _nbytes(shape: list[int] | tuple[int, ...], dtype: torch.dtype) -> int:
    numel = 1
    for d in shape:
        numel *= int(d)
    return numel * dtype.itemsize


def _retie_word_embeddings(model: torch.nn.Module, model_config: Any) -> None:
    """Refresh a tied LM head from the embedding after a reload.

    Checkpoints of tied models carry no ``lm_head`` weight, so the reload never touches the head:
    layerwise reload gives the embedding a fresh parameter, and CPU builds also keep a prepacked
    copy of the head's weight for their GEMM. Without this the server would keep sampling through
    the old output embeddings.
    """
    text_config = getattr(model_config, "hf_text_config", None) or getattr(model_config, "hf_config", None)
    if not getattr(text_config, "tie_word_embeddings", False):
        return
    # A vision-language model keeps both inside its language model (``language_model.lm_head``),
    # not at the top: look them up by name wherever they are.
    modules = dict(model.named_modules())
    lm_head = next((m for n, m in modules.items() if n == "lm_head" or n.endswith(".lm_head")), None)
    embed = next((m for n, m in modules.items() if n.endswith("embed_tokens")), None)
    if lm_head is None or embed is None:
        return
    if lm_head.weight is not embed.weight:
        lm_head.weight = embed.weight
    quant_method = getattr(lm_head, "quant_method", None)
    if quant_method is not None:
        quant_method.process_weights_after_loading(lm_head)


class GlooWeightTransferEngine(
    WeightTransferEngine[GlooWeightTransferInitInfo, GlooWeightTransferUpdateInfo]
):
    """Receives checkpoint-format weights over gloo and loads them with layerwise reload."""

    init_info_cls = GlooWeightTransferInitInfo
    update_info_cls = GlooWeightTransferUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config: Any, vllm_config: Any, device: torch.device, model: torch.nn.Module):
        super().__init__(config, vllm_config, device, model)
        self.group: Any = None
        self.dialer: Any = None

    def init_transfer_engine(self, init_info: GlooWeightTransferInitInfo) -> None:
        # Same rank formula as vLLM's NCCL backend, so multi-worker servers line up.
        from grpo_core.sync.address import local_address_towards
        from grpo_core.sync.gated_store import StoreDialer, gloo_group, member_store

        pc = self.parallel_config
        worker_rank = pc.data_parallel_index * pc.world_size + pc.rank
        if not init_info.secret:
            raise ValueError("init_info carries no rendezvous secret; this plugin joins only a gated rendezvous")
        # The trainer's store admits only connections that present the run's secret.
        self.dialer = StoreDialer(init_info.master_address, init_info.master_port, init_info.secret)
        store = member_store(self.dialer, init_info.world_size, _RENDEZVOUS_TIMEOUT)
        self.group = gloo_group(store, worker_rank + init_info.rank_offset, init_info.world_size, _RENDEZVOUS_TIMEOUT,
                                bind_address=local_address_towards(init_info.master_address))

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)
        _retie_word_embeddings(self.model, self.model_config)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # The base class ends with torch.accelerator.synchronize(), which raises on CPU-only
        # torch; gloo broadcasts are synchronous once .wait() returns, so nothing is pending.
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: GlooWeightTransferUpdateInfo) -> None:
        if self.group is None:
            raise RuntimeError("gloo weight transfer is not initialised: call /init_weight_transfer_engine first")
        dtypes = [getattr(torch, name) for name in update_info.dtype_names]
        start = 0
        for size in update_info.group_sizes:
            names = update_info.names[start : start + size]
            shapes = update_info.shapes[start : start + size]
            group_dtypes = dtypes[start : start + size]
            start += size
            nbytes = [_nbytes(s, d) for s, d in zip(shapes, group_dtypes)]
            buffer = torch.empty(sum(nbytes), dtype=torch.uint8)
            self.group.broadcast(buffer, 0).wait()
            weights = [
                (name, chunk.view(dtype).view(shape).clone())
                for name, chunk, dtype, shape in zip(names, buffer.split(nbytes), group_dtypes, shapes)
            ]
            self.model.load_weights(weights)

    def shutdown(self) -> None:
        if self.group is not None:
            self.group.shutdown()
            self.group = None
        if self.dialer is not None:
            self.dialer.close()
            self.dialer = None


@dataclass
class GlooTrainerInitInfo(TrainerInitInfo):
    """Trainer-side rendezvous parameters; ``world_size`` = 1 + number of vLLM workers."""

    backend: ClassVar[str] = "gloo"
    master_address: str = "127.0.0.1"
    master_port: int = 0
    world_size: int = 2
    weight_version: str | None = None
    bucket_bytes: int = DEFAULT_BUCKET_BYTES


class GlooTrainerWeightTransferEngine(TrainerWeightTransferEngine[GlooTrainerInitInfo]):
    """Sends the trainer's weights group by group; every trainer rank iterates the source
    (FSDP gathers are collectives), only rank 0 broadcasts and talks to vLLM."""

    init_info_cls = GlooTrainerInitInfo

    def __init__(
        self,
        *,
        client: VLLMWeightSyncClient,
        source: WeightSource,
        is_sender: bool = True,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    ):
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.group: Any = None
        self.gate: Any = None  # the rendezvous listener that checks the secret (rank 0)
        self.next_weight_version: str | None = None
        self.bucket_bytes = bucket_bytes
        self.bytes_sent = 0
        self.last_stats: TransferStats | None = None

    @classmethod
    def trainer_init(
        cls,
        init_info: GlooTrainerInitInfo,
        *,
        client: VLLMWeightSyncClient,
        source: WeightSource | None = None,
    ) -> Self:
        if source is None:
            raise ValueError("gloo weight transfer needs a WeightSource")
        engine = cls(client=client, source=source, is_sender=init_info.is_sender, bucket_bytes=init_info.bucket_bytes)
        if not engine.is_sender:
            return engine
        from grpo_core.sync.gated_store import StoreGate, gloo_group, new_secret, trainer_store

        secret = new_secret()
        worker_info = GlooWeightTransferInitInfo(
            master_address=init_info.master_address,
            master_port=init_info.master_port,
            rank_offset=1,
            world_size=init_info.world_size,
            secret=secret,
        )
        # This process hosts the store on sockets it binds itself (a tcp:// rendezvous inside a
        # torchrun rank would only connect as a client and wait forever): the store on loopback, and
        # on the chosen interface a gate that admits only connections presenting the secret.
        engine.gate = StoreGate(init_info.master_address, init_info.master_port, secret)
        # The workers block in init until the rendezvous completes, so the HTTP call runs on a
        # thread while this process hosts the store as rank 0.
        with ThreadPoolExecutor(max_workers=1) as pool:
            pending = pool.submit(client.init_weight_transfer_engine, asdict(worker_info))
            store = trainer_store(engine.gate, init_info.world_size, _RENDEZVOUS_TIMEOUT)
            engine.group = gloo_group(store, 0, init_info.world_size, _RENDEZVOUS_TIMEOUT,
                                      bind_address=init_info.master_address)
            pending.result()
        return engine

    def send_weights(self) -> None:
        assert self.source is not None
        meta = self.source.metadata()
        plan = plan_buckets(meta, self.bucket_bytes)
        device = source_device(self.source)
        if not self.is_sender:
            self.last_stats = send_buckets(plan, local_tensors(self.source), None, device)
            return
        info = update_info(meta) | {"group_sizes": [len(b.slots) for b in plan]}
        self.client.start_weight_update()
        with ThreadPoolExecutor(max_workers=1) as pool:
            # /update_weights blocks on the server until every broadcast below has landed.
            pending = pool.submit(self.client.update_weights, info)
            try:
                self.last_stats = send_buckets(plan, local_tensors(self.source), self._broadcast, device)
            except BaseException:
                pending.cancel()
                raise
            pending.result()
        self.bytes_sent = self.last_stats.bytes
        self.client.finish_weight_update(self.next_weight_version)

    def _broadcast(self, buffer: torch.Tensor) -> None:
        # gloo moves host memory; a trainer on CUDA with the gloo backend copies each bucket down.
        self.group.broadcast(buffer if buffer.device.type == "cpu" else buffer.cpu(), 0).wait()

    def shutdown(self) -> None:
        if self.group is not None:
            self.group.shutdown()
            self.group = None
        if self.gate is not None:
            self.gate.close()
            self.gate = None

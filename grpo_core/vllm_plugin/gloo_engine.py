"""A gloo weight-transfer backend for vLLM's weight-transfer protocol: the receiving side (vLLM workers).

vLLM ships NCCL and CUDA-IPC transports only; both need a GPU. This module implements the same
four-phase protocol (init → start → update → finish) over a gloo process group, so a CPU vLLM
server receives weights exactly as a GPU server does over NCCL:

* ``GlooWeightTransferEngine`` runs inside each vLLM worker (registered by ``entry_point``);
* ``grpo_core.sync.send.gloo_trainer.GlooTrainerWeightTransferEngine`` runs in the trainer; only trainer rank 0 talks to vLLM.

Wire format: one ``/update_weights`` call per sync carries every parameter's name, dtype and shape
plus ``group_sizes``, the number of parameters in each broadcast. The sender cuts the model into
buckets of about ``bucket_bytes`` (``buckets.plan_buckets``, the rule vLLM's packed NCCL format
uses) and broadcasts each: its flat bytes (``encoding="dense"``), or a header and the changed
elements against the previous push (``encoding="delta"``, ``delta.encode_bucket``), which the
receiver applies to the weights it kept (``receiver.HeldWeights``).

The same engine also applies weight patches from storage (``update_info['transport'] == 'storage'``,
``receiver.apply_storage_update``), for a server that cannot join the trainer's group: no
rendezvous is needed for those.
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import WeightTransferEngine

from grpo_core.sync.wire.delta import apply_bucket, payload_nbytes
from grpo_core.sync.wire.gloo_messages import (
    RENDEZVOUS_TIMEOUT,
    STORAGE_TRANSPORT,
    GlooWeightTransferInitInfo,
    GlooWeightTransferUpdateInfo,
)
from grpo_core.vllm_plugin.expert_repack import repack_cpu_experts
from grpo_core.vllm_plugin.receiver import HeldWeights, apply_storage_update

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
        self.held = HeldWeights()  # what deltas and storage patches apply to (empty until kept)

    @property
    def worker_rank(self) -> int:
        # Same rank formula as vLLM's NCCL backend, so multi-worker servers line up.
        pc = self.parallel_config
        return pc.data_parallel_index * pc.world_size + pc.rank

    def init_transfer_engine(self, init_info: GlooWeightTransferInitInfo) -> None:
        from grpo_core.sync.wire.address import local_address_towards
        from grpo_core.sync.wire.gated_store import StoreDialer, gloo_group, member_store

        if not init_info.secret:
            raise ValueError("init_info carries no rendezvous secret; this plugin joins only a gated rendezvous")
        self._close_group()  # a new session replaces one a failed push left behind
        # The trainer's store admits only connections that present the run's secret.
        self.dialer = StoreDialer(init_info.master_address, init_info.master_port, init_info.secret)
        store = member_store(self.dialer, init_info.world_size, RENDEZVOUS_TIMEOUT)
        self.group = gloo_group(store, self.worker_rank + init_info.rank_offset, init_info.world_size,
                                RENDEZVOUS_TIMEOUT, bind_address=local_address_towards(init_info.master_address))

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)
        _retie_word_embeddings(self.model, self.model_config)
        if self.device.type == "cpu":
            repack_cpu_experts(self.model)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # The base class ends with torch.accelerator.synchronize(), which raises on CPU-only
        # torch; gloo broadcasts are synchronous once .wait() returns, so nothing is pending.
        if update_info.get("transport") == STORAGE_TRANSPORT:
            apply_storage_update(self.held, update_info, self.model.load_weights, self.worker_rank)
            return
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: GlooWeightTransferUpdateInfo) -> None:
        if self.group is None:
            raise RuntimeError("gloo weight transfer is not initialised: call /init_weight_transfer_engine first")
        delta = update_info.encoding == "delta"
        if delta:
            self.held.require(update_info.base_version, "this delta push")
        elif not update_info.keep:
            self.held.clear()  # nothing to apply deltas to follows, so keep no copy
        receive = _Receiver(self.group, update_info.deadline_s)
        try:
            for bucket in update_info.plan():
                if delta:
                    header = receive(torch.empty(len(bucket.slots), dtype=torch.int64))
                    payload = receive(torch.empty(payload_nbytes(bucket, header), dtype=torch.uint8))
                    apply_bucket(bucket, header, payload, self.held.tensors)
                    self.model.load_weights(self.held.bucket_tensors(bucket))
                    continue
                buffer = receive(torch.empty(bucket.nbytes, dtype=torch.uint8))
                weights = [(s.name, buffer[s.offset : s.offset + s.nbytes].view(s.dtype).view(s.shape).clone())
                           for s in bucket.slots]
                if update_info.keep:
                    self.held.tensors.update((name, tensor.reshape(-1).clone()) for name, tensor in weights)
                self.model.load_weights(weights)
        except BaseException:
            self.held.forget()  # a partly received update is no version a delta could follow
            raise
        self.held.version = update_info.version if (delta or update_info.keep) else None

    @staticmethod
    def trainer_send_weights(*args: Any, **kwargs: Any) -> None:
        """The 0.25 line's engine base declares the trainer's send on the receiving engine (abstract there, absent on
        0.32); this engine only receives. The trainer sends through ``grpo_core.sync.send.gloo_trainer``."""
        raise NotImplementedError("the gloo engine receives only; the trainer sends through "
                                  "grpo_core.sync.send.gloo_trainer")

    def _close_group(self) -> None:
        if self.group is not None:
            self.group.shutdown()
            self.group = None
        if self.dialer is not None:
            self.dialer.close()
            self.dialer = None

    def shutdown(self) -> None:
        self._close_group()


class _Receiver:
    """Receives the broadcasts of one update, all within ``deadline_s`` of the first (None: the group's timeout)."""

    def __init__(self, group: Any, deadline_s: float | None):
        self.group = group
        self.ends = None if deadline_s is None else time.monotonic() + deadline_s

    def __call__(self, buffer: torch.Tensor) -> torch.Tensor:
        work = self.group.broadcast(buffer, 0)
        if self.ends is None:
            work.wait()
        else:
            # A trainer that stopped or died mid-push must not hold this worker for the group's timeout.
            work.wait(timedelta(seconds=max(0.001, self.ends - time.monotonic())))
        return buffer

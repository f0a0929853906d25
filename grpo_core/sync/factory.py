"""Pick the weight sync for a run: full weights over vLLM's protocol, or for LoRA merged or adapter-only.

The LoRA mode is chosen once, at start-up, from ``lora_sync_mode`` and what the server offers
(``vllm_server.checks.probe_lora_serving``); it never changes during the run, so every sample of a run
is produced the same way.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from grpo_core.config import SyncSettings
from grpo_core.models.lora import base_named_tensors, max_rank, merged_named_tensors
from grpo_core.sync.base import WeightSync
from grpo_core.sync.lora import LoraAdapterSync
from grpo_core.sync.protocol import ProtocolWeightSync
from grpo_core.sync.source import ModelWeightSource
from grpo_core.sync.storage_sync import PatchPublisher, StoragePatchSync
from grpo_core.sync.timing.deadline import DeadlineConfig
from grpo_core.sync.wire.address import parse_port_range
from grpo_core.vllm_server.checks import (
    LoraServing,
    ServerConfigError,
    check_lora_limits,
    probe_lora_serving,
)

log = logging.getLogger(__name__)

SYNC_MODE_CODES = {"full": 0.0, "merged": 1.0, "adapter": 2.0}
"""``sync/mode`` is logged as a number (trackers take floats); the run also gets a ``sync/mode`` tag."""


def resolve_lora_mode(requested: str, serving: LoraServing) -> str:
    """``merged`` or ``adapter`` for a run that asked for ``requested`` (``auto``/``merged``/``adapter``)."""
    if requested == "merged":
        return "merged"
    if requested == "adapter" or serving.can_serve_adapters:
        return "adapter"
    return "merged"


@dataclass
class SyncSetup:
    """What the weight sync needs to know about a run (built by the trainer; nothing else of it)."""

    config: SyncSettings  # the run's sync settings (``AsyncGRPOConfig.sync``), never the whole config
    model: Any  # the (sharded) policy
    rank: int
    backend: str  # resolved weight_transfer_backend
    wire_dtype: Any  # torch dtype the weights travel in (None: their own)
    model_path: str | None  # the base model's folder or hub id (names adapters)
    peft_config: Any = None  # LoRA: adapter sync or merged sync; None: full weights
    publisher: Any = None  # weight_sync_transport="storage": the run's PatchPublisher (outlives each sync)
    # LoRA: the server command adapter sync needs, shown when the server cannot serve adapters. A value written by
    # the orchestrator (``vllm_server.checks.lora_command``): the command spells fields of every part of the run.
    lora_command: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.config, SyncSettings):
            raise TypeError(f"SyncSetup.config takes the run's sync settings (config.sync), not a "
                            f"{type(self.config).__name__}: the weight sync reads only its own part")
        if self.peft_config is not None and self.lora_command is None:
            raise ValueError("a LoRA run's SyncSetup needs lora_command, the server command adapter sync needs "
                             "(vllm_server.checks.lora_command)")


def deadline_config(config: SyncSettings) -> DeadlineConfig:
    """The push deadlines a run's sync settings ask for (``weight_sync_deadline_*``)."""
    return DeadlineConfig(floor_s=config.weight_sync_deadline_floor_s, slack=config.weight_sync_deadline_slack,
                          assumed_mb_s=config.weight_sync_assumed_mb_s)


def make_patch_publisher(setup: SyncSetup) -> Any:
    """The writer of a storage-fed run's weight patches (one per trainer, kept across syncs)."""
    config = setup.config
    url = config.weight_patch_url or f"{config.output_dir.rstrip('/')}/weight_patches"
    return PatchPublisher(ModelWeightSource(setup.model, wire_dtype=setup.wire_dtype, named_tensors=_named(setup)),
                          url, setup.rank, bucket_bytes=config.weight_sync_bucket_mb << 20,
                          keyframe_every=config.weight_patch_keyframe_every)


def _named(setup: SyncSetup) -> Any:
    """LoRA: the merged weights (storage and group pushes of a LoRA run send them); else the parameters."""
    if setup.peft_config is None:
        return None
    return functools.partial(merged_named_tensors, setup.model)


def make_weight_sync(setup: SyncSetup, control: Any) -> WeightSync:
    """The ``WeightSync`` for ``setup`` and the server behind ``control`` (None off rank 0)."""
    config, model = setup.config, setup.model
    if config.weight_sync_transport == "storage":
        if setup.peft_config is not None and config.lora_sync_mode == "adapter":
            raise ValueError("weight_sync_transport='storage' pushes whole (merged) weights; set lora_sync_mode='merged'")
        if setup.publisher is None:
            raise ValueError("weight_sync_transport='storage' needs SyncSetup.publisher (make_patch_publisher)")
        return StoragePatchSync(control, setup.publisher, setup.rank, deadline_config(config),
                                mode="full" if setup.peft_config is None else "merged")
    ports = config.weight_transfer_port_range
    transport = dict(
        backend=setup.backend,
        rank=setup.rank,
        master_address=config.weight_transfer_address,
        port_range=parse_port_range(ports) if ports else None,
        bucket_bytes=config.weight_sync_bucket_mb << 20,
        encoding=config.weight_sync_encoding,
        deadline=deadline_config(config),
    )
    if setup.peft_config is None:
        return ProtocolWeightSync(control, ModelWeightSource(model, wire_dtype=setup.wire_dtype), **transport)

    mode = _agree_on_mode(_choose_lora_mode(setup, control, max_rank(setup.peft_config)) if control is not None else None)
    log.info("LoRA weight sync: %s", mode)
    if mode == "merged":
        merged = ModelWeightSource(model, wire_dtype=setup.wire_dtype, named_tensors=functools.partial(merged_named_tensors, model))
        return ProtocolWeightSync(control, merged, mode="merged", **transport)
    base = ModelWeightSource(model, wire_dtype=setup.wire_dtype, named_tensors=functools.partial(base_named_tensors, model))
    return LoraAdapterSync(
        control,
        model,
        output_dir=config.output_dir,
        max_staleness=config.max_staleness,
        base_sync=ProtocolWeightSync(control, base, mode="adapter", **(transport | {"encoding": "dense"})),
        base_model_name_or_path=setup.model_path,
        rank=setup.rank,
        # A request can run until its client gives up; its adapter folder must outlive it.
        delete_grace_s=config.request_timeout,
    )


def _choose_lora_mode(setup: SyncSetup, control: Any, adapter_rank: int) -> str:
    config = setup.config
    if len(config.server_urls()) > 1:
        return "merged"  # adapters are registered by name on one server; a fleet gets the merged weights
    serving = probe_lora_serving(control)
    mode = resolve_lora_mode(config.lora_sync_mode, serving)
    if mode == "adapter":
        check_lora_limits(serving, config.max_staleness, adapter_rank, setup.lora_command)
    elif config.lora_sync_mode == "auto":
        log.info(
            "the server cannot load LoRA adapters at run time, so every sync pushes merged weights; "
            "for adapter-only sync restart it with:\n%s",
            setup.lora_command,
        )
    return mode


def _agree_on_mode(mode: str | None) -> str:
    """Rank 0 probed the server; every other rank takes its answer (all ranks must sync alike)."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        box = [mode]
        dist.broadcast_object_list(box, src=0)
        mode = box[0]
    if mode is None:
        raise ServerConfigError("no trainer rank could probe the server's LoRA settings (rank 0 has no control client)")
    return mode

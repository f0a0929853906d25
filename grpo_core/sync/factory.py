"""Pick the weight sync for a run: full weights over vLLM's protocol, or for LoRA merged or adapter-only.

The LoRA mode is chosen once, at start-up, from ``lora_sync_mode`` and what the server offers
(``server_checks.probe_lora_serving``); it never changes during the run, so every sample of a run
is produced the same way.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

from grpo_core.server_checks import LoraServing, ServerConfigError, check_lora_limits, lora_command, probe_lora_serving
from grpo_core.sync.base import WeightSync

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


def wire_dtype(args: Any) -> Any:
    """The dtype weights travel in: bf16 when training in bf16 (the policy the trainer computes with,
    half the bytes of the fp32 master weights), else the weights' own dtype (None)."""
    import torch

    return torch.bfloat16 if args.bf16 else None


def make_weight_sync(trainer: Any, control: Any) -> WeightSync:
    """The ``WeightSync`` for ``trainer``'s model and the server behind ``control`` (None off rank 0)."""
    from grpo_core.sync.protocol import ProtocolWeightSync
    from grpo_core.sync.source import ModelWeightSource

    args, model, rank = trainer.args, trainer.model, trainer.dist.rank
    dtype = wire_dtype(args)
    peft_config = getattr(trainer, "peft_config", None)
    if peft_config is None:
        return ProtocolWeightSync(control, ModelWeightSource(model, wire_dtype=dtype), backend=args.weight_transfer_backend, rank=rank)

    from grpo_core.models.lora import base_named_tensors, max_rank, merged_named_tensors
    from grpo_core.sync.lora import LoraAdapterSync

    mode = _agree_on_mode(_choose_lora_mode(trainer, control, max_rank(peft_config)) if control is not None else None)
    log.info("LoRA weight sync: %s", mode)
    if mode == "merged":
        merged = ModelWeightSource(model, wire_dtype=dtype, named_tensors=functools.partial(merged_named_tensors, model))
        return ProtocolWeightSync(control, merged, backend=args.weight_transfer_backend, rank=rank, mode="merged")
    base = ModelWeightSource(model, wire_dtype=dtype, named_tensors=functools.partial(base_named_tensors, model))
    return LoraAdapterSync(
        control,
        model,
        output_dir=args.output_dir,
        max_staleness=args.max_staleness,
        base_sync=ProtocolWeightSync(control, base, backend=args.weight_transfer_backend, rank=rank, mode="adapter"),
        base_model_name_or_path=trainer.model_path,
        rank=rank,
        # A request can run until its client gives up; its adapter folder must outlive it.
        delete_grace_s=args.request_timeout,
    )


def _choose_lora_mode(trainer: Any, control: Any, adapter_rank: int) -> str:
    args = trainer.args
    model_name = trainer.model_path or "<model>"
    serving = probe_lora_serving(control.base_url, timeout=args.request_timeout)
    mode = resolve_lora_mode(args.lora_sync_mode, serving)
    if mode == "adapter":
        check_lora_limits(serving, args, adapter_rank, model_name)
    elif args.lora_sync_mode == "auto":
        log.info(
            "the server cannot load LoRA adapters at run time, so every sync pushes merged weights; "
            "for adapter-only sync restart it with:\n%s",
            lora_command(args, adapter_rank, model_name),
        )
    return mode


def _agree_on_mode(mode: str | None) -> str:
    """Rank 0 probed the server; every other rank takes its answer (all ranks must sync alike)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        box = [mode]
        dist.broadcast_object_list(box, src=0)
        mode = box[0]
    if mode is None:
        raise ServerConfigError("no trainer rank could probe the server's LoRA settings (rank 0 has no control client)")
    return mode

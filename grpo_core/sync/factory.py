"""Pick the weight sync for a run: full weights over vLLM's protocol (LoRA: merged or adapter-only)."""

from __future__ import annotations

from typing import Any

from grpo_core.sync.base import WeightSync


def make_weight_sync(trainer: Any, control: Any) -> WeightSync:
    """The ``WeightSync`` for ``trainer``'s model and the server behind ``control`` (None off rank 0)."""
    from grpo_core.sync.protocol import ProtocolWeightSync
    from grpo_core.sync.source import ModelWeightSource

    return ProtocolWeightSync(
        control,
        ModelWeightSource(trainer.model),
        backend=trainer.args.weight_transfer_backend,
        rank=trainer.dist.rank,
    )

"""Asynchronous GRPO: a vLLM rollout worker, a tree-packed trainer and weight sync through vLLM's protocol.

The public API follows TRL's asynchronous GRPO trainer. Imports are lazy so that importing the
package (as vLLM does for the weight-transfer plugin) stays cheap.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__all__ = ["AsyncGRPOConfig", "AsyncGRPOTrainer", "AsyncRolloutLoop", "Rollout", "RolloutGroup", "RolloutSample", "TurnRecord"]

_LOCATIONS = {
    "AsyncGRPOConfig": "grpo_core.config",
    "AsyncGRPOTrainer": "grpo_core.training.trainer",
    "AsyncRolloutLoop": "grpo_core.rollout.stages",
    "Rollout": "grpo_core.rollout.types",
    "RolloutGroup": "grpo_core.rollout.types",
    "RolloutSample": "grpo_core.rollout.types",
    "TurnRecord": "grpo_core.rollout.types",
}

if TYPE_CHECKING:
    from grpo_core.config import AsyncGRPOConfig
    from grpo_core.rollout.stages import AsyncRolloutLoop
    from grpo_core.rollout.types import Rollout, RolloutGroup, RolloutSample, TurnRecord
    from grpo_core.training.trainer import AsyncGRPOTrainer


def __getattr__(name: str) -> Any:
    if name in _LOCATIONS:
        import importlib

        return getattr(importlib.import_module(_LOCATIONS[name]), name)
    raise AttributeError(f"module 'grpo_core' has no attribute {name!r}")

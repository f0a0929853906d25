"""A curriculum: stop sampling prompts the policy already solves, as a custom ``AsyncRolloutLoop``.

Used by ``examples/curriculum.yaml`` as ``loop_cls: examples.curriculum:CurriculumRolloutLoop``. From
Python the same loop is set on a trainer subclass (``class MyTrainer(AsyncGRPOTrainer): loop_cls = ...``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from grpo_core import AsyncRolloutLoop
from grpo_core.rollout.types import RolloutGroup


class CurriculumRolloutLoop(AsyncRolloutLoop):
    """Skips a prompt for the rest of the epoch once most of its last group scored."""

    pass_rate_cap = 0.75
    """Skip a prompt while this share (or more) of its last group's rollouts scored above zero."""

    async def setup(self) -> None:
        self.pass_rates: dict[int, float] = {}

    def filter_prompt(self, row_index: int, row: dict[str, Any], epoch: int) -> bool:
        return self.pass_rates.get(row_index, 0.0) < self.pass_rate_cap

    def compute_advantages(self, group: RolloutGroup) -> np.ndarray:
        scored = group.rewards[~np.isnan(group.rewards)]
        if scored.size:
            self.pass_rates[group.row_index] = float(np.mean(scored > 0))
        return super().compute_advantages(group)

"""A curriculum written as a loop subclass, run through the trainer against the real CPU vLLM server.

The loop remembers each prompt's last pass rate and the epoch it was measured in (``setup`` makes the
table inside the rollout process, ``compute_advantages`` fills it), and ``filter_prompt`` skips a prompt
for one epoch after a group of it scored at ``pass_rate_cap`` or better, then tries it again. A skip that
lasted for good would be unsound here: a skipped prompt never gets a new pass rate, so the solved set only
grows, and once it holds every prompt an epoch has nothing to train (the scheduler raises). With the
worker racing ahead through skipped positions that happened within 14 steps. The trainer subclass only sets ``loop_cls``; everything is module-level
because the loop is pickled into the spawned rollout worker.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

from grpo_core.config import AsyncGRPOConfig
from grpo_core.rewards import accuracy_reward
from grpo_core.rollout.stages import AsyncRolloutLoop
from grpo_core.rollout.types import GroupReport, RolloutGroup
from grpo_core.tiny import arithmetic_dataset
from grpo_core.training.collector import StepBatch
from grpo_core.training.trainer import AsyncGRPOTrainer

pytestmark = pytest.mark.integration


@dataclass
class CurriculumConfig(AsyncGRPOConfig):
    pass_rate_cap: float = 0.75
    """Skip a prompt for one epoch after the share of its group's rollouts that scored > 0 reached this."""


class PassRateLoop(AsyncRolloutLoop):
    async def setup(self) -> None:
        self.pass_rates: dict[int, tuple[int, float]] = {}  # row -> (epoch measured, pass rate)

    def filter_prompt(self, row_index: int, row: dict[str, Any], epoch: int) -> bool:
        measured_epoch, rate = self.pass_rates.get(row_index, (-1, 0.0))
        return not (measured_epoch == epoch - 1 and rate >= self.config.pass_rate_cap)

    def compute_advantages(self, group: RolloutGroup) -> np.ndarray:
        scored = group.rewards[~np.isnan(group.rewards)]
        if scored.size:
            self.pass_rates[group.row_index] = (group.epoch, float(np.mean(scored > 0)))
        return super().compute_advantages(group)


class CurriculumTrainer(AsyncGRPOTrainer):
    loop_cls = PassRateLoop

    def training_step(self, batch: StepBatch) -> dict[str, float]:
        # Keep what reached the trainer, to check the filter decisions against the rewards.
        self.__dict__.setdefault("seen_reports", []).extend(batch.reports)
        return super().training_step(batch)


def pass_rate(report: GroupReport) -> float:
    scored = report.rewards[~np.isnan(report.rewards)]
    return float(np.mean(scored > 0)) if scored.size else 0.0


def test_curriculum_skips_solved_prompts(vllm_server, tiny_model_path, tmp_path) -> None:  # noqa: ANN001
    num_prompts = 16
    data = arithmetic_dataset(num_train=num_prompts, num_eval=4)["train"]
    config = CurriculumConfig(
        output_dir=str(tmp_path / "run"), vllm_server_base_url=vllm_server.base_url, report_to="none",
        max_steps=14, learning_rate=1e-5, num_generations=4, per_device_train_batch_size=8,
        max_completion_length=24, save_strategy="no", num_sampler_logprobs=0, max_concurrent_rollouts=8,
        # A short queue keeps the worker close to the trainer: without it the worker would race through
        # many epochs, and a curriculum that keeps skipping eventually rejects a whole epoch (an error).
        queue_maxsize=16, pass_rate_cap=0.5,
    )
    trainer = CurriculumTrainer(tiny_model_path, [accuracy_reward], train_dataset=data, args=config)
    history = trainer.train()

    assert len(history) == config.max_steps
    reports: list[GroupReport] = trainer.seen_reports
    generated = [r for r in reports if not r.filtered]
    filtered = [r for r in reports if r.filtered]
    print(f"curriculum: {len(reports)} prompt positions reached the trainer, {len(filtered)} skipped")
    assert sum(h["rollout/groups_filtered"] for h in history) == len(filtered)
    assert filtered, f"no prompt was skipped over {len(reports)} positions; pass rates seen: " + str(
        sorted({(r.row_index, pass_rate(r)) for r in generated})
    )
    # Every skip is justified: the previous epoch's group of that prompt passed the cap.
    for skip in filtered:
        previous = [pass_rate(r) for r in generated if r.row_index == skip.row_index and r.epoch == skip.epoch - 1]
        assert previous and max(previous) >= config.pass_rate_cap, (skip.row_index, skip.epoch, previous)
    # A skip lasts one epoch: no prompt is skipped in two epochs in a row.
    skipped_at = {(r.row_index, r.epoch) for r in filtered}
    assert not any((row, epoch - 1) in skipped_at for row, epoch in skipped_at), sorted(skipped_at)
    # Nothing is skipped in the first epoch (no pass rate yet), and a skipped prompt counts toward
    # its epoch: the training frontier (first position not done) moves past skipped positions.
    assert all(r.epoch >= 1 for r in filtered)
    assert trainer.frontier.position > min(r.position for r in filtered)

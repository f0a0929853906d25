"""Where a step's metrics go: the trainer's history, the tracker and the console.

The history (``TrainerState.log_history``, what ``train()`` returns) keeps every metric of every step on every
rank. Rank 0 also sends them to the tracker every ``logging_steps``: the metrics the run's settings fix (a flat
chart would say nothing) go as tags, once and again only if their value changes, and the rest as metrics. The
console gets one line per logged step, and ``log_completions`` a table of the step's completions.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from grpo_core.config import AsyncGRPOConfig
from grpo_core.tracking.run_view import constant_tags
from grpo_core.tracking.tracker import Tracker
from grpo_core.training.collector import StepBatch

log = logging.getLogger("grpo_core.training.trainer")  # the console line users know comes from the trainer


@dataclass
class StepLog:
    """One run's metric log; the trainer calls ``record`` once per step (and again for what the step adds later)."""

    args: AsyncGRPOConfig
    tracker: Tracker
    is_main: bool
    history: list[dict[str, float]]
    constant_metrics: frozenset[str]
    """Metric names whose value the settings fix: tags in the tracker, not charts."""
    _sent_tags: dict[str, str] = field(default_factory=dict)

    def _due(self, step: int) -> bool:
        return self.is_main and step % self.args.logging_steps == 0

    def record(self, step: int, metrics: dict[str, Any], same_step: bool = False) -> None:
        """``metrics`` of ``step`` (None and non-finite values left out); ``same_step`` adds them to its last entry."""
        metrics = {k: float(v) for k, v in metrics.items() if v is not None and math.isfinite(float(v))}
        if same_step:
            self.history[-1].update(metrics)
        else:
            self.history.append({"step": float(step), **metrics})
        if not self._due(step):
            return
        self._track(step, metrics)
        if not same_step:
            log.info("step %d  reward %.3f  loss %.4f  gen %.0f tok/s  wait %.2fs", step,
                     metrics.get("reward", float("nan")), metrics.get("loss", float("nan")),
                     metrics.get("rollout/generated_tok_s", 0.0), metrics.get("perf/rollout_wait_s", 0.0))

    def _track(self, step: int, metrics: dict[str, float]) -> None:
        self.tracker.log_metrics({k: v for k, v in metrics.items() if k not in self.constant_metrics}, step=step)
        tags = constant_tags({k: v for k, v in metrics.items() if k in self.constant_metrics})
        tags = {k: v for k, v in tags.items() if self._sent_tags.get(k) != v}
        if tags:
            self.tracker.set_tags(tags)
            self._sent_tags.update(tags)

    def completions(self, step: int, batch: StepBatch) -> None:
        """``log_completions``: a table of the step's prompts, completions and rewards to the tracker, and the
        first ``num_completions_to_print`` to the console."""
        if not (self.args.log_completions and self._due(step)):
            return
        table: dict[str, list[Any]] = {"step": [], "prompt": [], "completion": [], "reward": []}
        for report in batch.reports:
            for text, reward in zip(report.completions, report.rewards, strict=False):
                table["step"].append(step)
                table["prompt"].append(report.prompt_text)
                table["completion"].append(text)
                table["reward"].append(None if np.isnan(reward) else float(reward))
        if not table["step"]:
            return
        if self.args.num_completions_to_log is not None:  # the first groups of the step, whole where the count allows
            table = {k: v[: self.args.num_completions_to_log] for k, v in table.items()}
        self.tracker.log_table("completions", table, step=step)
        shown = list(zip(table["prompt"], table["completion"], table["reward"]))[: self.args.num_completions_to_print]
        for prompt, completion, reward in shown:
            log.info("step %d completion (reward %s)\n  prompt: %s\n  completion: %s", step, reward, prompt, completion)

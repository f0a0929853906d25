"""Where a step's metrics go: the trainer's history, the tracker and the console.

The history (``TrainerState.log_history``, what ``train()`` returns) keeps every metric of every step on every
rank. Rank 0 also sends them to the tracker every ``logging_steps``: the metrics the run's settings fix (a flat
chart would say nothing) go as tags, once and again only if their value changes, and the rest as metrics. The
console gets one line per logged step. With ``log_completions`` each logged step's completions go to the tracker as
a table of their own (a column per reward function), and every ``print_completions_steps`` a few of them to the
console as one compact table (``completions_table``), not a record per completion.
"""

from __future__ import annotations

import io
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
        """``log_completions``: a table of the step's prompts, completions, rewards and each reward function's score
        to the tracker; every ``print_completions_steps`` its first ``num_completions_to_print`` rows to the console."""
        if not (self.args.log_completions and self._due(step)):
            return
        table = completions_columns(step, batch)
        if not table["step"]:
            return
        if self.args.num_completions_to_log is not None:  # the first groups of the step, whole where the count allows
            table = {k: v[: self.args.num_completions_to_log] for k, v in table.items()}
        self.tracker.log_table("completions", table, step=step)
        rows = self.args.num_completions_to_print
        if rows and step % self.args.print_completions_steps == 0:
            log.info("completions of step %d (%d of %d):\n%s", step, min(rows, len(table["step"])), len(table["step"]),
                     completions_table(table, rows))


def completions_columns(step: int, batch: StepBatch) -> dict[str, list[Any]]:
    """The step's completions as columns: ``step``, ``prompt``, ``completion``, ``reward`` (the weighted sum) and one
    column per reward function, named after it (None where it did not score a completion)."""
    names: list[str] = []
    for report in batch.reports:
        names += [n for n in report.rewards_per_func if n not in names]
    table: dict[str, list[Any]] = {"step": [], "prompt": [], "completion": [], "reward": [], **{n: [] for n in names}}
    for report in batch.reports:
        for i, (text, reward) in enumerate(zip(report.completions, report.rewards, strict=False)):
            table["step"].append(step)
            table["prompt"].append(report.prompt_text)
            table["completion"].append(text)
            table["reward"].append(_score(reward))
            for name in names:
                scores = report.rewards_per_func.get(name)
                table[name].append(_score(scores[i]) if scores is not None and i < len(scores) else None)
    return table


def _score(value: Any) -> float | None:
    return None if value is None or np.isnan(value) else float(value)


def completions_table(table: dict[str, list[Any]], rows: int, width: int = 120) -> str:
    """The first ``rows`` rows of a completions table as text ``width`` characters wide: the scores, then the prompt
    and the completion each on one line, cut with an ellipsis."""
    from rich.console import Console
    from rich.table import Table

    scores = [c for c in table if c not in ("step", "prompt", "completion")]
    out = Table(show_header=True, header_style="bold", box=None, pad_edge=False)
    for name in scores:
        out.add_column(name, justify="right", no_wrap=True, min_width=max(len(name), 5))
    left = max(20, width - sum(max(len(n), 5) + 1 for n in scores))
    out.add_column("prompt", no_wrap=True, overflow="ellipsis", max_width=left // 3)
    out.add_column("completion", no_wrap=True, overflow="ellipsis", max_width=left - left // 3 - 2)
    for i in range(min(rows, len(table["step"]))):
        cells = ["-" if table[c][i] is None else f"{table[c][i]:.2f}" for c in scores]
        out.add_row(*cells, _one_line(table["prompt"][i]), _one_line(table["completion"][i]))
    console = Console(file=io.StringIO(), width=width, color_system=None, force_terminal=False)
    console.print(out)
    return console.file.getvalue().rstrip("\n")  # type: ignore[attr-defined]


def _one_line(text: Any) -> str:
    return " ".join(str(text).split())

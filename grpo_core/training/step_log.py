"""Where a step's metrics go: the trainer's history, the tracker and the console.

The history (``TrainerState.log_history``, what ``train()`` returns) keeps every metric of every step on every
rank. Rank 0 also sends them to the tracker every ``logging_steps``: the metrics the run's settings fix (a flat
chart would say nothing) go as tags, once and again only if their value changes, and the rest as metrics. The
console gets one line per logged step (``progress_line``: step of total, reward, loss, speed, time left). With ``log_completions`` each logged step's completions go to the tracker as
rows of a table (a column per reward function; a file per block of steps, ``tracking/tables.py``), and every ``print_completions_steps`` a few of them to the
console as one compact table (``completions_table``), not a record per completion.
"""

from __future__ import annotations

import io
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from grpo_core.config import TrackingSettings
from grpo_core.tracking.run_view import constant_tags
from grpo_core.tracking.tables import table_block
from grpo_core.tracking.tracker import Tracker
from grpo_core.training.collector import StepBatch

log = logging.getLogger("grpo_core.training.trainer")  # the console line users know comes from the trainer


@dataclass
class StepLog:
    """One run's metric log; the trainer calls ``record`` once per step (and again for what the step adds later)."""

    args: TrackingSettings  # the config's tracking settings (``config.tracking``)
    tracker: Tracker
    is_main: bool
    history: list[dict[str, float]]
    constant_metrics: frozenset[str]
    """Metric names whose value the settings fix: tags in the tracker, not charts."""
    _sent_tags: dict[str, str] = field(default_factory=dict)
    _first_logged: tuple[float, int] | None = None
    """When (monotonic seconds) and at which step the first line was logged: the pace the ETA is taken from."""

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
            now = time.monotonic()
            if self._first_logged is None:
                self._first_logged = (now, step)
            log.info("%s", progress_line(step, self.args.max_steps, metrics, eta_s(self._first_logged, (now, step),
                                                                                   self.args.max_steps)))

    def record_late(self, step: int, metrics: dict[str, Any]) -> None:
        """``metrics`` that belong to an earlier ``step`` and came in later (an evaluation beside training): a
        history entry of their own for that step, and the tracker's charts at that step."""
        metrics = {k: float(v) for k, v in metrics.items() if v is not None and math.isfinite(float(v))}
        self.history.append({"step": float(step), **metrics})
        if self.is_main:
            self._track(step, metrics)
            log.info("held-out evaluation of step %d: %s", step, ", ".join(
                f"{k.removeprefix('eval/')} {v:.3f}" for k, v in metrics.items() if k.startswith("eval/rewards/")
                or k in ("eval/reward", "eval/version_share")))

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
        self.tracker.log_table("completions", table, step=step,
                               block=table_block("completions", step, self.args.max_steps, self.args.logging_steps))
        rows = self.args.num_completions_to_print
        if rows and step % self.args.print_completions_steps == 0:
            log.info("completions of step %d (%d of %d):\n%s", step, min(rows, len(table["step"])), len(table["step"]),
                     completions_table(table, rows))


def eta_s(first: tuple[float, int], now: tuple[float, int], total: int) -> float | None:
    """Seconds left to step ``total`` at the pace from ``first`` to ``now`` (each ``(seconds, step)``); None before
    a pace is known or when the run is bounded by epochs (``total`` <= 0)."""
    (t0, s0), (t1, s1) = first, now
    if total <= 0 or s1 <= s0:
        return None
    return (t1 - t0) / (s1 - s0) * max(0, total - s1)


def progress_line(step: int, total: int, metrics: dict[str, float], eta: float | None) -> str:
    """The console's line for a logged step: step of total, reward, loss, generation speed, the wait for rollouts and
    the time left."""
    def number(key: str, fmt: str) -> str:
        value = metrics.get(key)
        return "-" if value is None else format(value, fmt)

    left = "?" if eta is None else "{}m{:02d}s".format(*divmod(round(eta), 60))
    of = f"/{total}" if total > 0 else ""
    return (f"step {step}{of}  reward {number('reward', '.3f')}  loss {number('loss', '.4f')}  "
            f"gen {number('rollout/generated_tok_s', ',.0f')} tok/s  wait {number('perf/rollout_wait_s', '.2f')}"
            f"{'s' if 'perf/rollout_wait_s' in metrics else ''}  eta {left}")


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
    """``rows`` rows of a completions table (``spread_rows``: one per prompt first) as text ``width`` characters wide:
    the scores, then the prompt and the completion each on one line, cut with an ellipsis."""
    from rich.console import Console
    from rich.table import Table

    scores = [c for c in table if c not in ("step", "prompt", "completion")]
    out = Table(show_header=True, header_style="bold", box=None, pad_edge=False)
    for name in scores:
        out.add_column(name, justify="right", no_wrap=True, min_width=max(len(name), 5))
    left = max(20, width - sum(max(len(n), 5) + 1 for n in scores))
    out.add_column("prompt", no_wrap=True, overflow="ellipsis", max_width=left // 3)
    out.add_column("completion", no_wrap=True, overflow="ellipsis", max_width=left - left // 3 - 2)
    for i in spread_rows(table["prompt"], rows):
        cells = ["-" if table[c][i] is None else f"{table[c][i]:.2f}" for c in scores]
        out.add_row(*cells, _one_line(table["prompt"][i]), _one_line(table["completion"][i]))
    console = Console(file=io.StringIO(), width=width, color_system=None, force_terminal=False)
    console.print(out)
    return console.file.getvalue().rstrip("\n")  # type: ignore[attr-defined]


def spread_rows(prompts: list[Any], rows: int) -> list[int]:
    """Indices of ``rows`` rows: the first row of each prompt (group), then the others, so that a few rows show several
    prompts."""
    seen: set[str] = set()
    first = [i for i, p in enumerate(prompts) if not (str(p) in seen or seen.add(str(p)))]
    rest = [i for i in range(len(prompts)) if i not in set(first)]
    return (first + rest)[:rows]


def _one_line(text: Any) -> str:
    return " ".join(str(text).split())

"""What a run generated and did not train, per step and for the run so far (``waste/*`` metrics).

A completion that is generated but never trained cost its generation for nothing. Three things are counted:

* **discarded tokens**: the sampled tokens of samples dropped as stale (``stale_samples="drop"``), against the
  tokens generated for groups with a learning signal. A group whose rollouts all scored alike is dropped under any
  policy (it has no advantage to train on), so neither side counts it: the share is what staleness alone wastes;
* **lengths**: the mean length of trained completions against that of generated ones (of groups with a signal).
  Long completions arrive last, so a policy that drops late samples trains on shorter ones than it generates: a
  ratio below 1 is that bias;
* **staleness of what was trained**: its mean (``sample/staleness_mean`` per step) and the samples trained past
  ``max_staleness`` (``sample/late_kept``, ``stale_samples="keep"``).

Per step the counts come from the step's batch (the groups reported and the samples collected while it was
collected); the ``*_total`` ratios are over every step this process trained. A run's whole totals, across resumes,
are summed from the per-step counts in its metric history (``run_waste``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

import numpy as np

from grpo_core.training.collector import trained_positions

if TYPE_CHECKING:
    from grpo_core.training.collector import StepBatch


@dataclass
class WasteCounts:
    """Sums over some steps; every ``waste/*`` metric is a ratio of two of them."""

    generated_tokens: float = 0.0  # tokens generated for groups with a learning signal
    generated_completions: float = 0.0  # their rollouts
    discarded_tokens: float = 0.0  # sampled tokens of samples dropped as stale
    trained_tokens: float = 0.0  # sampled tokens of trained samples
    trained_completions: float = 0.0  # trained samples

    def add(self, other: WasteCounts) -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))


COUNT_METRICS = {f.name: f"waste/{f.name}" for f in fields(WasteCounts)}
"""Each count's per-step metric: what ``run_waste`` sums back from a run's history."""


def step_counts(batch: StepBatch) -> WasteCounts:
    """The counts of one step's batch."""
    signal = [r for r in batch.reports if not r.filtered and not r.dropped]
    lengths = np.concatenate([r.completion_lengths for r in signal]) if signal else np.zeros(0)
    return WasteCounts(
        generated_tokens=float(lengths.sum()),
        generated_completions=float(lengths.size),
        discarded_tokens=float(batch.stale_dropped_tokens),
        trained_tokens=float(sum(trained_positions(s) for s in batch.samples)),
        trained_completions=float(len(batch.samples)),
    )


def _ratio(num: float, den: float) -> float:
    return num / den if den > 0 else float("nan")


def ratios(counts: WasteCounts) -> dict[str, float]:
    """The share of generated tokens discarded, the two mean lengths and the trained ÷ generated length."""
    trained = _ratio(counts.trained_tokens, counts.trained_completions)
    generated = _ratio(counts.generated_tokens, counts.generated_completions)
    return {
        "discarded_share": _ratio(counts.discarded_tokens, counts.generated_tokens),
        "trained_length_mean": trained,
        "generated_length_mean": generated,
        "length_ratio": _ratio(trained, generated),
    }


class WasteLedger:
    """The run's counts so far; ``step`` adds one batch and returns its ``waste/*`` metrics."""

    def __init__(self) -> None:
        self.total = WasteCounts()

    def step(self, batch: StepBatch) -> dict[str, float]:
        counts = step_counts(batch)
        self.total.add(counts)
        metrics = {COUNT_METRICS[f.name]: getattr(counts, f.name) for f in fields(counts)}
        metrics["waste/discarded_tokens_total"] = self.total.discarded_tokens
        metrics.update({f"waste/{name}": value for name, value in ratios(counts).items()})
        metrics.update({f"waste/{name}_total": value for name, value in ratios(self.total).items()})
        metrics["sample/late_kept"] = float(batch.late_kept)
        return metrics


def run_waste(history: Callable[[str], Iterable[tuple[int, float]]]) -> dict[str, float | None]:
    """A run's totals and ratios from its per-step counts; ``history(metric)`` yields ``(step, value)`` pairs, a
    resumed step's later value replacing the earlier one (MLflow's metric history, in logged order). A ratio with
    nothing to divide by is None (the summary is JSON)."""
    total = WasteCounts()
    for name, metric in COUNT_METRICS.items():
        by_step = dict(history(metric))
        setattr(total, name, float(sum(by_step.values())))
    return {"waste_discarded_tokens": total.discarded_tokens, "waste_generated_tokens": total.generated_tokens,
            **{f"waste_{name}": None if np.isnan(value) else value for name, value in ratios(total).items()}}

"""A picture of one training run: reward per step, held-out accuracy before and after with 95% intervals, and how
long each step waited for rollouts and how stale its samples were.

    history = metric_history(tracking_uri, run_id)          # {metric: [(step, value), ...]} from MLflow
    draw_run_picture(history, heldout, Path("run.png"))     # heldout: the summary's held-out entries

The flow writes it beside ``summary.json`` and logs it to the MLflow run; drawing reads only its arguments, so a
test can draw made-up runs.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

PICTURE_METRICS = ("reward", "perf/rollout_wait_s", "sample/staleness_mean", "sample/staleness_max")
"""The per-step metrics the picture draws (names as the trainer logs them)."""


def metric_history(tracking_uri: str, run_id: str, keys: Sequence[str] = PICTURE_METRICS) -> dict[str, list[tuple[int, float]]]:
    """Each metric's (step, value) pairs, in step order; a step logged twice (a resumed run) keeps its latest value.

    Read from the MLflow run rather than the trainer's own history, which holds only the last attempt's steps: after
    a resume the earlier attempts' steps exist only in the tracking store.
    """
    import mlflow

    client = mlflow.MlflowClient(tracking_uri)
    out: dict[str, list[tuple[int, float]]] = {}
    for key in keys:
        latest: dict[int, tuple[int, float]] = {}
        for m in client.get_metric_history(run_id, key):
            if m.step not in latest or m.timestamp >= latest[m.step][0]:
                latest[m.step] = (m.timestamp, m.value)
        out[key] = [(step, latest[step][1]) for step in sorted(latest)]
    return out


def _rolling_mean(values: Sequence[float], window: int) -> list[float]:
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def draw_run_picture(history: Mapping[str, Sequence[tuple[int, float]]], heldout: Mapping[str, Any], path: Path,
                     title: str = "GRPO run") -> Path:
    """Draw the run into ``path`` (PNG). ``heldout`` holds the summary's ``eval_accuracy_before``/``_after``, their
    ``_ci95`` pairs and ``eval_gain``/``eval_gain_ci95`` (any of them None: that part is left out)."""
    import matplotlib

    matplotlib.use("Agg")  # no display on a server; set before pyplot is imported
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5))
    ax_reward, ax_eval, ax_wait, ax_stale = axes.flat

    reward = history.get("reward", [])
    if reward:
        steps, values = zip(*reward, strict=True)
        ax_reward.plot(steps, values, color="tab:blue", alpha=0.35, lw=1, label="per step")
        ax_reward.plot(steps, _rolling_mean(values, 10), color="tab:blue", lw=2, label="mean of 10 steps")
        ax_reward.legend(loc="lower right", fontsize=8)
    ax_reward.set(title="reward (sum of the reward functions)", xlabel="step")

    labels, means, lows, highs = [], [], [], []
    for key, label in (("eval_accuracy_before", "before training"), ("eval_accuracy_after", "after training")):
        value, ci = heldout.get(key), heldout.get(f"{key}_ci95")
        if value is None:
            continue
        labels.append(label)
        means.append(value)
        low, high = ci if ci else (value, value)
        lows.append(value - low if math.isfinite(low) else 0.0)
        highs.append(high - value if math.isfinite(high) else 0.0)
    if means:
        ax_eval.bar(labels, means, color=["tab:gray", "tab:green"][: len(means)], yerr=[lows, highs], capsize=8)
        for i, m in enumerate(means):
            ax_eval.text(i, m / 2, f"{m:.3f}", ha="center", color="white", fontweight="bold")
        ax_eval.set_ylim(0, min(1.0, max(m + h for m, h in zip(means, highs, strict=True)) * 1.25 + 0.05))
    gain, gain_ci = heldout.get("eval_gain"), heldout.get("eval_gain_ci95")
    subtitle = f"\ngain {gain:+.3f}, 95% CI [{gain_ci[0]:+.3f}, {gain_ci[1]:+.3f}]" if gain is not None and gain_ci else ""
    ax_eval.set(title=f"held-out accuracy with 95% intervals{subtitle}", ylabel="accuracy")

    wait = history.get("perf/rollout_wait_s", [])
    if wait:
        steps, values = zip(*wait, strict=True)
        ax_wait.bar(steps, values, width=1.0, color="tab:orange")
    ax_wait.set(title="time the step waited for rollouts", xlabel="step", ylabel="seconds")

    for key, label, style in (("sample/staleness_mean", "mean", "-"), ("sample/staleness_max", "max", ":")):
        series = history.get(key, [])
        if series:
            steps, values = zip(*series, strict=True)
            ax_stale.plot(steps, values, style, color="tab:purple", label=label)
    if ax_stale.lines:
        ax_stale.legend(loc="upper right", fontsize=8)
    ax_stale.set(title="staleness of the step's samples", xlabel="step", ylabel="weight updates behind")

    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path

"""The job's held-out accuracy before and after training, with 95% intervals over problems, as the flow reports it.

    before = heldout_scores(result, problems)        # one evaluation: overall accuracy and per-problem means
    summary = heldout_summary(before, after)         # the summary.json entries: accuracies, intervals, the gain
    log_heldout(tracking_uri, run_id, before, after, last_step)   # heldout_accuracy at step 0 and the last step
    print(heldout_line(summary))

The intervals are Student-t intervals over per-problem means, and the gain's over per-problem paired
differences (``grpo_core.evaluation.intervals``): a problem asked in several phrasings counts once.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Sequence
from typing import Any

from grpo_core.evaluation.intervals import Interval, cluster_means, interval, paired_gain
from grpo_core.tracking.run_view import HELDOUT_ACCURACY, HELDOUT_CI95


def heldout_scores(result: Any, problems: Sequence[Any]) -> dict[str, Any]:
    """One evaluation (``evaluation.heldout.EvalResult``) as plain data: the accuracy, sample counts and the mean
    accuracy per problem (keys as text, so the result survives JSON)."""
    means = cluster_means(result.prompt_scores, [str(p) for p in problems])
    return {"accuracy": result.accuracy, "num_prompts": result.num_prompts, "num_samples": result.num_samples,
            "problems": means}


def prompts_digest(prompts: Sequence[Any]) -> str:
    """A short digest of the held-out prompts in order: equal digests, equal prompts."""
    return hashlib.sha256(json.dumps(list(prompts), sort_keys=True).encode()).hexdigest()[:16]


def _pair(ci: Interval) -> list[float] | None:
    return [ci.low, ci.high] if math.isfinite(ci.low) else None


def heldout_summary(before: dict[str, Any] | None, after: dict[str, Any] | None) -> dict[str, Any]:
    """The summary's held-out entries: ``eval_accuracy_before``/``_after`` (the overall means), each with its 95%
    interval over problems (``_ci95``), and ``eval_gain`` with the paired interval ``eval_gain_ci95`` (None where
    an evaluation is missing or the two covered different problems)."""
    out: dict[str, Any] = {}
    for label, scores in (("before", before), ("after", after)):
        out[f"eval_accuracy_{label}"] = scores["accuracy"] if scores else None
        out[f"eval_accuracy_{label}_ci95"] = _pair(interval(scores["problems"].values())) if scores else None
    out["eval_gain"] = out["eval_gain_ci95"] = None
    if before and after and set(before["problems"]) == set(after["problems"]):
        gain = paired_gain(before["problems"], after["problems"])
        out["eval_gain"], out["eval_gain_ci95"] = after["accuracy"] - before["accuracy"], _pair(gain)
    scores = after or before
    if scores:
        out["eval_problems"] = len(scores["problems"])
        out["eval_prompts"] = scores["num_prompts"]
        out["eval_samples"] = scores["num_samples"]
    return out


def heldout_line(summary: dict[str, Any]) -> str:
    """One line for the console: before and after with their intervals, and the gain with its interval."""
    def acc(label: str) -> str:
        value, ci = summary.get(f"eval_accuracy_{label}"), summary.get(f"eval_accuracy_{label}_ci95")
        if value is None:
            return "n/a"
        return f"{value:.3f} [{ci[0]:.3f}, {ci[1]:.3f}]" if ci else f"{value:.3f}"

    line = f"held-out accuracy {acc('before')} -> {acc('after')}"
    if summary.get("eval_gain") is not None:
        ci = summary.get("eval_gain_ci95")
        line += f"; gain {summary['eval_gain']:+.3f}" + (f", 95% CI [{ci[0]:+.3f}, {ci[1]:+.3f}]" if ci else "")
    if summary.get("eval_problems"):
        line += (f" ({summary['eval_problems']} problems, {summary['eval_prompts']} prompts, {summary['eval_samples']} "
                 "samples per evaluation; intervals over problems)")
    return line


def log_heldout(tracking_uri: str, run_id: str, before: dict[str, Any] | None, after: dict[str, Any] | None,
                last_step: int) -> None:
    """``heldout_accuracy`` and its interval (``heldout_accuracy_ci95_low``/``_high``, ``run_view.HELDOUT_CI95``) at
    step 0 (before training) and at the last step (after the final weight sync)."""
    import mlflow

    client = mlflow.MlflowClient(tracking_uri)
    for step, scores in ((0, before), (last_step, after)):
        if not scores:
            continue
        ci = interval(scores["problems"].values())
        client.log_metric(run_id, HELDOUT_ACCURACY, float(scores["accuracy"]), step=step)
        if math.isfinite(ci.low):
            client.log_metric(run_id, HELDOUT_CI95[0], ci.low, step=step)
            client.log_metric(run_id, HELDOUT_CI95[1], ci.high, step=step)

"""Metrics of one step: rewards and rollouts from its group reports, and its batch's samples and queue.

Rewards are averaged over every scored rollout of every group that finished during the step, kept or
dropped: a group dropped because all its rollouts failed is still part of how well the policy does.

Per-rollout counters (tools, environments, reconcile) travel in ``GroupReport.metrics`` as sums, so
a step's value is a sum over its groups; ``rollout.types.merge_counters`` is the one rule for that (keys
ending in ``_max`` take the maximum). Ratios and means are derived only here, from summed numerators and
denominators, because an average of per-group ratios would weight a 1-turn group like a 10-turn one.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import numpy as np

from grpo_core.rollout.types import GroupReport, merge_counters

if TYPE_CHECKING:
    from grpo_core.training.collector import StepBatch

# Counters carried by GroupReport.metrics that are summed over the step's groups.
_COUNTER_PREFIXES = ("tools/", "env/", "rollout/")
# GroupReport.metrics that are snapshots, not counters: the last group's value stands for the step.
_SNAPSHOTS = (
    "rollout/concurrency_cap", "rollout/concurrency", "rollout/report_interval_s", "rollout/backpressure_s",
    "rollout/score_queue_size", "rollout/completions_per_request",
)


def _ratio(num: float, den: float) -> float:
    return num / den if den > 0 else 0.0


def derived_rollout_metrics(counters: Mapping[str, float]) -> dict[str, float]:
    """Means and fractions from a step's summed counters (see ``agent.py`` and ``stages.py`` for the names)."""
    out: dict[str, float] = {}
    if "rollout/later_turns" in counters:
        # Forks over turns after the first: 0 for single-turn runs, by definition.
        out["rollout/fork_frac"] = _ratio(counters.get("rollout/fork_turns", 0.0), counters["rollout/later_turns"])
        out["rollout/realign_frac"] = _ratio(counters.get("rollout/realign_turns", 0.0), counters["rollout/later_turns"])
    tools = {key.split("/")[1] for key in counters if key.startswith("tools/") and key.endswith("/calls")}
    for name in sorted(tools):
        calls = counters[f"tools/{name}/calls"]
        out[f"tools/{name}/error_frac"] = _ratio(counters.get(f"tools/{name}/errors", 0.0), calls)
        out[f"tools/{name}/latency_s"] = _ratio(counters.get(f"tools/{name}/latency_s_sum", 0.0), calls)
    rollouts = counters.get("env/rollouts", 0.0)
    if rollouts:
        out["env/reward"] = _ratio(counters.get("env/reward_sum", 0.0), counters.get("env/scored", 0.0))
        out["env/scored_frac"] = _ratio(counters.get("env/scored", 0.0), rollouts)
        out["env/reset_s"] = _ratio(counters.get("env/reset_s_sum", 0.0), rollouts)
        out["env/get_reward_s"] = _ratio(counters.get("env/get_reward_s_sum", 0.0), rollouts)
    return out


def group_metrics(reports: list[GroupReport]) -> dict[str, float]:
    generated = [r for r in reports if not r.filtered]
    metrics: dict[str, float] = {
        "rollout/groups": float(len(generated)),
        "rollout/groups_filtered": float(len(reports) - len(generated)),
    }
    if not generated:
        return metrics
    rewards = np.concatenate([r.rewards for r in generated])
    scored = rewards[~np.isnan(rewards)]
    if scored.size:
        metrics["reward"] = float(scored.mean())
    stds = [float(np.nanstd(r.rewards)) for r in generated if np.isfinite(r.rewards).sum() >= 2]
    if stds:
        metrics["reward_std"] = float(np.mean(stds))
    # A column can be missing from some groups (e.g. rollout_reward when no rollout set one).
    names = dict.fromkeys(name for r in generated for name in r.rewards_per_func)
    for name in names:
        values = np.concatenate([r.rewards_per_func[name] for r in generated if name in r.rewards_per_func])
        values = values[~np.isnan(values)]
        if values.size:
            metrics[f"rewards/{name}/mean"] = float(values.mean())
            metrics[f"rewards/{name}/std"] = float(values.std())
    lengths = np.concatenate([r.completion_lengths for r in generated])
    if lengths.size:
        metrics["completions/mean_length"] = float(lengths.mean())
        metrics["completions/max_length"] = float(lengths.max())
        metrics["completions/min_length"] = float(lengths.min())
    metrics["rollout/groups_dropped_frac"] = float(np.mean([r.dropped for r in generated]))
    metrics["rollout/generated_tokens"] = float(sum(r.generated_tokens for r in generated))
    last = generated[-1].metrics
    for key in ("rollout/concurrency_cap", "rollout/concurrency", "rollout/score_queue_size", "rollout/completions_per_request"):
        if key in last:
            metrics[key] = last[key]
    metrics["rollout/backpressure_s"] = float(sum(r.metrics.get("rollout/backpressure_s", 0.0) for r in generated))
    # Each fleet server's gauges as the step's last group saw them (``rollout/server/<name>/...``); the groups each
    # server generated and the requests sent again after a server was lost are counters, summed below.
    metrics.update(generated[-1].fleet)
    counters = merge_counters(
        {k: v for k, v in r.metrics.items() if k.startswith(_COUNTER_PREFIXES) and k not in _SNAPSHOTS}
        for r in generated
    )
    metrics.update(counters)
    metrics.update(derived_rollout_metrics(counters))
    return metrics


def sample_and_queue_metrics(batch: StepBatch, wall_s: float, *, stale_dropped_total: int, server_restarts: int,
                             frontier: int, queue_size: int) -> dict[str, float]:
    """The step's metrics from its batch: rewards and rollouts (``group_metrics``), its rows, the samples'
    staleness and the queue it came from (see README, "Reading the rollout queue"). ``wall_s``: the
    step's wall clock so far."""
    metrics = group_metrics(batch.reports)
    metrics.update(batch.plan.metrics())
    generated = sum(r.generated_tokens for r in batch.reports)
    staleness = np.asarray(batch.staleness, dtype=np.float64)
    forwarded = [len(s.token_ids) for s in batch.samples]
    metrics.update(
        {
            "sample/staleness_mean": float(staleness.mean()) if staleness.size else 0.0,
            "sample/staleness_max": float(staleness.max()) if staleness.size else 0.0,
            "sample/stale_dropped": float(batch.stale_dropped),
            "sample/stale_dropped_total": float(stale_dropped_total),
            "sample/foreign_dropped": float(batch.foreign_dropped),
            "sync/server_restarts": float(server_restarts),
            "sample/forwarded_tokens_mean": float(np.mean(forwarded)) if forwarded else 0.0,
            "rollout/generated_tok_s": generated / wall_s if wall_s > 0 else 0.0,
            "rollout/queue_size": float(queue_size),
            "perf/rollout_wait_s": batch.wait_s,
            "perf/step_s": wall_s,
            "rollout/frontier": float(frontier),
        }
    )
    return metrics

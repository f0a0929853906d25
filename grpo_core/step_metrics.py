"""Reward and rollout metrics of one step, from the group reports that arrived during it.

Rewards are averaged over every scored rollout of every group that finished during the step, kept or
dropped: a group dropped because all its rollouts failed is still part of how well the policy does.
"""

from __future__ import annotations

import numpy as np

from grpo_core.rollout.types import GroupReport


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
    for name in generated[0].rewards_per_func:
        values = np.concatenate([r.rewards_per_func[name] for r in generated])
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
    for key in ("rollout/concurrency_cap", "rollout/concurrency"):
        if key in last:
            metrics[key] = last[key]
    metrics["rollout/backpressure_s"] = float(sum(r.metrics.get("rollout/backpressure_s", 0.0) for r in generated))
    summed: dict[str, float] = {}
    for report in generated:
        for key, value in report.metrics.items():
            if key.startswith(("tools/", "env/", "rollout/turns", "rollout/forks", "rollout/realigns")):
                summed[key] = summed.get(key, 0.0) + value
    metrics.update(summed)
    return metrics

"""Step metrics from group reports: counters summed, maxima kept, ratios from summed parts."""

from __future__ import annotations

import numpy as np

from grpo_core.rollout.types import GroupReport, merge_counters
from grpo_core.training.step_metrics import derived_rollout_metrics, group_metrics
from tests.tolerances import gamma


def report(metrics: dict[str, float], rewards: list[float] | None = None, per_func: dict | None = None, **kw) -> GroupReport:  # noqa: ANN003
    values = np.asarray(rewards if rewards is not None else [0.0, 1.0])
    return GroupReport(position=0, row_index=0, epoch=0, rewards=values,
                       rewards_per_func=per_func if per_func is not None else {}, num_samples=2, dropped=False,
                       completion_lengths=np.array([3.0, 5.0]), metrics=metrics, **kw)


def test_merge_sums_and_keeps_maxima() -> None:
    merged = merge_counters([{"a": 1, "t/latency_s_max": 0.5}, {"a": 2, "t/latency_s_max": 0.2, "b": 1}])
    assert merged == {"a": 3.0, "t/latency_s_max": 0.5, "b": 1.0}


def test_fork_frac_is_forks_over_later_turns_of_the_whole_step() -> None:
    # Group 1: 10 later turns, 1 fork; group 2: 1 later turn, 1 fork. Averaging per-group ratios would
    # give (0.1 + 1) / 2 = 0.55; over the step it is 2 / 11.
    step = group_metrics([
        report({"rollout/later_turns": 10, "rollout/fork_turns": 1, "rollout/realign_turns": 3}),
        report({"rollout/later_turns": 1, "rollout/fork_turns": 1, "rollout/realign_turns": 0}),
    ])
    assert step["rollout/fork_frac"] == 2 / 11 and step["rollout/realign_frac"] == 3 / 11
    assert derived_rollout_metrics({"rollout/later_turns": 0})["rollout/fork_frac"] == 0.0


def test_tool_and_environment_metrics() -> None:
    step = group_metrics([
        report({"tools/calc/calls": 3, "tools/calc/errors": 1, "tools/calc/latency_s_sum": 0.6,
                "tools/calc/latency_s_max": 0.4, "env/rollouts": 2, "env/scored": 1, "env/reward_sum": 0.5,
                "env/reset_s_sum": 0.2}),
        report({"tools/calc/calls": 1, "tools/calc/errors": 0, "tools/calc/latency_s_sum": 0.2,
                "tools/calc/latency_s_max": 0.2, "env/rollouts": 2, "env/scored": 2, "env/reward_sum": 1.0}),
    ])
    assert step["tools/calc/calls"] == 4 and step["tools/calc/errors"] == 1
    assert step["tools/calc/error_frac"] == 0.25
    # fp64: (0.6 + 0.2) / 4 against 0.2, with the three decimal literals' own roundings: γ_4 relative
    assert np.isclose(step["tools/calc/latency_s"], 0.2, rtol=gamma(4, float), atol=0)
    assert step["tools/calc/latency_s_max"] == 0.4
    assert step["env/reward"] == 1.5 / 3 and step["env/scored_frac"] == 3 / 4
    assert np.isclose(step["env/reset_s"], 0.05, rtol=gamma(3, float), atol=0)  # 0.2 / 4 against 0.05: γ_3


def test_snapshots_are_not_summed_and_concurrency_reaches_the_step() -> None:
    step = group_metrics([
        report({"rollout/concurrency_cap": 8, "rollout/concurrency": 5, "rollout/report_interval_s": 1.0}),
        report({"rollout/concurrency_cap": 10, "rollout/concurrency": 7, "rollout/report_interval_s": 2.0}),
    ])
    assert step["rollout/concurrency_cap"] == 10 and step["rollout/concurrency"] == 7
    assert "rollout/report_interval_s" not in step


def test_reward_columns_missing_from_some_groups() -> None:
    step = group_metrics([
        report({}, per_func={"acc": np.array([0.0, 1.0])}),
        report({}, per_func={"acc": np.array([1.0, 1.0]), "rollout_reward": np.array([0.5, np.nan])}),
    ])
    assert step["rewards/acc/mean"] == 0.75 and step["rewards/rollout_reward/mean"] == 0.5
    assert step["rewards/rollout_reward/std"] == 0.0

"""StepCollector and TrainingFrontier: staleness drops, step filling and the training frontier, by hand."""

from __future__ import annotations

import numpy as np
import pytest

from grpo_core.packing.collator import pack_row
from grpo_core.rollout.scheduler import END_OF_DATA
from grpo_core.rollout.types import GroupReport, RolloutSample
from grpo_core.training.collector import (
    NoLearningSignalError,
    SignalWatch,
    StepCollector,
    TrainingFrontier,
    WeightVersions,
    no_signal_groups,
)


def sample(position: int, version: int, n_prompt: int = 3, n_out: int = 2, group: int | None = None) -> RolloutSample:
    ids = np.arange(10 * position + 1, 10 * position + 1 + n_prompt + n_out, dtype=np.int32)
    mask = np.zeros(len(ids), dtype=bool)
    mask[n_prompt:] = True
    return RolloutSample(
        token_ids=ids, completion_mask=mask, sampler_logprobs=np.full(len(ids), -1.0, np.float32),
        advantage=1.0, reward=1.0, group_id=position if group is None else group, row_index=position, epoch=0,
        rollout_id=f"r{position}-{version}-{np.random.rand()}", policy_version=version, position=position,
    )


def report(position: int, num_samples: int, dropped: bool = False) -> GroupReport:
    return GroupReport(position=position, row_index=position, epoch=0, rewards=np.ones(2), rewards_per_func={},
                       num_samples=num_samples, dropped=dropped)


class ListSource:
    """Stands in for the rollout worker's queue: hands out a fixed list, then raises."""

    def __init__(self, items):
        self.items = list(items)

    def get(self, timeout_s: float):
        if not self.items:
            raise TimeoutError("no more items")
        return self.items.pop(0)


def collector(items, max_staleness=1, max_samples=4, frontier=None) -> StepCollector:
    return StepCollector(
        source=ListSource(items), world_size=1, gradient_accumulation_steps=1, token_budget=1000,
        max_samples_per_step=max_samples, max_staleness=max_staleness, flat=False,
        frontier=frontier or TrainingFrontier(), timeout_s=1.0,
    )


def test_stale_samples_are_dropped_and_counted():
    # At version 5 with max_staleness 1, versions 3 and 2 are too old; 4 and 5 train.
    items = [report(0, 4), sample(0, 3), sample(0, 4), sample(0, 2), sample(0, 5), END_OF_DATA]
    c = collector(items, max_staleness=1)
    batch = c.collect(WeightVersions([0, 1, 2, 3, 4, 5]))  # a push after every step
    assert [s.policy_version for s in batch.samples] == [4, 5]
    assert batch.stale_dropped == 2
    assert batch.staleness == [1, 0]
    assert c.stale_dropped_total == 2
    assert c.consumed_total == 4  # trained and dropped alike: what the rollout worker's budget counts


def test_step_stops_at_max_samples_and_carries_nothing_lost():
    items = [report(0, 2), sample(0, 0), sample(0, 0), report(1, 2), sample(1, 0), sample(1, 0), END_OF_DATA]
    c = collector(items, max_samples=3)
    first = c.collect(WeightVersions([0]))
    assert len(first.samples) == 3 and c.consumed_total == 3  # the carried fourth is not consumed yet
    second = c.collect(WeightVersions([0]))
    assert len(second.samples) == 1 and c.consumed_total == 4
    assert c.collect(WeightVersions([0])) is None


def test_staleness_counts_weight_updates_not_optimizer_steps():
    # weight_sync_steps=2: versions 0, 2, 4, 6 were pushed; the trainer is at step 7. A sample of
    # version 2 lags two updates (4 and 6), not five steps; one of version 0 lags three.
    pushed = WeightVersions([0, 2, 4, 6])
    items = [report(0, 4), sample(0, 0), sample(0, 2), sample(0, 4), sample(0, 6), END_OF_DATA]
    c = collector(items, max_staleness=2)
    batch = c.collect(pushed)
    assert [s.policy_version for s in batch.samples] == [2, 4, 6]
    assert batch.staleness == [2, 1, 0]
    # each sample carries its own into the packed rows (the per-staleness mismatch metrics)
    assert [s.staleness for s in batch.samples] == [2, 1, 0]
    assert sorted(pack_row(row).sample_staleness.tolist() for mb in batch.plan.microbatches for row in mb
                  if row.num_samples) == [[2, 1, 0]]
    assert batch.stale_dropped == 1
    assert [pushed.staleness(v) for v in (0, 1, 2, 3, 6, 7)] == [3, 3, 2, 2, 0, 0]


def test_weight_versions_record_only_newer_pushes():
    versions = WeightVersions()
    assert versions.current == 0 and versions.staleness(0) == 0
    for v in (0, 2, 2, 1, 4):
        versions.record(v)
    assert versions.pushed == [0, 2, 4] and versions.current == 4


def test_frontier_advances_only_over_fully_trained_prompts():
    f = TrainingFrontier()
    f.on_report(report(1, 2))
    f.on_report(report(0, 1))
    f.on_report(report(2, 0, dropped=True))  # dropped groups count as done at once
    assert f.position == 0
    f.on_consumed(sample(1, 0))
    assert f.position == 0  # prompt 1 has one sample left, prompt 0 none trained
    f.on_consumed(sample(0, 0))
    assert f.position == 1
    f.on_consumed(sample(1, 0))
    assert f.position == 3  # 1 done, 2 was dropped


def test_frontier_starts_at_resume_position():
    f = TrainingFrontier(start=7)
    f.on_report(report(7, 0, dropped=True))
    assert f.position == 8


def test_too_long_sample_is_dropped_and_counted_as_done():
    long = sample(0, 0, n_prompt=600, n_out=600)
    items = [report(0, 1), long, report(1, 1), sample(1, 0), END_OF_DATA]
    c = collector(items)
    batch = c.collect(WeightVersions([0]))
    assert [s.position for s in batch.samples] == [1]
    assert batch.plan.dropped_too_long == 1
    assert c.consumed_total == 2
    c.mark_trained(batch)
    assert c.frontier.position == 2


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_sample_rejects_non_finite_advantage(bad):
    s = sample(0, 0)
    with pytest.raises(ValueError, match="advantage"):
        RolloutSample(
            token_ids=s.token_ids, completion_mask=s.completion_mask, sampler_logprobs=s.sampler_logprobs,
            advantage=bad, reward=0.0, group_id=0, row_index=0, epoch=0, rollout_id="x", policy_version=0,
        )


# ---- groups without learning signal ----------------------------------------------------------------------------
def equal_group(position: int, reward: float = 0.0, filtered: bool = False) -> GroupReport:
    """A dropped group: every rollout scored ``reward``."""
    return GroupReport(position=position, row_index=position, epoch=0, rewards=np.full(4, reward),
                       rewards_per_func={}, num_samples=0, dropped=True, filtered=filtered)


def test_patience_is_counted_in_groups_of_a_step():
    assert no_signal_groups(20, samples_per_step=64, num_generations=8) == 160
    assert no_signal_groups(3, samples_per_step=10, num_generations=4) == 8  # 7.5 groups: a whole one more
    assert no_signal_groups(0, samples_per_step=64, num_generations=8) == 0


def test_a_run_of_equal_groups_stops_collection_with_the_reason():
    items = [report(0, 2), sample(0, 0), *[equal_group(i) for i in range(1, 6)], equal_group(6, 1.0)]
    c = StepCollector(source=ListSource(items), world_size=1, gradient_accumulation_steps=1, token_budget=1000,
                      max_samples_per_step=4, max_staleness=1, flat=False, frontier=TrainingFrontier(),
                      timeout_s=1.0, signal=SignalWatch(limit=6, steps=3))
    with pytest.raises(NoLearningSignalError) as err:
        c.collect(WeightVersions([0]))
    message = str(err.value)
    assert "the last 6 groups" in message and "no_signal_patience_steps=3" in message
    assert "reward 0 in 5, reward 1 in 1" in message and "no_signal_patience_steps=0 waits" in message


def test_a_kept_group_starts_the_count_again_and_a_filtered_prompt_counts_for_nothing():
    watch = SignalWatch(limit=3, steps=1)
    for position in range(2):
        watch.on_report(equal_group(position))
    watch.on_report(equal_group(2, filtered=True))
    assert watch.in_a_row == 2
    watch.on_report(report(3, 2))  # kept: its rollouts differ
    assert watch.in_a_row == 0 and not watch.rewards
    for position in range(4, 6):
        watch.on_report(equal_group(position))
    with pytest.raises(NoLearningSignalError):
        watch.on_report(equal_group(6))


def test_a_long_wait_on_equal_groups_is_said_every_minute_and_never_stops_at_patience_zero(caplog):
    now = [0.0]
    watch = SignalWatch(limit=0, steps=0, clock=lambda: now[0])
    with caplog.at_level("WARNING", logger="grpo_core.training.collector"):
        for position in range(200):
            now[0] = position * 1.0  # one group a second
            watch.on_report(equal_group(position))
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 3  # at 60, 120 and 180 s
    assert warnings[0].startswith("no trainable group for 60 s: the last 61 groups each scored one reward")
    assert "reward 0 in 61" in warnings[0] and "stops at" not in warnings[0]


def test_keep_trains_stale_samples_with_their_staleness_and_counts_them_late():
    # The same arrivals as test_stale_samples_are_dropped_and_counted, under stale_samples="keep".
    items = [report(0, 4), sample(0, 3), sample(0, 4), sample(0, 2, n_out=5), sample(0, 5), END_OF_DATA]
    c = StepCollector(
        source=ListSource(items), world_size=1, gradient_accumulation_steps=1, token_budget=1000,
        max_samples_per_step=4, max_staleness=1, flat=False, frontier=TrainingFrontier(), timeout_s=1.0,
        stale_samples="keep",
    )
    batch = c.collect(WeightVersions([0, 1, 2, 3, 4, 5]))
    assert [s.policy_version for s in batch.samples] == [3, 4, 2, 5]  # in arrival order: nothing waits
    assert batch.staleness == [2, 1, 3, 0] and [s.staleness for s in batch.samples] == [2, 1, 3, 0]
    assert batch.stale_dropped == 0 and batch.stale_dropped_tokens == 0 and batch.late_kept == 2
    assert c.consumed_total == 4


def test_drop_counts_the_sampled_tokens_it_discards():
    items = [report(0, 3), sample(0, 3, n_out=2), sample(0, 2, n_out=7), sample(0, 5, n_out=4), END_OF_DATA]
    batch = collector(items, max_staleness=1).collect(WeightVersions([0, 1, 2, 3, 4, 5]))
    assert batch.stale_dropped == 2 and batch.stale_dropped_tokens == 2 + 7 and batch.late_kept == 0


def test_an_unknown_stale_samples_policy_is_refused_naming_the_field():
    with pytest.raises(ValueError, match=r"stale_samples='requeue'.*\('drop', 'keep'\)"):
        StepCollector(source=ListSource([]), world_size=1, gradient_accumulation_steps=1, token_budget=10,
                      max_samples_per_step=1, max_staleness=0, flat=False, frontier=TrainingFrontier(), timeout_s=1.0,
                      stale_samples="requeue")

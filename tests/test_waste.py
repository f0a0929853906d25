"""``waste/*``: what a run generated and did not train, per step, for the run so far and from a run's history.

    .venv/bin/python -m pytest -q tests/test_waste.py
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from grpo_core.config import AsyncGRPOConfig
from grpo_core.rollout.types import GroupReport
from grpo_core.training.collector import StepCollector, TrainingFrontier, WeightVersions
from grpo_core.training.waste import COUNT_METRICS, WasteLedger, run_waste
from grpo_core.rollout.scheduler import END_OF_DATA
from tests.test_collector import ListSource, sample


def group(position: int, lengths: list[int], dropped: bool = False) -> GroupReport:
    values = np.asarray(lengths, dtype=np.float64)
    return GroupReport(position=position, row_index=position, epoch=0, rewards=np.arange(len(lengths), dtype=float),
                       rewards_per_func={}, num_samples=0 if dropped else len(lengths), dropped=dropped,
                       generated_tokens=int(values.sum()), completion_lengths=values)


def step(items, policy: str, versions: list[int]):
    c = StepCollector(source=ListSource(items), world_size=1, gradient_accumulation_steps=1, token_budget=1000,
                      max_samples_per_step=8, max_staleness=1, flat=False, frontier=TrainingFrontier(), timeout_s=1.0,
                      stale_samples=policy)
    return c.collect(WeightVersions(versions))


def arrivals():
    # One group of two short completions sampled now and one of two long ones sampled 3 updates ago (late), and a
    # group without signal (all rollouts scored alike: dropped under any policy, counted by neither side).
    return [group(0, [2, 2]), sample(0, 5, n_out=2), sample(0, 5, n_out=2),
            group(1, [8, 8]), sample(1, 2, n_out=8), sample(1, 2, n_out=8),
            group(2, [30, 30], dropped=True), END_OF_DATA]


def test_drop_discards_the_long_late_completions_and_shows_the_bias():
    metrics = WasteLedger().step(step(arrivals(), "drop", [0, 1, 2, 3, 4, 5]))
    assert metrics["waste/generated_tokens"] == 20 and metrics["waste/generated_completions"] == 4
    assert metrics["waste/discarded_tokens"] == 16 and metrics["waste/discarded_share"] == pytest.approx(0.8)
    assert metrics["waste/trained_length_mean"] == 2 and metrics["waste/generated_length_mean"] == 5
    assert metrics["waste/length_ratio"] == pytest.approx(0.4)  # trained on shorter answers than it generated
    assert metrics["sample/late_kept"] == 0


def test_keep_discards_nothing_and_trains_the_lengths_it_generated():
    metrics = WasteLedger().step(step(arrivals(), "keep", [0, 1, 2, 3, 4, 5]))
    assert metrics["waste/discarded_tokens"] == 0 and metrics["waste/discarded_share"] == 0
    assert metrics["waste/length_ratio"] == pytest.approx(1.0) and metrics["sample/late_kept"] == 2


def test_totals_are_over_the_steps_so_far_not_a_mean_of_step_ratios():
    ledger = WasteLedger()
    ledger.step(step(arrivals(), "drop", [0, 1, 2, 3, 4, 5]))  # 16 of 20 discarded
    second = ledger.step(step([group(3, [10] * 4), *(sample(3, 5, n_out=10) for _ in range(4)), END_OF_DATA], "drop", [5]))
    assert second["waste/discarded_share"] == 0
    assert second["waste/discarded_share_total"] == pytest.approx(16 / 60)  # not (0.8 + 0) / 2
    assert second["waste/discarded_tokens_total"] == 16
    assert second["waste/length_ratio_total"] == pytest.approx((44 / 6) / (60 / 8))


def test_a_step_with_nothing_generated_has_no_share():
    metrics = WasteLedger().step(step([sample(0, 0), END_OF_DATA], "drop", [0]))
    assert math.isnan(metrics["waste/discarded_share"]) and metrics["waste/trained_completions"] == 1


def test_run_waste_sums_each_step_once_a_resumed_step_counting_its_last_value():
    logged = {name: [(1, 10.0), (2, 10.0), (2, 20.0)] for name in COUNT_METRICS.values()}
    logged["waste/discarded_tokens"] = [(1, 3.0), (2, 4.0), (2, 5.0)]
    totals = run_waste(lambda name: logged[name])
    assert totals["waste_generated_tokens"] == 30 and totals["waste_discarded_tokens"] == 8
    assert totals["waste_discarded_share"] == pytest.approx(8 / 30) and totals["waste_length_ratio"] == 1.0
    empty = run_waste(lambda name: [])
    assert empty["waste_discarded_share"] is None and empty["waste_generated_tokens"] == 0


def test_the_config_names_the_field_and_its_choices_on_a_bad_policy():
    assert AsyncGRPOConfig().stale_samples in ("drop", "keep")
    with pytest.raises(Exception, match="stale_samples"):
        AsyncGRPOConfig(stale_samples="requeue")


def test_the_long_tail_reward_asks_half_the_problems_for_long_answers():
    from benchmarks.staleness.long_tail import LONG_TOKENS, long_answer_reward

    ids = [[1] * (LONG_TOKENS // 2), [1] * (2 * LONG_TOKENS), [1] * 5]
    assert long_answer_reward(completion_ids=ids, problem=["7 + 5", "3 + 1", "8 + 9"]) == [0.5, 1.0, 0.0]


def test_the_long_tail_loop_samples_only_the_long_answer_prompts_at_length():
    import asyncio

    from benchmarks.staleness.long_tail import LONG_MIN_TOKENS, LongTailLoop, _ASKS_FOR_LENGTH, asks_for_length

    loop = LongTailLoop(AsyncGRPOConfig(max_completion_length=64), None, None, [], "http://127.0.0.1:1", None)

    async def params_for(problem: str) -> dict:
        _ASKS_FOR_LENGTH.set(asks_for_length(problem))  # what generate_one sets in each rollout's own task
        return loop.sampling_params()

    assert asyncio.run(params_for("7 + 5"))["min_tokens"] == LONG_MIN_TOKENS
    assert "min_tokens" not in asyncio.run(params_for("8 + 5")) and "min_tokens" not in loop.sampling_params()

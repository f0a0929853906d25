"""The planner: budget, group affinity, cost balance across ranks, carry-over, drops and metrics."""

from __future__ import annotations

import logging

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from grpo_core.packing.planner import Planner, plan_step
from grpo_core.packing.trie import forwarded_positions
from tests.test_packing_trie import make_sample
from tests.tolerances import gamma


def group(gid: int, prompt_len: int, completion_lens, rng) -> list:
    prompt = rng.integers(100, 1000, prompt_len).tolist()
    return [make_sample(prompt + rng.integers(0, 100, c).tolist(), c, group_id=gid) for c in completion_lens]


@st.composite
def workloads(draw):
    rng = np.random.default_rng(draw(st.integers(0, 2**31)))
    samples = []
    for g in range(draw(st.integers(1, 12))):
        k = draw(st.integers(1, 6))
        samples += group(g, draw(st.integers(1, 60)), rng.integers(1, 40, k), rng)
    if draw(st.booleans()):
        rng.shuffle(samples)  # interleave groups
    return samples


@given(workloads(), st.integers(1, 4), st.integers(1, 4), st.integers(20, 200), st.booleans())
@settings(max_examples=80, deadline=None)
def test_budget_and_conservation(samples, world_size, gas, budget, flat):
    plan = plan_step(samples, world_size=world_size, gradient_accumulation_steps=gas, token_budget=budget, flat=flat)
    assert len(plan.microbatches) <= gas
    assert all(len(mb) == world_size for mb in plan.microbatches)
    placed = [s for row in plan.rows for s in row.samples]
    too_long = sum(forwarded_positions(s) > budget for s in samples[: len(samples) - len(plan.leftover)])
    assert plan.dropped_too_long == too_long
    assert len(placed) + too_long + len(plan.leftover) == len(samples)
    assert len({id(s) for s in placed}) == len(placed)
    for row in plan.rows:
        assert row.num_unique_tokens <= budget
        if flat:
            assert row.num_unique_tokens == row.num_raw_tokens
    if plan.leftover:  # a step only stops early when all its micro-batches are used
        assert len(plan.microbatches) == gas
    # every micro-batch but the last has no empty row
    for mb in plan.microbatches[:-1]:
        assert all(row.num_samples for row in mb)


def test_group_affinity_keeps_a_prompt_in_one_row():
    rng = np.random.default_rng(1)
    samples = []
    for g in range(8):
        samples += group(g, 300, rng.integers(20, 60, 8), rng)
    order = rng.permutation(len(samples))  # groups interleaved in the queue
    plan = plan_step([samples[i] for i in order], world_size=2, gradient_accumulation_steps=4, token_budget=2000)
    assert not plan.leftover
    for mb in plan.microbatches:
        for row in mb:  # within a micro-batch a group is split only when its row ran out of room
            for s in row.samples:
                others = [r for r in mb if r is not row and s.group_id in r.group_ids]
                assert not others or row.num_unique_tokens + 60 > 2000
    assert plan.metrics()["batch/packing_ratio"] > 2.5
    # groups arriving one after another (how the worker pushes them) each sit in exactly one row
    plan = plan_step(samples, world_size=2, gradient_accumulation_steps=4, token_budget=2000)
    for g in range(8):
        assert sum(g in row.group_ids for row in plan.rows) == 1
    assert plan.metrics()["batch/packing_ratio"] > 4


def test_cost_balance_across_ranks():
    rng = np.random.default_rng(2)
    samples = []
    for g in range(64):
        samples += group(g, int(rng.integers(50, 400)), rng.integers(10, 200, 4), rng)
    plan = plan_step(samples, world_size=4, gradient_accumulation_steps=100, token_budget=3000)
    for mb in plan.microbatches[:-1]:
        costs = [row.attention_cost for row in mb]
        # no rank waits on another for more than what the largest sample of the batch adds
        biggest = max(forwarded_positions(s) ** 2 + forwarded_positions(s) * 400 for r in mb for s in r.samples)
        assert max(costs) - min(costs) <= 4 * biggest
        assert max(costs) <= 1.6 * np.mean(costs)
    assert plan.metrics()["batch/row_cost_imbalance"] < 1.3


def test_single_rank_fills_rows_to_the_budget():
    rng = np.random.default_rng(3)
    samples = []
    for g in range(30):
        samples += group(g, 100, rng.integers(10, 50, 4), rng)
    plan = plan_step(samples, world_size=1, gradient_accumulation_steps=50, token_budget=1000)
    fills = [row.num_unique_tokens / 1000 for row in plan.rows[:-1]]
    assert min(fills) > 0.7  # a row closes only when the next sample does not fit


def test_incremental_offer_until_full_and_carry_over():
    rng = np.random.default_rng(4)
    queue = []
    for g in range(40):
        queue += group(g, 50, rng.integers(5, 30, 4), rng)
    planner = Planner(world_size=2, gradient_accumulation_steps=2, token_budget=400)
    steps, carried, pulled = [], None, iter(queue)
    while len(steps) < 3:
        sample = carried if carried is not None else next(pulled)
        carried = None
        if not planner.offer(sample):
            assert planner.full() and not planner.offer(sample)
            carried = sample
            steps.append(planner.finish())
            assert not planner.full() and len(planner) == 0
    seen = [s for plan in steps for s in (x for row in plan.rows for x in row.samples)]
    assert sorted(id(s) for s in seen) == sorted(id(s) for s in queue[: len(seen)])  # nothing lost
    assert carried is queue[len(seen)]
    for plan in steps:
        assert len(plan.microbatches) == 2 and all(r.num_samples for r in plan.rows)


def test_too_long_samples_are_dropped_and_counted(caplog):
    samples = [make_sample(list(range(50)), 10), make_sample([1, 2, 3], 1), make_sample(list(range(80)), 5)]
    with caplog.at_level(logging.WARNING, logger="grpo_core.packing.planner"):
        plan = plan_step(samples, world_size=1, gradient_accumulation_steps=1, token_budget=40)
    assert plan.dropped_too_long == 2 and plan.num_samples == 1 and not plan.leftover
    assert "exceed token_budget=40" in caplog.text
    assert plan.metrics()["batch/dropped_too_long"] == 2


def test_metrics_ladder():
    rng = np.random.default_rng(5)
    samples = []
    for g in range(12):
        samples += group(g, 80, rng.integers(5, 40, 6), rng)
    tree = plan_step(samples, world_size=2, gradient_accumulation_steps=8, token_budget=500)
    flat = plan_step(samples, world_size=2, gradient_accumulation_steps=64, token_budget=500, flat=True)
    mt, mf = tree.metrics(), flat.metrics()
    slots = mt["batch/microbatches_per_step"] * 2
    # fp64 means of integer counts times the integer slot count: a division and a product (γ_2); the
    # fill fraction is one division against two (γ_3).
    assert mt["batch/samples_per_step"] == pytest.approx(slots * mt["batch/samples_per_row"], rel=gamma(2, float), abs=0)
    assert mt["batch/forwarded_tokens_per_step"] == pytest.approx(slots * mt["batch/row_tokens_mean"], rel=gamma(2, float), abs=0)
    assert mt["batch/row_fill_frac"] == pytest.approx(mt["batch/row_tokens_mean"] / 500, rel=gamma(3, float), abs=0)
    assert mf["batch/packing_ratio"] == 1.0 and mt["batch/packing_ratio"] > 1.5
    # Exact: the tree rows' one-by-one positions and the flat plan's forwarded positions are the same
    # integer, and each side is one division of it by the same integer.
    assert mt["batch/packing_ratio"] == mf["batch/forwarded_tokens_per_step"] / mt["batch/forwarded_tokens_per_step"]
    assert mt["batch/trained_tokens_per_step"] == mf["batch/trained_tokens_per_step"] == sum(
        s.num_trained for s in samples)
    assert mt["batch/samples_per_step"] == mf["batch/samples_per_step"] == len(samples)
    assert mt["batch/microbatches_per_step"] < mf["batch/microbatches_per_step"]


def test_bad_arguments():
    with pytest.raises(ValueError, match="token_budget"):
        Planner(world_size=1, gradient_accumulation_steps=1, token_budget=0)

"""A resume never trains a prompt twice: the checkpoint keeps the positions done past its frontier, and the resumed
rollout worker skips them.

Groups finish out of order, so when a checkpoint is written some positions past the frontier (the first position
not done) are already in the model. Found by the whole-run driver (benchmarks/device/e2e_gpu.py --smoke): killed
after a step-2 checkpoint whose frontier was 0, the resumed run trained positions 1, 2, 4 and 6 again."""

from __future__ import annotations

import asyncio
import threading

import numpy as np

from grpo_core.config import AsyncGRPOConfig
from grpo_core.rollout.scheduler import RolloutScheduler
from grpo_core.rollout.types import GroupReport
from grpo_core.training.collector import TrainingFrontier
from tests.test_loop_scheduler import ScriptedLoop, dataset, right_or_wrong, tokenizer  # noqa: F401 - the fixture


def done(position: int) -> GroupReport:
    """A group of ``position`` with nothing to train (filtered): done as soon as it is reported."""
    return GroupReport(position=position, row_index=position, epoch=0, rewards=np.zeros(0), rewards_per_func={},
                       num_samples=0, dropped=False, filtered=True)


def test_the_frontier_keeps_what_is_done_past_it():
    frontier = TrainingFrontier()
    for position in (1, 2, 4, 6):
        frontier.on_report(done(position))
    assert frontier.position == 0 and frontier.done_ahead == [1, 2, 4, 6]
    resumed = TrainingFrontier()
    resumed.load_state_dict(frontier.state_dict())
    assert resumed.position == 0 and resumed.done_ahead == [1, 2, 4, 6]
    resumed.on_report(done(0))
    assert resumed.position == 3 and resumed.done_ahead == [4, 6]
    old = TrainingFrontier()
    old.load_state_dict({"position": 5})  # a checkpoint from before done_ahead was recorded
    assert old.position == 5 and old.done_ahead == []


def test_a_resumed_worker_skips_the_positions_its_model_trained(tokenizer):  # noqa: F811 - the fixture
    items: list = []

    async def emit(item):  # noqa: ANN001, ANN202
        items.append(item)
        return 0.0

    config = AsyncGRPOConfig(num_generations=2, max_completion_length=64, num_sampler_logprobs=0,
                             max_concurrent_rollouts=4, max_steps=0, num_train_epochs=1, report_to="none")
    loop = ScriptedLoop(config, tokenizer, dataset(6), [right_or_wrong], "http://unused", emit, start_position=0,
                        skip_positions=[1, 3])
    asyncio.run(RolloutScheduler(loop, threading.Event()).run())
    admitted = sorted({i.position for i in items if isinstance(i, GroupReport)})
    assert admitted == [0, 2, 4, 5]

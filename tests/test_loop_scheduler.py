"""The scheduler driving a loop subclass: filter_prompt and epochs, setup, group reports and their metrics.

Generation is scripted (``ScriptedClient``) so that every count is exact; ``integration/`` repeats
the subclassing story through the trainer against the real server.
"""

from __future__ import annotations

import asyncio
import re
import threading
from typing import Any

import numpy as np
import pytest

from grpo_core.config import AsyncGRPOConfig
from grpo_core.rollout.scheduler import END_OF_DATA, RolloutScheduler
from grpo_core.rollout.stages import AsyncRolloutLoop
from grpo_core.rollout.types import GroupReport, RolloutGroup, RolloutSample
from grpo_core.training.step_metrics import group_metrics
from tests.test_loop_multiturn import ScriptedClient, calculator, tool_call, turn_index


def right_or_wrong(prompts: list[Any], completions: list[Any], solution: list[str], **kwargs: Any) -> list[float]:
    return [1.0 if f"\\boxed{{{s}}}" in c[-1]["content"] else 0.0 for c, s in zip(completions, solution, strict=True)]


def script(prompt: str) -> str:
    """Problem k is solved by every rollout when k is even and by none when odd; "tool" asks for one call."""
    if turn_index(prompt) == 0 and "Problem 2 tool" in prompt:
        return tool_call("calculator", '{"expression": "1 + 1"}')
    number = int(re.search(r"Problem (\d+)", prompt).group(1))
    return "\\boxed{2}" if number % 2 == 0 else "\\boxed{3}"


class ScriptedLoop(AsyncRolloutLoop):
    """Connects to a scripted client; records what the scheduler asked of it."""

    async def connect(self) -> None:
        self.client = ScriptedClient(self.tokenizer, script)  # type: ignore[assignment]
        self.max_model_len = 512

    async def setup(self) -> None:
        self.setup_calls = getattr(self, "setup_calls", 0) + 1
        self.setup_in_loop = asyncio.get_running_loop() is not None
        self.seen: list[tuple[int, int]] = []

    def filter_prompt(self, row_index: int, row: dict[str, Any], epoch: int) -> bool:
        return True


class SkipOddRows(ScriptedLoop):
    def filter_prompt(self, row_index: int, row: dict[str, Any], epoch: int) -> bool:
        return row_index % 2 == 0


class RejectAll(ScriptedLoop):
    def filter_prompt(self, row_index: int, row: dict[str, Any], epoch: int) -> bool:
        return False


class PassRateCurriculum(ScriptedLoop):
    """Skip a prompt once every rollout of an earlier group solved it (the docs' curriculum shape)."""

    async def setup(self) -> None:
        await super().setup()
        self.pass_rates: dict[int, float] = {}

    def filter_prompt(self, row_index: int, row: dict[str, Any], epoch: int) -> bool:
        return self.pass_rates.get(row_index, 0.0) < 0.9

    def compute_advantages(self, group: RolloutGroup) -> np.ndarray:
        scored = group.rewards[~np.isnan(group.rewards)]
        if len(scored):
            self.pass_rates[group.row_index] = float(np.mean(scored > 0))
        return super().compute_advantages(group)


def dataset(n: int) -> list[dict[str, Any]]:
    return [{"prompt": [{"role": "user", "content": f"Problem {k}"}], "solution": "2"} for k in range(n)]


@pytest.fixture(scope="module")
def tokenizer():  # noqa: ANN201
    from grpo_core.tiny.spec import TaskSpec, TokenizerSpec
    from grpo_core.tiny.tokenizer import train_tokenizer

    return train_tokenizer(TaskSpec(), TokenizerSpec(), seed=0)


def drive(loop_cls: type[AsyncRolloutLoop], tokenizer: Any, rows: list[dict[str, Any]], tools: list[Any] = (), **overrides: Any):  # noqa: ANN201
    values: dict[str, Any] = dict(num_generations=2, max_completion_length=64, num_sampler_logprobs=0,
                                  max_concurrent_rollouts=4, max_steps=0, num_train_epochs=2, report_to="none")
    values.update(overrides)
    items: list[Any] = []

    async def emit(item: Any) -> float:
        items.append(item)
        return 0.0

    loop = loop_cls(AsyncGRPOConfig(**values), tokenizer, rows, [right_or_wrong], "http://unused", emit, tools=list(tools))
    asyncio.run(RolloutScheduler(loop, threading.Event()).run())
    return loop, items


def reports(items: list[Any]) -> list[GroupReport]:
    return [i for i in items if isinstance(i, GroupReport)]


def test_every_position_is_reported_once_and_data_ends(tokenizer) -> None:  # noqa: ANN001
    loop, items = drive(ScriptedLoop, tokenizer, dataset(4))
    assert items[-1] == END_OF_DATA
    assert sorted(r.position for r in reports(items)) == list(range(8))
    assert loop.setup_calls == 1 and loop.setup_in_loop
    # Even rows: both rollouts right -> dropped (no spread); odd rows: both wrong -> dropped too.
    assert all(r.dropped and r.num_samples == 0 for r in reports(items))


def test_filtered_prompts_count_toward_the_epoch(tokenizer) -> None:  # noqa: ANN001
    _, items = drive(SkipOddRows, tokenizer, dataset(4))
    got = reports(items)
    assert sorted(r.position for r in got) == list(range(8))  # the epoch still covers every prompt
    filtered = [r for r in got if r.filtered]
    assert sorted(r.row_index for r in filtered) == [1, 1, 3, 3]
    assert all(r.num_samples == 0 and r.rewards.size == 0 for r in filtered)
    assert group_metrics(got)["rollout/groups_filtered"] == 4.0


def test_epoch_with_every_prompt_rejected_raises(tokenizer) -> None:  # noqa: ANN001
    with pytest.raises(RuntimeError, match="filter_prompt rejected every prompt of epoch 0"):
        drive(RejectAll, tokenizer, dataset(3))


def test_curriculum_skips_solved_prompts_in_later_epochs(tokenizer) -> None:  # noqa: ANN001
    # One prompt at a time, so each group has finished before the next filter decision.
    loop, items = drive(PassRateCurriculum, tokenizer, dataset(4), num_train_epochs=3, max_concurrent_rollouts=2)
    got = reports(items)
    assert loop.pass_rates == {0: 1.0, 1: 0.0, 2: 1.0, 3: 0.0}
    filtered = [r for r in got if r.filtered]
    assert {r.row_index for r in filtered} == {0, 2} and {r.epoch for r in filtered} == {1, 2}
    assert sorted(r.position for r in got) == list(range(12))


def test_group_report_carries_tool_reconcile_and_concurrency_metrics(tokenizer) -> None:  # noqa: ANN001
    rows = [{"prompt": [{"role": "user", "content": "Problem 2 tool"}], "solution": "2"}]
    _, items = drive(ScriptedLoop, tokenizer, rows, tools=[calculator], num_train_epochs=1)
    (report,) = reports(items)
    m = report.metrics
    assert m["rollout/concurrency_cap"] == 4.0 and "rollout/concurrency" in m
    assert m["tools/calculator/calls"] == 2.0 and m["rollout/turns"] == 4.0
    assert m["rollout/later_turns"] == 2.0 and m["rollout/clean_turns"] == 2.0 and m["rollout/fork_turns"] == 0.0
    step = group_metrics([report])
    assert step["rollout/fork_frac"] == 0.0 and step["tools/calculator/calls"] == 2.0
    assert step["rollout/concurrency_cap"] == 4.0


def wrong_by_turn_count(prompts: list[Any], completions: list[Any], **kwargs: Any) -> list[float]:
    return [float(i) for i in range(len(completions))]  # a spread, so the group is kept


def test_kept_multi_turn_group_queues_one_sample_per_sequence(tokenizer) -> None:  # noqa: ANN001
    rows = [{"prompt": [{"role": "user", "content": "Problem 2 tool"}], "solution": "2"}]
    items: list[Any] = []

    async def emit(item: Any) -> float:
        items.append(item)
        return 0.0

    config = AsyncGRPOConfig(num_generations=2, max_completion_length=64, num_sampler_logprobs=0,
                             max_concurrent_rollouts=4, max_steps=0, num_train_epochs=1, report_to="none")
    loop = ScriptedLoop(config, tokenizer, rows, [wrong_by_turn_count], "http://unused", emit, tools=[calculator])
    asyncio.run(RolloutScheduler(loop, threading.Event()).run())
    (report,) = reports(items)
    samples = [i for i in items if isinstance(i, RolloutSample)]
    assert not report.dropped and report.num_samples == len(samples) == 2
    kinds = [i if isinstance(i, str) else type(i).__name__ for i in items]
    assert kinds == ["GroupReport", "RolloutSample", "RolloutSample", END_OF_DATA]  # report, then samples
    for s in samples:
        assert s.metrics["turns"] == 2.0
        assert "<tool_response>" in tokenizer.decode(s.token_ids[~s.completion_mask])


class SelfScoringLoop(ScriptedLoop):
    """A custom generate_one that scores its own rollout (e.g. with a judge it called)."""

    async def generate_one(self, row_index: int, row: dict[str, Any], rollout_index: int) -> Any:
        rollout = await super().generate_one(row_index, row, rollout_index)
        rollout.reward = 0.25 * rollout_index
        return rollout


def test_custom_generate_one_reward_is_summed_and_reported(tokenizer) -> None:  # noqa: ANN001
    # Problem 1 is always answered wrong: right_or_wrong gives 0, so the spread comes from generate_one.
    rows = [{"prompt": [{"role": "user", "content": "Problem 1"}], "solution": "2"}]
    _, items = drive(SelfScoringLoop, tokenizer, rows, num_train_epochs=1, num_generations=3)
    (report,) = reports(items)
    # Exact: multiples of 1/4 and their sums with 0 are exact in binary.
    np.testing.assert_array_equal(report.rewards, [0.0, 0.25, 0.5])
    np.testing.assert_array_equal(report.rewards_per_func["right_or_wrong"], [0.0, 0.0, 0.0])
    np.testing.assert_array_equal(report.rewards_per_func["rollout_reward"], [0.0, 0.25, 0.5])
    assert not report.dropped and report.num_samples == 3
    assert group_metrics([report])["rewards/rollout_reward/mean"] == 0.25


class CountingLoop(ScriptedLoop):
    async def generate_one(self, row_index: int, row: dict[str, Any], rollout_index: int) -> Any:
        self.started = getattr(self, "started", 0) + 1
        return await super().generate_one(row_index, row, rollout_index)


def test_a_full_queue_stops_new_groups_until_it_drains(tokenizer) -> None:  # noqa: ANN001
    # The first emits find the queue full for 0.5 s. Meanwhile only groups created before the first
    # one blocked may run (two caps' worth here); without back-pressure all 40 rollouts are generated.
    config = AsyncGRPOConfig(num_generations=2, max_completion_length=64, num_sampler_logprobs=0,
                             max_concurrent_rollouts=4, max_steps=0, num_train_epochs=1, report_to="none")
    items: list[Any] = []
    started_while_full: list[int] = []

    async def emit(item: Any) -> float:
        if not items and not started_while_full:
            await asyncio.sleep(0.5)
            started_while_full.append(loop.started)
        items.append(item)
        return 0.0

    loop = CountingLoop(config, tokenizer, dataset(20), [right_or_wrong], "http://unused", emit)
    asyncio.run(RolloutScheduler(loop, threading.Event()).run())
    assert max(started_while_full) <= 2 * 4, started_while_full
    assert loop.started == 40  # and everything runs once the queue drains
    assert sorted(r.position for r in reports(items)) == list(range(20))


def one_of_two_right(prompts: list[Any], completions: list[Any], **kwargs: Any) -> list[float]:
    """Rewards that differ within every group, so that every group is kept and queues its samples."""
    return [float(i % 2) for i in range(len(completions))]


def test_new_groups_wait_until_the_trainer_consumed_enough_to_keep_them_fresh(tokenizer) -> None:  # noqa: ANN001
    # max_staleness=0, 4 samples per step: at most 4 samples (two groups of 2) may be ahead of the trainer.
    # The trainer's consumed count (published with each weight version) lets the next step's groups start.
    config = AsyncGRPOConfig(num_generations=2, max_completion_length=64, num_sampler_logprobs=0, per_device_train_batch_size=4,
                             max_staleness=0, max_concurrent_rollouts=8, max_steps=0, num_train_epochs=1, report_to="none")
    items: list[Any] = []
    consumed = [0]
    started_at: list[int] = []

    async def emit(item: Any) -> float:
        items.append(item)
        return 0.0

    async def trainer() -> None:
        for step in (1, 2):
            await asyncio.sleep(0.4)
            started_at.append(loop.started)
            consumed[0] = 4 * step  # a step trained and its weights pushed
        await asyncio.sleep(0.4)
        started_at.append(loop.started)
        consumed[0] = 1 << 30  # every later step at once

    async def main() -> None:
        task = asyncio.create_task(trainer())
        await RolloutScheduler(loop, threading.Event()).run()
        await task

    loop = CountingLoop(config, tokenizer, dataset(10), [one_of_two_right], "http://unused", emit)
    loop.consumed_samples = lambda: consumed[0]
    asyncio.run(main())
    assert started_at == [4, 8, 12], started_at  # one step's worth of rollouts per consumed step
    assert loop.started == 20 and sorted(r.position for r in reports(items)) == list(range(10))
    assert max(r.metrics["rollout/samples_ahead"] for r in reports(items)) <= 4 + 4  # a finishing group's own samples


def test_without_a_trainer_behind_the_loop_there_is_no_staleness_budget(tokenizer) -> None:  # noqa: ANN001
    loop, items = drive(ScriptedLoop, tokenizer, dataset(6), max_staleness=0, per_device_train_batch_size=2, num_train_epochs=1)
    assert len(reports(items)) == 6 and all(r.metrics["rollout/samples_ahead"] == -1 for r in reports(items))

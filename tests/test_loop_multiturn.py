"""The loop's multi-turn path on a scripted generation client: tools, environments, budget, reconcile.

The client here stands in for vLLM only to make each scenario exact (which call, which failure);
the same paths run against the real server in ``integration/test_tools.py``.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from grpo_core.config import AsyncGRPOConfig
from grpo_core.rollout.stages import AsyncRolloutLoop, reconcile_metrics
from grpo_core.rollout.token_prompts import sampled_exactly
from grpo_core.rollout.types import RolloutGroup, merge_counters
from grpo_core.training.step_metrics import derived_rollout_metrics
from grpo_core.vllm_server.replies import GeneratedChoice
from tests.test_loop_templates import COMPACT_ARGS_TEMPLATE, NO_THINK_TEMPLATE, with_template

# --------------------------------------------------------------------------------------------------
# Module-level tools and environments (the worker finds them by name)
# --------------------------------------------------------------------------------------------------

CALLS: list[str] = []


def calculator(expression: str) -> str:
    """Evaluate a sum of integers.

    Args:
        expression: Such as "7 + 5".
    """
    CALLS.append(expression)
    return str(sum(int(x) for x in expression.split("+")))


def broken(x: int) -> str:
    """Always raises.

    Args:
        x: Any number.
    """
    raise ValueError(f"cannot handle {x}")


def slow(seconds: float) -> str:
    """Sleeps in its thread.

    Args:
        seconds: How long.
    """
    time.sleep(seconds)
    return "done"


async def async_upper(text: str) -> str:
    """An async tool.

    Args:
        text: What to upper-case.
    """
    await asyncio.sleep(0)
    return text.upper()


class CounterEnv:
    """Counts; rewards 1 when the count reaches the row's target. Sync methods."""

    instances: list["CounterEnv"] = []

    def __init__(self) -> None:
        self.count = 0
        self.target = -1
        self.closed = False
        self.threads: set[str] = set()
        CounterEnv.instances.append(self)

    def reset(self, target: str, **_: Any) -> str:
        self.target = int(target)
        self.threads.add(threading.current_thread().name)
        return f" Count to {target}."

    def increment(self, by: int) -> str:
        """Add to the counter.

        Args:
            by: How much to add.
        """
        self.count += by
        self.threads.add(threading.current_thread().name)
        return str(self.count)

    def get_reward(self, completion: list[dict[str, Any]]) -> float:
        return 1.0 if self.count == self.target else 0.0

    def close(self) -> None:
        self.closed = True


class AsyncEnv:
    """All methods async; no reset; reward None (the environment declines to score)."""

    async def shout(self, text: str) -> str:
        """Upper-case the text.

        Args:
            text: What to upper-case.
        """
        return text.upper()

    async def get_reward(self, completion: list[dict[str, Any]]) -> float | None:
        return None


class ClashingEnv:
    def calculator(self, expression: str) -> str:
        """Same name as the module-level tool."""
        return expression


# --------------------------------------------------------------------------------------------------
# A scripted client: the reply is a function of the rendered prompt
# --------------------------------------------------------------------------------------------------


def tool_call(name: str, arguments: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>'


class ScriptedClient:
    """Replies with ``script(prompt_text)``, tokenised, plus EOS; truncated to ``max_tokens``."""

    def __init__(self, tokenizer: Any, script: Callable[[str], str], max_model_len: int = 512,
                 delay: Callable[[str], float] = lambda prompt: 0.001) -> None:
        self.tokenizer = tokenizer
        self.script = script
        self.delay = delay
        self._max_model_len = max_model_len
        self.prompts: list[list[int]] = []
        self.max_tokens: list[int] = []

    async def generate(self, token_ids: list[int], params: dict[str, Any], num_top: int = 0) -> list[GeneratedChoice]:
        self.prompts.append(list(token_ids))
        self.max_tokens.append(params["max_tokens"])
        prompt = self.tokenizer.decode(token_ids)
        text = self.script(prompt)
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"] + [self.tokenizer.eos_token_id]
        finish = "stop" if len(ids) <= params["max_tokens"] else "length"
        ids = ids[: params["max_tokens"]]
        await asyncio.sleep(self.delay(prompt))  # the "server" generating
        top_ids = np.tile(np.arange(num_top, dtype=np.int32), (len(ids), 1)) if num_top else None
        top_lp = np.full((len(ids), num_top), -2.0, dtype=np.float32) if num_top else None
        return [GeneratedChoice(ids, [-0.5] * len(ids), finish, top_ids, top_lp)]

    async def max_model_len(self) -> int:
        return self._max_model_len

    async def metrics_text(self) -> str | None:
        return None

    async def aclose(self) -> None:
        pass


def turn_index(prompt_text: str) -> int:
    return prompt_text.count("<tool_response>")


@pytest.fixture(scope="module")
def tokenizer():  # noqa: ANN201
    from grpo_core.tiny.spec import TaskSpec, TokenizerSpec
    from grpo_core.tiny.tokenizer import train_tokenizer

    return train_tokenizer(TaskSpec(), TokenizerSpec(), seed=0)


@pytest.fixture(autouse=True)
def _clear() -> None:
    CALLS.clear()
    CounterEnv.instances.clear()


PROMPT = [{"role": "user", "content": "What is 7 + 5?"}]
ROW = {"prompt": PROMPT, "solution": "12"}


def make_loop(tokenizer: Any, script: Callable[[str], str], *, tools=(), env=None, reward_funcs=(), **overrides: Any):  # noqa: ANN001, ANN201
    values: dict[str, Any] = dict(num_generations=2, max_completion_length=128, num_sampler_logprobs=2,
                                  max_concurrent_rollouts=4, report_to="none")
    values.update(overrides)
    config = AsyncGRPOConfig(**values)
    loop = AsyncRolloutLoop(config, tokenizer, [ROW], list(reward_funcs), "http://unused", emit=None,
                            tools=list(tools), environment_factory=env)
    loop.client = ScriptedClient(tokenizer, script)  # type: ignore[assignment]
    loop.max_model_len = 512
    return loop


def run(coro: Any) -> Any:
    return asyncio.run(coro)


# --------------------------------------------------------------------------------------------------
# Single turn and the tool loop
# --------------------------------------------------------------------------------------------------


def test_without_tools_one_turn_prompt_context_output_trained(tokenizer) -> None:  # noqa: ANN001
    loop = make_loop(tokenizer, lambda p: tool_call("calculator", '{"expression": "7 + 5"}'))
    rollout = run(loop.generate_one(0, ROW, 0))
    # No tools registered: a tool-call-looking answer is just text, and the rollout ends.
    assert len(rollout.turns) == 1 and CALLS == []
    assert rollout.messages[-1] == {"role": "assistant", "content": tool_call("calculator", '{"expression": "7 + 5"}')}
    (seq,) = loop.reconcile(rollout).sequences
    turn = rollout.turns[0]
    assert seq.token_ids.tolist() == turn.prompt_ids + turn.output_ids
    assert seq.completion_mask.tolist() == [False] * len(turn.prompt_ids) + [True] * len(turn.output_ids)


def calc_then_answer(prompt: str) -> str:
    if turn_index(prompt) == 0:
        return tool_call("calculator", '{"expression": "7 + 5"}')
    return "The answer is \\boxed{12}"


def test_tool_call_runs_and_result_is_fed_back(tokenizer) -> None:  # noqa: ANN001
    loop = make_loop(tokenizer, calc_then_answer, tools=[calculator])
    rollout = run(loop.generate_one(0, ROW, 0))
    assert CALLS == ["7 + 5"]
    roles = [m["role"] for m in rollout.messages]
    assert roles == ["user", "assistant", "tool", "assistant"]
    assert rollout.messages[1]["tool_calls"][0]["function"] == {"name": "calculator", "arguments": {"expression": "7 + 5"}}
    assert rollout.messages[2] == {"role": "tool", "name": "calculator", "content": "12"}
    assert "<tool_response>\n12\n</tool_response>" in tokenizer.decode(rollout.turns[1].prompt_ids)
    assert '"name": "calculator"' in tokenizer.decode(rollout.turns[0].prompt_ids)  # schema offered
    assert rollout.metrics["tools/calculator/calls"] == 1 and rollout.metrics["tools/calculator/errors"] == 0
    assert rollout.metrics["rollout/turns"] == 2

    result = loop.reconcile(rollout)
    assert result.turn_kinds == [None, "clean"]
    (seq,) = result.sequences  # one sequence: both answers trained, the tool result is context
    t0, t1 = rollout.turns
    assert seq.token_ids.tolist() == t1.prompt_ids + t1.output_ids
    trained = seq.token_ids[seq.completion_mask].tolist()
    assert trained == t0.output_ids + t1.output_ids
    response_start = len(t0.prompt_ids) + len(t0.output_ids)
    assert not seq.completion_mask[response_start: len(t1.prompt_ids)].any()


def test_calls_run_in_model_order_and_errors_go_back_as_text(tokenizer) -> None:  # noqa: ANN001
    def script(prompt: str) -> str:
        if turn_index(prompt) == 0:
            return "\n".join([tool_call("calculator", '{"expression": "1 + 1"}'), tool_call("broken", '{"x": 3}'),
                              tool_call("calculator", '{"expression": "2 + 2"}'), tool_call("nope", "{}"),
                              "<tool_call>\n{not json}\n</tool_call>"])
        return "\\boxed{4}"

    loop = make_loop(tokenizer, script, tools=[calculator, broken])
    rollout = run(loop.generate_one(0, ROW, 0))
    assert CALLS == ["1 + 1", "2 + 2"]
    results = [m for m in rollout.messages if m["role"] == "tool"]
    assert [r["content"] for r in results[:3]] == ["2", "Error: ValueError: cannot handle 3", "4"]
    assert "unknown tool 'nope'" in results[3]["content"] and "not valid JSON" in results[4]["content"]
    # A malformed call cannot be re-rendered by a template: the turn keeps its raw text.
    assert "tool_calls" not in rollout.messages[1] and "{not json}" in rollout.messages[1]["content"]
    m = rollout.metrics
    assert (m["tools/calculator/calls"], m["tools/calculator/errors"]) == (2, 0)
    assert (m["tools/broken/calls"], m["tools/broken/errors"]) == (1, 1)
    assert m["rollout/tool_calls"] == 5 and m["rollout/tool_call_errors"] == 3 and m["rollout/unknown_tool_calls"] == 2
    assert not any("nope" in key for key in m)  # a made-up name never becomes a metric


def test_tool_timeout_returns_error_and_counts(tokenizer) -> None:  # noqa: ANN001
    script = lambda p: tool_call("slow", '{"seconds": 2}') if turn_index(p) == 0 else "\\boxed{1}"  # noqa: E731
    loop = make_loop(tokenizer, script, tools=[slow], tool_timeout_s=0.2)
    start = time.perf_counter()
    rollout = run(loop.generate_one(0, ROW, 0))
    assert time.perf_counter() - start < 1.5
    assert rollout.messages[2]["content"] == "Error: tool 'slow' timed out after 0.2 s."
    assert rollout.metrics["tools/slow/timeouts"] == 1 and rollout.metrics["tools/slow/errors"] == 1
    assert 0.15 < rollout.metrics["tools/slow/latency_s_max"] < 1.0
    loop.pool.shutdown(wait=False)


def test_max_tool_calling_iterations_caps_the_loop(tokenizer) -> None:  # noqa: ANN001
    loop = make_loop(tokenizer, lambda p: tool_call("calculator", '{"expression": "1 + 1"}'), tools=[calculator],
                     max_tool_calling_iterations=2)
    rollout = run(loop.generate_one(0, ROW, 0))
    assert len(CALLS) == 2 and len(rollout.turns) == 3
    assert rollout.metrics["rollout/tool_iterations_capped"] == 1
    assert rollout.messages[-1]["role"] == "assistant"  # the third turn's calls were not run


def test_completion_budget_is_summed_over_turns(tokenizer) -> None:  # noqa: ANN001
    loop = make_loop(tokenizer, lambda p: tool_call("calculator", '{"expression": "1 + 1"}'), tools=[calculator],
                     max_completion_length=60)
    rollout = run(loop.generate_one(0, ROW, 0))
    generated = sum(len(t.output_ids) for t in rollout.turns)
    assert generated == 60
    assert loop.client.max_tokens[0] == 60 and loop.client.max_tokens[1] == 60 - len(rollout.turns[0].output_ids)
    # The last turn was cut off mid-call: its call is not run.
    assert rollout.turns[-1].finish_reason == "length" and rollout.metrics["rollout/truncated_tool_turns"] == 1
    assert len(CALLS) == len(rollout.turns) - 1


def test_async_tool_is_awaited(tokenizer) -> None:  # noqa: ANN001
    script = lambda p: tool_call("async_upper", '{"text": "hi"}') if turn_index(p) == 0 else "\\boxed{1}"  # noqa: E731
    loop = make_loop(tokenizer, script, tools=[async_upper])
    rollout = run(loop.generate_one(0, ROW, 0))
    assert rollout.messages[2]["content"] == "HI"


def test_slow_sync_tool_does_not_block_other_rollouts(tokenizer) -> None:  # noqa: ANN001
    # The SLOW rollout's first turn returns at once and calls a tool that sleeps 1.5 s in its thread;
    # the other rollouts' requests take 0.3 s, so they are in flight while the tool sleeps. Had the
    # tool run on the event loop, their replies could not be read until it returned.
    def script(prompt: str) -> str:
        if "SLOW" in prompt and turn_index(prompt) == 0:
            return tool_call("slow", '{"seconds": 1.5}')
        return "\\boxed{1}"

    loop = make_loop(tokenizer, script, tools=[slow])
    loop.client = ScriptedClient(tokenizer, script, delay=lambda p: 0.0 if "SLOW" in p else 0.3)  # type: ignore[assignment]
    slow_row = {"prompt": [{"role": "user", "content": "SLOW"}], "solution": "1"}

    async def timed(row: dict[str, Any]) -> float:
        start = time.perf_counter()
        await loop.generate_one(0, row, 0)
        return time.perf_counter() - start

    async def main() -> list[float]:
        return await asyncio.gather(timed(slow_row), *(timed(ROW) for _ in range(3)))

    slow_s, *quick = run(main())
    assert slow_s > 1.4
    assert max(quick) < 0.5 * 1.5, f"quick rollouts took {quick} while a sync tool slept"


# --------------------------------------------------------------------------------------------------
# Environments
# --------------------------------------------------------------------------------------------------


def test_environment_reset_tools_reward_and_close(tokenizer) -> None:  # noqa: ANN001
    def script(prompt: str) -> str:
        k = turn_index(prompt)
        return tool_call("increment", '{"by": 2}') if k < 2 else "done"

    loop = make_loop(tokenizer, script, tools=[calculator], env=CounterEnv)
    row = {"prompt": PROMPT, "target": "4"}
    rollout = run(loop.generate_one(0, row, 0))
    (env,) = CounterEnv.instances
    assert rollout.messages[0]["content"] == "What is 7 + 5? Count to 4."  # reset's observation
    assert PROMPT[0]["content"] == "What is 7 + 5?"  # the dataset row is not mutated
    assert env.count == 4 and rollout.reward == 1.0 and env.closed
    # reset and the tool method ran in the tool pool, not on the event loop's thread.
    assert env.threads and all(name.startswith("rollout-tool") for name in env.threads)
    first_prompt = tokenizer.decode(rollout.turns[0].prompt_ids)
    assert '"name": "increment"' in first_prompt and '"name": "calculator"' in first_prompt
    assert '"name": "reset"' not in first_prompt and '"name": "get_reward"' not in first_prompt
    m = rollout.metrics
    assert m["tools/increment/calls"] == 2 and m["env/rollouts"] == 1 and m["env/scored"] == 1
    assert m["env/reward_sum"] == 1.0 and m["env/reset_s_sum"] >= 0


def test_each_rollout_gets_its_own_environment(tokenizer) -> None:  # noqa: ANN001
    loop = make_loop(tokenizer, lambda p: tool_call("increment", '{"by": 1}') if turn_index(p) == 0 else "x",
                     env=CounterEnv)
    row = {"prompt": PROMPT, "target": "1"}

    async def both() -> list[Any]:
        return await asyncio.gather(loop.generate_one(0, row, 0), loop.generate_one(0, row, 1))

    rollouts = run(both())
    assert [r.reward for r in rollouts] == [1.0, 1.0]
    assert len(CounterEnv.instances) == 2 and all(e.count == 1 for e in CounterEnv.instances)


def test_async_environment_without_reset_and_unscored(tokenizer) -> None:  # noqa: ANN001
    loop = make_loop(tokenizer, lambda p: tool_call("shout", '{"text": "a"}') if turn_index(p) == 0 else "b",
                     env=AsyncEnv)
    rollout = run(loop.generate_one(0, ROW, 0))
    assert rollout.messages[2]["content"] == "A" and rollout.reward is None
    assert rollout.metrics["env/rollouts"] == 1 and "env/scored" not in rollout.metrics


def test_environment_method_clashing_with_a_tool_fails(tokenizer) -> None:  # noqa: ANN001
    loop = make_loop(tokenizer, lambda p: "x", tools=[calculator], env=ClashingEnv)
    with pytest.raises(ValueError, match="environment method 'calculator'"):
        run(loop.generate_one(0, ROW, 0))


# --------------------------------------------------------------------------------------------------
# Scoring: reward functions (sync, async) plus the rollout's own reward
# --------------------------------------------------------------------------------------------------


def contains_twelve(prompts: list[Any], completions: list[Any], **kwargs: Any) -> list[float]:
    return [1.0 if "12" in c[-1]["content"] else 0.0 for c in completions]


async def async_judge(prompts: list[Any], completions: list[Any], solution: list[str], **kwargs: Any) -> list[float | None]:
    await asyncio.sleep(0)
    return [None if i == 0 else 0.5 for i in range(len(completions))]


def test_score_sums_weighted_functions_and_rollout_reward(tokenizer) -> None:  # noqa: ANN001
    loop = make_loop(tokenizer, calc_then_answer, tools=[calculator], env=CounterEnv,
                     reward_funcs=[contains_twelve, async_judge], reward_weights=[2.0, 1.0])
    row = {"prompt": PROMPT, "target": "0", "solution": "12"}

    async def group() -> RolloutGroup:
        rollouts = [await loop.generate_one(0, row, i) for i in range(2)]
        g = RolloutGroup(row_index=0, epoch=0, prompt=PROMPT, rollouts=rollouts, row=row)
        await loop.score(g)
        return g

    g = run(group())
    # contains_twelve = 1 (x2), async_judge = None then 0.5, environment: count 0 == target 0 -> 1.
    # Exact: weights and rewards are small binary fractions, so products and sums are exact (NaN = NaN here).
    np.testing.assert_array_equal(g.rewards, [2.0 + 1.0, 2.0 + 0.5 + 1.0])
    np.testing.assert_array_equal(g.rewards_per_func, [[1.0, np.nan], [1.0, 0.5]])


# --------------------------------------------------------------------------------------------------
# Reconcile through the loop: REALIGN and FORK templates
# --------------------------------------------------------------------------------------------------


def test_compact_arguments_template_realigns_in_the_loop(tokenizer) -> None:  # noqa: ANN001
    loop = make_loop(with_template(tokenizer, COMPACT_ARGS_TEMPLATE), calc_then_answer, tools=[calculator],
                     multi_turn_prompts="messages")
    rollout = run(loop.generate_one(0, ROW, 0))
    result = loop.reconcile(rollout)
    assert result.turn_kinds == [None, "realign"] and len(result.sequences) == 1
    (seq,) = result.sequences
    t0, t1 = rollout.turns
    assert seq.token_ids.tolist() == t1.prompt_ids + t1.output_ids  # the re-rendered history is kept
    # The re-serialised arguments became context; the rest of the call and the answer stay trained.
    assert 0 < result.stats.realigned_tokens < 10
    assert seq.num_trained == len(t0.output_ids) + len(t1.output_ids) - result.stats.realigned_tokens


def test_no_think_template_forks_in_the_loop(tokenizer) -> None:  # noqa: ANN001
    loop = make_loop(with_template(tokenizer, NO_THINK_TEMPLATE), calc_then_answer, tools=[calculator],
                     multi_turn_prompts="messages")
    rollout = run(loop.generate_one(0, ROW, 0))
    result = loop.reconcile(rollout)
    assert result.turn_kinds == [None, "fork"] and len(result.sequences) == 2
    t0, t1 = rollout.turns
    first, second = result.sequences
    assert first.token_ids.tolist() == t0.prompt_ids + t0.output_ids
    assert second.token_ids.tolist() == t1.prompt_ids + t1.output_ids
    counters = merge_counters([reconcile_metrics([result])])
    assert derived_rollout_metrics(counters)["rollout/fork_frac"] == 1.0

    group = RolloutGroup(row_index=0, epoch=0, prompt=PROMPT, rollouts=[rollout], row=ROW, rewards=np.array([1.0]))
    samples = loop.samples_of(group, np.array([0.5]), position=7, reconciled=[result])
    assert [s.num_trained for s in samples] == [len(t0.output_ids), len(t1.output_ids)]
    assert all(s.advantage == 0.5 and s.rollout_id == rollout.rollout_id for s in samples)
    assert [s.sampler_top_ids.shape for s in samples] == [(len(t0.output_ids), 2), (len(t1.output_ids), 2)]
    assert [s.metrics["turns"] for s in samples] == [1.0, 1.0]


def test_sequence_without_trained_tokens_is_dropped(tokenizer) -> None:  # noqa: ANN001
    loop = make_loop(tokenizer, lambda p: "", max_completion_length=1)
    rollout = run(loop.generate_one(0, ROW, 0))
    rollout.turns[0].output_ids, rollout.turns[0].output_logprobs = [], []
    result = loop.reconcile(rollout)
    assert result.sequences == [] and result.stats.dropped_sequences == 1


@pytest.mark.parametrize("template", [None, COMPACT_ARGS_TEMPLATE, NO_THINK_TEMPLATE], ids=["tiny", "compact_args", "no_think"])
def test_token_path_trains_exactly_the_sampled_tokens(tokenizer, template) -> None:  # noqa: ANN001
    """The templates that realign or fork on the message path reconcile CLEAN on the token path: turn 1's prompt is
    turn 0's prompt and answer as sampled, then the tool result and the generation prompt."""
    loop = make_loop(with_template(tokenizer, template) if template else tokenizer, calc_then_answer, tools=[calculator])
    rollout = run(loop.generate_one(0, ROW, 0))
    result = loop.reconcile(rollout)
    t0, t1 = rollout.turns
    assert t1.prompt_ids[: len(t0.prompt_ids) + len(t0.output_ids)] == t0.prompt_ids + t0.output_ids
    assert result.turn_kinds == [None, "clean"] and len(result.sequences) == 1
    (seq,) = result.sequences
    assert seq.token_ids.tolist() == t1.prompt_ids + t1.output_ids
    assert seq.num_trained == len(t0.output_ids) + len(t1.output_ids)
    assert sampled_exactly(result.sequences, rollout.turns)
    assert "rollout/token_path_fallbacks" not in rollout.metrics
    # The continuation is what the template puts between the answer and the next generation prompt, and the
    # message path renders the same tool result (the tiny template re-renders the history byte for byte).
    text = tokenizer.decode(t1.prompt_ids[len(t0.prompt_ids) + len(t0.output_ids):], skip_special_tokens=False)
    assert text.startswith("\n<|im_start|>user\n<tool_response>\n12\n</tool_response><|im_end|>\n<|im_start|>assistant\n")


def test_message_path_realign_is_not_sampled_exactly(tokenizer) -> None:  # noqa: ANN001
    """The check the mismatch count uses tells a realigned rollout from an exact one."""
    loop = make_loop(with_template(tokenizer, COMPACT_ARGS_TEMPLATE), calc_then_answer, tools=[calculator],
                     multi_turn_prompts="messages")
    rollout = run(loop.generate_one(0, ROW, 0))
    assert not sampled_exactly(loop.reconcile(rollout).sequences, rollout.turns)


def test_token_path_falls_back_when_the_answer_has_no_end_of_turn(tokenizer) -> None:  # noqa: ANN001
    """An answer stopped without a special token leaves the token path nothing to close; that turn is re-rendered."""
    loop = make_loop(tokenizer, calc_then_answer, tools=[calculator])
    original = loop.client.generate

    async def without_end(*args: Any, **kwargs: Any):  # noqa: ANN202
        choices = await original(*args, **kwargs)
        for c in choices:
            if c.token_ids and c.token_ids[-1] in tokenizer.all_special_ids:
                c.token_ids, c.logprobs = c.token_ids[:-1], c.logprobs[:-1]
                if c.top_ids is not None:
                    c.top_ids, c.top_logprobs = c.top_ids[:-1], c.top_logprobs[:-1]
        return choices

    loop.client.generate = without_end
    rollout = run(loop.generate_one(0, ROW, 0))
    assert len(rollout.turns) == 2 and rollout.metrics["rollout/token_path_fallbacks"] == 1.0

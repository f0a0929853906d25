"""Tool use against the real CPU vLLM server, with the tiny model warmed up to call ``calculator``.

(a) Through ``AsyncGRPOTrainer``: rollouts call the tool, and their multi-turn samples (tool result as
context, the call and the answer trained) reach the optimizer step. Run three times, so that the second
turn's prompt lines up with the held tokens in each of the three ways (``tests/test_loop_templates.py``):
the tiny template re-renders a call, thought included, byte for byte (CLEAN); a template that
re-serialises the arguments compactly drifts inside the previous answer (REALIGN); a template that
drops earlier reasoning, as Qwen3's does, removes the thought the tools model writes before every
call, a drift of about eight tokens, which forks at ``fork_threshold_tokens=2`` (FORK: two samples per
rollout). The CLEAN run hands the tool over as an environment's method, so environments go through
the same path.
(b) On the loop directly: while tools sleep in the pool, rollouts that call none take as long as
their generation; with the same tool run on the event loop (the control) they wait out the sleeps.

The shared server holds the arithmetic model; each test pushes the tools model's weights first
(same architecture and tokenizer), as every trainer does at start-up.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import statistics
import time
from typing import Any

import numpy as np
import pytest
import torch

from grpo_core.config import AsyncGRPOConfig
from grpo_core.rewards import accuracy_reward
from grpo_core.rollout.agent import RolloutTools
from grpo_core.rollout.stages import AsyncRolloutLoop
from grpo_core.rollout.tool_calls import ToolRegistry
from grpo_core.rollout.types import RolloutSample
from grpo_core.tiny import CALCULATOR_SCHEMA, arithmetic_dataset, build_tiny_model
from grpo_core.tiny import calculator as tiny_calculator
from grpo_core.training.collector import StepBatch
from grpo_core.training.trainer import AsyncGRPOTrainer
from tests.test_loop_templates import COMPACT_ARGS_TEMPLATE, DROP_REASONING_TEMPLATE, with_template

pytestmark = pytest.mark.integration

SLEEP_S = 0.0
"""How long ``calculator`` sleeps; the timing test sets it (the tool runs in-process there)."""
SLEEPS: list[tuple[float, float]] = []
"""(start, end) ``perf_counter`` of every call (and its sleep, if any), for the timing test."""


def calculator(expression: str):  # noqa: ANN201 - no return hint: the schema must be CALCULATOR_SCHEMA
    """Evaluate an integer arithmetic expression.

    Args:
        expression: such as 7 + 5
    """
    start = time.perf_counter()
    if SLEEP_S:
        time.sleep(SLEEP_S)
    SLEEPS.append((start, time.perf_counter()))
    return tiny_calculator(expression)


class CalculatorEnv:
    """The calculator as an environment: its one public method is the tool; it rewards using it."""

    def __init__(self) -> None:
        self.calls = 0

    def reset(self, solution: str, **_: Any) -> None:
        self.solution = solution

    def calculator(self, expression: str):  # noqa: ANN201 - no return hint: the schema must be CALCULATOR_SCHEMA
        """Evaluate an integer arithmetic expression.

        Args:
            expression: such as 7 + 5
        """
        self.calls += 1
        return tiny_calculator(expression)

    def get_reward(self, completion: list[dict[str, Any]]) -> float:
        return 0.5 if self.calls else 0.0


def called_calculator(prompts: list[Any], completions: list[Any], **kwargs: Any) -> list[float]:
    """1 for a rollout that called the calculator. Only a few percent of the tools model's rollouts do,
    so this reward is what puts tool use in the trained batch: a group in which nobody called has
    equal rewards and is dropped, as every group without a spread is."""
    return [float(any(c.get("function", {}).get("name") == "calculator" for m in comp for c in m.get("tool_calls") or []))
            for comp in completions]


class RecordingTrainer(AsyncGRPOTrainer):
    """Keeps every sample that reached an optimizer step."""

    def training_step(self, batch: StepBatch) -> dict[str, float]:
        self.__dict__.setdefault("trained_samples", []).extend(batch.samples)
        return super().training_step(batch)


@pytest.fixture(scope="module")
def tools_model_path() -> str:
    return str(build_tiny_model(variant="tools"))


@pytest.fixture(scope="module")
def tools_tokenizer(tools_model_path: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tools_model_path)


def config(server_url: str, tmp_path: Any, **overrides: Any) -> AsyncGRPOConfig:
    values: dict[str, Any] = dict(
        output_dir=str(tmp_path / "run"), vllm_server_base_url=server_url, report_to="none", max_steps=2,
        learning_rate=1e-5, num_generations=8, per_device_train_batch_size=16, max_completion_length=64,
        save_strategy="no", num_sampler_logprobs=4, max_concurrent_rollouts=16, queue_maxsize=64,
        reward_weights=[1.0, 0.0],  # accuracy is logged, not trained on: only tool use makes a spread
    )
    values.update(overrides)
    return AsyncGRPOConfig(**values)


def total(history: list[dict[str, float]], key: str) -> float:
    return sum(h.get(key, 0.0) for h in history)


def context_text(tokenizer: Any, sample: RolloutSample) -> str:
    return tokenizer.decode(sample.token_ids[~sample.completion_mask].tolist())


TEMPLATES = {"clean": None, "realign": COMPACT_ARGS_TEMPLATE, "fork": DROP_REASONING_TEMPLATE}


@pytest.mark.parametrize("kind", ["clean", "realign", "fork"])
def test_tool_rollouts_reach_the_trainer(vllm_server, tools_model_path, tools_tokenizer, tmp_path, kind) -> None:  # noqa: ANN001
    tokenizer = tools_tokenizer if TEMPLATES[kind] is None else with_template(tools_tokenizer, TEMPLATES[kind])
    tool_kwargs: dict[str, Any] = {"environment_factory": CalculatorEnv} if kind == "clean" else {"tools": [calculator]}
    # The tiny policy calls the calculator only when shown the schema it was trained on; with another one
    # groups without a call have no reward spread and are dropped, and the run waits for minutes.
    shown = RolloutTools([], CalculatorEnv()) if kind == "clean" else RolloutTools([calculator])
    assert shown.schemas() == [CALCULATOR_SCHEMA]
    data = arithmetic_dataset(num_train=64, num_eval=4)["train"]
    trainer = RecordingTrainer(
        tools_model_path, [called_calculator, accuracy_reward], train_dataset=data,
        args=config(vllm_server.base_url, tmp_path, fork_threshold_tokens=2 if kind == "fork" else 1024,
                    # the message path: the token path turns every one of these CLEAN (test_token_path.py)
                    multi_turn_prompts="tokens" if kind == "clean" else "messages"),
        processing_class=tokenizer, **tool_kwargs,
    )
    history = trainer.train()
    samples: list[RolloutSample] = trainer.trained_samples

    assert len(history) == 2
    assert any(h.get("rollout/concurrency_cap", 0) >= 1 and "rollout/concurrency" in h for h in history)
    calls = total(history, "tools/calculator/calls")
    assert calls > 0 and total(history, "tools/calculator/errors") < calls, (calls, history[-1])
    assert all("tools/calculator/latency_s" in h for h in history if h.get("tools/calculator/calls"))
    assert total(history, f"rollout/{kind}_turns") > 0, {k: total(history, k) for k in
                                                          ("rollout/clean_turns", "rollout/realign_turns", "rollout/fork_turns")}
    kinds = {k: total(history, f"rollout/{k}_turns") for k in ("clean", "realign", "fork")}
    print(f"{kind}: {calls:.0f} calculator calls, later turns by kind {kinds}, {len(samples)} samples trained")
    # Samples holding a tool result reached the optimizer: the result is context, never trained.
    end_id = tokenizer.convert_tokens_to_ids("</tool_response>")
    with_result = [s for s in samples if end_id in s.token_ids.tolist()]
    assert with_result, "no sample with a tool result reached the trainer"
    split = [(s, int(np.flatnonzero(s.token_ids == end_id)[-1])) for s in with_result]
    assert all("<tool_response>" not in tokenizer.decode(s.token_ids[s.completion_mask].tolist()) for s in with_result)

    if kind in ("clean", "realign"):
        # One sequence for the whole rollout: the call before the result and the answer after it are
        # both trained (a realign only turns the re-serialised arguments into context).
        both = [s for s, end in split if s.completion_mask[:end].any() and s.completion_mask[end:].any()]
        assert both and all(s.metrics["turns"] >= 2 for s in both)
    if kind == "clean":
        assert total(history, "env/rollouts") > 0 and total(history, "env/scored") == total(history, "env/rollouts")
        assert any(h.get("rewards/rollout_reward/mean", 0.0) > 0 for h in history)
    if kind == "realign":
        assert total(history, "rollout/realigned_tokens") > 0
    if kind == "fork":
        assert max(h.get("rollout/fork_frac", 0.0) for h in history) > 0
        # After a fork the new sequence starts from the re-rendered history: the call and its result
        # are context, only the final answer is trained; the call was trained in the first sequence.
        restarted = [s for s, end in split if not s.completion_mask[:end].any() and s.completion_mask[end:].any()]
        assert restarted and all(s.metrics["turns"] == 1 for s in restarted)
        assert any(t.rollout_id == s.rollout_id and t is not s for s in restarted for t in samples)
        # What forked it: the thought was trained in the first sequence and is gone from the re-rendered
        # one. The template keeps what follows the last ``</think>``, so no closing tag survives in the
        # context; an opening tag may (the sampled model can write one after it, or never close it).
        assert all("</think>" not in context_text(tokenizer, s) for s in restarted)
        firsts = [t for s in restarted for t in samples if t.rollout_id == s.rollout_id and t is not s]
        assert any("<think>" in tokenizer.decode(t.token_ids[t.completion_mask].tolist()) for t in firsts)


# --------------------------------------------------------------------------------------------------
# A sleeping tool does not slow the other rollouts
# --------------------------------------------------------------------------------------------------


class InlineExecutor(concurrent.futures.Executor):
    """The control: runs a sync tool on the calling thread, i.e. on the event loop."""

    def submit(self, fn: Any, /, *args: Any, **kwargs: Any) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        future.set_result(fn(*args, **kwargs))
        return future


@pytest.fixture
def tools_policy_on_server(vllm_server, tools_model_path: str) -> str:  # noqa: ANN001
    from transformers import AutoModelForCausalLM

    from grpo_core.sync.protocol import ProtocolWeightSync
    from grpo_core.sync.source import ModelWeightSource
    from grpo_core.vllm_server.control import VLLMControlClient

    model = AutoModelForCausalLM.from_pretrained(tools_model_path, dtype=torch.float32)
    sync = ProtocolWeightSync(VLLMControlClient(vllm_server.base_url), ModelWeightSource(model), backend="gloo")
    sync.push(0)
    sync.close()
    return vllm_server.base_url


async def stream(loop: AsyncRolloutLoop, rows: list[dict[str, Any]], concurrency: int) -> list[tuple[float, float, bool]]:
    """One rollout per row, ``concurrency`` in flight at all times; per rollout (start, end, called a tool)."""
    slots = asyncio.Semaphore(concurrency)

    async def one(i: int) -> tuple[float, float, bool]:
        async with slots:
            start = time.perf_counter()
            rollout = await loop.generate_one(i, rows[i], 0)
            return start, time.perf_counter(), bool(rollout.metrics.get("tools/calculator/calls"))

    return await asyncio.gather(*(one(i) for i in range(len(rows))))


def test_sleeping_tool_does_not_slow_other_rollouts(tools_policy_on_server, tools_tokenizer) -> None:  # noqa: ANN001
    """Rollouts that call no tool but are in flight when another rollout's tool starts sleeping take as
    long as their generation. The control runs the same tool on the event loop: each of them then
    waits for the sleep to end, so it takes at least one sleep."""
    global SLEEP_S
    # The tiny policy calls the calculator only when shown the schema it was trained on.
    assert ToolRegistry([calculator]).schemas() == [CALCULATOR_SCHEMA]
    # 48 rows: a few percent of rollouts call the tool, so a stream of 48 has a qualifying call in most runs
    # (another stream is run when it has none), and the control stream waits a whole sleep per call.
    rows = [dict(r) for r in arithmetic_dataset(num_train=48, num_eval=4)["train"]]
    concurrency, sleep = 8, 8.0
    cfg = AsyncGRPOConfig(vllm_server_base_url=tools_policy_on_server, report_to="none", max_completion_length=48,
                          num_sampler_logprobs=0, max_concurrent_rollouts=concurrency, num_generations=2)

    def run_stream(inline: bool) -> list[tuple[float, float, bool]]:
        loop = AsyncRolloutLoop(cfg, tools_tokenizer, rows, [], tools_policy_on_server, emit=None, tools=[calculator])
        if inline:
            loop.pool = InlineExecutor()  # type: ignore[assignment]

        async def run() -> list[tuple[float, float, bool]]:
            await loop.connect()
            try:
                return await stream(loop, rows, concurrency)
            finally:
                await loop.close()

        SLEEPS.clear()
        return asyncio.run(run())

    def in_flight_at_a_call(inline: bool) -> list[float]:
        """Seconds of each tool-free rollout that was in flight when a tool call began. A few percent
        of rollouts call the calculator, so a stream is repeated in the rare case that none qualifies.
        (Rollouts caught in flight at an instant are the longer ones, so compare like with like.)"""
        seen = []
        for _ in range(5):
            times = run_stream(inline)
            hit = [e - s for s, e, called in times if not called and any(s < a < e for a, _ in SLEEPS)]
            if hit:
                return hit
            seen.append(f"{sum(called for *_, called in times)} of {len(times)} rollouts called the tool, "
                        f"{len(SLEEPS)} calls")
        raise AssertionError("in 5 streams no tool-free rollout was in flight when a tool call began: "
                             + "; ".join(seen))

    try:
        SLEEP_S = 0.0
        base = in_flight_at_a_call(inline=False)
        SLEEP_S = sleep
        pooled = in_flight_at_a_call(inline=False)
        blocked = in_flight_at_a_call(inline=True)
    finally:
        SLEEP_S = 0.0
    report = (f"tool-free rollouts in flight when another rollout's tool began: median {statistics.median(base):.2f} s "
              f"with an instant tool ({len(base)} rollouts); with a {sleep:g} s tool in the pool the median is "
              f"{statistics.median(pooled) / statistics.median(base):.2f}x that and the slowest took "
              f"{max(pooled) / sleep:.2f} sleeps ({len(pooled)} rollouts); with it on the event loop the median is "
              f"{statistics.median(blocked) / statistics.median(base):.1f}x and the fastest took "
              f"{min(blocked) / sleep:.2f} sleeps ({len(blocked)} rollouts)")
    print(report)
    assert max(pooled) < 0.5 * sleep, report
    assert min(blocked) > 0.8 * sleep, report

"""Held-out evaluation by sampling from a vLLM server (whatever weights it serves right now).

A held-out prompt is rolled out and scored by the run's own rollout loop (``rollout.stages.AsyncRolloutLoop``, or
the trainer's ``loop_cls``): the same turns, tools, environment sessions and ``get_reward``, the same reward
functions called the same way (sync or async, ``None`` for unscored, ``reward_weights``), so a verifiers rubric or a
reasoning-gym scorer scores a held-out answer exactly as it scores a trained one. Only the sampling differs from
training: ``num_generations_eval`` rollouts per prompt, and nothing is queued for training.

``evaluate_rewards`` (every reward function's mean and their weighted sum) is used by the job flow before
training and after the final weight sync (the first function's mean as the held-out accuracy) and by the
trainer every ``eval_steps`` right after a push, with the same settings (``AsyncGRPOConfig.do_eval``,
``num_generations_eval``, ``eval_strategy``, ``eval_steps``), so both measure the policy the server actually
serves, not a copy in the trainer.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from grpo_core.config import AsyncGRPOConfig
from grpo_core.data.inputs import as_messages, first_rows, refuse_images
from grpo_core.rollout.stages import AsyncRolloutLoop, rollout_rewards
from grpo_core.rollout.types import RolloutGroup

PROBLEM_COLUMN = "problem"
"""A data set column naming the problem each prompt asks, when several prompts ask one (the tiny task phrases each
problem 5 ways): the held-out intervals count problems, not prompts, as independent draws (``evaluation.intervals``)."""

OWN_REWARD = "rollout_reward"
"""The name an environment's ``get_reward`` (``Rollout.reward``) is reported under, as the rollout worker reports it."""


def problem_keys(dataset: Any) -> list[Any]:
    """Each row's problem: its ``PROBLEM_COLUMN`` value, or its own index when the data set has no such column."""
    rows = first_rows(dataset, 1 << 62)
    return [row.get(PROBLEM_COLUMN, index) for index, row in enumerate(rows)]


@dataclass
class EvalResult:
    accuracy: float  # mean of the first reward function (the flow's held-out accuracy)
    num_prompts: int
    num_samples: int
    mean_length: float
    per_func: dict[str, float] = field(default_factory=dict)  # mean of each reward function
    reward: float = float("nan")  # mean weighted sum, as the trainer sums rewards
    prompt_scores: list[float] = field(default_factory=list)  # the first function's mean per prompt (NaN: none judged)
    # The weight versions the completions were sampled under (oldest token of each), as the server reported them.
    versions: list[int] = field(default_factory=list)


@dataclass
class EvalRollouts:
    """How held-out prompts are rolled out: the run's loop class and what it is built from, as the trainer hands
    them to its rollout worker (``training.orchestrator.RolloutInputs``)."""

    reward_funcs: list[Callable[..., Any]]
    loop_cls: type[AsyncRolloutLoop] = AsyncRolloutLoop
    tools: list[Callable[..., Any]] = field(default_factory=list)
    environment_factory: Callable[[], Any] | None = None


async def _rollout_groups(loop: AsyncRolloutLoop, rows: list[dict[str, Any]], samples_per_prompt: int,
                          concurrency: int) -> list[RolloutGroup]:
    """Every row rolled out ``samples_per_prompt`` times and scored, by the loop's own stages; ``concurrency``
    prompts at a time."""
    # Per prompt, not per rollout: a prompt's rollouts start together, so the client sends their identical first
    # turns as one request for all of them (``rollout.generation``), as a group's are sent in training.
    gate = asyncio.Semaphore(concurrency)

    async def group(index: int, row: dict[str, Any]) -> RolloutGroup:
        async with gate:
            rollouts = await asyncio.gather(*(loop.generate_one(index, row, k) for k in range(samples_per_prompt)))
        scored = RolloutGroup(row_index=index, epoch=0, prompt=_prompt_messages(row), rollouts=list(rollouts), row=row)
        await loop.score(scored)
        return scored

    await loop.connect()
    try:
        await loop.setup()
        return list(await asyncio.gather(*(group(i, row) for i, row in enumerate(rows))))
    finally:
        await loop.close()


def _prompt_messages(row: dict[str, Any]) -> list[dict[str, Any]]:
    messages = as_messages(row["prompt"])
    refuse_images(messages, row)
    return messages


def summarise(groups: list[RolloutGroup]) -> EvalResult:
    """The scored groups as one result: each reward function's mean (an environment's own reward as
    ``OWN_REWARD``), the weighted sum's mean and the first function's mean per prompt (NaN-scored ones skipped)."""
    names = list(groups[0].reward_func_names) if groups else []
    per_func_values = [np.concatenate([g.rewards_per_func[:, j] for g in groups]) for j in range(len(names))]
    own = np.concatenate([rollout_rewards(g) for g in groups]) if groups else np.zeros(0)
    if own.size and not np.isnan(own).all():
        names.append(OWN_REWARD)
        per_func_values.append(own)
    per_func = {name: _nan_mean(values) for name, values in zip(names, per_func_values, strict=True)}
    first = per_func_values[0] if per_func_values else np.zeros(0)
    totals = np.concatenate([g.rewards for g in groups]) if groups else np.zeros(0)
    lengths = [sum(len(t.output_ids) for t in r.turns) for g in groups for r in g.rollouts]
    versions = [min((t.policy_version for t in r.turns), default=0) for g in groups for r in g.rollouts]
    return EvalResult(
        accuracy=next(iter(per_func.values()), float("nan")),
        num_prompts=len(groups),
        num_samples=len(lengths),
        mean_length=float(np.mean(lengths)) if lengths else 0.0,
        per_func=per_func,
        reward=_nan_mean(totals),
        prompt_scores=_per_prompt(first, [len(g.rollouts) for g in groups]) if first.size else [],
        versions=versions,
    )


def _per_prompt(values: np.ndarray, counts: list[int]) -> list[float]:
    # Completions are laid out prompt after prompt, ``counts[i]`` of them for prompt i.
    bounds = np.cumsum([0, *counts])
    return [_nan_mean(values[lo:hi]) for lo, hi in zip(bounds[:-1], bounds[1:], strict=True)]


def _nan_mean(values: np.ndarray) -> float:
    return float(np.nanmean(values)) if np.isfinite(values).any() else float("nan")


def evaluate_rewards(
    base_url: str,
    tokenizer: Any,
    dataset: Any,
    reward_funcs: list[Callable[..., Any]],
    *,
    weights: list[float] | None = None,
    samples_per_prompt: int = 4,
    temperature: float = 1.0,
    max_tokens: int = 64,
    concurrency: int = 32,
    tokens_endpoint: bool = True,
    config: AsyncGRPOConfig | None = None,
    rollouts: EvalRollouts | None = None,
    version: int = 0,
) -> EvalResult:
    """Every reward function's mean (and their weighted sum) over ``samples_per_prompt`` rollouts of each of
    ``dataset``'s prompts, rolled out and scored by the run's loop (module docstring); ``accuracy`` is the first
    function's mean.

    ``config`` is the run's (its tool, template and turn settings; a default config without one), with the
    evaluation's ``temperature``, ``max_tokens`` and ``weights`` in place of its own; ``rollouts`` the run's loop
    class, tools and environment factory (None: the plain loop with ``reward_funcs``). ``version`` is the weight
    version asked for: a completion dates to it when the server reports no versions of its own.
    """
    rows = first_rows(dataset, 1 << 62)
    for row in rows:
        _prompt_messages(row)  # a bad prompt is refused before any request
    setup = rollouts or EvalRollouts(reward_funcs=list(reward_funcs))
    if rollouts is not None and list(rollouts.reward_funcs) != list(reward_funcs):
        raise ValueError("evaluate_rewards: reward_funcs differ from rollouts.reward_funcs; pass the same functions")
    run_config = (config or AsyncGRPOConfig()).replace(
        temperature=temperature, max_completion_length=max_tokens, reward_weights=weights)
    loop = setup.loop_cls(
        config=run_config, tokenizer=tokenizer, dataset=dataset, reward_funcs=list(setup.reward_funcs),
        base_url=base_url, emit=_never_emits, tools=list(setup.tools),
        environment_factory=setup.environment_factory, tokens_endpoint=tokens_endpoint,
    )
    loop.served_version = lambda: version
    return summarise(asyncio.run(_rollout_groups(loop, rows, samples_per_prompt, concurrency)))


async def _never_emits(item: Any) -> float:
    raise RuntimeError("held-out evaluation queues nothing for training; an evaluation loop called emit()")


def evaluate_on_server(base_url: str, args: AsyncGRPOConfig, tokenizer: Any, dataset: Any, rollouts: EvalRollouts,
                       tokens_endpoint: bool = True, version: int = 0, concurrency: int = 32) -> dict[str, float]:
    """The trainer's ``evaluate()``: ``dataset`` rolled out on the server at ``base_url`` (serving weight
    ``version``) with the run's settings (``args``: reward weights, samples per prompt, temperature, completion
    length, tools), ``concurrency`` prompts at once, and scored; ``eval/*`` metrics."""
    start = time.perf_counter()
    result = evaluate_rewards(
        base_url, tokenizer, dataset, rollouts.reward_funcs,
        weights=args.reward_weights,
        samples_per_prompt=args.num_eval_generations(),
        temperature=args.temperature,
        max_tokens=args.max_completion_length,
        tokens_endpoint=tokens_endpoint,
        config=args,
        rollouts=rollouts,
        version=version,
        concurrency=concurrency,
    )
    return eval_metrics(result, time.perf_counter() - start, version)


def eval_metrics(result: EvalResult, seconds: float, version: int) -> dict[str, float]:
    """``eval/*`` metrics of one evaluation of weight ``version``."""
    metrics = {"eval/reward": result.reward, "eval/completion_length": result.mean_length, "eval/seconds": seconds,
               # The share of completions sampled entirely under the version asked for (the server may have taken a
               # newer one while the evaluation ran beside training).
               "eval/version_share": float(np.mean([v == version for v in result.versions])) if result.versions
               else float("nan")}
    metrics.update({f"eval/rewards/{name}": value for name, value in result.per_func.items()})
    return metrics

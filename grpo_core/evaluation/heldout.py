"""Held-out evaluation by sampling from the vLLM server (whatever weights it serves right now).

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

from grpo_core.data.inputs import as_messages, first_rows, refuse_images, reward_name
from grpo_core.rollout.generation import VLLMGenerateClient


PROBLEM_COLUMN = "problem"
"""A data set column naming the problem each prompt asks, when several prompts ask one (the tiny task phrases each
problem 5 ways): the held-out intervals count problems, not prompts, as independent draws (``evaluation.intervals``)."""


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


async def _evaluate(
    base_url: str,
    tokenizer: Any,
    prompts: list[list[dict[str, Any]]],
    columns: dict[str, list[Any]],
    reward_funcs: list[Callable[..., Any]],
    weights: list[float] | None,
    samples_per_prompt: int,
    temperature: float,
    max_tokens: int,
    seed: int | None,
    concurrency: int,
    tokens_endpoint: bool,
) -> EvalResult:
    client = VLLMGenerateClient(base_url, tokens_endpoint=tokens_endpoint)
    gate = asyncio.Semaphore(concurrency)
    context = await client.max_model_len()

    async def one(i: int) -> list[tuple[str, int]]:
        text = tokenizer.apply_chat_template(prompts[i], tokenize=False, add_generation_prompt=True)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        # Never past the server's context, as in training.
        params: dict[str, Any] = {"max_tokens": max(1, min(max_tokens, context - len(ids))), "temperature": temperature,
                                  "n": samples_per_prompt}
        if seed is not None:
            params["seed"] = seed + i
        async with gate:
            choices = await client.generate(ids, params)
        return [(tokenizer.decode(c.token_ids, skip_special_tokens=True), len(c.token_ids)) for c in choices]

    try:
        outputs = await asyncio.gather(*(one(i) for i in range(len(prompts))))
    finally:
        await client.aclose()
    flat_prompts, completions, lengths = [], [], []
    flat_columns: dict[str, list[Any]] = {k: [] for k in columns}
    for i, outs in enumerate(outputs):
        for text, n in outs:
            flat_prompts.append(prompts[i])
            completions.append([{"role": "assistant", "content": text}])
            lengths.append(n)
            for k in columns:
                flat_columns[k].append(columns[k][i])
    per_func: dict[str, float] = {}
    weighted = np.zeros(len(completions))
    scored = np.zeros(len(completions), dtype=bool)
    for j, func in enumerate(reward_funcs):
        scores = func(prompts=flat_prompts, completions=completions, **flat_columns)
        values = np.array([np.nan if v is None else float(v) for v in scores])
        if j == 0:
            first_values = values
        per_func[reward_name(func)] = _nan_mean(values)
        weighted += np.nan_to_num(values) * (weights[j] if weights else 1.0)
        scored |= ~np.isnan(values)
    first = next(iter(per_func.values()), float("nan"))
    prompt_scores = _per_prompt(first_values, [len(outs) for outs in outputs]) if reward_funcs else []
    return EvalResult(
        accuracy=first,
        num_prompts=len(prompts),
        num_samples=len(completions),
        mean_length=float(np.mean(lengths)) if lengths else 0.0,
        per_func=per_func,
        reward=float(weighted[scored].mean()) if scored.any() else float("nan"),
        prompt_scores=prompt_scores,
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
    seed: int | None = None,
    concurrency: int = 32,
    tokens_endpoint: bool = True,
) -> EvalResult:
    """Every reward function's mean (and their weighted sum) over sampled completions of ``dataset``'s prompts
    (NaN-scored ones skipped); ``accuracy`` is the first function's.

    ``seed`` (prompt i gets ``seed + i``) makes the samples repeatable on GPU servers. It stays off by
    default because vLLM's CPU build fails its engine on a seeded request whose prefill is split
    across scheduler steps ("CPU Generator does not use offset"), which happens as soon as the
    prompts in flight exceed the server's batched-token budget.
    """
    rows = first_rows(dataset, 1 << 62)
    prompts = [as_messages(r["prompt"]) for r in rows]
    for prompt, row in zip(prompts, rows):
        refuse_images(prompt, row)
    columns = {k: [r[k] for r in rows] for k in rows[0] if k != "prompt"} if rows else {}
    return asyncio.run(
        _evaluate(base_url, tokenizer, prompts, columns, reward_funcs, weights, samples_per_prompt, temperature, max_tokens,
                  seed, concurrency, tokens_endpoint)
    )


def evaluate_on_server(base_url: str, args: Any, tokenizer: Any, dataset: Any, reward_funcs: list[Callable[..., Any]],
                       tokens_endpoint: bool = True) -> dict[str, float]:
    """The trainer's ``evaluate()``: ``dataset`` sampled from the server at ``base_url`` with the run's settings
    (``args``, the config's evaluation section ``config.evaluation``: reward weights, samples per prompt,
    temperature, completion length) and scored; ``eval/*`` metrics."""
    start = time.perf_counter()
    result = evaluate_rewards(
        base_url, tokenizer, dataset, reward_funcs,
        weights=args.reward_weights,
        samples_per_prompt=args.num_eval_generations(),
        temperature=args.temperature,
        max_tokens=args.max_completion_length,
        tokens_endpoint=tokens_endpoint,
    )
    metrics = {"eval/reward": result.reward, "eval/completion_length": result.mean_length,
               "eval/seconds": time.perf_counter() - start}
    metrics.update({f"eval/rewards/{name}": value for name, value in result.per_func.items()})
    return metrics

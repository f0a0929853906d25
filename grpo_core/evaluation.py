"""Held-out evaluation by sampling from the vLLM server (whatever weights it serves right now).

Used by the flow before training and after the final weight sync, so "after" measures the policy
the server actually serves, not a copy in the trainer.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from grpo_core.rollout.client import VLLMGenerateClient


@dataclass
class EvalResult:
    accuracy: float
    num_prompts: int
    num_samples: int
    mean_length: float


async def _evaluate(
    base_url: str,
    tokenizer: Any,
    prompts: list[list[dict[str, Any]]],
    columns: dict[str, list[Any]],
    reward_func: Callable[..., list[float | None]],
    samples_per_prompt: int,
    temperature: float,
    max_tokens: int,
    seed: int | None,
    concurrency: int,
) -> EvalResult:
    client = VLLMGenerateClient(base_url)
    gate = asyncio.Semaphore(concurrency)

    async def one(i: int) -> list[tuple[str, int]]:
        text = tokenizer.apply_chat_template(prompts[i], tokenize=False, add_generation_prompt=True)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        params: dict[str, Any] = {"max_tokens": max_tokens, "temperature": temperature, "n": samples_per_prompt}
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
    scores = reward_func(flat_prompts, completions, **flat_columns)
    values = np.array([np.nan if s is None else float(s) for s in scores])
    return EvalResult(
        accuracy=float(np.nanmean(values)) if np.isfinite(values).any() else float("nan"),
        num_prompts=len(prompts),
        num_samples=len(completions),
        mean_length=float(np.mean(lengths)) if lengths else 0.0,
    )


def evaluate_on_server(
    base_url: str,
    tokenizer: Any,
    dataset: Any,
    reward_func: Callable[..., list[float | None]],
    *,
    samples_per_prompt: int = 4,
    temperature: float = 1.0,
    max_tokens: int = 64,
    seed: int | None = None,
    concurrency: int = 32,
    max_prompts: int | None = None,
) -> EvalResult:
    """Mean of ``reward_func`` over sampled completions of ``dataset``'s prompts (NaN-scored ones skipped).

    ``seed`` (prompt i gets ``seed + i``) makes the samples repeatable on GPU servers. It stays off by
    default because vLLM's CPU build fails its engine on a seeded request whose prefill is split
    across scheduler steps ("CPU Generator does not use offset"), which happens as soon as the
    prompts in flight exceed the server's batched-token budget.
    """
    n = len(dataset) if max_prompts is None else min(max_prompts, len(dataset))
    rows = [dataset[i] for i in range(n)]
    prompts = [list(r["prompt"]) for r in rows]
    columns = {k: [r[k] for r in rows] for k in rows[0] if k != "prompt"} if rows else {}
    return asyncio.run(
        _evaluate(base_url, tokenizer, prompts, columns, reward_func, samples_per_prompt, temperature, max_tokens, seed, concurrency)
    )

"""``AsyncRolloutLoop``: what the rollout process does for each prompt, one overridable method per stage.

    filter_prompt → generate_one (× num_generations) → score → compute_advantages → samples

The loop runs in its own process and its own asyncio event loop. Subclass it (at module level, so
it pickles) and set ``loop_cls`` on a trainer subclass to change a stage; build clients in
``setup()``, which runs inside the event loop, rather than in ``__init__``.
"""

from __future__ import annotations

import asyncio
import inspect
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from grpo_core.advantages import group_advantages, should_drop_group
from grpo_core.config import AsyncGRPOConfig
from grpo_core.rollout.client import GeneratedChoice, VLLMGenerateClient
from grpo_core.rollout.types import GroupReport, Rollout, RolloutGroup, RolloutSample, TurnRecord


def prompt_order(num_prompts: int, epoch: int, seed: int) -> np.ndarray:
    """The order in which epoch ``epoch`` visits the prompts (a seeded permutation, stable across resumes)."""
    return np.random.default_rng([seed, epoch]).permutation(num_prompts)


def reward_func_name(func: Callable[..., Any]) -> str:
    name = getattr(func, "__name__", None) or type(func).__name__
    return str(name)


def version_number(version: str) -> int:
    """Weight versions are the trainer's step numbers as strings; the server starts at 'default' (0)."""
    try:
        return int(version)
    except ValueError:
        return 0


def oldest_version(choice: GeneratedChoice, fallback: int) -> int:
    """The oldest policy version that sampled any token of ``choice`` (conservative staleness)."""
    if not choice.weight_versions:
        return fallback
    return min(version_number(v) for v, start, end in choice.weight_versions if end > start) if any(
        end > start for _, start, end in choice.weight_versions
    ) else fallback


class AsyncRolloutLoop:
    """Generates, scores and queues samples for the prompts of ``dataset``, in epoch order."""

    def __init__(
        self,
        config: AsyncGRPOConfig,
        tokenizer: Any,
        dataset: Any,
        reward_funcs: list[Callable[..., Any]],
        base_url: str,
        emit: Callable[[Any], Any],
        start_position: int = 0,
        num_processes: int = 1,
    ):
        self.config = config
        self.tokenizer = tokenizer
        self.dataset = dataset
        self.reward_funcs = reward_funcs
        self.reward_names = [reward_func_name(f) for f in reward_funcs]
        self.reward_weights = np.asarray(config.reward_weights or [1.0] * len(reward_funcs), dtype=np.float64)
        self.base_url = base_url
        self.emit = emit  # async callable putting a GroupReport / RolloutSample on the queue
        self.start_position = start_position
        self.num_processes = num_processes
        self.ceiling = config.resolved_max_concurrent_rollouts(num_processes)
        self.pool = ThreadPoolExecutor(max_workers=self.ceiling, thread_name_prefix="rollout-tool")
        self.client: VLLMGenerateClient | None = None
        self.current_version = 0
        self.max_model_len = 1 << 30  # read from the server before the first request

    # ---- overridable stages -------------------------------------------------------------------------
    async def setup(self) -> None:
        """Runs once inside the loop's event loop before the first prompt; build clients here."""

    def filter_prompt(self, row_index: int, row: dict[str, Any], epoch: int) -> bool:
        """Return False to skip this prompt for this epoch (it still counts toward the epoch)."""
        return True

    def sampling_params(self) -> dict[str, Any]:
        c = self.config
        params: dict[str, Any] = {"max_tokens": c.max_completion_length, "temperature": c.temperature}
        if c.top_p < 1.0:
            params["top_p"] = c.top_p
        if c.top_k > 0:
            params["top_k"] = c.top_k
        return params

    def prompt_ids(self, messages: list[dict[str, Any]]) -> list[int]:
        text = self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True, **(self.config.chat_template_kwargs or {})
        )
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    async def generate_one(self, row_index: int, row: dict[str, Any], rollout_index: int) -> Rollout:
        """One rollout of the prompt ``row['prompt']``: a single generation turn."""
        assert self.client is not None
        messages = list(row["prompt"])
        prompt_ids = self.prompt_ids(messages)
        params = self.sampling_params()
        params["max_tokens"] = self.completion_budget(len(prompt_ids), params["max_tokens"])
        (choice,) = await self.client.generate(prompt_ids, params, num_top=self.config.num_sampler_logprobs)
        turn = TurnRecord(
            prompt_ids=prompt_ids,
            output_ids=choice.token_ids,
            output_logprobs=choice.logprobs,
            top_ids=choice.top_ids,
            top_logprobs=choice.top_logprobs,
            sampling_masks=choice.sampling_masks,
            finish_reason=choice.finish_reason,
            policy_version=oldest_version(choice, self.current_version),
        )
        text = self.tokenizer.decode(choice.token_ids, skip_special_tokens=True)
        return Rollout(
            rollout_id=uuid.uuid4().hex,
            row_index=row_index,
            messages=messages + [{"role": "assistant", "content": text}],
            turns=[turn],
            completion_text=text,
        )

    def completion_budget(self, num_prompt_tokens: int, wanted: int) -> int:
        """Tokens the server can still generate after the prompt, within ``max_model_len``."""
        room = self.max_model_len - num_prompt_tokens
        if room < 1:
            raise ValueError(
                f"prompt of {num_prompt_tokens} tokens leaves no room under the server's max_model_len "
                f"{self.max_model_len}; raise --max-model-len or shorten the prompt"
            )
        return min(wanted, room)

    async def score(self, group: RolloutGroup) -> None:
        """Fill ``group.rewards_per_func`` and ``group.rewards`` (NaN where nothing scored)."""
        g = len(group.rollouts)
        columns = {k: [v] * g for k, v in group.row.items() if k != "prompt"}
        prompts = [group.prompt] * g
        completions = [[m for m in r.messages[len(group.prompt):]] for r in group.rollouts]
        per_func = np.full((g, len(self.reward_funcs)), np.nan)
        for j, func in enumerate(self.reward_funcs):
            if inspect.iscoroutinefunction(func) or inspect.iscoroutinefunction(getattr(func, "__call__", None)):
                values = await func(prompts, completions, **columns)
            else:
                loop = asyncio.get_running_loop()
                values = await loop.run_in_executor(self.pool, lambda f=func: f(prompts, completions, **columns))
            if len(values) != g:
                raise ValueError(f"reward function {self.reward_names[j]} returned {len(values)} values for {g} completions")
            per_func[:, j] = [np.nan if v is None else float(v) for v in values]
        own = np.array([np.nan if r.reward is None else float(r.reward) for r in group.rollouts])
        weighted = per_func * self.reward_weights[None, :]
        scored_any = ~np.isnan(per_func).all(axis=1) | ~np.isnan(own)
        total = np.nansum(weighted, axis=1) + np.nan_to_num(own)
        group.rewards = np.where(scored_any, total, np.nan)
        group.rewards_per_func = per_func
        group.reward_func_names = list(self.reward_names)

    def compute_advantages(self, group: RolloutGroup) -> np.ndarray:
        """Per-rollout advantages for ``group`` (runs for every group, even those dropped later)."""
        return group_advantages(group.rewards, scale=self.config.scale_rewards)

    # ---- samples from a scored group ------------------------------------------------------------------
    def samples_of(self, group: RolloutGroup, advantages: np.ndarray, position: int) -> list[RolloutSample]:
        samples = []
        for rollout, advantage, reward in zip(group.rollouts, advantages, group.rewards):
            if np.isnan(reward):
                continue
            for seq in self.sequences_of(rollout):
                samples.append(
                    RolloutSample(
                        token_ids=seq["token_ids"],
                        completion_mask=seq["completion_mask"],
                        sampler_logprobs=seq["sampler_logprobs"],
                        advantage=float(advantage),
                        reward=float(reward),
                        group_id=position,
                        row_index=group.row_index,
                        epoch=group.epoch,
                        rollout_id=rollout.rollout_id,
                        policy_version=seq["policy_version"],
                        position=position,
                        sampler_top_ids=seq.get("top_ids"),
                        sampler_top_logprobs=seq.get("top_logprobs"),
                        sampling_masks=seq.get("sampling_masks"),
                    )
                )
        return samples

    def sequences_of(self, rollout: Rollout) -> list[dict[str, Any]]:
        """Training sequences of one rollout (single turn: prompt as context, output trained)."""
        (turn,) = rollout.turns
        n_prompt, n_out = len(turn.prompt_ids), len(turn.output_ids)
        if n_out == 0:
            return []
        mask = np.zeros(n_prompt + n_out, dtype=bool)
        mask[n_prompt:] = True
        logprobs = np.zeros(n_prompt + n_out, dtype=np.float32)
        logprobs[n_prompt:] = turn.output_logprobs
        return [
            {
                "token_ids": np.asarray(turn.prompt_ids + turn.output_ids, dtype=np.int32),
                "completion_mask": mask,
                "sampler_logprobs": logprobs,
                "policy_version": turn.policy_version,
                "top_ids": turn.top_ids,
                "top_logprobs": turn.top_logprobs,
                "sampling_masks": turn.sampling_masks,
            }
        ]

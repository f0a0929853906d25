"""``AsyncRolloutLoop``: what the rollout process does for each prompt, one overridable method per stage.

    filter_prompt → generate_one (× num_generations) → score → compute_advantages → samples

The loop runs in its own process and its own asyncio event loop. Subclass it (anywhere: a subclass
in a script's ``__main__`` crosses to that process by value) and set ``loop_cls`` on a trainer subclass
to change a stage; build clients in
``setup()``, which runs inside the event loop, rather than in ``__init__``.

A rollout is a chain of turns. Each turn renders the whole message list with the chat template,
generates, and, when the model called tools (``tools=`` or the environment's methods, see
``agent.py``), runs them and feeds their results back for the next turn. Because every turn is a
fresh tokenisation, the chain is reconciled (``reconcile.py``: CLEAN / REALIGN / FORK) into one or
more training sequences once the group is scored. Rewards are the weighted sum of the reward
functions plus ``Rollout.reward``, which the environment's ``get_reward`` or a custom
``generate_one`` sets.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable, Collection
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from grpo_core.config import AsyncGRPOConfig
from grpo_core.data.inputs import as_messages, check_reward_values, refuse_images
from grpo_core.rollout.advantages import group_advantages
from grpo_core.rollout.agent import (
    EnvironmentSession,
    RolloutTools,
    append_observation,
    assistant_message,
    is_async_callable,
    record_tool_results,
    tool_messages,
)
from grpo_core.rollout.routing_client import FleetView, RoutingClient
from grpo_core.rollout.reconcile import ReconcileResult, gather_sampling_masks, gather_top_logprobs, reconcile_turns
from grpo_core.rollout.routes import sequence_routes
from grpo_core.rollout.token_prompts import continuation_ids, extended_prompt
from grpo_core.rollout.tool_calls import ParsedToolCalls, parse_tool_calls
from grpo_core.rollout.types import Rollout, RolloutGroup, RolloutSample, TurnRecord
from grpo_core.vllm_server.control import VLLMRequestError
from grpo_core.vllm_server.replies import GeneratedChoice, check_routes


def reward_func_name(func: Callable[..., Any]) -> str:
    name = getattr(func, "__name__", None) or type(func).__name__
    return str(name)


UNKNOWN_VERSION = -1
"""A weight version the trainer never sets: the server's start-up ``"default"`` (a restarted server
serving the weights it loaded from disk) or any label someone else gave it; never trained."""


def version_number(version: str) -> int:
    """Weight versions are the trainer's step numbers as strings; anything else is ``UNKNOWN_VERSION``."""
    try:
        return int(version)
    except ValueError:
        return UNKNOWN_VERSION


def oldest_version(choice: GeneratedChoice, fallback: int) -> int:
    """The oldest policy version that sampled any token of ``choice`` (conservative staleness)."""
    spans = [version_number(v) for v, start, end in choice.weight_versions if end > start]
    return min(spans) if spans else fallback


def row_columns(row: dict[str, Any]) -> dict[str, Any]:
    """A dataset row without its prompt: what reward functions and ``reset`` receive as keywords."""
    return {k: v for k, v in row.items() if k != "prompt"}


def transcript(messages: list[dict[str, Any]]) -> str:
    """Readable text of the messages a rollout added, for completion logging."""
    if len(messages) == 1:
        return str(messages[0].get("content") or "")
    parts = []
    for m in messages:
        calls = "".join(f" <call {c['function']['name']}({c['function']['arguments']})>" for c in m.get("tool_calls") or [])
        parts.append(f"[{m['role']}] {m.get('content') or ''}{calls}")
    return "\n".join(parts)


class AsyncRolloutLoop:
    """Generates, scores and queues samples for the prompts of ``dataset``, in epoch order."""

    def __init__(
        self,
        config: AsyncGRPOConfig,
        tokenizer: Any,
        dataset: Any,
        reward_funcs: list[Callable[..., Any]],
        base_url: str | list[str],
        emit: Callable[[Any], Any],
        start_position: int = 0,
        num_processes: int = 1,
        skip_positions: Collection[int] = (),
        tools: list[Callable[..., Any]] | None = None,
        environment_factory: Callable[[], Any] | None = None,
        adapter: Any = None,
        tokens_endpoint: bool = True,
    ):
        self.config = config
        self.tokenizer = tokenizer
        self.dataset = dataset
        self.reward_funcs = reward_funcs
        self.reward_names = [reward_func_name(f) for f in reward_funcs]
        self.reward_weights = np.asarray(config.reward_weights or [1.0] * len(reward_funcs), dtype=np.float64)
        # One server, or a fleet of them (``routing_client.RoutingClient`` routes each group to one).
        self.base_urls = [base_url] if isinstance(base_url, str) else list(base_url)
        self.base_url = self.base_urls[0]
        self.emit = emit  # async callable putting a GroupReport / RolloutSample on the queue
        self.start_position = start_position
        # Positions past ``start_position`` that the resumed model has trained on already: never admitted again.
        self.skip_positions = frozenset(skip_positions)
        self.num_processes = num_processes
        self.ceiling = config.resolved_max_concurrent_rollouts(num_processes)
        # Sync tools, environment calls and sync reward functions share this pool: at most `ceiling`
        # rollouts are in flight, so each can have one blocking call running without waiting.
        self.pool = ThreadPoolExecutor(max_workers=self.ceiling, thread_name_prefix="rollout-tool")
        self.tools = list(tools or [])
        self.environment_factory = environment_factory
        # Built once (and validated here, before any request) for rollouts without an environment.
        self.shared_tools = RolloutTools(self.tools)
        self.client: RoutingClient | None = None
        self.tokens_endpoint = tokens_endpoint
        # The weight version the server serves now, as the trainer publishes it (the rollout process
        # replaces this); dates a turn when the server reports no per-token versions.
        self.served_version: Callable[[], int] = lambda: 0
        # Samples the trainer has consumed by the served version (the rollout process replaces this);
        # None: no trainer behind this loop, so the scheduler's staleness budget is off.
        self.consumed_samples: Callable[[], int | None] = lambda: None
        # LoRA adapter sync: the trainer's AdapterPointer to the newest registered adapter (None otherwise).
        self.adapter = adapter
        self.max_model_len = 1 << 30  # read from the server before the first request
        # The trainer's view of the fleet (which servers serve, ``fleet.FleetView``), newest first or None, and the
        # way to tell it that this process drained one; the rollout process replaces both.
        self.fleet_view: Callable[[], FleetView | None] = lambda: None
        self.report_drained: Callable[[str, int, str], None] = lambda name, epoch, reason: None

    async def connect(self) -> None:
        """Open the generation client over the servers the trainer says serve, and read their context length (the
        scheduler calls this)."""
        c = self.config
        self.client = RoutingClient.for_urls(
            self.base_urls, timeout=c.request_timeout, tokens_endpoint=self.tokens_endpoint,
            unavailable_timeout_s=c.server_unavailable_timeout_s, drain_after_s=c.server_drain_after_s,
            report_drained=lambda name, epoch, reason: self.report_drained(name, epoch, reason),
            fleet=len(self.base_urls) > 1 or c.vllm_server_fleet_file is not None,
        )
        self.max_model_len = await self.client.start(self.ceiling, self.fleet_view())

    async def close(self) -> None:
        if self.client is not None:
            await self.client.aclose()
        # A sync tool that timed out may still be running; do not wait for it.
        self.pool.shutdown(wait=False, cancel_futures=True)

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

    def prompt_ids(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> list[int]:
        """The whole conversation so far, rendered by the chat template and tokenised."""
        text = self.tokenizer.apply_chat_template(
            messages, tools=tools, tokenize=False, add_generation_prompt=True, **(self.config.chat_template_kwargs or {})
        )
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    async def generate_one(self, row_index: int, row: dict[str, Any], rollout_index: int) -> Rollout:
        """One rollout of ``row['prompt']``: turns until the model stops calling tools or the budget ends."""
        metrics: dict[str, float] = {}
        messages = as_messages(row["prompt"])
        refuse_images(messages, row)  # rows past the ones checked before the spawn
        num_prompt = len(messages)
        tools = self.shared_tools
        session: EnvironmentSession | None = None
        try:
            if self.environment_factory is not None:
                session = await EnvironmentSession.open(self.environment_factory, self.pool, metrics)
                observation = await session.reset(row_columns(row))
                if observation:
                    messages = append_observation(messages, observation)
                tools = RolloutTools(self.tools, session.env)
            turns = await self.run_turns(messages, tools, metrics)
            reward = await session.reward(messages[num_prompt:]) if session is not None else None
        finally:
            if session is not None:
                await session.close()
        return Rollout(
            rollout_id=uuid.uuid4().hex,
            row_index=row_index,
            messages=messages,
            turns=turns,
            completion_text=transcript(messages[num_prompt:]),
            reward=reward,
            metrics=metrics,
        )

    async def run_turns(self, messages: list[dict[str, Any]], tools: RolloutTools, metrics: dict[str, float]) -> list[TurnRecord]:
        """Generate, run tools and feed results back, appending to ``messages``; returns the turns."""
        assert self.client is not None, "connect() first"
        c = self.config
        schemas = tools.schemas()
        budget = c.max_completion_length  # summed over the rollout's turns
        pinned = self.sampling_adapter()  # every turn samples from the adapter version the rollout started with
        turns: list[TurnRecord] = []
        tool_rounds = 0
        while True:
            prompt_ids = self.next_prompt_ids(messages, schemas, turns, metrics)
            if turns and len(prompt_ids) >= self.max_model_len:
                # The conversation outgrew the context; the first turn raises instead (a config error).
                metrics["rollout/context_exhausted"] = 1.0
                break
            params = self.sampling_params()
            params["max_tokens"] = self.completion_budget(len(prompt_ids), budget)
            started_under = self.served_version()
            choice, pinned = await self.generate_turn(prompt_ids, params, pinned)
            turns.append(self.turn_record(prompt_ids, choice, pinned, started_under))
            budget -= len(choice.token_ids)
            text = self.tokenizer.decode(choice.token_ids, skip_special_tokens=True)
            parsed = parse_tool_calls(text) if tools else ParsedToolCalls(text, [])
            messages.append(assistant_message(text, parsed))
            if not parsed.calls:
                break
            if choice.finish_reason == "length" or budget < 1:
                # Cut off mid-turn, or no tokens left to read the results with: running the calls would
                # only feed a turn that cannot happen.
                metrics["rollout/truncated_tool_turns"] = 1.0
                break
            if c.max_tool_calling_iterations is not None and tool_rounds >= c.max_tool_calling_iterations:
                metrics["rollout/tool_iterations_capped"] = 1.0
                break
            results = await tools.run(parsed.calls, self.pool, c.tool_timeout_s)
            tool_rounds += 1
            record_tool_results(metrics, results, tools)
            messages.extend(tool_messages(results))
        metrics["rollout/turns"] = float(len(turns))
        return turns

    def next_prompt_ids(self, messages: list[dict[str, Any]], schemas: list[dict[str, Any]] | None,
                        turns: list[TurnRecord], metrics: dict[str, float]) -> list[int]:
        """The prompt of the next turn: extended from the sampled tokens (``multi_turn_prompts="tokens"``), or the
        conversation re-rendered (the first turn, ``"messages"``, or a turn the token path cannot take)."""
        if turns and self.config.multi_turn_prompts == "tokens":
            answer_at = max(i for i, m in enumerate(messages) if m.get("role") == "assistant")
            continuation = continuation_ids(self.tokenizer, messages[answer_at], turns[-1].output_ids,
                                            messages[answer_at + 1:], schemas, self.config.chat_template_kwargs)
            if continuation is not None:
                return extended_prompt(turns[-1].prompt_ids, turns[-1].output_ids, continuation)
            metrics["rollout/token_path_fallbacks"] = metrics.get("rollout/token_path_fallbacks", 0.0) + 1.0
        return self.prompt_ids(messages, schemas)

    def sampling_adapter(self) -> tuple[str, int] | None:
        """LoRA adapter sync: ``(name, version)`` of the newest registered adapter; None samples the base."""
        return self.adapter.get() if self.adapter is not None else None

    async def generate_turn(
        self, prompt_ids: list[int], params: dict[str, Any], pinned: tuple[str, int] | None
    ) -> tuple[GeneratedChoice, tuple[str, int] | None]:
        """One generation under ``pinned``; returns the choice and the adapter it actually used.

        A rollout that outlives its adapter's window finds the name unloaded (HTTP 404). Its sample
        is stale by then (kept or dropped: ``stale_samples``), so it continues under the newest adapter rather than
        failing the worker; the first turn's older version keeps it marked stale. (Dropped
        connections are retried by the client.)
        """
        assert self.client is not None, "connect() first"
        num_top = self.config.num_sampler_logprobs
        while True:
            named = {"model": pinned[0]} if pinned is not None else {}  # no adapter: the call stays as before
            try:
                (choice,) = await self.client.generate(prompt_ids, params, num_top=num_top, **named)
                return choice, pinned
            except VLLMRequestError as exc:
                newest = self.sampling_adapter()
                # Move on only to a different, newer adapter: each retry advances, so this ends.
                if pinned is None or "HTTP 404" not in str(exc) or newest is None or newest[1] <= pinned[1]:
                    raise
                pinned = newest

    def turn_record(
        self, prompt_ids: list[int], choice: GeneratedChoice, pinned: tuple[str, int] | None = None, started_under: int = 0
    ) -> TurnRecord:
        return TurnRecord(
            prompt_ids=prompt_ids,
            output_ids=choice.token_ids,
            output_logprobs=choice.logprobs,
            top_ids=choice.top_ids,
            top_logprobs=choice.top_logprobs,
            sampling_masks=choice.sampling_masks,
            finish_reason=choice.finish_reason,
            routed_experts=_checked_routes(choice, len(prompt_ids)),
            # In adapter mode the server's weight version is the base's; the adapter is the policy. Without
            # per-token versions (/v1/completions), the version the request started under is the oldest.
            policy_version=pinned[1] if pinned is not None else oldest_version(choice, started_under),
        )

    def completion_budget(self, num_prompt_tokens: int, wanted: int) -> int:
        """Tokens the server can still generate after the prompt, within ``max_model_len``."""
        room = self.max_model_len - num_prompt_tokens
        if room < 1:
            raise ValueError(
                f"prompt of {num_prompt_tokens} tokens leaves no room under the server's max_model_len "
                f"{self.max_model_len}; raise the server's max_model_len or shorten the prompt"
            )
        return min(wanted, room)

    async def score(self, group: RolloutGroup) -> None:
        """Fill ``group.rewards_per_func`` and ``group.rewards`` (NaN where nothing scored).

        Reward functions are called with keywords, as TRL calls them: ``prompts``, ``completions``,
        ``completion_ids`` and the dataset's other columns. A prompt given as a string gets its
        completions as strings; a conversation gets them as lists of messages.
        """
        g = len(group.rollouts)
        columns = {k: [v] * g for k, v in row_columns(group.row).items()}
        as_text = isinstance(group.row.get("prompt"), str)
        prompts = [group.row["prompt"] if as_text else group.prompt] * g
        if as_text:
            completions: list[Any] = [r.completion_text for r in group.rollouts]
        else:
            completions = [list(r.messages[len(group.prompt):]) for r in group.rollouts]
        completion_ids = [[t for turn in r.turns for t in turn.output_ids] for r in group.rollouts]
        kwargs = dict(prompts=prompts, completions=completions, completion_ids=completion_ids, **columns)
        per_func = np.full((g, len(self.reward_funcs)), np.nan)
        for j, func in enumerate(self.reward_funcs):
            name = self.reward_names[j]
            try:
                if is_async_callable(func):
                    values = await func(**kwargs)
                else:
                    values = await asyncio.get_running_loop().run_in_executor(self.pool, lambda f=func: f(**kwargs))
            except Exception as exc:
                raise RuntimeError(f"reward function {name!r} raised on dataset row {group.row_index}: {type(exc).__name__}: {exc}") from exc
            per_func[:, j] = check_reward_values(name, group.row_index, values, g)
        own = rollout_rewards(group)
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
    def reconcile(self, rollout: Rollout) -> ReconcileResult:
        """The rollout's training sequences (one per fork), with the CLEAN/REALIGN/FORK counts."""
        return reconcile_turns(rollout.turns, self.config.fork_threshold_tokens)

    def samples_of(
        self,
        group: RolloutGroup,
        advantages: np.ndarray,
        position: int,
        reconciled: list[ReconcileResult] | None = None,
    ) -> list[RolloutSample]:
        """One sample per training sequence of every scored rollout; all share the rollout's advantage."""
        if reconciled is None:
            reconciled = [self.reconcile(r) for r in group.rollouts]
        samples = []
        for rollout, result, advantage, reward in zip(group.rollouts, reconciled, advantages, group.rewards, strict=True):
            if np.isnan(reward):
                continue
            for seq in result.sequences:
                top = gather_top_logprobs(seq, rollout.turns)
                samples.append(
                    RolloutSample(
                        token_ids=seq.token_ids,
                        completion_mask=seq.completion_mask,
                        sampler_logprobs=seq.sampler_logprobs,
                        advantage=float(advantage),
                        reward=float(reward),
                        group_id=position,
                        row_index=group.row_index,
                        epoch=group.epoch,
                        rollout_id=rollout.rollout_id,
                        policy_version=seq.policy_version,
                        position=position,
                        sampler_top_ids=top[0] if top is not None else None,
                        sampler_top_logprobs=top[1] if top is not None else None,
                        sampling_masks=gather_sampling_masks(seq, rollout.turns),
                        routed_experts=sequence_routes(seq, rollout.turns),
                        metrics={"turns": float(seq.last_turn - seq.first_turn + 1)},
                    )
                )
        return samples


def _checked_routes(choice: GeneratedChoice, num_prompt_tokens: int) -> np.ndarray | None:
    if choice.routed_experts is not None:
        check_routes(choice.routed_experts, num_prompt_tokens + len(choice.token_ids))
    return choice.routed_experts


def rollout_rewards(group: RolloutGroup) -> np.ndarray:
    """[G] ``Rollout.reward`` of each rollout (environment or custom ``generate_one``), NaN where unset."""
    return np.array([np.nan if r.reward is None else float(r.reward) for r in group.rollouts], dtype=np.float64)


def reconcile_metrics(results: list[ReconcileResult]) -> dict[str, float]:
    """Counters of one group's reconciles; ``rollout/fork_frac`` is derived from them per step."""
    out = {
        "rollout/later_turns": 0.0,
        "rollout/clean_turns": 0.0,
        "rollout/realign_turns": 0.0,
        "rollout/fork_turns": 0.0,
        "rollout/realigned_tokens": 0.0,
        "rollout/sequences": 0.0,
        "rollout/dropped_sequences": 0.0,
    }
    for r in results:
        s = r.stats
        out["rollout/later_turns"] += max(s.turns - 1, 0)
        out["rollout/clean_turns"] += s.clean
        out["rollout/realign_turns"] += s.realign
        out["rollout/fork_turns"] += s.fork
        out["rollout/realigned_tokens"] += s.realigned_tokens
        out["rollout/sequences"] += len(r.sequences)
        out["rollout/dropped_sequences"] += s.dropped_sequences
    return out

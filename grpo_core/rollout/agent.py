"""Tools and environments of one rollout: what the model may call between turns, and who scores it.

Tools
    Module-level functions passed as ``tools=``; the model calls each by its ``__name__`` (see
    ``tool_calls.ToolRegistry`` for the rules on signatures and how calls are parsed). Sync tools run
    in the loop's thread pool (``max_concurrent_rollouts`` threads), so a slow tool delays only its own
    rollout; async tools are awaited on the loop. Calls of one turn run in the order the model wrote
    them. A tool that raises, times out (``tool_timeout_s``) or gets bad arguments answers with its
    error text: the model sees it as the tool message.

Environments
    ``environment_factory`` is a picklable zero-argument callable (a class, a module-level function,
    ``functools.partial``) that builds one fresh environment per rollout. The environment is an object
    whose methods, sync or ``async``, follow this contract:

    ``reset(**columns) -> str | None`` (optional)
        Called once before the first turn with the dataset row's columns other than ``prompt``. A
        returned string is appended to the last user message (the starting observation).
    public methods (names not starting with ``_``)
        The environment's tools, described and validated exactly like module-level tools: typed
        parameters (str, int, float, bool) and a docstring. They are offered to the model next to
        ``tools=``; a name used by both is an error.
    ``get_reward(completion) -> float | None`` (optional)
        Called once after the last turn with the messages the rollout added after the prompt; it
        becomes ``Rollout.reward``, summed with the reward functions' weighted sum. None leaves the
        rollout unscored by the environment.
    ``close()`` (optional)
        Called last, even when the rollout failed, to release what the environment holds.

    Every call into the environment runs in the same thread pool as sync tools, so a slow
    environment delays only its own rollout. An exception from ``reset``, ``get_reward`` or ``close``
    is a bug in the environment and fails the run; an exception from a tool method is an observation.
    Each rollout has its own instance, but sync methods of different instances run concurrently in
    the pool, so state shared between instances must be thread-safe.

Metrics recorded per rollout (summed over a step by ``group_metrics``): ``tools/<name>/calls``,
``tools/<name>/errors``, ``tools/<name>/latency_s_sum`` and ``_max`` for registered names only (a
name the model made up must not mint a metric); ``rollout/tool_calls``, ``rollout/tool_call_errors``,
``rollout/unknown_tool_calls``; ``env/reset_s_sum``, ``env/get_reward_s_sum``, ``env/rollouts``,
``env/scored``, ``env/reward_sum``.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from grpo_core.rollout.tool_calls import ParsedToolCalls, ToolCall, ToolCallError, ToolRegistry, ToolResult, _describe

RESERVED_METHODS = frozenset({"reset", "get_reward", "close"})
"""Environment methods that belong to the contract, never offered to the model as tools."""


def is_async_callable(fn: Any) -> bool:
    """An ``async def`` function, a partial of one, or an instance whose ``__call__`` is ``async def``."""
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))


async def call_in_pool(fn: Callable[..., Any], pool: ThreadPoolExecutor, *args: Any, **kwargs: Any) -> Any:
    """Await ``fn`` if it is async, else run it in ``pool`` so the event loop keeps streaming."""
    if is_async_callable(fn):
        return await fn(*args, **kwargs)
    result = await asyncio.get_running_loop().run_in_executor(pool, functools.partial(fn, *args, **kwargs))
    # A decorator can hide an async function behind a sync wrapper that returns the coroutine.
    return await result if inspect.isawaitable(result) else result


class _EnvironmentRegistry(ToolRegistry):
    """A registry that also accepts the bound methods of one environment instance.

    ``ToolRegistry.register`` refuses bound methods (a tool object's state belongs in an environment);
    the environment's own methods are built inside the worker, once per rollout, so only the
    signature checks apply.
    """

    def register_method(self, name: str, method: Callable[..., Any]) -> None:
        if name in self:
            raise ValueError(
                f"environment method {name!r} has the name of a tool passed as tools=; rename one of them"
            )
        self._tools[name] = _describe(method)


def environment_methods(env: Any) -> dict[str, Callable[..., Any]]:
    """The public methods of ``env`` that the model may call, by name, in definition order."""
    # Base classes first, then each class's own order: the schema lists tools as the author wrote them.
    names = dict.fromkeys(name for cls in reversed(type(env).__mro__) for name in vars(cls))
    methods: dict[str, Callable[..., Any]] = {}
    for name in names:
        if name.startswith("_") or name in RESERVED_METHODS:
            continue
        member = getattr(env, name)
        if inspect.ismethod(member):
            methods[name] = member
    return methods


class RolloutTools:
    """The tools of one rollout: the shared module-level tools plus its environment's methods."""

    def __init__(self, tools: Sequence[Callable[..., Any]], env: Any = None) -> None:
        self.registry = _EnvironmentRegistry(tools)
        if env is not None:
            for name, method in environment_methods(env).items():
                self.registry.register_method(name, method)

    def __bool__(self) -> bool:
        return len(self.registry) > 0

    def schemas(self) -> list[dict[str, Any]] | None:
        """The ``tools=`` argument of the chat template (None when there are none, so no tool header)."""
        return self.registry.schemas() if len(self.registry) else None

    async def run(
        self, calls: Sequence[ToolCall | ToolCallError], pool: ThreadPoolExecutor, timeout: float | None
    ) -> list[ToolResult]:
        return await self.registry.run_all(calls, pool, timeout)


def assistant_message(text: str, parsed: ParsedToolCalls) -> dict[str, Any]:
    """The message for one generated turn.

    Well-formed calls become structured ``tool_calls`` (what reward functions and templates expect),
    so the template re-renders them in its own format; reconcile absorbs any difference. A turn with
    a malformed call keeps its raw text, since no template can re-render a call it cannot read.
    """
    if not parsed.calls or any(isinstance(c, ToolCallError) for c in parsed.calls):
        return {"role": "assistant", "content": text}
    calls = [
        {"type": "function", "function": {"name": c.name, "arguments": c.arguments}}
        for c in parsed.calls
        if isinstance(c, ToolCall)
    ]
    return {"role": "assistant", "content": parsed.content, "tool_calls": calls}


def tool_messages(results: Sequence[ToolResult]) -> list[dict[str, Any]]:
    return [{"role": "tool", "name": r.name, "content": r.content} for r in results]


def _bump(metrics: dict[str, float], key: str, value: float = 1.0) -> None:
    metrics[key] = metrics.get(key, 0.0) + value


def record_tool_results(metrics: dict[str, float], results: Sequence[ToolResult], known: RolloutTools) -> None:
    """Add one turn's tool results to the rollout's counters."""
    for r in results:
        _bump(metrics, "rollout/tool_calls")
        if not r.ok:
            _bump(metrics, "rollout/tool_call_errors")
        if r.name not in known.registry:
            # Parse errors and made-up names: counted, but never as a metric named by the model.
            _bump(metrics, "rollout/unknown_tool_calls")
            continue
        prefix = f"tools/{r.name}"
        _bump(metrics, f"{prefix}/calls")
        _bump(metrics, f"{prefix}/errors", 0.0 if r.ok else 1.0)
        if r.error_kind == "timeout":
            _bump(metrics, f"{prefix}/timeouts")
        _bump(metrics, f"{prefix}/latency_s_sum", r.duration_s)
        metrics[f"{prefix}/latency_s_max"] = max(metrics.get(f"{prefix}/latency_s_max", 0.0), r.duration_s)


class EnvironmentSession:
    """One rollout's environment: reset, tools, reward and close, all off the event loop."""

    def __init__(self, env: Any, pool: ThreadPoolExecutor, metrics: dict[str, float]) -> None:
        self.env = env
        self.pool = pool
        self.metrics = metrics

    @classmethod
    async def open(cls, factory: Callable[[], Any], pool: ThreadPoolExecutor, metrics: dict[str, float]) -> "EnvironmentSession":
        env = await call_in_pool(factory, pool)
        _bump(metrics, "env/rollouts")
        return cls(env, pool, metrics)

    async def reset(self, columns: dict[str, Any]) -> str | None:
        method = getattr(self.env, "reset", None)
        if method is None:
            return None
        start = time.perf_counter()
        observation = await call_in_pool(method, self.pool, **columns)
        _bump(self.metrics, "env/reset_s_sum", time.perf_counter() - start)
        if observation is not None and not isinstance(observation, str):
            raise TypeError(f"{type(self.env).__name__}.reset returned {type(observation).__name__}; return a str or None")
        return observation

    async def reward(self, completion: list[dict[str, Any]]) -> float | None:
        method = getattr(self.env, "get_reward", None)
        if method is None:
            return None
        start = time.perf_counter()
        value = await call_in_pool(method, self.pool, completion)
        _bump(self.metrics, "env/get_reward_s_sum", time.perf_counter() - start)
        if value is None:
            return None
        value = float(value)
        _bump(self.metrics, "env/scored")
        _bump(self.metrics, "env/reward_sum", value)
        return value

    async def close(self) -> None:
        method = getattr(self.env, "close", None)
        if method is not None:
            await call_in_pool(method, self.pool)


def append_observation(messages: list[dict[str, Any]], observation: str) -> list[dict[str, Any]]:
    """A copy of ``messages`` with ``observation`` appended to the last user message."""
    out = [dict(m) for m in messages]
    for message in reversed(out):
        if message.get("role") == "user":
            message["content"] = f"{message.get('content') or ''}{observation}"
            return out
    raise ValueError("environment reset returned an observation but the prompt has no user message to append it to")

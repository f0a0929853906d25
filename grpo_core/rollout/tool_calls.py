"""Tool calls: parse Qwen3/Hermes-style calls from generated text, and run registered tools safely.

The model writes calls as ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` blocks after
its text. ``parse_tool_calls`` returns them in order, plus the text before the first one; a block that
is not valid JSON becomes a ``ToolCallError`` entry whose message the worker feeds back to the model as
the tool result, so the model can learn the format instead of the rollout dying.

``ToolRegistry`` holds the user's tools. The rollout worker runs in a spawned process, and the model
calls a tool by name, so every tool must be a module-level function registered under its
``__name__``: lambdas, closures and nested functions are refused with a TypeError at registration.
Its schema is transformers' ``get_json_schema`` of the function (type hints and a Google-style
docstring with an ``Args:`` entry per parameter), as TRL builds it. Sync tools run in the worker's thread pool so
a slow tool never blocks the event loop that streams the other rollouts; async tools are awaited. A
tool that raises, times out or gets bad arguments yields its error text as the result: a tool failure
is an observation for the model, not a crash of the rollout. Tests: tests/test_tool_calls.py.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import json
import re
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

# ---------------------------------------------------------------------------------------------------
# Parsing
# ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class ToolCallError:
    """A ``<tool_call>`` block that could not be read; ``message`` is meant for the model."""

    raw: str
    message: str


@dataclass(frozen=True)
class ParsedToolCalls:
    content: str  # text before the first <tool_call>, stripped
    calls: list[ToolCall | ToolCallError]


TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
_BLOCK = re.compile(re.escape(TOOL_CALL_OPEN) + r"(.*?)(?:" + re.escape(TOOL_CALL_CLOSE) + r"|\Z)", re.DOTALL)


def _read_call(body: str, closed: bool) -> ToolCall | ToolCallError:
    raw = body.strip()
    if not closed:
        return ToolCallError(raw, f"Error: unterminated {TOOL_CALL_OPEN} (missing {TOOL_CALL_CLOSE}).")
    try:
        obj = json.loads(raw)
    except json.JSONDecodeError as e:
        return ToolCallError(raw, f"Error: tool call is not valid JSON ({e.msg} at line {e.lineno} column {e.colno}).")
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return ToolCallError(raw, 'Error: a tool call must be a JSON object {"name": "...", "arguments": {...}}.')
    args = obj.get("arguments", {})
    if isinstance(args, str):
        # Some models emit the arguments as a JSON-encoded string (OpenAI's wire format); accept it.
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            pass
    if args is None:
        args = {}
    if not isinstance(args, dict):
        return ToolCallError(raw, f"Error: the arguments of tool {obj['name']!r} must be a JSON object.")
    return ToolCall(obj["name"], args)


def parse_tool_calls(text: str) -> ParsedToolCalls:
    """Split generated text into its content and its tool calls, in the order the model wrote them."""
    first = text.find(TOOL_CALL_OPEN)
    if first < 0:
        return ParsedToolCalls(text.strip(), [])
    calls = [_read_call(m.group(1), closed=m.group(0).endswith(TOOL_CALL_CLOSE)) for m in _BLOCK.finditer(text, first)]
    return ParsedToolCalls(text[:first].strip(), calls)


# ---------------------------------------------------------------------------------------------------
# Registry
# ---------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Param:
    name: str
    json_type: str
    required: bool
    description: str


@dataclass(frozen=True)
class _Tool:
    fn: Callable[..., Any]
    is_async: bool
    schema: dict[str, Any]  # OpenAI function-tool shape, from transformers' get_json_schema
    params: tuple[_Param, ...]


@dataclass(frozen=True)
class ToolResult:
    """What one call produced; ``content`` is always the text to feed back as the tool message."""

    name: str
    content: str
    ok: bool
    # None on success; else "parse_error", "unknown_tool", "bad_arguments", "exception" or "timeout".
    error_kind: str | None
    duration_s: float


def _check_named_function(fn: Any) -> None:
    """A tool is a ``def`` function: the model calls it by ``__name__``, which a lambda lacks. Where it is
    defined does not matter (a script's ``__main__``, a closure): functions cross to the rollout
    process by value when they cannot be imported there."""
    if inspect.ismethod(fn):
        raise TypeError(
            f"tool {fn.__qualname__!r} is a bound method: pass a function, or make its object an environment "
            "(environment_factory=...), whose public methods are its tools"
        )
    if not inspect.isfunction(fn):
        kind = type(fn).__name__
        raise TypeError(f"tool {fn!r} is a {kind}, not a function: tools are functions defined with def")
    if fn.__name__ == "<lambda>":
        raise TypeError(f"tool {fn.__qualname__!r} is a lambda, which has no name for the model to call: define it with def")


def _describe(fn: Callable[..., Any]) -> _Tool:
    """The tool's schema, as transformers builds it from the type hints and the Google-style docstring
    (what a chat template expects), and the parameters the runner checks calls against."""
    from transformers.utils import get_json_schema
    from transformers.utils.chat_template_utils import DocstringParsingException, TypeHintParsingException

    name = fn.__name__
    for p in inspect.signature(fn).parameters.values():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD, p.POSITIONAL_ONLY):
            raise TypeError(f"tool {name!r}: parameter {p.name!r} must be passable by keyword (no *args, **kwargs, /)")
    try:
        schema = get_json_schema(fn)
    except (DocstringParsingException, TypeHintParsingException) as exc:
        raise TypeError(
            f"tool {name!r}: {exc}. A tool needs a type hint on every parameter and a docstring with a summary line and "
            "an 'Args:' entry per parameter: the model reads them"
        ) from exc
    parameters = schema["function"].get("parameters", {})
    required = set(parameters.get("required", []))
    params = tuple(
        _Param(key, str(spec.get("type", "")), key in required, str(spec.get("description", "")))
        for key, spec in parameters.get("properties", {}).items()
    )
    return _Tool(fn, inspect.iscoroutinefunction(fn), schema, params)


def _type_ok(json_type: str, value: Any) -> bool:
    """Whether ``value`` fits a parameter's JSON type (compound types are left to the tool itself)."""
    if json_type == "string":
        return isinstance(value, str)
    if json_type == "boolean":
        return isinstance(value, bool)
    if json_type == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if json_type == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return True


def _render(value: Any) -> str:
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        return str(value)


class ToolRegistry:
    """Module-level functions callable by the model, keyed by ``__name__``."""

    def __init__(self, tools: Iterable[Callable[..., Any]] = ()) -> None:
        self._tools: dict[str, _Tool] = {}
        for fn in tools:
            self.register(fn)

    def register(self, fn: Callable[..., Any]) -> None:
        """Add a tool; TypeError for anything the spawned worker could not look up by name."""
        _check_named_function(fn)
        name = fn.__name__
        if name in self._tools:
            raise ValueError(f"a tool named {name!r} is already registered")
        self._tools[name] = _describe(fn)

    @property
    def names(self) -> list[str]:
        return list(self._tools)

    def __contains__(self, name: object) -> bool:
        return name in self._tools

    def __len__(self) -> int:
        return len(self._tools)

    def schemas(self) -> list[dict[str, Any]]:
        """JSON schemas in the OpenAI function-tool shape, for the chat template's ``tools=`` argument."""
        return [tool.schema for tool in self._tools.values()]

    def _argument_error(self, tool: _Tool, name: str, args: dict[str, Any]) -> str | None:
        known = {p.name: p for p in tool.params}
        unknown = sorted(set(args) - set(known))
        if unknown:
            return f"Error: tool {name!r} has no parameter(s) {', '.join(map(repr, unknown))}."
        missing = [p.name for p in tool.params if p.required and p.name not in args]
        if missing:
            return f"Error: tool {name!r} is missing required argument(s) {', '.join(map(repr, missing))}."
        for key, value in args.items():
            if not _type_ok(known[key].json_type, value):
                return f"Error: argument {key!r} of tool {name!r} must be {known[key].json_type}, got {type(value).__name__}."
        return None

    async def run(self, call: ToolCall | ToolCallError, executor: ThreadPoolExecutor, timeout: float | None) -> ToolResult:
        """Run one call; never raises (except on cancellation of the caller, which must propagate)."""
        start = time.perf_counter()

        def result(name: str, content: str, error_kind: str | None = None) -> ToolResult:
            return ToolResult(name, content, error_kind is None, error_kind, time.perf_counter() - start)

        if isinstance(call, ToolCallError):
            return result("", call.message, "parse_error")
        tool = self._tools.get(call.name)
        if tool is None:
            known = ", ".join(self._tools) or "none"
            return result(call.name, f"Error: unknown tool {call.name!r}; available tools: {known}.", "unknown_tool")
        bad = self._argument_error(tool, call.name, call.arguments)
        if bad is not None:
            return result(call.name, bad, "bad_arguments")

        deadline = asyncio.timeout(timeout)
        try:
            async with deadline:
                if tool.is_async:
                    value = await tool.fn(**call.arguments)
                else:
                    loop = asyncio.get_running_loop()
                    value = await loop.run_in_executor(executor, functools.partial(tool.fn, **call.arguments))
        except TimeoutError as e:
            if deadline.expired():
                # A sync tool's thread cannot be stopped: it keeps its pool slot until it returns.
                return result(call.name, f"Error: tool {call.name!r} timed out after {timeout:g} s.", "timeout")
            return result(call.name, f"Error: {type(e).__name__}: {e}", "exception")
        except Exception as e:  # noqa: BLE001 - any tool failure is fed back to the model as text
            return result(call.name, f"Error: {type(e).__name__}: {e}", "exception")
        return result(call.name, _render(value))

    async def run_all(
        self, calls: Sequence[ToolCall | ToolCallError], executor: ThreadPoolExecutor, timeout: float | None
    ) -> list[ToolResult]:
        """Run one assistant turn's calls one after another, in the order the model made them.

        Sequential on purpose: a later call may depend on an earlier one's side effects, and the model
        reads the results in its own order. Concurrency comes from the many rollouts in flight.
        """
        return [await self.run(call, executor, timeout) for call in calls]

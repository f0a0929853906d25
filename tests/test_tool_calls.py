"""Tool-call parsing and the tool registry: order, non-blocking sync tools, timeouts, errors as text."""

from __future__ import annotations

import asyncio
import functools
import pickle
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from grpo_core.rollout.tool_calls import (
    ToolCall,
    ToolCallError,
    ToolRegistry,
    parse_tool_calls,
)

# --------------------------------------------------------------------------------------------------
# Module-level tools (the only kind the registry accepts)
# --------------------------------------------------------------------------------------------------

CALL_LOG: list[str] = []
_LOG_LOCK = threading.Lock()


def add(a: int, b: int = 0) -> int:
    """Add two integers.

    Args:
        a: The first term.
        b: The second term, defaulting to zero.

    Returns:
        The sum.
    """
    return a + b


def describe(name: str, loud: bool | None = None, scale: float = 1.0) -> dict:
    """Describe something.

    Args:
        name: What to describe.
        loud: Shout it.
        scale: How much.
    """
    return {"name": name, "loud": loud, "scale": scale}


def sleepy(seconds: float, tag: str) -> str:
    """Block the calling thread (a slow sync tool).

    Args:
        seconds: How long to block.
        tag: What to log.
    """
    time.sleep(seconds)
    with _LOG_LOCK:
        CALL_LOG.append(tag)
    return tag


async def async_sleepy(seconds: float, tag: str) -> str:
    """A slow async tool.

    Args:
        seconds: How long to wait.
        tag: What to log.
    """
    await asyncio.sleep(seconds)
    CALL_LOG.append(tag)
    return tag


def explode(message: str) -> str:
    """Always fails.

    Args:
        message: The error's message.
    """
    raise RuntimeError(message)


def raises_timeout() -> str:
    """Fails with its own TimeoutError, well within the deadline."""
    raise TimeoutError("upstream timed out")


def _decorator(fn):  # type: ignore[no-untyped-def]
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):  # type: ignore[no-untyped-def]
        return fn(*args, **kwargs)

    return wrapper


@_decorator
def decorated(x: str) -> str:
    """A tool behind a functools.wraps decorator: still importable by name.

    Args:
        x: The text to upper-case.
    """
    return x.upper()


not_a_def = lambda x: x  # noqa: E731 - the point of the test


def make_closure(k: int):  # type: ignore[no-untyped-def]
    def scaled(x: int) -> int:
        """Scale a number by the captured factor.

        Args:
            x: The number to scale.
        """
        return x * k

    return scaled


def make_nested():  # type: ignore[no-untyped-def]
    def inner(x: int) -> int:
        """Return a number as it is.

        Args:
            x: The number.
        """
        return x

    return inner


class Holder:
    def method(self, x: int) -> int:
        return x


def untyped(x):  # type: ignore[no-untyped-def]
    """No type hint.

    Args:
        x: Anything.
    """
    return x


def undocumented(xs: list[int]) -> int:
    return len(xs)


def star(*args: int) -> int:
    return 0


@pytest.fixture
def executor() -> Iterator[ThreadPoolExecutor]:
    pool = ThreadPoolExecutor(max_workers=4)
    yield pool
    pool.shutdown(wait=True)


@pytest.fixture(autouse=True)
def clear_log() -> None:
    CALL_LOG.clear()


# --------------------------------------------------------------------------------------------------
# Parsing
# --------------------------------------------------------------------------------------------------


def test_parse_calls_in_order_with_content() -> None:
    text = (
        "Let me look both up.\n\n"
        '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'
        '<tool_call>\n{"name": "describe", "arguments": {"name": "x"}}\n</tool_call>'
    )
    parsed = parse_tool_calls(text)
    assert parsed.content == "Let me look both up."
    assert parsed.calls == [ToolCall("add", {"a": 1, "b": 2}), ToolCall("describe", {"name": "x"})]


def test_parse_tolerates_whitespace() -> None:
    text = '<tool_call>   {"name":"add",\n  "arguments":{"a":5}}  \t\n\n</tool_call><tool_call>{"name": "add", "arguments": {}}</tool_call>'
    parsed = parse_tool_calls(text)
    assert parsed.content == ""
    assert parsed.calls == [ToolCall("add", {"a": 5}), ToolCall("add", {})]


def test_parse_no_calls() -> None:
    parsed = parse_tool_calls("  The answer is 4.\n")
    assert parsed.content == "The answer is 4." and parsed.calls == []


def test_parse_malformed_entries_keep_their_place() -> None:
    text = (
        '<tool_call>\n{"name": "add", "arguments": {"a": 1}\n</tool_call>\n'  # missing brace
        '<tool_call>\n{"name": "add", "arguments": {"a": 2}}\n</tool_call>\n'
        '<tool_call>\n["add"]\n</tool_call>\n'
        '<tool_call>\n{"name": "add", "arguments": [1, 2]}\n</tool_call>\n'
        '<tool_call>\n{"name": "add", "arguments": {"a": 3'  # truncated generation
    )
    calls = parse_tool_calls(text).calls
    assert len(calls) == 5
    assert isinstance(calls[0], ToolCallError) and "not valid JSON" in calls[0].message
    assert calls[0].raw.startswith('{"name": "add"')
    assert calls[1] == ToolCall("add", {"a": 2})
    assert isinstance(calls[2], ToolCallError) and '"name"' in calls[2].message
    assert isinstance(calls[3], ToolCallError) and "JSON object" in calls[3].message
    assert isinstance(calls[4], ToolCallError) and "unterminated" in calls[4].message


def test_parse_arguments_as_json_string_and_missing() -> None:
    text = (
        '<tool_call>{"name": "add", "arguments": "{\\"a\\": 4}"}</tool_call>'
        '<tool_call>{"name": "now"}</tool_call>'
    )
    assert parse_tool_calls(text).calls == [ToolCall("add", {"a": 4}), ToolCall("now", {})]


# --------------------------------------------------------------------------------------------------
# Registration and schemas
# --------------------------------------------------------------------------------------------------


def test_register_by_name() -> None:
    reg = ToolRegistry([add, describe, decorated])
    assert reg.names == ["add", "describe", "decorated"]
    assert "add" in reg and "nope" not in reg and len(reg) == 3
    with pytest.raises(ValueError, match="already registered"):
        reg.register(add)


@pytest.mark.parametrize(
    ("fn", "words"),
    [
        (not_a_def, "is a lambda, which has no name"),
        (Holder().method, "bound method.*environment_factory"),
        (functools.partial(add, 1), "partial, not a function"),
        (Holder(), "Holder, not a function"),
    ],
    ids=["lambda", "bound-method", "partial", "instance"],
)
def test_register_refuses_what_has_no_name_to_call(fn: object, words: str) -> None:
    with pytest.raises(TypeError, match=words):
        ToolRegistry().register(fn)  # type: ignore[arg-type]


@pytest.mark.parametrize("fn", [make_closure(3), make_nested()], ids=["closure", "nested"])
def test_closures_and_nested_functions_are_tools_that_cross_by_value(fn) -> None:
    import cloudpickle

    registry = ToolRegistry([fn])
    assert registry.names == [fn.__name__]
    # Not importable by module + name: cloudpickle sends the code and the captured values.
    copy = cloudpickle.loads(cloudpickle.dumps(fn))
    assert ToolRegistry([copy]).schemas() == registry.schemas() and copy(2) == fn(2)


@pytest.mark.parametrize(
    ("fn", "words"),
    [(untyped, "type hint"), (undocumented, "docstring"), (star, r"\*args")],
)
def test_register_rejects_unsupported_signatures(fn: object, words: str) -> None:
    with pytest.raises(TypeError, match=words):
        ToolRegistry([fn])  # type: ignore[list-item]


def test_schemas_from_signature_and_docstring() -> None:
    schemas = ToolRegistry([add, describe]).schemas()
    assert schemas[0] == {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers.",
            "parameters": {
                "type": "object",
                "properties": {
                    "a": {"type": "integer", "description": "The first term."},
                    "b": {"type": "integer", "description": "The second term, defaulting to zero."},
                },
                "required": ["a"],
            },
            "return": {"type": "integer", "description": "The sum."},
        },
    }
    props = schemas[1]["function"]["parameters"]
    assert {k: v["type"] for k, v in props["properties"].items()} == {"name": "string", "loud": "boolean", "scale": "number"}
    assert props["properties"]["loud"].get("nullable") is True
    assert props["required"] == ["name"]


def test_schemas_render_in_a_chat_template() -> None:
    jinja2 = pytest.importorskip("jinja2")
    template = jinja2.Template("{% for t in tools %}{{ t.function.name }}:{{ t.function.parameters.required | join(',') }};{% endfor %}")
    assert template.render(tools=ToolRegistry([add, describe]).schemas()) == "add:a;describe:name;"


# --------------------------------------------------------------------------------------------------
# Running
# --------------------------------------------------------------------------------------------------


def run(coro):  # type: ignore[no-untyped-def]
    return asyncio.run(coro)


def test_run_sync_and_async_and_render(executor: ThreadPoolExecutor) -> None:
    reg = ToolRegistry([add, describe, async_sleepy, decorated])

    async def main():  # type: ignore[no-untyped-def]
        return [
            await reg.run(ToolCall("add", {"a": 2, "b": 3}), executor, timeout=5),
            await reg.run(ToolCall("describe", {"name": "ü", "scale": 2}), executor, timeout=5),
            await reg.run(ToolCall("async_sleepy", {"seconds": 0.0, "tag": "t"}), executor, timeout=5),
            await reg.run(ToolCall("decorated", {"x": "hi"}), executor, timeout=5),
        ]

    results = run(main())
    assert [r.content for r in results] == ["5", '{"name": "ü", "loud": null, "scale": 2}', "t", "HI"]
    assert all(r.ok and r.error_kind is None and r.duration_s >= 0 for r in results)


def test_calls_run_in_the_order_the_model_made_them(executor: ThreadPoolExecutor) -> None:
    reg = ToolRegistry([sleepy, async_sleepy])
    # The first call is the slowest: a concurrent runner would log it last.
    text = (
        '<tool_call>{"name": "sleepy", "arguments": {"seconds": 0.15, "tag": "first"}}</tool_call>'
        '<tool_call>{"name": "async_sleepy", "arguments": {"seconds": 0.05, "tag": "second"}}</tool_call>'
        '<tool_call>{"name": "sleepy", "arguments": {"seconds": 0.0, "tag": "third"}}</tool_call>'
    )
    results = run(reg.run_all(parse_tool_calls(text).calls, executor, timeout=5))
    assert CALL_LOG == ["first", "second", "third"]
    assert [r.content for r in results] == ["first", "second", "third"]


def test_sleeping_sync_tool_does_not_block_event_loop(executor: ThreadPoolExecutor) -> None:
    reg = ToolRegistry([sleepy])
    sleep_s, tick_s = 0.6, 0.01

    async def main() -> tuple[list[float], float, float]:
        ticks: list[float] = []
        stop = asyncio.Event()

        async def ticker() -> None:
            while not stop.is_set():
                ticks.append(time.perf_counter())
                await asyncio.sleep(tick_s)

        task = asyncio.create_task(ticker())
        await asyncio.sleep(0)
        start = time.perf_counter()
        # Two rollouts each calling the slow tool: they overlap in the pool.
        results = await asyncio.gather(
            reg.run(ToolCall("sleepy", {"seconds": sleep_s, "tag": "a"}), executor, timeout=10),
            reg.run(ToolCall("sleepy", {"seconds": sleep_s, "tag": "b"}), executor, timeout=10),
        )
        wall = time.perf_counter() - start
        stop.set()
        await task
        assert all(r.ok for r in results)
        gaps = [b - a for a, b in zip(ticks, ticks[1:], strict=False)]
        return gaps, wall, start

    gaps, wall, _ = run(main())
    # The loop kept ticking through the sleep: its longest stall is a small fraction of the sleep
    # (a blocking call would stall it for the whole 0.6 s). Generous bounds for a loaded 2-core box.
    assert max(gaps) / sleep_s < 0.35
    assert len(gaps) >= 0.25 * sleep_s / tick_s
    # And the two calls overlapped: wall time well under the serial 1.2 s.
    assert wall / (2 * sleep_s) < 0.8


def test_timeout_returns_text(executor: ThreadPoolExecutor) -> None:
    reg = ToolRegistry([sleepy, async_sleepy])

    async def main():  # type: ignore[no-untyped-def]
        t0 = time.perf_counter()
        sync_result = await reg.run(ToolCall("sleepy", {"seconds": 1.0, "tag": "s"}), executor, timeout=0.1)
        async_result = await reg.run(ToolCall("async_sleepy", {"seconds": 1.0, "tag": "a"}), executor, timeout=0.1)
        return sync_result, async_result, time.perf_counter() - t0

    sync_result, async_result, elapsed = run(main())
    for r in (sync_result, async_result):
        assert not r.ok and r.error_kind == "timeout"
        assert "timed out after 0.1 s" in r.content
    assert elapsed < 1.0  # neither waited for its tool to finish
    assert "a" not in CALL_LOG  # the async tool was cancelled


def test_errors_are_returned_as_text(executor: ThreadPoolExecutor) -> None:
    reg = ToolRegistry([explode, add, raises_timeout])
    calls = parse_tool_calls(
        '<tool_call>{"name": "explode", "arguments": {"message": "boom"}}</tool_call>'
        '<tool_call>{"name": "missing", "arguments": {}}</tool_call>'
        '<tool_call>{"name": "add", "arguments": {"a": "1"}}</tool_call>'
        '<tool_call>{"name": "add", "arguments": {"b": 1}}</tool_call>'
        '<tool_call>{"name": "add", "arguments": {"a": 1, "c": 2}}</tool_call>'
        '<tool_call>{"name": "add", "arguments": {"a": true}}</tool_call>'
        '<tool_call>{"name": "raises_timeout", "arguments": {}}</tool_call>'
        "<tool_call>{not json}</tool_call>"
    ).calls
    results = run(reg.run_all(calls, executor, timeout=5))
    kinds = [r.error_kind for r in results]
    assert kinds == [
        "exception",
        "unknown_tool",
        "bad_arguments",
        "bad_arguments",
        "bad_arguments",
        "bad_arguments",
        "exception",
        "parse_error",
    ]
    assert results[0].content == "Error: RuntimeError: boom"
    assert "available tools: explode, add, raises_timeout" in results[1].content
    assert "must be integer, got str" in results[2].content
    assert "missing required argument(s) 'a'" in results[3].content
    assert "no parameter(s) 'c'" in results[4].content
    assert "must be integer, got bool" in results[5].content
    assert results[6].content == "Error: TimeoutError: upstream timed out"
    assert "not valid JSON" in results[7].content
    assert all(isinstance(r.content, str) and not r.ok for r in results)


def test_float_parameter_accepts_int(executor: ThreadPoolExecutor) -> None:
    reg = ToolRegistry([describe])
    r = run(reg.run(ToolCall("describe", {"name": "x", "scale": 3, "loud": True}), executor, timeout=None))
    assert r.ok and r.content == '{"name": "x", "loud": true, "scale": 3}'


def test_registry_pickles_for_the_spawned_worker(executor: ThreadPoolExecutor) -> None:
    reg = pickle.loads(pickle.dumps(ToolRegistry([add, decorated])))
    assert reg.names == ["add", "decorated"]
    assert run(reg.run(ToolCall("add", {"a": 1, "b": 1}), executor, timeout=5)).content == "2"

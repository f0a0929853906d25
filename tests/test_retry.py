"""The one retry policy (``grpo_core.retry``): what passes, the waits, the deadline from the first failure.

Its callers keep their own judgement and deadline and are tested with it: storage in
``tests/test_storage_faults.py``, generation and the restart watch in ``tests/test_server_watch.py``, the
tracking outbox in ``tests/test_outbox.py``.

    .venv/bin/python -m pytest -q tests/test_retry.py
"""

from __future__ import annotations

import asyncio
import itertools

import pytest

from grpo_core import retry
from grpo_core.retry import RetryPolicy


class Flaky:
    """Fails with the listed errors, then answers."""

    def __init__(self, *errors: BaseException):
        self.errors = list(errors)
        self.calls = 0

    def __call__(self) -> str:
        self.calls += 1
        if self.errors:
            raise self.errors.pop(0)
        return "answer"


@pytest.fixture
def clock(monkeypatch):
    """A clock that only the waits move."""
    now = [0.0]
    monkeypatch.setattr(retry.time, "monotonic", lambda: now[0])
    monkeypatch.setattr(retry.time, "sleep", lambda s: now.__setitem__(0, now[0] + s))
    return now


def test_the_waits_go_at_once_then_double_up_to_the_cap():
    policy = RetryPolicy(passes=lambda e: True, deadline_s=None, first_s=0.5, max_s=4.0, immediate=2)
    assert [policy.wait_before(n) for n in range(1, 9)] == [0.0, 0.0, 0.5, 1.0, 2.0, 4.0, 4.0, 4.0]


def test_failures_that_pass_are_retried_and_counted(clock):
    call = Flaky(ConnectionError("refused"), TimeoutError("slow"))
    attempts = RetryPolicy(passes=lambda e: isinstance(e, OSError), deadline_s=60).attempts()
    seen: list[str] = []
    assert attempts.call(call, before_wait=lambda e: seen.append(type(e).__name__)) == "answer"
    assert (call.calls, attempts.count, seen) == (3, 3, ["ConnectionError", "TimeoutError"])
    assert clock[0] == 0.5 + 1.0 and attempts.failing_for_s == 0.5  # the second failure came after one wait


def test_a_failure_that_cannot_pass_is_raised_at_once_as_it_is(clock):
    call = Flaky(PermissionError("no"), ConnectionError("refused"))
    with pytest.raises(PermissionError):
        RetryPolicy(passes=lambda e: isinstance(e, ConnectionError), deadline_s=60).attempts().call(call)
    assert call.calls == 1 and clock[0] == 0.0


def test_the_deadline_counts_from_the_first_failure_and_the_last_error_is_raised(clock):
    call = Flaky(*[ConnectionError(f"refused {i}") for i in range(100)])
    attempts = RetryPolicy(passes=lambda e: True, deadline_s=10.0, first_s=1.0, max_s=2.0).attempts()
    with pytest.raises(ConnectionError, match="refused 6"):
        attempts.call(call)
    # failures at 0, 1, 3, 5, 7, 9, 11: the one past 10 s after the first ends it
    assert attempts.count == 7 and attempts.failing_for_s == 11.0


def test_the_resends_at_once_come_before_the_deadline(clock):
    call = Flaky(*[ConnectionError("refused")] * 5)
    attempts = RetryPolicy(passes=lambda e: True, deadline_s=0.0, immediate=2).attempts()
    with pytest.raises(ConnectionError):
        attempts.call(call)
    assert call.calls == 3 and clock[0] == 0.0


def test_the_caller_can_stop_early_and_wait_its_own_way():
    closed = itertools.count()
    waits: list[float] = []
    call = Flaky(*[ConnectionError("refused")] * 100)
    with pytest.raises(ConnectionError):
        RetryPolicy(passes=lambda e: True, deadline_s=None, first_s=0.01).attempts().call(
            call, stop_when=lambda: next(closed) >= 3, sleep=waits.append)
    assert call.calls == 4 and waits == [0.01, 0.02, 0.04]


def test_a_coroutine_is_retried_the_same_way(monkeypatch):
    async def no_wait(seconds: float) -> None:
        return None

    monkeypatch.setattr(asyncio, "sleep", no_wait)
    flaky = Flaky(ConnectionError("refused"), ConnectionError("refused"))

    async def call() -> str:
        return flaky()

    attempts = RetryPolicy(passes=lambda e: True, deadline_s=60).attempts()
    assert asyncio.run(attempts.acall(call)) == "answer" and attempts.count == 3

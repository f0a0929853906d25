"""Calls to a tracking server, delivered in order by a background thread and retried while it is down.

The training loop must not stop because MLflow is restarting: ``Outbox.put(what, call)`` returns at
once and a single thread makes the calls in the order they were put, each one again with backoff
(``grpo_core.retry``'s policy, with no deadline) while it fails for a reason that passes (a refused
connection, a timeout, HTTP 5xx or throttling).
A call that the server refuses for good (a bad value, a missing run) is logged with what it was and
dropped, so one bad metric cannot hold back the rest.

A retried call must be idempotent, and the caller makes it so: a metric carries the timestamp it was
given when it was first put, so that a batch the server stored while its reply was lost is stored
again as the very same rows, which MLflow ignores (its metric key is key, step, timestamp, value).

``flush(timeout_s)`` waits for the queue to drain and returns what is still undelivered; ``close``
flushes and stops the thread.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from grpo_core.retry import RetryPolicy

log = logging.getLogger(__name__)

_BACKOFF_FIRST_S = 0.5
_BACKOFF_MAX_S = 15.0

# MLflow's error codes for requests that will never succeed as sent; anything else is retried.
PERMANENT_ERROR_CODES = frozenset({
    "INVALID_PARAMETER_VALUE", "RESOURCE_DOES_NOT_EXIST", "RESOURCE_ALREADY_EXISTS", "BAD_REQUEST",
    "PERMISSION_DENIED", "UNAUTHENTICATED", "INVALID_STATE", "ENDPOINT_NOT_FOUND",
})


def is_permanent(error: BaseException) -> bool:
    """Whether ``error`` says the call itself is wrong (retrying cannot help)."""
    return getattr(error, "error_code", None) in PERMANENT_ERROR_CODES


@dataclass
class _Call:
    what: str
    call: Callable[[], None]


class Outbox:
    """One thread that makes ``put`` calls in order, retrying each until it succeeds or is refused."""

    def __init__(self, name: str, permanent: Callable[[BaseException], bool] = is_permanent):
        self.name = name
        self.permanent = permanent
        self._pending: deque[_Call] = deque()
        self._cond = threading.Condition()
        self._busy = False  # a call is being made (it is no longer in _pending)
        self._closed = False
        self._failing_since: float | None = None
        self.delivered = 0
        self.refused: list[str] = []  # calls dropped because the server refused them for good
        self._thread = threading.Thread(target=self._run, name=f"outbox-{name}", daemon=True)
        self._thread.start()

    def put(self, what: str, call: Callable[[], None]) -> None:
        with self._cond:
            if self._closed:
                raise RuntimeError(f"outbox {self.name} is closed; cannot send {what}")
            self._pending.append(_Call(what, call))
            self._cond.notify_all()

    def undelivered(self) -> list[str]:
        with self._cond:
            return [c.what for c in self._pending]

    def flush(self, timeout_s: float) -> list[str]:
        """Wait up to ``timeout_s`` for every call put so far; returns those still undelivered."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while (self._pending or self._busy) and time.monotonic() < deadline:
                self._cond.wait(min(1.0, max(0.0, deadline - time.monotonic())))
            return [c.what for c in self._pending]

    def close(self, timeout_s: float) -> list[str]:
        """Flush, then stop the thread; returns what could not be delivered in ``timeout_s``."""
        left = self.flush(timeout_s)
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout=5.0)
        return left

    # ---- the delivering thread ----------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._pending and not self._closed:
                    self._cond.wait()
                if not self._pending:
                    return  # closed and drained
                item = self._pending[0]
                self._busy = True
            if not self._deliver(item):
                return  # close() already waited its time for this call

    def _deliver(self, item: _Call) -> bool:
        """Make ``item``'s call until it succeeds or is refused for good (True), or the outbox closes (False)."""
        # Read when each call starts, so that a test can shorten the waits.
        policy = RetryPolicy(passes=lambda err: not self.permanent(err), deadline_s=None,
                             first_s=_BACKOFF_FIRST_S, max_s=_BACKOFF_MAX_S)

        def failed(err: BaseException) -> None:
            with self._cond:
                self._busy = False
            self._note_failure(item, err)

        try:
            policy.attempts().call(item.call, before_wait=failed, stop_when=self._is_closed, sleep=self._pause)
        except Exception as err:  # noqa: BLE001 - every failure is either retried or reported
            if not self.permanent(err):
                with self._cond:
                    self._busy = False
                return False
            log.error("%s: the server refused %s for good, dropped: %s", self.name, item.what, err)
            self._finish(item, refused=True)
            return True
        self._finish(item, refused=False)
        return True

    def _is_closed(self) -> bool:
        with self._cond:
            return self._closed

    def _pause(self, seconds: float) -> None:
        """The wait between attempts; ``close()`` cuts it short so that a final flush can end on time."""
        with self._cond:
            if not self._closed:
                self._cond.wait(seconds)
            self._busy = True

    def _finish(self, item: _Call, refused: bool) -> None:
        with self._cond:
            if self._pending and self._pending[0] is item:
                self._pending.popleft()
            self._busy = False
            if refused:
                self.refused.append(item.what)
            else:
                self.delivered += 1
            if self._failing_since is not None and not refused:
                log.warning("%s: reachable again after %.0f s; delivering the %d calls that waited",
                            self.name, time.monotonic() - self._failing_since, len(self._pending) + 1)
                self._failing_since = None
            self._cond.notify_all()

    def _note_failure(self, item: _Call, err: BaseException) -> None:
        if self._failing_since is None:
            self._failing_since = time.monotonic()
            log.warning("%s: %s failed (%s); keeping it and what follows, retrying with backoff",
                        self.name, item.what, str(err)[:300])

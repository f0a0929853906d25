"""One retry policy: a call made again while its failure is one that passes, waiting longer each time.

Storage (``storage.retry``), the rollout's generation client, the restart watch (``vllm_server.watch``) and
the tracking outbox retry through here; each caller keeps its own judgement of which errors pass and its
own deadline. A ``RetryPolicy`` says:

* ``passes(error)``: whether the same call may succeed a little later (a refused connection, throttling);
  any other error is raised at once, as it is;
* ``deadline_s``: how long after the *first failure* to keep trying (None: until it succeeds, or until
  the caller's ``stop_when`` says so); the error of the last attempt is then raised, as it is;
* the waits: ``immediate`` failures resent at once (a keep-alive connection the server closed as the
  request went out), then ``first_s``, doubling, at most ``max_s``.

``policy.attempts()`` makes one call's retries (``Attempts``): run the call with ``call`` (or ``acall`` for
a coroutine function), then read how many attempts it took and how long it failed. Built on tenacity.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import tenacity

T = TypeVar("T")


@dataclass(frozen=True)
class RetryPolicy:
    """Which failures pass, for how long after the first one, and the waits between attempts."""

    passes: Callable[[BaseException], bool]
    deadline_s: float | None
    first_s: float = 0.5
    max_s: float = 15.0
    immediate: int = 0

    def attempts(self) -> Attempts:
        return Attempts(self)

    def wait_before(self, attempt: int) -> float:
        """Seconds to wait after failed attempt number ``attempt`` (1-based)."""
        if attempt <= self.immediate:
            return 0.0
        return min(self.max_s, self.first_s * 2 ** (attempt - self.immediate - 1))


class Attempts:
    """One call's attempts under a policy: ``count`` made so far, ``failing_for_s`` since the first failure."""

    def __init__(self, policy: RetryPolicy):
        self.policy = policy
        self.count = 0
        self.first_failure: float | None = None
        self.last_failure: float | None = None

    @property
    def failing_for_s(self) -> float:
        """Seconds from the first failure to the last one (0 when none failed)."""
        if self.first_failure is None or self.last_failure is None:
            return 0.0
        return self.last_failure - self.first_failure

    def call(self, fn: Callable[[], T], *, before_wait: Callable[[BaseException], None] | None = None,
             stop_when: Callable[[], bool] | None = None, sleep: Callable[[float], Any] | None = None) -> T:
        """``fn()``, made again while it fails in a way that passes; ``before_wait(error)`` runs before each wait,
        ``stop_when()`` ends the retries early (the last error is raised), ``sleep`` replaces ``time.sleep``."""
        extra = {} if sleep is None else {"sleep": sleep}
        retrying = tenacity.Retrying(**self._settings(before_wait, stop_when), **extra)
        return retrying(self._counted(fn))

    async def acall(self, fn: Callable[[], Awaitable[T]], *,
                    before_wait: Callable[[BaseException], None] | None = None) -> T:
        """``await fn()`` under the same rules; waits with ``asyncio.sleep``."""
        retrying = tenacity.AsyncRetrying(**self._settings(before_wait, None))

        async def counted() -> T:
            self.count += 1
            return await fn()

        return await retrying(counted)

    # ---- the policy as tenacity's settings ------------------------------------------------------------------
    def _counted(self, fn: Callable[[], T]) -> Callable[[], T]:
        def counted() -> T:
            self.count += 1
            return fn()

        return counted

    def _settings(self, before_wait: Callable[[BaseException], None] | None,
                  stop_when: Callable[[], bool] | None) -> dict[str, Any]:
        def passes(error: BaseException) -> bool:
            now = time.monotonic()
            self.first_failure = now if self.first_failure is None else self.first_failure
            self.last_failure = now
            return self.policy.passes(error)

        def stop(state: tenacity.RetryCallState) -> bool:
            if stop_when is not None and stop_when():
                return True
            deadline = self.policy.deadline_s
            return (deadline is not None and state.attempt_number > self.policy.immediate
                    and self.failing_for_s >= deadline)

        def wait(state: tenacity.RetryCallState) -> float:
            return self.policy.wait_before(state.attempt_number)

        def announce(state: tenacity.RetryCallState) -> None:
            if before_wait is not None and state.outcome is not None:
                before_wait(state.outcome.exception())

        return dict(retry=tenacity.retry_if_exception(passes), stop=stop, wait=wait, before_sleep=announce,
                    reraise=True)

"""When a server leaves service: the fleet's one rule, applied alike by the rollout worker and the trainer.

A server is **out** on evidence, never on one slow answer:

* **refused**: a connection to it was refused or reset (nothing listens: the process is gone);
* **silent**: no call to it has been answered for ``drain_after_s``, counted from the first unanswered one (every
  call since failed or timed out: a hung or frozen process);
* **stalled**: it answers, has requests running, and its progress counters (``/metrics`` prompt and generation
  tokens) have stood still for ``drain_after_s`` while it was not paused for a weight push.

A server that answers slowly, or fails now and then but answers again within the window, or is slow but its
counters move, is **suspect** at most: it keeps its requests. What "out" does depends only on whether another
server serves (``action``): with another, the server is drained (its groups and requests in flight move there);
as the last serving server (a fleet of one always) there is nowhere to move them, so they wait for it, up to
``server_unavailable_timeout_s`` after its trouble began, and the run then fails naming it.

``ServerHealth`` holds what is known of one server and answers ``verdict(now)``; it reads no clock and makes no
call (its callers do), so every case is a unit test (tests/test_server_health.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Standing = Literal["ok", "suspect", "out"]
Action = Literal["keep", "drain", "wait"]


@dataclass(frozen=True)
class Verdict:
    """What the evidence says of one server at one moment."""

    standing: Standing
    reason: str = ""
    """Why it is suspect or out ("" when ok)."""
    since: float | None = None
    """When the trouble began (its last answer, or the last time its counters moved)."""
    deadline: float | None = None
    """When a suspect server is out unless it answers (or moves) first; None when ok or out."""


@dataclass
class ServerHealth:
    """The evidence about one server (module docstring). Times are the caller's clock, in seconds."""

    drain_after_s: float
    last_answer: float | None = None
    """When it last answered anything."""
    failing_since: float | None = None
    """When the first call that failed since its last answer was sent (None: its last call answered)."""
    refused: str | None = None
    """The refusal of its last call, when that call was refused (cleared by any answer)."""
    progress: float | None = None
    """Its progress counter at the last answer (prompt + generation tokens)."""
    progress_at: float | None = None
    """When its counter last moved, or it was last seen idle or paused (no request to make progress on)."""

    def __post_init__(self) -> None:
        if not self.drain_after_s > 0:
            raise ValueError(f"drain_after_s must be > 0, got {self.drain_after_s!r} (server_drain_after_s)")

    def answered(self, now: float, progress: float | None = None, busy: bool = False, paused: bool = False) -> None:
        """It answered at ``now``. ``progress``: its token counter then (None: not read); ``busy``: it has
        requests running; ``paused``: paused for a weight push (running requests wait by design)."""
        came_back = self.failing_since is not None
        self.last_answer, self.failing_since, self.refused = now, None, None
        if progress is None:
            return
        moved = self.progress is None or progress != self.progress
        # Back from a silence (judged by its own window), its requests get a whole window to move again: the first
        # answer after a freeze shows the counters where the freeze left them.
        if moved or not busy or paused or came_back or self.progress_at is None:
            self.progress_at = now
        self.progress = progress

    def failed(self, sent_at: float, refused: str | None = None) -> None:
        """A call sent at ``sent_at`` got no answer: ``refused`` names a refused connection, None a timeout or other
        failure (which counts only once it has lasted ``drain_after_s``)."""
        if self.failing_since is None:
            self.failing_since = sent_at
        self.refused = refused

    def verdict(self, now: float) -> Verdict:
        """The server's standing at ``now``."""
        if self.refused is not None:
            return Verdict("out", f"it refused a connection ({self.refused})", self.failing_since)
        if self.failing_since is not None:
            start = self.failing_since  # its first unanswered call: before that it was not asked
            silent = now - start
            if silent >= self.drain_after_s:
                return Verdict("out", f"it has not answered for {silent:.0f} s (server_drain_after_s="
                                      f"{self.drain_after_s:g})", start)
            return Verdict("suspect", f"it has not answered for {silent:.0f} s", start, start + self.drain_after_s)
        if self.progress_at is not None and self.last_answer is not None and self.progress_at < self.last_answer:
            stalled = now - self.progress_at
            if stalled >= self.drain_after_s:
                return Verdict("out", f"its requests made no progress for {stalled:.0f} s (its /metrics token "
                                      f"counters stood at {self.progress:.0f}; server_drain_after_s="
                                      f"{self.drain_after_s:g})", self.progress_at)
            return Verdict("suspect", f"its requests made no progress for {stalled:.0f} s", self.progress_at,
                           self.progress_at + self.drain_after_s)
        return Verdict("ok")


def action(verdict: Verdict, others_serving: bool) -> Action:
    """What the fleet does with a server: ``drain`` one that is out while another serves, ``wait`` for one that is
    out as the last serving server (``server_unavailable_timeout_s`` after ``verdict.since``), else ``keep``."""
    if verdict.standing != "out":
        return "keep"
    return "drain" if others_serving else "wait"


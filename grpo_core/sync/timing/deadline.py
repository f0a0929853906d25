"""Deadlines for every phase of a push, from its bytes and the bandwidth measured on earlier pushes.

A push is a chain of waits on another machine: the pause, the rendezvous (init), the start, the
transfer itself, the server's answer that it loaded everything (update), the finish (the server
processes the loaded layers) and the resume. Any of them can hang for good: a server process
stopped or swapped out, a network partition, a collective that never matches. Each phase gets

    deadline = max(floor_s, slack × bytes / bandwidth)

where ``bytes`` is the model's dense size for the phases that move or process every weight
(transfer, update, finish; a delta moves fewer bytes but the server still loads every weight) and 0
for the others, and ``bandwidth`` is the slowest rate of the last ``history`` pushes to this server
(bytes / seconds from the start of the transfer to the end of the finish), or ``assumed_mb_s``
before the first one. A phase that passes its deadline raises ``WeightSyncTimeout`` naming the
phase, the server, the version and the formula; the caller tears the session down and recovers.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from grpo_core.sync.errors import WeightSyncError, WeightSyncTimeout

__all__ = ["DeadlineConfig", "Deadlines", "PhaseClock", "WeightSyncError", "WeightSyncTimeout"]

PHASES_WITH_BYTES = frozenset({"transfer", "update", "finish"})


@dataclass(frozen=True)
class DeadlineConfig:
    """How long each phase of a push may take (see the module docstring for the formula)."""

    floor_s: float = 60.0
    """The least any phase gets: HTTP round trips, the rendezvous, a busy server's pause."""
    slack: float = 4.0
    """Multiple of the time the phase's bytes take at the measured bandwidth."""
    assumed_mb_s: float = 50.0
    """Bandwidth (MB/s, 10^6 bytes) assumed until a push to this server has been measured: low, so
    that a first push to a CPU server that reloads slowly is not cut off."""
    history: int = 8
    """Pushes whose slowest measured bandwidth sets the deadlines."""

    def __post_init__(self) -> None:
        for name in ("floor_s", "slack", "assumed_mb_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"DeadlineConfig.{name}={getattr(self, name)!r}: must be > 0")
        if self.history < 1:
            raise ValueError(f"DeadlineConfig.history={self.history}: must be at least 1")


class Deadlines:
    """The deadlines of pushes to one server, and the bandwidth measured on them."""

    def __init__(self, config: DeadlineConfig, server: str):
        self.config = config
        self.server = server
        self._rates: deque[float] = deque(maxlen=config.history)

    @property
    def bandwidth(self) -> float:
        """Bytes per second the deadlines assume."""
        return min(self._rates) if self._rates else self.config.assumed_mb_s * 1e6

    def seconds(self, phase: str, nbytes: int) -> float:
        moved = nbytes if phase in PHASES_WITH_BYTES else 0
        return max(self.config.floor_s, self.config.slack * moved / self.bandwidth)

    def explain(self, phase: str, nbytes: int) -> str:
        moved = nbytes if phase in PHASES_WITH_BYTES else 0
        return (f"max(floor {self.config.floor_s:g} s, {self.config.slack:g} x {moved / 1e6:.1f} MB / "
                f"{self.bandwidth / 1e6:.1f} MB/s)")

    def record(self, nbytes: int, seconds: float) -> None:
        """A push that moved and loaded ``nbytes`` in ``seconds`` (transfer start to finish end)."""
        if nbytes > 0 and seconds > 0:
            self._rates.append(nbytes / seconds)

    def clock(self, phase: str, nbytes: int, version: int | str | None) -> PhaseClock:
        return PhaseClock(self, phase, nbytes, version)


class PhaseClock:
    """One phase's deadline, started now: ``remaining()`` for waits, ``expired()`` for the error."""

    def __init__(self, deadlines: Deadlines, phase: str, nbytes: int, version: int | str | None):
        self.deadlines = deadlines
        self.phase = phase
        self.nbytes = nbytes
        self.version = version
        self.seconds = deadlines.seconds(phase, nbytes)
        self.started = time.monotonic()

    def remaining(self) -> float:
        return max(0.0, self.started + self.seconds - time.monotonic())

    def expired(self, detail: str = "") -> WeightSyncTimeout:
        """The error to raise when the phase's wait gave up."""
        waited = time.monotonic() - self.started
        return WeightSyncTimeout(
            f"weight sync to {self.deadlines.server}: phase '{self.phase}' of the push of version {self.version} "
            f"passed its deadline of {self.seconds:.1f} s = {self.deadlines.explain(self.phase, self.nbytes)} "
            f"(waited {waited:.1f} s){': ' + detail if detail else ''}",
            server=self.deadlines.server, version=self.version, phase=self.phase,
        )

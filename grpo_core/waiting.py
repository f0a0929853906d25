"""Waits that say what they wait for: at once, for how long at most, what to do if that is wrong, and a line every
few seconds while they last, so a quiet terminal is never mistaken for a hung one.

    with announced_wait("the vLLM server at http://host:8000", limit_s=240,
                        hint="check the URL (vllm_server_base_url)"):
        ...poll...

Lines go to stderr (a library's progress, like the rollout worker's notices): a training process's stderr is what
the job flow copies to its console and log, and what a script run in a terminal shows whatever logging is set to.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TextIO

HEARTBEAT_S = 15.0
"""Seconds between the lines a wait prints while it lasts."""


def _duration(seconds: float) -> str:
    seconds = max(0, round(seconds))
    return f"{seconds} s" if seconds < 600 else f"{seconds // 60} min {seconds % 60:02d} s"


def wait_notice(what: str, limit_s: float | None, hint: str, limit_text: str | None = None) -> str:
    """The first line of a wait: what, how long at most (or ``limit_text`` where no deadline applies) and the hint."""
    limit = limit_text or (f"at most {_duration(limit_s)}" if limit_s is not None else "no time limit")
    return f"waiting for {what} ({limit}); {hint}"


def heartbeat_line(what: str, elapsed_s: float, limit_s: float | None, detail: str = "") -> str:
    """A line while the wait lasts: how long so far, out of how long at most, and what the awaited thing says."""
    of = f" of at most {_duration(limit_s)}" if limit_s is not None else ""
    return f"  ... still waiting for {what}: {_duration(elapsed_s)}{of}" + (f" ({detail})" if detail else "")


@contextmanager
def announced_wait(what: str, limit_s: float | None, hint: str, *, limit_text: str | None = None,
                   delay_s: float = 0.0, every_s: float = HEARTBEAT_S, detail: Callable[[], str] | None = None,
                   out: TextIO | None = None) -> Iterator[None]:
    """Announce the wait after ``delay_s`` (0: at once; a short delay keeps a wait that ends at once silent), then
    print a heartbeat every ``every_s`` until the block ends; ``detail`` adds what the awaited thing reports (a log's
    last line) to each heartbeat."""
    stream = out if out is not None else sys.stderr
    start = time.monotonic()
    done = threading.Event()

    def say(line: str) -> None:
        try:
            print(line, file=stream, flush=True)
        except (ValueError, OSError):  # the stream was closed under a wait that outlived its caller's output
            done.set()

    def run() -> None:
        if done.wait(delay_s):
            return
        say(wait_notice(what, limit_s, hint, limit_text))
        while not done.wait(every_s):
            try:
                extra = detail() if detail else ""
            except Exception:  # noqa: BLE001 - a heartbeat must never fail the wait it reports on
                extra = ""
            say(heartbeat_line(what, time.monotonic() - start, limit_s, extra))

    thread = threading.Thread(target=run, name="announced-wait", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join(timeout=1.0)

"""Held-out evaluation beside training: an evaluation of a weight version runs in a thread while the steps go on.

``EvaluationBeside.start(version, run)`` starts ``run()`` (the blocking held-out evaluation of what the server serves,
``heldout.evaluate_on_server``) on its own thread, right after ``version`` was pushed; the trainer's step does not
wait for it. ``finished()`` hands back, at a later step, each evaluation that ended as ``(version, metrics)``: the
trainer logs the metrics against the step of that version, not the step at which they came back.

Each completion carries the weight version it was sampled under (the oldest of its tokens, as the server reports
it; ``EvalResult.versions``). The server goes on receiving pushes meanwhile, so an evaluation that outlasts the
next push samples part of its completions from a newer version: ``eval/version_share`` is the share sampled entirely
under the version asked for (1.0 when it ended before the next push), so a reader knows what the accuracy measured.

One evaluation runs at a time: one asked for while another still runs is skipped (``eval/skipped`` counts them, at
the step of the version that was not evaluated), since queuing it would evaluate a later version than asked.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

log = logging.getLogger(__name__)


class EvaluationBeside:
    """At most one held-out evaluation running beside training, and the ones that ended, oldest first."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="eval-beside")
        self._running: tuple[int, Future[dict[str, float]]] | None = None
        self._ended: list[tuple[int, Future[dict[str, float]]]] = []  # ended before the next one started
        self._lock = threading.Lock()
        self.skipped = 0

    def start(self, version: int, run: Callable[[], dict[str, float]]) -> bool:
        """Evaluate ``version`` (``run()``, the server serving it now) beside training; False, and nothing started,
        while an earlier evaluation still runs."""
        with self._lock:
            if self._running is not None and not self._running[1].done():
                self.skipped += 1
                log.warning("held-out evaluation of weight version %d is skipped: the evaluation of version %d still "
                            "runs (raise eval_steps to evaluate less often)", version, self._running[0])
                return False
            if self._running is not None:
                self._ended.append(self._running)  # ended since the last finished(): handed back by the next
            self._running = (version, self._pool.submit(run))
            return True

    def finished(self) -> list[tuple[int, dict[str, float]]]:
        """The evaluations that ended since the last call, oldest first, as ``(version, metrics)`` (an evaluation's
        error is raised here)."""
        with self._lock:
            ended, self._ended = self._ended, []
            if self._running is not None and self._running[1].done():
                ended.append(self._running)
                self._running = None
        return [(version, future.result()) for version, future in ended]

    @property
    def running(self) -> int | None:
        """The version being evaluated, or None."""
        with self._lock:
            return None if self._running is None or self._running[1].done() else self._running[0]

    def wait(self, timeout_s: float) -> list[tuple[int, dict[str, float]]]:
        """Wait up to ``timeout_s`` for the running evaluation (the run's end), then hand back what ended."""
        with self._lock:
            running = self._running
        if running is not None:
            try:
                running[1].result(timeout=timeout_s)
            except TimeoutError:
                log.warning("held-out evaluation of weight version %d did not end within %.0f s of the run's end; "
                            "its metrics are not logged", running[0], timeout_s)
                return []
            except Exception:  # noqa: BLE001 - raised to the caller by finished()
                pass
        return self.finished()

    def close(self) -> None:
        # A running evaluation is not waited for: its thread ends with its requests' timeouts.
        self._pool.shutdown(wait=False, cancel_futures=True)

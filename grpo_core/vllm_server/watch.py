"""Notice that the vLLM server restarted, so that the trainer pushes its weights to it again.

An external server (``server.managed: false``: a crashed or rescheduled pod) comes back serving the
weights it loaded from disk under the weight version ``"default"``, with no weight-transfer session.
What it generates would otherwise be dated by the trainer's last version and trained as on-policy.

Two things keep that from happening:

* every generated token carries the server's weight version (``/inference/v1/generate``); a version
  the trainer never pushed maps to ``rollout.stages.UNKNOWN_VERSION`` and the collector drops such
  samples (``WeightVersions.was_pushed``), whenever they arrive;
* ``ServerWatch.restarted()`` tells the trainer that the server is no longer the one it pushed to, so
  it opens a new weight transfer and pushes again. It is one ``GET /weight_info`` (the served weight
  version must be the one read back after the trainer's last push) made before each step's
  collection and every few seconds while the collection waits for samples (the trainer's
  ``grpo_core.training.collector.WatchedSource``). When the server does not answer it waits, with
  backoff, for ``server_unavailable_timeout_s``; a server that answers again is also compared by
  identity (its process start time and model root), which tells a restart apart from a network pause
  even if someone set a matching version.

Rank 0 only: the other ranks learn the answer from the trainer's broadcast.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import time
from dataclasses import dataclass
from typing import Any

import httpx

from grpo_core.retry import RetryPolicy
from grpo_core.vllm_server.control import SERVER_UNREACHABLE, VLLMRequestError
from grpo_core.waiting import announced_wait

log = logging.getLogger(__name__)

# A server that is starting may answer 404/503 for a moment: the same wait as for one that does not answer.
ANSWER_FAILURES = (*SERVER_UNREACHABLE, httpx.ReadTimeout, VLLMRequestError)
ANSWER = RetryPolicy(passes=lambda err: isinstance(err, ANSWER_FAILURES), deadline_s=None, first_s=0.5, max_s=10.0)
"""How the watch waits for a server that does not answer (the deadline is ``server_unavailable_timeout_s``)."""
PROBE_TRY_S = 5.0
"""How long one look at a server (its weight version, whether it answers) may take: a look that takes longer is a
failed one, which counts against the server only once failures last ``server_drain_after_s``
(``vllm_server.health``); the last serving server is looked at again with backoff instead."""
ANNOUNCE_AFTER_S = 5.0
"""A wait on a server (a push, a look) that lasts longer than this says so, with the server and the limit."""


def refusal(err: BaseException) -> str | None:
    """``err`` as a refused connection (nothing listens there: the rule's immediate evidence), or None."""
    return f"{type(err).__name__}: {err}" if isinstance(err, httpx.ConnectError) else None

_START_TIME = re.compile(r"^process_start_time_seconds\s+(\S+)$", re.M)


class ServerUnavailableError(RuntimeError):
    """The server did not answer for ``server_unavailable_timeout_s``; the message names it."""


@dataclass(frozen=True)
class ServerIdentity:
    """What tells one server process from the next on the same address."""

    start_time: float | None  # Prometheus' process_start_time_seconds of the API server (None: not exported)
    model_root: str


class ServerWatch:
    """Remembers what the server reported after the trainer's last push; says when that changed."""

    def __init__(self, control: Any, unavailable_timeout_s: float):
        self.control = control
        self.unavailable_timeout_s = unavailable_timeout_s
        self.expected_version: str | None = None
        self.identity: ServerIdentity | None = None
        self.restarts = 0
        self.waited_s = 0.0  # seconds spent waiting for it to answer again (``fleet/<name>/waited_s``)
        self._known_restart: str | None = None  # noticed by WatchedSource, not yet acted on

    def after_push(self, pushed: list[int]) -> None:
        """Read back the version the push set; one the trainer never pushed means the server restarted
        between the push and now."""
        version, waited = self._weight_version()
        if version not in {str(v) for v in pushed}:
            self._known_restart = f"the server reports weight version {version!r} right after a push"
            return
        self.expected_version = version
        if self.identity is None or waited:
            self.identity = self._identity()

    def restarted(self) -> str | None:
        """Why the server is not the one the trainer last pushed to, or None when it is. Waits while the
        server does not answer; raises ``ServerUnavailableError`` after ``unavailable_timeout_s``."""
        if self._known_restart is not None:
            reason, self._known_restart = self._known_restart, None
            return reason
        if self.expected_version is None:
            return None  # nothing pushed yet: the start-up push comes next anyway
        version, waited = self._weight_version()
        if version != self.expected_version:
            return f"it serves weight version {version!r}, the trainer last pushed {self.expected_version!r}"
        if waited:
            identity = self._identity()
            if self.identity is not None and identity != self.identity:
                return f"it answers as another process ({identity}, before {self.identity})"
        return None

    def wait_until_answering(self, per_try_s: float = 5.0) -> None:
        """Return once the server answers ``/weight_info`` (each try waits ``per_try_s``: a stopped engine
        leaves requests unanswered rather than refused); raises ``ServerUnavailableError`` after
        ``unavailable_timeout_s``."""
        self._answering(lambda: self.control.weight_version(timeout=per_try_s))

    def note_restart(self, reason: str) -> None:
        """Keep a restart noticed while collecting for the next ``restarted()``."""
        self._known_restart = reason

    # ---- reading the server -------------------------------------------------------------------------
    def _weight_version(self) -> tuple[str, bool]:
        """The served weight version, and whether the server had to be waited for."""
        return self._answering(lambda: self.control.weight_version(timeout=PROBE_TRY_S))

    def _identity(self) -> ServerIdentity:
        models, _ = self._answering(self.control.models)
        match = _START_TIME.search(self.control.metrics_text() or "")
        return ServerIdentity(start_time=float(match.group(1)) if match else None, model_root=str(models[0].get("root", "")))

    def _answering(self, call: Any) -> tuple[Any, bool]:
        """``call()``'s result once the server answers, and whether it failed first (``ANSWER``'s backoff between
        tries, for ``unavailable_timeout_s`` after the first failure)."""
        attempts = dataclasses.replace(ANSWER, deadline_s=self.unavailable_timeout_s).attempts()

        def waiting(err: BaseException) -> None:
            if attempts.count == 1:
                log.warning("the vLLM server at %s does not answer (%s); waiting up to %.0f s for it",
                            self.control.base_url, err, self.unavailable_timeout_s)

        started = time.monotonic()
        try:
            with announced_wait(f"the vLLM server at {self.control.base_url} to answer", self.unavailable_timeout_s,
                                "no other server serves, so its rollouts wait for it; past the limit the run fails "
                                "naming it (server_unavailable_timeout_s)", delay_s=ANNOUNCE_AFTER_S):
                result = attempts.call(call, before_wait=waiting)
            return result, attempts.count > 1
        except ANSWER_FAILURES as err:
            raise ServerUnavailableError(
                f"the vLLM server at {self.control.base_url} did not answer for {attempts.failing_for_s:.0f} s "
                f"(server_unavailable_timeout_s={self.unavailable_timeout_s:g}); last error: {err}"
            ) from err
        finally:
            if attempts.count > 1:
                self.waited_s += time.monotonic() - started


# ---- a server a dead trainer left mid-push ---------------------------------------------------------
def left_paused(control: Any) -> bool:
    """Whether the server is paused, as a trainer that died during a weight sync leaves it."""
    try:
        paused = control.is_paused()
    except VLLMRequestError:
        return False  # no dev-mode routes: check_server names the missing flag
    if paused:
        log.warning("the vLLM server was left paused, by a trainer that died during a weight sync; pushing weights")
    return paused


def close_open_weight_update(control: Any) -> None:
    """Finish the weight-update session a trainer killed between start and finish left open, so the
    next push can start one. vLLM answers a start while a session is open, and a finish while none
    is, with an error (the engine runs on) and cannot be asked which holds: finish, and accept the
    refusal when there was nothing to finish."""
    try:
        control.finish_weight_update()
    except VLLMRequestError as err:
        if "without a matching start" not in str(err):
            raise
        return
    log.warning("closed the weight-update session that the dead trainer left open")

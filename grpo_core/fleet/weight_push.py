"""The trainer's pushes to its server: push, confirm what the server serves, recover from a failed push.

    push(v)     every rank: the sync's push (gathers are collectives; rank 0 talks to the server)
                → rank 0 reads the served version back (``fleet.verify.check_version``) and, every
                  ``weight_sync_verify_every`` pushes, compares the server's probe log-probs with the
                  trainer's (every rank computes those: the forward is collective; a 16-bit server's outlier
                  is settled with further sequences, ``fleet.verify.ProbeOutlier``) and, where the
                  transport can, the bytes the server holds (``check_applied``: storage receipts)
                → the ranks take rank 0's verdict (one broadcast)
    on failure  a ``WeightSyncError`` (a phase past its deadline, a refusal, a mismatch) or the server
                gone: close the session, wait for the server to answer (``server_unavailable_timeout_s``),
                finish a weight update it left open, open a new session and push again;
                ``weight_sync_attempts`` pushes of a version in all, then the run fails with the
                last named error (the flow resumes it)

One ``WeightPusher`` per server (``fleet.servers`` makes one for each server of the run); nothing here is
specific to one transport.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx
import torch

from grpo_core.fleet.verify import ProbeOutlier, PushVerifier, VerifyConfig, VerifyReport, check_version
from grpo_core.ranks import DistInfo, broadcast_object
from grpo_core.sync.base import SyncStats, WeightSync
from grpo_core.sync.errors import WeightSyncError
from grpo_core.sync.factory import SYNC_MODE_CODES, make_patch_publisher, make_weight_sync
from grpo_core.vllm_server.control import VLLMRequestError
from grpo_core.vllm_server.watch import close_open_weight_update

log = logging.getLogger(__name__)

PUSH_FAILURES = (httpx.TransportError, VLLMRequestError, RuntimeError)
"""What a push to a server that went away or misbehaved raises (``WeightSyncError`` is a ``RuntimeError``)."""

Probe = Callable[[list[int]], torch.Tensor]
"""The trainer's own log-probs of a probe sequence (``fleet.probe.VersionProbe``); every rank calls it."""


@dataclass(frozen=True)
class PushOutcome:
    """One version pushed and confirmed."""

    stats: SyncStats
    report: VerifyReport | None
    """The log-prob check (None when none was due)."""
    attempts: int
    check_s: float
    """Seconds spent confirming (version read-back, probe forward and request, receipts)."""

    def metrics(self, version: int, recoveries: int) -> dict[str, float]:
        """The push's ``sync/*`` metrics (and ``weight_version``) for the step's log."""
        stats, report = self.stats, self.report
        metrics = {
            "sync/bytes": float(stats.bytes),
            "sync/seconds": stats.seconds,
            "sync/mode": SYNC_MODE_CODES[stats.mode],
            "sync/check_s": self.check_s,
            "sync/recoveries": float(recoveries),
            "sync/dense_bytes": stats.dense_bytes,
            "sync/changed_share": stats.changed_share,
            "sync/adapters_registered": stats.adapters_registered,
            "sync/verify_logprob_diff": report.max_diff if report else None,
            "sync/verify_logprob_moved": report.moved if report else None,
            "sync/verify_logprob_diff_mean": report.mean_diff if report else None,
            "sync/verify_tolerance": report.tolerance if report else None,
            "sync/verify_reprobes": report.reprobes if report else None,
            "weight_version": float(version),
        }
        return {k: float(v) for k, v in metrics.items() if v is not None}


class WeightPusher:
    """Pushes, confirms and recovers (module docstring). ``make_sync`` opens a new session to the server."""

    def __init__(self, make_sync: Callable[[], WeightSync], dist: DistInfo, control: Any, watch: Any,
                 attempts: int, verify: VerifyConfig, probe: Probe | None, vocab_size: int):
        self.make_sync = make_sync
        self.dist = dist
        self.control = control
        self.watch = watch
        self.attempts = attempts
        self.verifier = PushVerifier(verify, vocab_size) if verify.every > 0 else None
        self.probe = probe
        self.sync: WeightSync | None = None
        self.base_version: int | None = None  # adapter sync: the version of the base weights, pushed once per session
        self.confirmed = 0
        self.recoveries = 0

    @classmethod
    def for_run(cls, args: Any, setup: Any, dist: DistInfo, control: Any, watch: Any, vocab_size: int,
                probe: Probe) -> WeightPusher:
        """The pusher of a run: ``args`` the fleet's settings (``config.fleet``: attempts and checks of a push),
        ``setup`` what the transfer needs (``sync.factory.SyncSetup``)."""
        if args.weight_sync_transport == "storage":
            setup.publisher = make_patch_publisher(setup)  # one writer for the run, whatever the sessions
        return cls(lambda: make_weight_sync(setup, control), dist, control, watch, attempts=args.weight_sync_attempts,
                   verify=VerifyConfig(every=args.weight_sync_verify_every, logprob_atol=args.weight_sync_verify_atol),
                   probe=probe, vocab_size=vocab_size)

    @property
    def mode(self) -> str:
        return self.open().mode

    def open(self) -> WeightSync:
        if self.sync is None:
            self.sync = self.make_sync()
        return self.sync

    def reopen(self) -> WeightSync:
        """A new session (the server restarted: the old one died with its workers)."""
        self.close()
        return self.open()

    def close(self) -> None:
        self.base_version = None  # a new session pushes the base weights again
        if self.sync is not None:
            sync, self.sync = self.sync, None
            try:
                sync.close()
            except Exception as err:  # noqa: BLE001 - whatever a broken session says, a new one follows
                log.info("closing the weight transfer to %s: %s", sync.server_url, err)

    def push(self, version: int, attempts: int | None = None) -> PushOutcome:
        """Push ``version`` and confirm it (module docstring); raises the last named error when every attempt failed.
        ``attempts``: this push's, in place of the run's (a fleet gives a server one while others serve: a failed
        server is drained rather than waited for)."""
        attempts = self.attempts if attempts is None else attempts
        for attempt in range(1, attempts + 1):
            failure: BaseException | None = None
            stats = report = None
            try:
                stats = self.open().push(version)
            except PUSH_FAILURES as err:
                failure = err
            failure = self._agree(failure, version)
            check_s = 0.0
            if failure is None:
                start = time.perf_counter()
                report, failure = self._confirm(version)
                check_s = time.perf_counter() - start
            if failure is None:
                self.confirmed += 1
                return PushOutcome(stats=stats, report=report, attempts=attempt, check_s=check_s)
            if attempt == attempts or self.open().mode == "adapter":
                # Adapter-only LoRA sync registers adapters by name; a new session cannot rebuild them here.
                raise failure
            self._recover(version, failure, attempt)
        raise AssertionError("unreachable")

    # ---- confirming -------------------------------------------------------------------------------------
    def served_version(self, pushed: int) -> int:
        """The version the server reports once ``pushed`` is confirmed: adapter-only LoRA sync registers each
        version as a named adapter and leaves the served base weights at the version of the session's first push."""
        if self.sync is not None and self.sync.mode == "adapter":
            if self.base_version is None:
                self.base_version = pushed
            return self.base_version
        return pushed

    def _confirm(self, version: int) -> tuple[VerifyReport | None, BaseException | None]:
        due = self.verifier is not None and self.verifier.due(self.confirmed + 1)
        expected, rounding_gap = self._trainer_side(self.verifier.token_ids) if due else (None, None)
        failure: BaseException | None = None
        outlier: ProbeOutlier | None = None
        report = None
        if self.dist.is_main and self.control is not None:  # without a control client there is nothing to ask
            try:
                check_version(self.control, self.served_version(version))
                if due:
                    try:
                        report = self.verifier.check_logprobs(self.control, version, expected,
                                                              model=self.sync.served_model_name(version),
                                                              rounding_gap=rounding_gap)
                    except ProbeOutlier as err:  # settled below, with sequences every rank computes
                        outlier = err
                check_applied = getattr(self.sync, "check_applied", None)
                if callable(check_applied):
                    check_applied(version)
            except PUSH_FAILURES as err:
                failure = err
        if due and self._agree_flag(outlier is not None and failure is None):
            probes = [(ids, *self._trainer_side(ids)) for ids in self.verifier.confirm_token_ids()]
            if outlier is not None:
                try:
                    report = self.verifier.confirm(self.control, outlier, probes,
                                                   model=self.sync.served_model_name(version))
                except PUSH_FAILURES as err:
                    failure = err
        return report, self._agree(failure, version)

    def _trainer_side(self, token_ids: list[int]) -> tuple[torch.Tensor, float | None]:
        """The trainer's probe log-probs of ``token_ids`` and its own 16-bit rounding of them where it measures one
        (``fleet.probe.VersionProbe``); every rank calls it, since the forwards are collective."""
        rounding = getattr(self.probe, "rounding_gap", None)
        return self.probe(token_ids), (rounding(token_ids) if callable(rounding) else None)

    def _agree_flag(self, flag: bool) -> bool:
        """Rank 0's ``flag`` on every rank."""
        if self.dist.world_size == 1:
            return flag and self.dist.is_main
        return bool(broadcast_object(flag if self.dist.is_main else None))

    def _agree(self, failure: BaseException | None, version: int) -> BaseException | None:
        """Rank 0's verdict on every rank (only rank 0 talks to the server)."""
        if self.dist.world_size == 1:
            return failure
        said = broadcast_object(f"{type(failure).__name__}: {failure}" if self.dist.is_main and failure else None)
        if said is None or self.dist.is_main:
            return failure
        return WeightSyncError(f"trainer rank 0: {said}", server=self.control.base_url if self.control else "",
                               version=version, phase="push")

    # ---- recovering -------------------------------------------------------------------------------------
    def _recover(self, version: int, failure: BaseException, attempt: int) -> None:
        log.warning("the push of weight version %d failed (%s: %s); waiting for the server, then pushing again over a "
                    "new session (attempt %d of %d)", version, type(failure).__name__, failure, attempt + 1,
                    self.attempts)
        self.close()  # the communicator goes before anything waits on the server
        if self.dist.is_main:
            self.watch.wait_until_answering()
            close_open_weight_update(self.control)
        broadcast_object(None)  # the other ranks wait here for rank 0's server
        self.recoveries += 1
        self.open()

"""The trainer's servers: every push reaches every serving server; a lost one is drained, checked and caught up.

    start()      rank 0: the control client and restart watch of each server; wait for them to answer and finish
                 weight updates a killed trainer left open (a server left paused gets the weights before any check)
    check()      rank 0: the start-up checks on every server (same model, same flags, same backend, the trainer's
                 dtype: ``vllm_server.checks.ServerChecks``), then the servers against each other; the error names
                 the one that differs
    inform(w)    rank 0: the rollout worker is told which servers serve, at every change, and reports those it drained
    push(v)      every rank: v to each serving server over that server's own transfer session, confirmed there
                 (``weight_push.WeightPusher``: the version read back, the probe's log-probs); the push is done
                 when all serving servers have it. A server whose push fails is drained while another serves
    tend()       rank 0 decides, every rank follows: servers the rollout worker drained, servers that stopped
                 answering or restarted; a lost server that answers again is checked and returned to the caller,
                 which pushes it the current weights (``push``) before the worker is told it serves again

One transfer session per server, not one group spanning all of them: a server that dies or hangs fails only its
own session (a spanning group fails the push for everyone and must be re-formed, with every server, whenever one
leaves or joins), a server that joins gets its own dense first push while the others go on with deltas, and servers
of different shapes (tensor-parallel sizes, one on another cluster through storage) mix. The price is the trainer
sending the weights once per server (``benchmarks/sync/fleet_push.py`` measures both on CPU; docs/fleet.md).

When a server is out of service follows one rule for every fleet size (``vllm_server.health``): refused, silent
for ``server_drain_after_s``, or not progressing for that long; a slow answer alone is not evidence. An out server
is drained while another serves; the last serving one (a fleet of one always) is waited for, up to
``server_unavailable_timeout_s``. A fleet of one is never drained: a failed push is recovered by waiting for the
server (``weight_sync_attempts``), and a restart is noticed by its ``ServerWatch`` and pushed to again. A wait on a
server longer than a few seconds (a push, a look, a decision) is announced with the server's name and its limit.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from grpo_core.fleet.probe import VersionProbe
from grpo_core.fleet.verify import VerifyConfig
from grpo_core.fleet.weight_push import PUSH_FAILURES, PushOutcome, WeightPusher
from grpo_core.ranks import DistInfo, broadcast_object
from grpo_core.rollout.routing_client import FleetView, server_name
from grpo_core.vllm_server.checks import (
    ServerCapabilities, ServerChecks, ServerConfigError, check_fleet_alike, server_fingerprint)
from grpo_core.vllm_server.control import VLLMControlClient
from grpo_core.vllm_server.health import ServerHealth, Verdict
from grpo_core.vllm_server.watch import (
    ANNOUNCE_AFTER_S, ANSWER_FAILURES, PROBE_TRY_S, ServerUnavailableError, ServerWatch, close_open_weight_update,
    left_paused, refusal)
from grpo_core.waiting import announced_wait

log = logging.getLogger(__name__)

PROBE_LOST_EVERY_S = 5.0
"""How often a lost server is asked whether it answers again (one ``GET /v1/models``, ``PROBE_TRY_S`` at most)."""


@dataclass(eq=False)
class Member:
    """One server of the run."""

    name: str
    url: str
    pusher: WeightPusher
    control: Any = None  # VLLMControlClient (rank 0)
    watch: Any = None  # ServerWatch (rank 0)
    state: str = "lost"
    """``serving``; ``joining`` (checked, waits for the current weights); ``lost`` (drained, or never answered)."""
    epoch: int = 0
    """Admissions so far; the rollout worker re-admits a server whose epoch grew (``rollout.routing_client``)."""
    left_at: float | None = None
    next_probe: float = 0.0
    check_failure: str | None = None
    health: ServerHealth | None = None
    """What the trainer's looks found (``vllm_server.health``; the rollout worker keeps its own, with progress)."""
    suspect_since: float | None = None
    """When the trainer said it was slow, once per spell (None: it answers)."""
    out_s: float = 0.0
    """Seconds out of service in ended spells (``fleet/<name>/out_s`` adds the current one)."""
    push_wait_s: float = 0.0
    """Seconds of its pushes that lasted past ``ANNOUNCE_AFTER_S`` (``fleet/<name>/waited_s``)."""


class RunServers:
    """The run's servers (module docstring). ``make_pusher(url, control, watch)`` makes one server's pusher;
    ``checks`` (``ServerChecks``) waits for one server and checks it."""

    def __init__(self, urls: list[str], dist: DistInfo, make_pusher: Callable[[str, Any, Any], WeightPusher],
                 make_control: Callable[[str], Any] | None = None, make_watch: Callable[[Any], Any] | None = None,
                 unavailable_timeout_s: float = 900.0, listing: Callable[[], list[str]] | None = None,
                 clock: Callable[[], float] = time.monotonic, drain_after_s: float = 10.0,
                 push_deadline_floor_s: float = 60.0, checks: ServerChecks | None = None):
        self.dist = dist
        self.checks = checks
        self.clock = clock
        self.drain_after_s = drain_after_s
        self.push_deadline_floor_s = push_deadline_floor_s  # each push phase's least deadline: the push's announcement
        self.drains = 0
        self.make_pusher, self.make_control, self.make_watch = make_pusher, make_control, make_watch
        self.members: dict[str, Member] = {}
        for url in urls:
            self._add(url)
        self.listing = listing  # the servers a fleet file lists now (rank 0 reads it; None: no file)
        self.next_listing = 0.0
        self.added: list[tuple[str, str]] = []  # (name, url) added on rank 0 since the ranks last heard

        self.capabilities: ServerCapabilities | None = None  # the first checked server's
        self.unavailable_timeout_s = unavailable_timeout_s
        self.probe: VersionProbe | None = None  # told each push's version
        self.reference: dict[str, tuple[ServerCapabilities, dict[str, Any]]] = {}  # the first checked server's
        self.rejoins = 0
        self.publish: Callable[[FleetView], None] = lambda view: None  # to the rollout worker, once it runs
        self.drained_by_worker: Callable[[], list[tuple[str, int, str]]] = lambda: []

    @classmethod
    def for_run(cls, args: Any, dist: DistInfo, setup: Any, probe: VersionProbe, vocab_size: int,
                checks: ServerChecks) -> RunServers:
        """A run's servers (``args``: the config's fleet settings, ``config.fleet``: ``vllm_server_base_url``, then
        those ``vllm_server_fleet_file`` lists), one pusher each over ``setup`` (``sync.factory.SyncSetup``), every
        push checked against ``probe`` (the policy's; ``vocab_size`` its vocabulary's)."""
        listing = (lambda: read_fleet_file(args.vllm_server_fleet_file)) if args.vllm_server_fleet_file else None
        urls = args.server_urls()
        urls += [u for u in (listing() if listing else []) if u not in urls]
        fleet = cls(
            urls, dist, unavailable_timeout_s=args.server_unavailable_timeout_s, listing=listing,
            drain_after_s=args.server_drain_after_s, push_deadline_floor_s=args.weight_sync_deadline_floor_s,
            make_pusher=lambda url, control, watch: WeightPusher.for_run(args, setup, dist, control, watch, vocab_size,
                                                                         probe=probe),
            make_control=lambda url: VLLMControlClient(url, timeout=args.request_timeout),
            make_watch=lambda control: ServerWatch(control, args.server_unavailable_timeout_s), checks=checks,
        )
        fleet.probe = probe
        return fleet

    @classmethod
    def around(cls, transfer: Any, dist: DistInfo, vocab_size: int, args: Any = None,
               checks: ServerChecks | None = None) -> RunServers:
        """A fleet of one whose pushes go through ``transfer`` (the trainer's ``weight_transfer=``), unconfirmed:
        the transport is the caller's, and so is knowing that the sampler got the weights. ``args``: the config's
        fleet settings, whose one server the rollouts come from (watched for restarts, checked by ``checks``);
        None: the trainer talks to no server."""
        def make_pusher(_url: str, _control: Any, watch: Any) -> WeightPusher:
            return WeightPusher(lambda: transfer, dist, None, watch, attempts=1, verify=VerifyConfig(every=0),
                                probe=None, vocab_size=vocab_size)

        if args is not None:
            return cls(args.server_urls()[:1], dist, make_pusher,
                       make_control=lambda url: VLLMControlClient(url, timeout=args.request_timeout),
                       make_watch=lambda control: ServerWatch(control, args.server_unavailable_timeout_s),
                       checks=checks)
        fleet = cls([], dist, make_pusher)
        member = Member(name="weight_transfer", url="", pusher=make_pusher("", None, None), state="joining")
        fleet.members[member.name] = member  # nothing to wait for: it serves after its first push
        return fleet

    def serving_metrics(self) -> dict[str, float]:
        """Which servers serve now (``rollout/server/<name>/serving``, as the trainer sees it: a server is back once
        it holds the current weights) and how many do; servers taken out of service so far (``fleet/drains``), the
        seconds each has spent out of service (``fleet/<name>/out_s``) and waited for while it did not answer
        (``fleet/<name>/waited_s``: the trainer's waits for it to answer as the last serving server, and its pushes
        that lasted more than ``ANNOUNCE_AFTER_S``, whole)."""
        now = self.clock()
        metrics = {f"rollout/server/{m.name}/serving": float(m.state == "serving") for m in self.members.values()}
        metrics["rollout/servers_serving"] = float(len(self.serving()))
        metrics["fleet/drains"] = float(self.drains)
        for m in self.members.values():
            away = now - m.left_at if m.state != "serving" and m.left_at is not None else 0.0
            metrics[f"fleet/{m.name}/out_s"] = m.out_s + away
            metrics[f"fleet/{m.name}/waited_s"] = m.push_wait_s + (m.watch.waited_s if m.watch is not None else 0.0)
        return metrics

    def _add(self, url: str) -> Member:
        control = self.make_control(url) if self.dist.is_main and self.make_control is not None else None
        watch = self.make_watch(control) if control is not None and self.make_watch is not None else None
        member = Member(name=server_name(url), url=url, pusher=self.make_pusher(url, control, watch),
                        control=control, watch=watch, health=ServerHealth(self.drain_after_s))
        self.members[member.name] = member
        return member

    def _read_listing(self) -> None:
        """Rank 0, every few seconds: servers the fleet file lists that the run does not know join it (lost until
        they answer and pass the checks)."""
        if self.listing is None or self.clock() < self.next_listing:
            return
        self.next_listing = self.clock() + PROBE_LOST_EVERY_S
        try:
            urls = self.listing()
        except Exception as err:  # noqa: BLE001 - a file being rewritten, storage down: read it next time
            log.warning("fleet: could not read the fleet file: %s", err)
            return
        for url in urls:
            if server_name(url) not in self.members:
                self._add(url)
                self.added.append((server_name(url), url))
                log.warning("fleet: %s added to the run; it serves once it answers, passes the start-up checks and "
                            "has the current weights", url)

    @property
    def single(self) -> bool:
        return len(self.members) == 1

    def serving(self) -> list[Member]:
        return [m for m in self.members.values() if m.state == "serving"]

    def serving_urls(self) -> list[str]:
        return [m.url for m in self.serving()] or [next(iter(self.members.values())).url]

    def view(self) -> FleetView:
        return {m.name: (m.url, m.epoch if m.state == "serving" else 0) for m in self.members.values()}

    def inform(self, worker: Any) -> None:
        """Rank 0: the rollout worker (``rollout.worker.RolloutWorker``) sends only to the servers this fleet says
        serve, told now and at every change, and tells the fleet which ones it drained."""
        self.publish = worker.publish_fleet
        self.drained_by_worker = worker.drained_servers
        worker.publish_fleet(self.view())

    # ---- start-up (rank 0) ------------------------------------------------------------------------------
    def start(self) -> bool:
        """Rank 0, at the run's start: wait for the servers and finish weight updates a killed trainer left open.
        True when a server was left paused: it holds half-loaded weights on which a request would crash it, so it
        must be pushed the current weights before ``check`` sends it any."""
        self.connect()
        return self.left_paused()

    def connect(self) -> None:
        """Wait for the servers, side by side (``ServerChecks.wait``). A fleet starts with those that answer (the
        others join once they do: ``tend``); a single server that does not answer fails the run."""
        members = list(self.members.values())
        with ThreadPoolExecutor(max_workers=len(members)) as pool:
            errors = list(pool.map(lambda m: _error_of(self.checks.wait, m.control), members))
        for member, error in zip(members, errors):
            if error is None:
                member.state = "joining"
            elif self.single or all(e is not None for e in errors):
                raise error
            else:
                log.warning("fleet: %s (%s) does not answer; it joins once it does (%s)", member.name, member.url,
                            str(error).splitlines()[0])

    def _answering(self) -> list[Member]:
        return [m for m in self.members.values() if m.state != "lost"]

    def left_paused(self) -> bool:
        """Finish weight updates a dead trainer left open; True when any server was paused (push before checking)."""
        paused = False
        for member in self._answering():
            if left_paused(member.control):
                close_open_weight_update(member.control)
                paused = True
        return paused

    def check(self) -> ServerCapabilities:
        """The start-up checks on every answering server (``ServerChecks.check``), then the servers against each
        other; raises ``ServerConfigError`` naming the server."""
        found = {m.url: (self._checked(m), server_fingerprint(m.control)) for m in self._answering()}
        check_fleet_alike(found)
        first = next(iter(found))
        self.reference = {first: found[first]}
        self.capabilities = found[first][0]
        return self.capabilities

    def _checked(self, member: Member) -> ServerCapabilities:
        try:
            return self.checks.check(member.control)
        except ServerConfigError as err:
            if self.single:
                raise
            raise ServerConfigError(f"fleet server {member.name} ({member.url}): {err}") from err

    # ---- pushes (every rank) ----------------------------------------------------------------------------
    def push(self, version: int, only: list[str] | None = None) -> dict[str, float]:
        """Push ``version`` to every serving and joining server (``only``: to those named); a joining one serves
        once it has it. Returns the push's metrics: totals, and per server under ``sync/server/<name>/``."""
        plan = None
        if self.dist.is_main:
            self._take_worker_reports()  # no push to a server the worker has already drained
            targets = [m.name for m in self.members.values()
                       if m.state in ("serving", "joining") and (only is None or m.name in only)]
            plan = (targets, sum(1 for m in self.serving() if m.name not in targets))
        targets, others_serving = broadcast_object(plan)  # every rank pushes to the same servers in the same order
        if not targets and only is None:
            targets, others_serving = self.wait_for_any(), 0  # no server serves: push to the first that comes back
        if self.probe is not None:
            self.probe.version = version
        outcomes: dict[str, PushOutcome] = {}
        for i, name in enumerate(targets):
            member = self.members[name]
            # While another server holds (or will hold) this version, a failed server is drained, not waited for.
            others = not self.single and len(outcomes) + (len(targets) - i - 1) + others_serving > 0
            push_started, recoveries = self.clock(), member.pusher.recoveries
            try:
                with announced_wait(
                        f"fleet server {member.name} ({member.url}) to take weight version {version}", None,
                        "a server that stopped is drained once a phase passes its deadline" if others else
                        "past a deadline the run waits for it (server_unavailable_timeout_s) and pushes again",
                        limit_text=f"each phase of the push within its deadline, at least "
                                   f"{self.push_deadline_floor_s:g} s (weight_sync_deadline_floor_s)",
                        delay_s=ANNOUNCE_AFTER_S) if self.dist.is_main else _nothing():
                    outcomes[name] = member.pusher.push(version, attempts=1 if others else None)
            except PUSH_FAILURES as err:
                self._count_push_wait(member, push_started)
                if not others:
                    raise
                self._lose(member, f"its push of weight version {version} failed ({type(err).__name__}: {err})")
                continue
            self._count_push_wait(member, push_started)
            if member.state == "joining":
                self._admit(member)
            elif member.pusher.recoveries > recoveries:
                # The push waited for the server (a lone one, waited for rather than drained) and got through on a
                # new session: it came back and holds the weights, as a server tend() lets back in does.
                self.rejoins += 1
                where = "the restarted server" if self.single else f"{member.name} ({member.url}), back in service,"
                log.warning("re-pushed weight version %d to %s after its push waited for it (server restart %d of "
                            "this attempt)", version, where, self.rejoins)
            if member.watch is not None:
                # What the server reads back: this version, or under adapter-only LoRA sync its base weights' version.
                member.watch.after_push([member.pusher.served_version(version)])
        self._publish()
        return fleet_push_metrics(outcomes, version, sum(m.pusher.recoveries for m in self.members.values()))

    def _count_push_wait(self, member: Member, started: float) -> None:
        took = self.clock() - started
        if took > ANNOUNCE_AFTER_S:  # a push that long was waiting on the server (a frozen one waits for its thaw)
            member.push_wait_s += took

    def _admit(self, member: Member) -> None:
        member.state = "serving"
        member.epoch += 1
        member.check_failure = None
        member.health = ServerHealth(self.drain_after_s)  # a new admission starts with no evidence against it
        member.suspect_since = None
        if member.left_at is not None:
            member.out_s += self.clock() - member.left_at
        if member.epoch > 1:
            self.rejoins += 1
            away = f" after {self.clock() - member.left_at:.0f} s away" if member.left_at is not None else ""
            log.warning("fleet: %s (%s) serves again%s, on the current weights", member.name, member.url, away)

    def _lose(self, member: Member, reason: str) -> None:
        if member.state == "lost":
            return
        if member.state == "serving" or member.left_at is None:
            member.left_at = self.clock()  # a joining server has been out since it left service
        member.state, member.next_probe = "lost", self.clock() + PROBE_LOST_EVERY_S
        self.drains += 1
        log.warning("fleet: %s (%s) drained: %s; %d of %d servers serve", member.name, member.url, reason,
                    len(self.serving()), len(self.members))
        self._publish()

    def _publish(self) -> None:
        if self.dist.is_main:
            self.publish(self.view())

    # ---- between steps ------------------------------------------------------------------------------------
    def needs_tending(self) -> bool:
        """Rank 0: whether ``tend`` has something to do now (the collection waiting for samples asks every few
        seconds): a server restarted or ready to join again. Servers that stopped answering are drained here."""
        self._take_worker_reports()
        self._read_listing()
        if self.single:
            member = next(iter(self.members.values()))
            if member.watch is None:
                return False  # a transport of the caller's, no server to watch
            reason = member.watch.restarted()  # waits while the server does not answer, as a single server always has
            if reason is not None:
                member.watch.note_restart(reason)
            return reason is not None
        for member in self.serving():
            self._look_at_serving(member)
        now = self.clock()
        return any(m.state == "joining"
                   or (m.state == "lost" and now >= m.next_probe and m.control.answers(timeout=PROBE_TRY_S))
                   for m in self.members.values())

    def tend(self) -> list[str]:
        """Rank 0 looks at every server, every rank gets the outcome: the servers ready to receive the current
        weights (checked; ``push(v, only=...)`` admits them). A fleet's last serving server that stops answering is
        waited for (``ServerWatch``), as a single server is."""
        ready = added = None
        if self.dist.is_main:
            self._take_worker_reports()
            self._read_listing()
            for member in self.serving():
                self._look_at_serving(member)
            for member in [m for m in self.members.values() if m.state == "lost" and self.clock() >= m.next_probe]:
                self._look_at_lost(member)
            ready = [m.name for m in self.members.values() if m.state == "joining"]
            added, self.added = self.added, []
        ready, added = broadcast_object((ready, added))
        for name, url in added:
            if name not in self.members:  # the other ranks: a pusher for a server added from the fleet file
                self._add(url)
        for name in ready:
            self.members[name].state = "joining"
            self.members[name].pusher.reopen()  # the old session died with the server (or never was)
        return ready

    def _take_worker_reports(self) -> None:
        for name, epoch, reason in self.drained_by_worker():
            member = self.members.get(name)
            if member is not None and member.epoch == epoch and member.state == "serving":
                self._lose(member, f"the rollout worker drained it: {reason}")

    def _look_at_serving(self, member: Member) -> None:
        if member.watch is None:
            return  # a transport of the caller's, no server to watch
        if self.single or len(self.serving()) == 1:
            reason = member.watch.restarted()  # the last serving server is waited for, up to its timeout
        else:
            version = self._look(member)
            if version is None:
                return
            reason = (f"it serves weight version {version!r}, the trainer last pushed {member.watch.expected_version!r}"
                      if member.watch.expected_version is not None and version != member.watch.expected_version else None)
        if reason is not None:
            log.warning("fleet: %s (%s) restarted (%s); it gets the current weights again", member.name, member.url,
                        reason)
            member.state, member.left_at = "joining", self.clock()

    def _look(self, member: Member) -> str | None:
        """One look at a serving server of several: its weight version, or None when it did not answer. It is
        drained only on the rule's evidence (``vllm_server.health``): a refusal, or no answer for
        ``drain_after_s``; a slow answer makes it suspect, which is said once."""
        assert member.health is not None
        sent = self.clock()
        try:
            version = member.control.weight_version(timeout=PROBE_TRY_S)
        except ANSWER_FAILURES as err:
            member.health.failed(sent, refused=refusal(err))
            self._judge(member, member.health.verdict(self.clock()), f"{type(err).__name__}: {err}")
            return None
        member.health.answered(self.clock())
        if member.suspect_since is not None:
            log.warning("fleet: %s (%s) answers again after %.0f s; it kept serving", member.name, member.url,
                        self.clock() - member.suspect_since)
            member.suspect_since = None
        return version

    def _judge(self, member: Member, verdict: Verdict, error: str) -> None:
        """The rule's outcome for a server of several that serve (the last one is waited for by its watch)."""
        if verdict.standing == "out":
            self._lose(member, verdict.reason)
        elif member.suspect_since is None:
            member.suspect_since = verdict.since if verdict.since is not None else self.clock()
            left = (verdict.deadline or self.clock()) - self.clock()
            log.warning("fleet: %s (%s) is slow to answer (%s); it keeps serving, and is drained in %.0f s unless it "
                        "answers (server_drain_after_s=%g)", member.name, member.url, error, max(left, 0.0),
                        self.drain_after_s)

    def _look_at_lost(self, member: Member) -> None:
        member.next_probe = self.clock() + PROBE_LOST_EVERY_S
        if not member.control.answers(timeout=PROBE_TRY_S):
            return
        try:
            if left_paused(member.control):
                # Paused by a push of ours that failed: its weights may be half-loaded, and generation probes would
                # wait for a resume. The push resumes it; its version and probe log-probs are checked after it.
                close_open_weight_update(member.control)
            else:
                found = {member.url: (self._checked(member), server_fingerprint(member.control))}
                check_fleet_alike({**self.reference, **found} if member.url not in self.reference else found)
        except (ServerConfigError, *ANSWER_FAILURES) as err:
            if str(err) != member.check_failure:
                log.error("fleet: %s (%s) answers again but does not pass the start-up checks; it stays out: %s",
                          member.name, member.url, err)
                member.check_failure = str(err)
            return
        member.state = "joining"

    def wait_for_any(self) -> list[str]:
        """Every rank: with no server serving, tend until one is ready (``ServerUnavailableError`` after
        ``unavailable_timeout_s``)."""
        timeout_s = self.unavailable_timeout_s
        deadline = self.clock() + timeout_s
        log.warning("fleet: no server serves; waiting up to %.0f s for one to come back", timeout_s)
        while True:
            for member in self.members.values():
                member.next_probe = min(member.next_probe, self.clock())
            ready = self.tend()
            if ready:
                return ready
            done = broadcast_object(self.clock() >= deadline if self.dist.is_main else None)
            if done:
                raise ServerUnavailableError(
                    f"no server of the fleet served for {timeout_s:g} s (server_unavailable_timeout_s): "
                    + ", ".join(f"{m.name} ({m.url})" for m in self.members.values()))
            time.sleep(1.0)

    def close(self) -> None:
        for member in self.members.values():
            member.pusher.close()
            if member.control is not None:
                member.control.close()


def fleet_push_metrics(outcomes: dict[str, PushOutcome], version: int, recoveries: int) -> dict[str, float]:
    """One push's metrics over its servers: bytes, seconds and checks summed, the worst probe difference, the
    push of each server under ``sync/server/<name>/``."""
    metrics: dict[str, float] = {"weight_version": float(version), "sync/servers": float(len(outcomes))}
    for name, outcome in outcomes.items():
        own = outcome.metrics(version, recoveries)
        for key in ("sync/seconds", "sync/verify_logprob_diff", "sync/verify_logprob_diff_mean", "sync/verify_tolerance",
                    "sync/check_s", "sync/verify_reprobes"):
            if key in own:
                metrics[f"sync/server/{name}/{key.removeprefix('sync/')}"] = own[key]
        for key, value in own.items():
            if key in ("sync/bytes", "sync/seconds", "sync/check_s", "sync/dense_bytes", "sync/verify_reprobes"):
                metrics[key] = metrics.get(key, 0.0) + value
            elif key in ("sync/verify_logprob_diff", "sync/verify_logprob_diff_mean", "sync/verify_logprob_moved",
                         "sync/verify_tolerance", "sync/changed_share"):
                metrics[key] = max(metrics.get(key, value), value)
            else:
                metrics.setdefault(key, value)
    return metrics


@contextmanager
def _nothing() -> Iterator[None]:
    yield


def _error_of(call: Callable[[Any], None], arg: Any) -> BaseException | None:
    try:
        call(arg)
    except ServerConfigError as err:
        return err
    return None


def read_fleet_file(url: str) -> list[str]:
    """The base URLs a fleet file lists (``AsyncGRPOConfig.vllm_server_fleet_file``): one per line, ``#`` comments."""
    import fsspec

    with fsspec.open(url, "rt") as f:
        lines = [line.split("#", 1)[0].strip() for line in f]
    return [line.rstrip("/") for line in lines if line]

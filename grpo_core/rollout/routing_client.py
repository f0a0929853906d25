"""The rollout worker's generation client over a fleet of vLLM servers: routing, each server's state, drain and resend.

``RoutingClient`` is what the loop calls ``client``: ``generate`` sends a call to the server of its group (``ROUTE``,
which the scheduler sets around each group; ``router.Router`` chose the server), through that server's own
``generation.VLLMGenerateClient`` (so a group's identical first turns are still coalesced into one request).

A server leaves service ("drained") on the evidence ``vllm_server.health`` states once for the worker and the trainer:

* a request to it fails to connect (after the immediate resends of a dropped keep-alive connection), or its
  ``/metrics`` scrape (every two seconds) is refused,
* no scrape has been answered for ``drain_after_s``, or its requests made no progress (its ``/metrics`` token
  counters stood still while it had requests and was not paused for a push) for ``drain_after_s``, or
* the trainer says so (it failed a push, restarted, or the trainer's own look found it out: ``apply_view``).

A server that is slow but answers or progresses within the window keeps its groups and requests. A drained
server's groups move to the other servers (``Router.drain``), its requests in flight are cancelled and sent again
there (``rollout/resent_requests``); a request that got no reply produced nothing, so nothing is trained twice.
The worker tells the trainer (``report_drained``), which admits the server again only once it answers, passes the
start-up checks and holds the current weights (a view with a newer epoch). The last serving server is never
drained: requests wait for it (or for another server) for ``unavailable_timeout_s``, as with a single server, whose
client keeps its resend-with-backoff behaviour.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Awaitable, Callable
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse

from grpo_core.rollout.concurrency import ConcurrencyController, parse_vllm_metrics
from grpo_core.rollout.generation import RESEND, VLLMGenerateClient
from grpo_core.rollout.router import GroupRoute, Router, ServerSlot
from grpo_core.vllm_server.control import SERVER_UNREACHABLE, VLLMRequestError
from grpo_core.vllm_server.health import ServerHealth, action
from grpo_core.vllm_server.watch import ANNOUNCE_AFTER_S

log = logging.getLogger(__name__)

ROUTE: ContextVar[GroupRoute | None] = ContextVar("grpo_group_route", default=None)
"""The route of the group whose rollout is running (the scheduler sets it before the group's rollouts start)."""

FleetView = dict[str, tuple[str, int]]
"""The trainer's view of the fleet: server name -> (base URL, epoch); epoch 0: not serving, else the admission."""


def server_name(url: str) -> str:
    """A server's name in metrics (``rollout/server/<name>/...``): its host's first label (the whole address for
    an IP) and port, in characters every tracker accepts: ``http://127.0.0.1:8001`` -> ``127.0.0.1-8001``."""
    parsed = urlparse(url if "//" in url else f"http://{url}")
    host = parsed.hostname or "server"
    if not re.fullmatch(r"[\d.]+|[0-9a-fA-F:]+", host):
        host = host.split(".")[0]
    return re.sub(r"[^A-Za-z0-9_.-]", "_", f"{host}-{parsed.port or (443 if parsed.scheme == 'https' else 80)}")


class ServerDrained(Exception):
    """The server a request was waiting on left service; the request goes to another."""


class NoServerAvailable(RuntimeError):
    """No server of the fleet served for ``server_unavailable_timeout_s``; the message names them."""


@dataclass
class ServerStats:
    """What the worker measures of one server (``rollout/server/<name>/...``)."""

    requests: int = 0
    errors: int = 0
    active: int = 0
    tok_s: float = 0.0
    tokens_total: float | None = None
    scraped_at: float | None = None
    suspect: str = ""
    """The standing last announced while not ok (``vllm_server.health``): "" when ok."""
    trouble_since: float | None = None
    """When its current spell of not answering or not progressing began (None: it is ok)."""
    trouble_s: float = 0.0
    """Seconds of its ended spells (``rollout/server/<name>/unhealthy_s`` adds the current one)."""


class RoutingClient:
    """Generation over a fleet (module docstring). ``report_drained(name, epoch, reason)`` tells the trainer."""

    def __init__(self, members: list[tuple[str, Any]], *, unavailable_timeout_s: float = 0.0,
                 drain_after_s: float = 10.0, report_drained: Callable[[str, int, str], None] | None = None,
                 make_client: Callable[[str], Any] | None = None, own_resends: bool = False,
                 clock: Callable[[], float] = time.monotonic):
        self.clients = {server_name(url): client for url, client in members}
        slots = [ServerSlot(name=server_name(url), url=url.rstrip("/")) for url, _ in members]
        self.router = Router(slots, ceiling=1)  # the real ceiling comes with start()
        self.stats = {s.name: ServerStats() for s in slots}
        self.health: dict[str, ServerHealth] = {}  # the evidence of each server (``vllm_server.health``)
        self.moved_groups = 0
        self.drains = 0
        self.unavailable_timeout_s = unavailable_timeout_s
        self.drain_after_s = drain_after_s
        self.report_drained = report_drained or (lambda name, epoch, reason: None)
        self.make_client = make_client  # a client for a server added while the run goes on
        self.own_resends = own_resends
        self.clock = clock
        self.on_change: Callable[[], None] = lambda: None  # the scheduler wakes its waiters here
        self.resent = 0
        self.max_len: int | None = None
        self.started = False
        self._drained: dict[str, asyncio.Event] = {}
        self._membership = asyncio.Event()  # set and replaced at every admission

    @classmethod
    def for_urls(cls, urls: list[str], *, timeout: float, tokens_endpoint: bool, unavailable_timeout_s: float,
                 drain_after_s: float, report_drained: Callable[[str, int, str], None] | None = None,
                 fleet: bool | None = None) -> RoutingClient:
        def make(url: str, wait: float = 0.0) -> VLLMGenerateClient:
            return VLLMGenerateClient(url, timeout=timeout, tokens_endpoint=tokens_endpoint, unavailable_timeout_s=wait)

        # One server keeps its client's own resends with backoff (a restart on the same address); in a fleet a
        # failure surfaces at once, and this class decides between draining and waiting.
        single = not (len(urls) > 1 if fleet is None else fleet)
        wait = unavailable_timeout_s if single else 0.0
        return cls([(url, make(url, wait)) for url in urls], unavailable_timeout_s=unavailable_timeout_s,
                   drain_after_s=drain_after_s, report_drained=report_drained, make_client=make, own_resends=single)

    @classmethod
    def around(cls, client: Any, url: str) -> RoutingClient:
        """A one-server fleet over any client with ``generate`` (a loop that built its own client)."""
        return cls([(url, client)])

    # ---- life cycle ---------------------------------------------------------------------------------
    async def start(self, ceiling: int, view: FleetView | None = None) -> int:
        """Admit the servers the trainer says serve (all of them without a trainer), each with a cap from its own
        ``/metrics``, the fleet's rollouts under ``ceiling``; returns the servers' context length."""
        self.router.ceiling = ceiling
        view = view or {s.name: (s.url, 1) for s in self.router.slots.values()}
        first = next((name for name, (_, epoch) in view.items() if epoch > 0 and name in self.clients),
                     next(iter(self.clients)))
        self.max_len = await self.clients[first].max_model_len()
        await self.apply_view(view)
        self.started = True
        return self.max_len

    async def aclose(self) -> None:
        for client in self.clients.values():
            await client.aclose()

    @property
    def single(self) -> bool:
        """One server whose client resends to it by itself (``for_urls``): a failure that gets here is final."""
        return self.own_resends

    @property
    def requests_sent(self) -> int:
        return sum(getattr(c, "requests_sent", 0) for c in self.clients.values())

    @property
    def completions_received(self) -> int:
        return sum(getattr(c, "completions_received", 0) for c in self.clients.values())

    async def max_model_len(self) -> int:
        slot = (self.router.serving() or list(self.router.slots.values()))[0]
        return await self.clients[slot.name].max_model_len()

    async def metrics_text(self) -> str | None:
        serving = self.router.serving()
        return await self.clients[serving[0].name].metrics_text() if serving else None

    # ---- generation ---------------------------------------------------------------------------------
    async def generate(self, token_ids: list[int], sampling_params: dict[str, Any], num_top: int = 0,
                       model: str | None = None) -> list[Any]:
        """The choices of one call, from its group's server; sent again elsewhere if that server is lost."""
        route = ROUTE.get()
        failing_since: float | None = None
        attempt = 0
        while True:
            slot = await self._slot_for(route)
            stats = self.stats[slot.name]
            try:
                choices = await self._on(slot, self.clients[slot.name].generate(
                    token_ids, sampling_params, num_top=num_top, **({"model": model} if model is not None else {})))
            except ServerDrained:
                self._resent(route)
                continue
            except SERVER_UNREACHABLE as err:
                stats.errors += 1
                if self.single:
                    raise  # its client already waited unavailable_timeout_s for it
                if self.router.others_serving(slot):
                    self.drain(slot, f"a request failed to reach it ({type(err).__name__}: {err})")
                    self._resent(route)
                    continue
                # The last serving server: wait for it (or for another one), as for a single server.
                now = self.clock()
                failing_since = failing_since if failing_since is not None else now
                if now - failing_since >= self.unavailable_timeout_s:
                    raise
                attempt += 1
                await asyncio.sleep(RESEND.wait_before(attempt) or 0.05)
                continue
            except VLLMRequestError:
                stats.errors += 1
                raise
            stats.requests += 1
            return choices

    async def _on(self, slot: ServerSlot, call: Awaitable[Any]) -> Any:
        """``call``'s result, or ``ServerDrained`` as soon as ``slot`` leaves service (the request is cancelled)."""
        stats = self.stats[slot.name]
        drained_event = self._drained_event(slot)
        task = asyncio.ensure_future(call)
        drained = asyncio.ensure_future(drained_event.wait())
        stats.active += 1
        try:
            await asyncio.wait({task, drained}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stats.active -= 1
            drained.cancel()
            if not task.done():
                task.cancel()
        if task.done() and not task.cancelled() and task.exception() is None:
            return task.result()  # a reply that came in as the server left still counts, once
        if drained_event.is_set():
            raise ServerDrained(slot.name)
        return task.result()  # its own error, or the cancellation from outside

    async def _slot_for(self, route: GroupRoute | None) -> ServerSlot:
        """The server this call goes to: its group's, or any serving one for a call outside a group; waits
        while none serves (``NoServerAvailable`` after ``unavailable_timeout_s``)."""
        deadline = self.clock() + self.unavailable_timeout_s
        while True:
            if route is not None and route.slot.serving:
                return route.slot
            if route is None:
                serving = sorted(self.router.serving(), key=lambda s: self.stats[s.name].active)
                if serving:
                    return serving[0]
            remaining = deadline - self.clock()
            if remaining <= 0:
                names = ", ".join(f"{s.name} ({s.url})" for s in self.router.slots.values())
                raise NoServerAvailable(f"no server of the fleet served for {self.unavailable_timeout_s:g} s "
                                        f"(server_unavailable_timeout_s): {names}")
            event = self._membership
            try:
                await asyncio.wait_for(event.wait(), timeout=min(remaining, 1.0))
            except TimeoutError:
                pass

    def _resent(self, route: GroupRoute | None) -> None:
        self.resent += 1
        if route is not None:
            route.resent += 1

    # ---- membership ---------------------------------------------------------------------------------
    def _drained_event(self, slot: ServerSlot) -> asyncio.Event:
        return self._drained.setdefault(slot.name, asyncio.Event())

    def drain(self, slot: ServerSlot, reason: str, report: bool = True) -> None:
        """Take ``slot`` out of service: its groups move, its requests in flight are sent again elsewhere."""
        if not slot.serving:
            return
        stats = self.stats[slot.name]
        if stats.trouble_since is not None:  # its spell ends here: out of service is the trainer's out_s
            stats.trouble_s += self.clock() - stats.trouble_since
            stats.trouble_since = None
        moved = self.router.drain(slot)
        self.moved_groups += len(moved)
        self.drains += 1
        self._drained_event(slot).set()
        log.warning("rollout: server %s (%s) drained: %s; %d groups moved to %s", slot.name, slot.url, reason,
                    len(moved), ", ".join(s.name for s in self.router.serving()) or "no server (they wait)")
        if report:
            self.report_drained(slot.name, slot.epoch, reason)
        self.on_change()

    async def apply_view(self, view: FleetView) -> None:
        """Follow the trainer's view: admit servers with a newer epoch (a fresh cap from their ``/metrics``),
        drain those it no longer lists as serving."""
        for name, (url, epoch) in view.items():
            slot = self.router.slots.get(name)
            if slot is None and epoch > 0 and self.make_client is not None:  # a server added to the running job
                slot = ServerSlot(name=name, url=url)
                self.router.slots[name] = slot
                self.stats[name] = ServerStats()
                self.clients[name] = self.make_client(url)
            if slot is None:
                continue
            if epoch > slot.epoch:
                controller = await self._controller(slot)
                self._drained[name] = asyncio.Event()
                self.health[name] = ServerHealth(self.drain_after_s)  # a new admission: no old evidence
                self.stats[name].suspect = ""
                moved = self.router.admit_server(slot, epoch, controller)
                if epoch > 1:
                    log.warning("rollout: server %s (%s) serves again (admission %d); %d waiting groups moved to it",
                                name, url, epoch, len(moved))
                self._membership.set()
                self._membership = asyncio.Event()
                self.on_change()
            elif epoch == 0 and slot.serving:
                self.drain(slot, "the trainer took it out of service", report=False)

    async def _controller(self, slot: ServerSlot) -> ConcurrencyController:
        text = await self.clients[slot.name].metrics_text()
        metrics = parse_vllm_metrics(text) if text else None
        return ConcurrencyController.from_server(self.router.ceiling, metrics, self.max_len)

    # ---- what each server says ----------------------------------------------------------------------
    async def poll(self) -> None:
        """Read every serving server's ``/metrics`` (side by side): feed its cap, its KV usage and tokens/s, and the
        evidence of ``vllm_server.health``; drain one that is out while another serves."""
        await asyncio.gather(*(self._poll_one(slot) for slot in list(self.router.serving())))

    async def _poll_one(self, slot: ServerSlot) -> None:
        client, stats, health = self.clients[slot.name], self.stats[slot.name], self._health(slot.name)
        scrape = getattr(client, "scrape", None)
        sent = self.clock()
        answered, text = await scrape() if scrape is not None else (True, await client.metrics_text())
        now = self.clock()
        if not slot.serving:
            return  # drained while its scrape was out
        if not answered:
            health.failed(sent, refused=getattr(client, "refusal", None))
            self._judge(slot, health, now)
            return
        metrics = parse_vllm_metrics(text) if text else None
        self._observe(slot, stats, metrics, now)
        if metrics is not None and (metrics.num_requests_running is not None or metrics.num_requests_waiting is not None):
            busy = (metrics.num_requests_running or 0) + (metrics.num_requests_waiting or 0) > 0
        else:
            busy = stats.active > 0
        progress = metrics.tokens_processed if metrics is not None else None
        health.answered(now, progress, busy)
        if health.verdict(now).standing == "out" and await self._paused(client):
            health.answered(now, progress, busy, paused=True)  # a push holds its requests: not a stall
        self._judge(slot, health, now)

    def _judge(self, slot: ServerSlot, health: ServerHealth, now: float) -> None:
        """Apply the rule (``vllm_server.health``): drain a server that is out while another serves; say once per
        spell that a server is suspect, or out but waited for as the last serving one."""
        verdict = health.verdict(now)
        stats = self.stats[slot.name]
        if verdict.standing == "ok":
            if stats.trouble_since is not None:
                stats.trouble_s += now - stats.trouble_since
                stats.trouble_since = None
            if stats.suspect:
                log.warning("rollout: server %s (%s) answers and makes progress again; it kept its requests",
                            slot.name, slot.url)
            stats.suspect = ""
            return
        if stats.trouble_since is None:
            stats.trouble_since = verdict.since if verdict.since is not None else now
        what = action(verdict, self.router.others_serving(slot))
        if what == "drain":
            stats.suspect = ""
            self.drain(slot, verdict.reason)
            return
        if verdict.standing != stats.suspect and (what == "wait" or now - stats.trouble_since >= ANNOUNCE_AFTER_S):
            stats.suspect = verdict.standing
            if what == "wait":
                deadline = (verdict.since or now) + self.unavailable_timeout_s - now
                log.warning("rollout: server %s (%s) is out (%s) but no other server serves: its requests wait for it "
                            "for %.0f s more (server_unavailable_timeout_s)", slot.name, slot.url, verdict.reason,
                            max(deadline, 0.0))
            else:
                log.warning("rollout: server %s (%s) is slow: %s; it keeps its requests, and is drained in %.0f s "
                            "unless it answers and makes progress (server_drain_after_s)", slot.name, slot.url,
                            verdict.reason, max((verdict.deadline or now) - now, 0.0))

    def _observe(self, slot: ServerSlot, stats: ServerStats, metrics: Any, now: float) -> None:
        assert slot.controller is not None
        slot.controller.observe_metrics(metrics)
        slot.kv_usage = metrics.kv_cache_usage_perc if metrics else None
        total = metrics.generation_tokens_total if metrics else None
        if total is not None and stats.tokens_total is not None and stats.scraped_at is not None and now > stats.scraped_at:
            stats.tok_s = max(0.0, total - stats.tokens_total) / (now - stats.scraped_at)
        stats.tokens_total, stats.scraped_at = total, now

    @staticmethod
    async def _paused(client: Any) -> bool:
        is_paused = getattr(client, "is_paused", None)
        return bool(await is_paused()) if is_paused is not None else False

    def _health(self, name: str) -> ServerHealth:
        if name not in self.health:
            self.health[name] = ServerHealth(self.drain_after_s)
        return self.health[name]

    def snapshot(self) -> dict[str, float]:
        """Each server's gauges and running counts, as ``rollout/server/<name>/...`` metrics."""
        out: dict[str, float] = {"rollout/servers_serving": float(len(self.router.serving()))}
        for name, slot in self.router.slots.items():
            stats, prefix = self.stats[name], f"rollout/server/{name}"
            out[f"{prefix}/serving"] = float(slot.serving)
            out[f"{prefix}/in_flight"] = float(slot.in_flight)
            out[f"{prefix}/requests_in_flight"] = float(stats.active)
            out[f"{prefix}/concurrency_cap"] = float(slot.controller.cap) if slot.controller else 0.0
            out[f"{prefix}/generated_tok_s"] = stats.tok_s
            out[f"{prefix}/requests"] = float(stats.requests)
            out[f"{prefix}/errors"] = float(stats.errors)
            # Seconds it served but did not answer or progress (slow or frozen, before a drain or a recovery).
            ongoing = self.clock() - stats.trouble_since if stats.trouble_since is not None and slot.serving else 0.0
            out[f"{prefix}/unhealthy_s"] = stats.trouble_s + ongoing
            if slot.kv_usage is not None:
                out[f"{prefix}/kv_usage"] = slot.kv_usage
        out["rollout/resent_requests_total"] = float(self.resent)
        out["rollout/moved_groups_total"] = float(self.moved_groups)
        out["rollout/drains_total"] = float(self.drains)
        return out

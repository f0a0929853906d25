"""The rollout worker's routing client: routing by group, drain and resend, the trainer's view, and the scheduler over it.

Servers are scripted stand-ins (no HTTP); a drained server's request is cancelled and sent to another exactly once.
"""

from __future__ import annotations

import asyncio
import threading
from collections import Counter
from typing import Any

import httpx
import pytest

from grpo_core.config import AsyncGRPOConfig
from grpo_core.rollout.routing_client import ROUTE, NoServerAvailable, RoutingClient, server_name
from grpo_core.rollout.scheduler import RolloutScheduler
from grpo_core.rollout.types import GroupReport, RolloutSample
from grpo_core.training.step_metrics import group_metrics
from grpo_core.vllm_server.replies import GeneratedChoice
from tests.test_loop_scheduler import ScriptedLoop, dataset, right_or_wrong, tokenizer  # noqa: F401 - a fixture
from tests.test_loop_multiturn import ScriptedClient


class FakeServer:
    """Answers every call with one token, or refuses (``down``), or never answers (``hung``)."""

    def __init__(self) -> None:
        self.down = False
        self.hung = False
        self.calls: list[list[int]] = []
        self.answered = 0

    async def generate(self, token_ids: list[int], params: dict[str, Any], num_top: int = 0) -> list[GeneratedChoice]:
        self.calls.append(list(token_ids))
        if self.down:
            raise httpx.ConnectError("[Errno 111] Connection refused")
        if self.hung:
            await asyncio.Event().wait()
        await asyncio.sleep(0)
        self.answered += 1
        return [GeneratedChoice([7], [-0.5], "stop", None, None)]

    async def max_model_len(self) -> int:
        return 512

    async def metrics_text(self) -> str | None:
        return None

    async def scrape(self) -> tuple[bool, str | None]:
        return not (self.down or self.hung), None

    async def aclose(self) -> None:
        pass


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def two_servers(**kwargs: Any) -> tuple[RoutingClient, FakeServer, FakeServer, list]:
    a, b = FakeServer(), FakeServer()
    reports: list = []
    fleet = RoutingClient([("http://a:1", a), ("http://b:1", b)], unavailable_timeout_s=5.0,
                        report_drained=lambda *r: reports.append(r), **kwargs)
    return fleet, a, b, reports


async def in_group(fleet: RoutingClient, server: str, calls: int = 1) -> tuple[Any, list]:
    route = fleet.router.open_route(fleet.router.slots[server], calls)
    for _ in range(calls):
        fleet.router.admit(route)
    ROUTE.set(route)
    results = await asyncio.gather(*(fleet.generate([1, 2, 3], {"max_tokens": 1}) for _ in range(calls)))
    return route, results


def test_a_group_stays_on_its_server():
    async def go():
        fleet, a, b, _ = two_servers()
        await fleet.start(ceiling=16)
        await in_group(fleet, "a:1".replace(":", "-"), calls=3)
        return a, b

    a, b = asyncio.run(go())
    assert len(a.calls) == 3 and b.calls == []


def test_a_refused_request_drains_its_server_and_goes_to_the_other_once():
    async def go():
        fleet, a, b, reports = two_servers()
        await fleet.start(ceiling=16)
        a.down = True
        route, results = await in_group(fleet, "a-1", calls=2)
        return fleet, a, b, reports, route, results

    fleet, a, b, reports, route, results = asyncio.run(go())
    assert len(results) == 2 and b.answered == 2 and a.answered == 0
    assert route.server == "b-1" and route.resent == 2 and fleet.resent == 2
    assert [r[:2] for r in reports] == [("a-1", 1)]  # told to the trainer once, with the epoch it was admitted at
    assert not fleet.router.slots["a-1"].serving and fleet.stats["a-1"].errors >= 1
    assert fleet.snapshot()["rollout/server/a-1/serving"] == 0.0


def test_a_hung_server_is_drained_by_its_silent_metrics_and_its_request_resent():
    async def go():
        clock = Clock()
        fleet, a, b, reports = two_servers(drain_after_s=10.0, clock=clock)
        await fleet.start(ceiling=16)
        a.hung = True
        route = fleet.router.open_route(fleet.router.slots["a-1"], 1)
        fleet.router.admit(route)
        ROUTE.set(route)
        call = asyncio.ensure_future(fleet.generate([1], {"max_tokens": 1}))
        await asyncio.sleep(0.01)
        await fleet.poll()  # the first silence starts the clock
        assert fleet.router.slots["a-1"].serving
        clock.now = 11.0
        await fleet.poll()
        return await asyncio.wait_for(call, 5), a, b, reports, route

    result, a, b, reports, route = asyncio.run(go())
    assert len(result) == 1 and a.answered == 0 and b.answered == 1 and route.server == "b-1"
    assert "not answered for 11 s" in reports[0][2]


class CountingServer(FakeServer):
    """A server whose ``/metrics`` shows one request running and a token counter that moves only when told; its
    requests finish when ``release`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.tokens = 100.0
        self.paused = False
        self.release = asyncio.Event()

    async def generate(self, token_ids: list[int], params: dict[str, Any], num_top: int = 0) -> list[GeneratedChoice]:
        self.calls.append(list(token_ids))
        await self.release.wait()
        self.answered += 1
        return [GeneratedChoice([7], [-0.5], "stop", None, None)]

    async def scrape(self) -> tuple[bool, str | None]:
        if self.hung:
            return False, None
        return True, (f"vllm:num_requests_running{{engine=\"0\"}} 1.0\n"
                      f"vllm:generation_tokens_total{{engine=\"0\"}} {self.tokens}\n")

    async def is_paused(self) -> bool:
        return self.paused


async def one_request_on_a(fleet: RoutingClient) -> tuple[Any, asyncio.Future]:
    route = fleet.router.open_route(fleet.router.slots["a-1"], 1)
    fleet.router.admit(route)
    ROUTE.set(route)
    call = asyncio.ensure_future(fleet.generate([1], {"max_tokens": 1}))
    await asyncio.sleep(0.01)
    return route, call


def test_a_slow_server_whose_counters_move_keeps_its_request_past_the_window():
    async def go():
        clock = Clock()
        a, b = CountingServer(), FakeServer()
        fleet = RoutingClient([("http://a:1", a), ("http://b:1", b)], drain_after_s=10.0, clock=clock)
        await fleet.start(ceiling=16)
        route, call = await one_request_on_a(fleet)
        for now in range(0, 60, 2):
            clock.now = float(now)
            a.tokens += 1.0  # slow: one token every two seconds
            await fleet.poll()
        a.release.set()
        return await asyncio.wait_for(call, 5), a, b, route, fleet

    result, a, b, route, fleet = asyncio.run(go())
    assert len(result) == 1 and a.answered == 1 and b.calls == [] and route.resent == 0
    assert fleet.router.slots["a-1"].serving and fleet.snapshot()["rollout/drains_total"] == 0.0


def test_a_server_silent_for_less_than_the_window_keeps_its_request():
    async def go():
        clock = Clock()
        a, b = CountingServer(), FakeServer()
        fleet = RoutingClient([("http://a:1", a), ("http://b:1", b)], drain_after_s=10.0, clock=clock)
        await fleet.start(ceiling=16)
        route, call = await one_request_on_a(fleet)
        a.hung = True  # frozen: its scrapes time out
        for now in (0.0, 4.0, 9.0):
            clock.now = now
            await fleet.poll()
        a.hung = False  # thawed within the window, and its counters move again
        a.tokens += 5.0
        clock.now = 11.0
        await fleet.poll()
        a.release.set()
        return await asyncio.wait_for(call, 5), a, b, route, fleet

    result, a, b, route, fleet = asyncio.run(go())
    assert a.answered == 1 and b.calls == [] and route.resent == 0 and fleet.router.slots["a-1"].serving
    assert fleet.snapshot()["rollout/server/a-1/unhealthy_s"] == 11.0  # from its first silent scrape to its answer


def test_a_server_whose_requests_stall_is_drained_after_the_window_but_not_while_paused_for_a_push():
    async def go():
        clock = Clock()
        a, b = CountingServer(), FakeServer()
        reports: list = []
        fleet = RoutingClient([("http://a:1", a), ("http://b:1", b)], drain_after_s=10.0, clock=clock,
                            report_drained=lambda *r: reports.append(r))
        await fleet.start(ceiling=16)
        route, call = await one_request_on_a(fleet)
        a.paused = True
        for now in range(0, 30, 2):  # counters still, but paused for a push: no stall
            clock.now = float(now)
            await fleet.poll()
        assert fleet.router.slots["a-1"].serving
        a.paused = False
        for now in range(30, 42, 2):
            clock.now = float(now)
            await fleet.poll()
        return await asyncio.wait_for(call, 5), a, b, route, reports, fleet

    result, a, b, route, reports, fleet = asyncio.run(go())
    assert len(result) == 1 and a.answered == 0 and b.answered == 1 and route.resent == 1
    assert reports and "made no progress for 10 s" in reports[0][2]
    snapshot = fleet.snapshot()
    assert snapshot["rollout/drains_total"] == 1.0 and snapshot["rollout/moved_groups_total"] == 1.0


def test_the_last_serving_server_is_waited_for_not_drained():
    async def go():
        fleet, a, b, reports = two_servers()
        await fleet.start(ceiling=16)
        fleet.drain(fleet.router.slots["b-1"], "test", report=False)
        a.down = True
        route = fleet.router.open_route(fleet.router.slots["a-1"], 1)
        fleet.router.admit(route)
        ROUTE.set(route)
        call = asyncio.ensure_future(fleet.generate([1], {"max_tokens": 1}))
        await asyncio.sleep(0.3)
        assert not call.done() and fleet.router.slots["a-1"].serving  # still its server, being retried
        a.down = False
        return await asyncio.wait_for(call, 10), reports

    result, reports = asyncio.run(go())
    assert len(result) == 1 and reports == []


def test_with_no_server_serving_calls_wait_then_give_up_naming_them():
    async def go():
        fleet, a, b, _ = two_servers()
        fleet.unavailable_timeout_s = 0.3
        await fleet.start(ceiling=16)
        for slot in list(fleet.router.serving()):
            fleet.drain(slot, "test", report=False)
        await fleet.generate([1], {"max_tokens": 1})

    with pytest.raises(NoServerAvailable, match=r"a-1 \(http://a:1\), b-1 \(http://b:1\)"):
        asyncio.run(go())


def test_the_trainers_view_readmits_only_with_a_newer_epoch():
    async def go():
        fleet, a, b, _ = two_servers()
        await fleet.start(ceiling=16)
        fleet.drain(fleet.router.slots["a-1"], "refused")
        await fleet.apply_view({"a-1": ("http://a:1", 1), "b-1": ("http://b:1", 1)})  # the report not seen yet
        stale = fleet.router.slots["a-1"].serving
        await fleet.apply_view({"a-1": ("http://a:1", 0), "b-1": ("http://b:1", 1)})
        await fleet.apply_view({"a-1": ("http://a:1", 2), "b-1": ("http://b:1", 1)})  # checked and caught up
        back = fleet.router.slots["a-1"].serving, fleet.router.slots["a-1"].epoch
        await fleet.apply_view({"a-1": ("http://a:1", 2), "b-1": ("http://b:1", 0)})  # the trainer drained b
        return stale, back, fleet.router.slots["b-1"].serving

    stale, back, b_serving = asyncio.run(go())
    assert stale is False and back == (True, 2) and b_serving is False


# ---- the scheduler over a fleet -----------------------------------------------------------------------------
class TwoServerLoop(ScriptedLoop):
    """Two scripted servers; ``fail_a_after`` requests, server a refuses every connection."""

    fail_a_after: int | None = None
    kv_usage: tuple[float, float] | None = None  # each server's KV-cache gauge in its /metrics (None: no /metrics)

    async def connect(self) -> None:
        from tests.test_loop_scheduler import script

        servers = [CountingClient(self.tokenizer, script, fail_after=self.fail_a_after), CountingClient(self.tokenizer, script)]
        for server, kv in zip(servers, self.kv_usage or (None, None)):
            server.kv_usage = kv
        self.servers = servers
        self.client = RoutingClient([("http://a:1", servers[0]), ("http://b:1", servers[1])], unavailable_timeout_s=5.0)
        self.max_model_len = await self.client.start(self.ceiling)


class CountingClient(ScriptedClient):
    def __init__(self, *args: Any, fail_after: int | None = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.fail_after = fail_after
        self.groups: set[str] = set()

    async def generate(self, token_ids: list[int], params: dict[str, Any], num_top: int = 0) -> list[GeneratedChoice]:
        if self.fail_after is not None and len(self.prompts) >= self.fail_after:
            raise httpx.ConnectError("[Errno 111] Connection refused")
        self.groups.add(self.tokenizer.decode(token_ids).split("Problem ")[1].split()[0])
        return await super().generate(token_ids, params, num_top)

    kv_usage: float | None = None  # what its /metrics says (None: no /metrics)

    async def scrape(self) -> tuple[bool, str | None]:
        if self.kv_usage is None:
            return True, None
        return True, (f"vllm:kv_cache_usage_perc{{engine=\"0\"}} {self.kv_usage}\n"
                      f"vllm:num_requests_waiting{{engine=\"0\"}} 0.0\n")


def drive_fleet(tokenizer: Any, rows: int, fail_a_after: int | None = None,
                kv_usage: tuple[float, float] | None = None) -> tuple[TwoServerLoop, list[Any]]:
    items: list[Any] = []

    async def emit(item: Any) -> float:
        items.append(item)
        return 0.0

    config = AsyncGRPOConfig(num_generations=2, max_completion_length=16, num_sampler_logprobs=0,
                             max_concurrent_rollouts=4, max_steps=0, num_train_epochs=1, report_to="none",
                             vllm_server_base_url=["http://a:1", "http://b:1"])
    loop = TwoServerLoop(config, tokenizer, dataset(rows), [right_or_wrong], config.server_urls(), emit)
    loop.fail_a_after = fail_a_after
    loop.kv_usage = kv_usage
    asyncio.run(RolloutScheduler(loop, threading.Event()).run())
    return loop, items


def test_the_scheduler_spreads_groups_over_both_servers_one_server_each(tokenizer):
    loop, items = drive_fleet(tokenizer, rows=12)
    reports = [i for i in items if isinstance(i, GroupReport)]
    servers = [r.server for r in reports]
    assert sorted(set(servers)) == ["a-1", "b-1"] and min(servers.count("a-1"), servers.count("b-1")) >= 4
    a, b = loop.servers
    assert not (a.groups & b.groups)  # every group's requests went to one server
    metrics = group_metrics(reports)
    assert metrics["rollout/server/a-1/groups"] + metrics["rollout/server/b-1/groups"] == 12
    assert metrics["rollout/servers_serving"] == 2.0 and "rollout/server/b-1/in_flight" in metrics


def test_the_scheduler_spreads_groups_although_one_server_read_a_block_fuller(tokenizer):
    # The run takes less than one metrics period: the first scrape's gauges (one KV block apart) hold throughout.
    loop, items = drive_fleet(tokenizer, rows=12, kv_usage=(2 / 4096, 1 / 4096))
    servers = [r.server for r in items if isinstance(r, GroupReport)]
    assert len(servers) == 12 and min(servers.count("a-1"), servers.count("b-1")) >= 4, servers


def test_a_server_lost_mid_run_loses_no_group_and_trains_none_twice(tokenizer):
    loop, items = drive_fleet(tokenizer, rows=12, fail_a_after=4)
    reports = [i for i in items if isinstance(i, GroupReport)]
    samples = [i for i in items if isinstance(i, RolloutSample)]
    assert sorted(r.position for r in reports) == list(range(12))  # every group, once
    # Each group's samples once, as many as its report says (this script's groups all score alike, so are dropped).
    assert Counter(s.position for s in samples) == Counter({r.position: r.num_samples for r in reports if r.num_samples})
    assert sum(len(server.prompts) for server in loop.servers) >= 24  # every rollout got its turn somewhere
    assert not loop.client.router.slots["a-1"].serving
    resent = sum(r.metrics.get("rollout/resent_requests", 0.0) for r in reports)
    assert resent >= 1 and resent == loop.client.resent
    assert reports[-1].server == "b-1"


def test_server_name_of_the_test_urls():
    assert server_name("http://a:1") == "a-1"


def test_a_server_added_to_the_run_gets_a_client_and_groups():
    async def go():
        fleet, a, b, _ = two_servers()
        c = FakeServer()
        fleet.make_client = lambda url: c
        await fleet.start(ceiling=16)
        await fleet.apply_view({"a-1": ("http://a:1", 1), "b-1": ("http://b:1", 1), "c-1": ("http://c:1", 1)})
        fleet.drain(fleet.router.slots["a-1"], "test", report=False)
        fleet.drain(fleet.router.slots["b-1"], "test", report=False)
        await in_group(fleet, fleet.router.pick().name, calls=2)
        return c

    assert asyncio.run(go()).answered == 2

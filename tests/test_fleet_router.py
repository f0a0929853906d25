"""The fleet's router as pure bookkeeping: where groups go, the caps and the ceiling, drains and re-admissions."""

from __future__ import annotations

import pytest

from grpo_core.rollout.concurrency import ConcurrencyController
from grpo_core.rollout.routing_client import server_name
from grpo_core.rollout.router import Router, ServerSlot


def fleet(caps: dict[str, int], ceiling: int = 100) -> Router:
    router = Router([ServerSlot(name=n, url=f"http://{n}:8000") for n in caps], ceiling=ceiling)
    for epoch, (name, cap) in enumerate(caps.items(), start=1):
        router.admit_server(router.slots[name], 1, ConcurrencyController(ceiling, initial_cap=cap))
    return router


def fill(router: Router, size: int) -> list:
    """Open a group where ``pick`` says and admit all of its rollouts that fit."""
    slot = router.pick()
    assert slot is not None
    route = router.open_route(slot, size)
    while route.unadmitted and router.can_admit(route):
        router.admit(route)
    return route


def test_groups_alternate_between_equal_servers_and_fill_the_emptier():
    router = fleet({"a": 8, "b": 8})
    servers = [fill(router, 4).server for _ in range(4)]
    assert sorted(servers) == ["a", "a", "b", "b"] and servers[0] != servers[1]
    assert router.pick() is None  # both caps are full: the next group waits
    assert router.in_flight == 16


def test_equal_servers_share_the_groups_whatever_their_last_kv_readings():
    # Caps at the ceiling (where they start on a server whose KV cache holds a ceiling's worth of requests): every
    # server's room is the fleet's, so every pick is a tie. The KV gauges, read seconds ago, differ by one block of a
    # 4,096-block cache; they must not send every group to the same server until the next scrape.
    router = fleet({"a": 16, "b": 16}, ceiling=16)
    router.slots["a"].kv_usage, router.slots["b"].kv_usage = 2 / 4096, 1 / 4096
    routes = [fill(router, 4) for _ in range(4)]
    assert [r.server for r in routes] == ["a", "b", "a", "b"]
    # b's groups finish first: the next groups go to b, which holds none, while a still holds two.
    for route in routes[1::2]:
        for _ in range(4):
            router.release(route)
        router.close(route)
    assert [fill(router, 4).server for _ in range(2)] == ["b", "b"]


def test_a_group_goes_where_its_server_has_room_by_its_own_cap():
    router = fleet({"a": 2, "b": 10})
    assert [fill(router, 2).server for _ in range(3)] == ["b", "b", "b"]  # b has more room each time
    route = fill(router, 2)
    assert route.server in ("a", "b")
    # A cut on b's cap (its KV cache filled) sends the next groups to a.
    router.slots["b"].controller.observe(0.95, 0)
    assert router.pick().name == "a"


def test_promised_rollouts_count_against_a_server_before_they_start():
    router = fleet({"a": 4, "b": 4})
    first = router.open_route(router.pick(), 4)  # created, none admitted yet
    assert router.room(first.slot) == 0
    assert router.pick() is not first.slot


def test_the_ceiling_bounds_the_whole_fleet():
    router = fleet({"a": 8, "b": 8}, ceiling=6)
    fill(router, 4)
    route = fill(router, 4)
    assert router.in_flight == 6 and route.unadmitted == 2  # two wait although b's own cap has room
    assert router.pick() is None


def test_a_drained_servers_groups_move_with_their_rollouts_and_are_released_there():
    router = fleet({"a": 4, "b": 4})
    on_a = fill(router, 4)
    on_b = fill(router, 2)
    assert (on_a.server, on_b.server) == ("a", "b")
    moved = router.drain(router.slots["a"])
    assert moved == [on_a] and on_a.server == "b" and on_a.moves == 1
    b = router.slots["b"].controller
    assert b.in_flight == 6 and not b.can_admit()  # adopted over its cap; nothing new until it drains
    for _ in range(4):
        router.release(on_a)
    router.close(on_a)
    assert b.in_flight == 2 and router.in_flight == 2
    assert not router.slots["a"].serving and router.slots["a"].controller is None


def test_with_no_server_left_groups_wait_and_move_to_the_first_admitted_again():
    router = fleet({"a": 4, "b": 4})
    route = router.open_route(router.pick(), 3)
    router.admit(route)
    router.drain(router.slots["a"])
    router.drain(router.slots["b"])
    assert not router.can_admit(route) and router.pick() is None
    assert route.slot.serving is False  # stranded
    router.release(route)  # a rollout that ended meanwhile needs no controller
    moved = router.admit_server(router.slots["b"], 2, ConcurrencyController(100, initial_cap=4))
    assert moved == [route] and route.server == "b" and router.slots["b"].unadmitted == 2
    assert router.slots["b"].controller.in_flight == 0 and router.can_admit(route)


def test_a_server_admitted_again_while_serving_keeps_its_rollouts_in_flight():
    """The trainer can catch a restarted server up between two looks of the worker: the worker sees a newer epoch
    without having seen the server leave. Its groups stay, and the new cap counts their rollouts."""
    router = fleet({"a": 4})
    route = fill(router, 3)
    router.admit_server(router.slots["a"], 2, ConcurrencyController(100, initial_cap=4))
    assert router.slots["a"].controller.in_flight == 3 and route.server == "a" and route.moves == 0
    for _ in range(3):
        router.release(route)  # each one ends under the new cap
    router.close(route)
    assert router.slots["a"].controller.in_flight == 0 and router.in_flight == 0


def test_admitting_a_rollout_without_room_is_refused():
    router = fleet({"a": 1})
    route = router.open_route(router.pick(), 2)
    router.admit(route)
    with pytest.raises(RuntimeError, match="without room"):
        router.admit(route)


@pytest.mark.parametrize("url,name", [
    ("http://127.0.0.1:8001", "127.0.0.1-8001"),
    ("http://grpo-ab12-server-1.grpo-ab12-server.grpo.svc:8000/", "grpo-ab12-server-1-8000"),
    ("https://vllm.example.com", "vllm-443"),
])
def test_server_names_are_short_and_tracker_safe(url, name):
    assert server_name(url) == name

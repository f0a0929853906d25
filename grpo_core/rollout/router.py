"""Which fleet server each group goes to, and where its rollouts go when that server is lost: pure bookkeeping.

A GROUP's requests all go to one server: its rollouts share the prompt, which that server then holds in its
prefix cache, and a multi-turn continuation finds its own earlier turns there. ``Router.pick`` sends a new
group to the serving server with the most room: the free slots of that server's own adaptive concurrency cap
(``concurrency.ConcurrencyController``, steered by its KV-cache usage) less the rollouts already promised to it.
All servers together stay under the run's ceiling (``max_concurrent_rollouts``), which bounds what the trainer can
consume before samples go stale, however many servers there are.

Ties go to the server with the least load now (its rollouts in flight and promised, as a share of its cap), then
to the one that got a group least recently. They are the rule, not the exception: while each server's cap is at
the ceiling (where it starts whenever the KV cache holds a ceiling's worth of full-length requests), every server's
room is the fleet's room under the ceiling. The tie is not broken by the KV-cache gauge itself: that is read every
few seconds, and at low load two servers differ in it by a block or two of a cache of thousands, so one server
won every tie until the next scrape and took every new group meanwhile, while the other idled. The gauge steers
each server's cap; the live counts pick.

A drained server's groups move, with their rollouts in flight and those not yet admitted, to the serving server
with the most room (whose cap adopts them, over its limit if need be); with no server serving they stay where
they are ("stranded") and move to the first server admitted again. Nothing here does I/O or reads a clock
(``routing_client.RoutingClient`` does); ``tests/test_fleet_router.py`` drives it.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from grpo_core.rollout.concurrency import ConcurrencyController


@dataclass(eq=False)
class ServerSlot:
    """One server of the fleet as the router sees it."""

    name: str
    url: str
    serving: bool = False
    epoch: int = 0
    """The trainer's admission count for this server (0: never admitted); a view with a newer epoch re-admits it."""
    controller: ConcurrencyController | None = None
    """Its own adaptive cap, made fresh at each admission (None while it is not serving)."""
    unadmitted: int = 0
    """Rollouts of its groups that wait for a slot under its cap."""
    kv_usage: float | None = None
    """The last KV-cache usage read from its ``/metrics`` (a fraction): a metric and its cap's input, not a tie-break."""
    last_picked: int = 0
    routes: set[GroupRoute] = field(default_factory=set)

    @property
    def in_flight(self) -> int:
        return sum(route.in_flight for route in self.routes)

    @property
    def load(self) -> float:
        """Its rollouts in flight and promised (created, not yet admitted), as a share of its cap, counted now."""
        cap = self.controller.cap if self.controller is not None else 1
        return (self.in_flight + self.unadmitted) / max(1, cap)


@dataclass(eq=False)
class GroupRoute:
    """Where one group's requests go; moved as a whole when its server is drained."""

    slot: ServerSlot
    unadmitted: int
    """Rollouts of the group not admitted yet."""
    in_flight: int = 0
    moves: int = 0
    """Times the group moved to another server."""
    resent: int = 0
    """Requests of the group sent again to another server after its server left service."""

    @property
    def server(self) -> str:
        return self.slot.name


class Router:
    """Groups to servers and rollouts under each server's cap (module docstring); drive it from one event loop."""

    def __init__(self, slots: list[ServerSlot], ceiling: int):
        if ceiling < 1:
            raise ValueError(f"ceiling={ceiling}: at least one rollout must be allowed in flight")
        if len({s.name for s in slots}) != len(slots):
            raise ValueError(f"server names repeat: {[s.name for s in slots]}")
        self.slots = {s.name: s for s in slots}
        self.ceiling = ceiling
        self._picks = itertools.count(1)

    # ---- state -------------------------------------------------------------------------------------
    def serving(self) -> list[ServerSlot]:
        return [s for s in self.slots.values() if s.serving]

    @property
    def in_flight(self) -> int:
        return sum(s.in_flight for s in self.slots.values())

    @property
    def unadmitted(self) -> int:
        return sum(s.unadmitted for s in self.slots.values())

    def room(self, slot: ServerSlot) -> int:
        """Rollouts a new group could still start on ``slot`` now (0 or less: none)."""
        if not slot.serving or slot.controller is None:
            return 0
        own = slot.controller.free_slots() - slot.unadmitted
        return min(own, self.ceiling - self.in_flight - self.unadmitted)

    def others_serving(self, slot: ServerSlot) -> bool:
        return any(s is not slot for s in self.serving())

    # ---- groups ------------------------------------------------------------------------------------
    def pick(self) -> ServerSlot | None:
        """The server for a new group, or None while no server has room."""
        candidates = [s for s in self.serving() if self.room(s) > 0]
        return self._best(candidates)

    def open_route(self, slot: ServerSlot, size: int) -> GroupRoute:
        """A new group of ``size`` rollouts on ``slot`` (from ``pick``)."""
        route = GroupRoute(slot=slot, unadmitted=size)
        slot.unadmitted += size
        slot.routes.add(route)
        slot.last_picked = next(self._picks)
        return route

    def can_admit(self, route: GroupRoute) -> bool:
        slot = route.slot
        return (slot.serving and slot.controller is not None and slot.controller.can_admit()
                and self.in_flight < self.ceiling)

    def admit(self, route: GroupRoute) -> None:
        """One of the group's rollouts starts (after ``can_admit``)."""
        if not self.can_admit(route):
            raise RuntimeError(f"rollout admitted on {route.server} without room; check can_admit() first")
        assert route.slot.controller is not None
        route.slot.controller.on_rollout_started()
        route.unadmitted -= 1
        route.slot.unadmitted -= 1
        route.in_flight += 1

    def release(self, route: GroupRoute) -> None:
        """One of the group's rollouts ended (it counts on the server the group is on now)."""
        route.in_flight -= 1
        if route.slot.controller is not None:
            route.slot.controller.on_rollout_finished()

    def close(self, route: GroupRoute) -> None:
        """The group is done with its server (all its rollouts ended)."""
        route.slot.routes.discard(route)
        route.slot.unadmitted -= route.unadmitted
        route.unadmitted = 0

    # ---- membership --------------------------------------------------------------------------------
    def drain(self, slot: ServerSlot) -> list[GroupRoute]:
        """Take ``slot`` out of service; its groups move to the others (returned), or stay stranded."""
        slot.serving = False
        slot.controller = None
        slot.kv_usage = None
        return self._rehome([r for r in slot.routes])

    def admit_server(self, slot: ServerSlot, epoch: int, controller: ConcurrencyController) -> list[GroupRoute]:
        """Put ``slot`` (back) in service with a fresh cap; stranded groups move (returned)."""
        if slot.name not in self.slots:
            self.slots[slot.name] = slot
        # Stranded groups, this server's own included (its new cap must count their rollouts in flight too).
        stranded = [r for s in self.slots.values() if not s.serving for r in s.routes]
        # Re-admitted while still serving here (the trainer caught a restart up before this worker saw it leave):
        # its groups stay, and the fresh cap counts their rollouts in flight as its own.
        kept = sum(r.in_flight for r in slot.routes) if slot.serving else 0
        slot.serving, slot.epoch, slot.controller = True, epoch, controller
        controller.adopt(kept)
        return self._rehome(stranded)

    def _rehome(self, routes: list[GroupRoute]) -> list[GroupRoute]:
        moved = []
        for route in routes:
            # Moved groups must land somewhere: the serving server with the most room, even if that is none.
            target = self._best(self.serving(), rank_by=lambda s: self.room(s))
            if target is None:
                continue
            old = route.slot
            old.routes.discard(route)
            old.unadmitted -= route.unadmitted
            target.routes.add(route)
            target.unadmitted += route.unadmitted
            assert target.controller is not None
            target.controller.adopt(route.in_flight)
            route.moves += target is not old
            route.slot = target
            moved.append(route)
        return moved

    def _best(self, candidates: list[ServerSlot], rank_by=None) -> ServerSlot | None:  # noqa: ANN001
        if not candidates:
            return None
        rank_by = rank_by or self.room

        def key(s: ServerSlot) -> tuple[float, float, int]:
            return (-rank_by(s), s.load, s.last_picked)  # ties: see the module docstring

        return min(candidates, key=key)

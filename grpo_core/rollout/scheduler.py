"""Drives an ``AsyncRolloutLoop`` inside the rollout process: prompt order, admission, groups, queueing.

Prompts are visited from ``start_position`` on (``prompts.prompts_from``: a seeded per-epoch order
for a map-style dataset, the stream's own order for an ``IterableDataset``), so a resume continues
exactly where training stopped. Each prompt becomes a group of ``num_generations`` rollouts,
sent to one server of the fleet (``routing_client.RoutingClient``; ``router.Router`` picks the server with room under its own
live concurrency cap), and its rollouts are admitted while that server's rollouts in flight stay under the cap. A finished
group is scored, gets advantages, its rollouts are reconciled into training sequences, and it is
reported (kept or dropped) before its samples are queued. The report carries the group's summed
per-rollout counters (tools, environment, CLEAN/REALIGN/FORK) for ``group_metrics``.

Back-pressure: while a finished group waits for room on the trainer's full queue, no new group is
created. Rollouts already admitted run on, so generation stops at most one cap's worth of rollouts
past a full queue instead of running ahead of the trainer with samples that would only go stale.

Staleness budget: a new group is created only while the samples ahead of the trainer (queued, being
scored, and the groups still generating, counted at ``num_generations`` each) stay within what the
trainer consumes before they would be too stale: ``(max_staleness + 1) x weight_sync_steps x`` samples
per step. The trainer publishes what it consumed with each weight version, so with ``max_staleness=0``
the next step's rollouts start only once the weights of the step before are served (a synchronous
run), and with ``max_staleness=S`` generation runs at most S updates ahead. Without the budget the
worker ran ahead by the whole queue (``queue_maxsize``), generating samples the trainer then dropped
as stale while they took the CPU cores from training (benchmarks/peers/peer_trl.py).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import numpy as np

from grpo_core.data.inputs import as_messages
from grpo_core.data.prompts import prompts_from
from grpo_core.rollout.advantages import should_drop_group
from grpo_core.rollout.routing_client import ROUTE, RoutingClient
from grpo_core.rollout.router import GroupRoute, ServerSlot
from grpo_core.rollout.stages import AsyncRolloutLoop, reconcile_metrics, rollout_rewards
from grpo_core.rollout.types import GroupReport, RolloutGroup, merge_counters
from grpo_core.staleness import samples_ahead

END_OF_DATA = "end-of-data"
"""Queued after the last group when the run is bounded by epochs (``max_steps`` <= 0)."""

_METRICS_POLL_S = 2.0
_CONSUMED_POLL_S = 0.05  # the trainer's consumed count is a shared integer: cheap to read often


def samples_per_step(config: Any, num_processes: int) -> int:
    return config.per_device_train_batch_size * config.gradient_accumulation_steps * num_processes


def sample_budget(config: Any, num_processes: int) -> int:
    """Samples that may be ahead of the trainer (queued or being generated) without going stale
    (``staleness.samples_ahead``)."""
    return samples_ahead(config.max_staleness, config.weight_sync_steps, samples_per_step(config, num_processes))


class RolloutScheduler:
    def __init__(self, loop: AsyncRolloutLoop, stop_event: Any):
        self.loop = loop
        self.stop_event = stop_event
        self.fleet: RoutingClient | None = None
        self.backpressure_s = 0.0
        self.generated_tokens = 0
        self.last_report_time = time.perf_counter()
        self._room = asyncio.Condition()
        self.failure: BaseException | None = None
        self.blocked_groups = 0  # finished groups waiting for room on the full queue
        self.scoring_groups = 0  # groups whose rollouts all finished, being scored (rollout/score_queue_size)
        self.pending_samples = 0  # num_generations per created group that has not emitted its samples yet
        self.emitted_samples = 0  # samples handed to the queue
        processes = getattr(loop, "num_processes", 1)
        self.sample_budget = sample_budget(loop.config, processes)
        self.per_step = samples_per_step(loop.config, processes)

    def _on_group_done(self, task: asyncio.Task[None], tasks: set[asyncio.Task[None]]) -> None:
        tasks.discard(task)
        if not task.cancelled() and task.exception() is not None and self.failure is None:
            self.failure = task.exception()

    def _raise_failure(self) -> None:
        if self.failure is not None:
            raise self.failure

    # ------------------------------------------------------------------------------------------------
    async def run(self) -> None:
        loop = self.loop
        await loop.connect()
        self.fleet = await self._fleet()
        await loop.setup()
        poller = asyncio.create_task(self._poll_metrics())
        watcher = asyncio.create_task(self._watch_consumed())
        tasks: set[asyncio.Task[None]] = set()
        try:
            await self._schedule(tasks)
            if tasks:
                await _gather_or_raise(tasks)
            if not self.stop_event.is_set():
                await loop.emit(END_OF_DATA)
        finally:
            poller.cancel()
            watcher.cancel()
            for task in tasks:
                task.cancel()
            # Let cancelled rollouts run their cleanup (environment close) before the pool goes.
            await asyncio.gather(*tasks, return_exceptions=True)
            await loop.close()

    async def _schedule(self, tasks: set[asyncio.Task[None]]) -> None:
        loop, config = self.loop, self.loop.config
        epochs = None if config.max_steps > 0 else config.num_train_epochs
        rejected_in_epoch, current_epoch = 0, None
        skip = getattr(loop, "skip_positions", frozenset())  # a user's loop that keeps its own __init__ has none
        for prompt in prompts_from(loop.dataset, loop.start_position, config.seed, epochs):
            if self.stop_event.is_set():
                break
            if prompt.position in skip:
                continue  # trained before the checkpoint this run resumed from
            if prompt.epoch != current_epoch:
                rejected_in_epoch, current_epoch = 0, prompt.epoch
            if not loop.filter_prompt(prompt.row_index, prompt.row, prompt.epoch):
                rejected_in_epoch += 1
                if prompt.epoch_size is not None and rejected_in_epoch == prompt.epoch_size:
                    raise RuntimeError(f"filter_prompt rejected every prompt of epoch {prompt.epoch}; nothing left to train")
                await loop.emit(_filtered_report(prompt.position, prompt.row_index, prompt.epoch))
                continue
            slot = await self._wait_for_room()
            self._raise_failure()
            if slot is None:
                break  # stopping
            route = self.fleet.router.open_route(slot, config.num_generations)
            self.pending_samples += config.num_generations
            task = asyncio.create_task(self._run_group(route, prompt.position, prompt.row_index, prompt.row, prompt.epoch))
            tasks.add(task)
            task.add_done_callback(lambda t: self._on_group_done(t, tasks))
            await asyncio.sleep(0)  # let admitted rollouts start before creating more groups
        self._raise_failure()

    # ---- admission ----------------------------------------------------------------------------------
    async def _fleet(self) -> RoutingClient:
        """The loop's servers: the fleet its ``connect`` opened, or a one-server fleet around a client it built."""
        loop = self.loop
        client = loop.client
        if not isinstance(client, RoutingClient):
            client = RoutingClient.around(client, loop.base_urls[0])
        if not client.started:
            await client.start(loop.ceiling)
        client.on_change = self._wake
        return client

    def _wake(self) -> None:
        """Re-check every waiting condition soon (the fleet changed: a server drained or admitted)."""
        async def notify() -> None:
            async with self._room:
                self._room.notify_all()

        asyncio.get_running_loop().create_task(notify())

    async def _poll_metrics(self) -> None:
        assert self.fleet is not None
        while True:
            await self.fleet.poll()
            # Also wakes the scheduler after a group failure, so the error surfaces within one poll.
            async with self._room:
                self._room.notify_all()
            await asyncio.sleep(_METRICS_POLL_S)

    async def _watch_consumed(self) -> None:
        """Wake the scheduler as soon as the trainer publishes a new consumed count (a new weight version), and
        follow the trainer's view of the fleet (servers it took out of service or admitted again)."""
        assert self.fleet is not None
        last = self.loop.consumed_samples()
        while True:
            await asyncio.sleep(_CONSUMED_POLL_S)
            view = self.loop.fleet_view()
            if view is not None:
                await self.fleet.apply_view(view)
            now = self.loop.consumed_samples()
            if now != last:
                last = now
                async with self._room:
                    self._room.notify_all()

    def samples_ahead(self) -> int | None:
        """Samples queued, being scored or being generated that the trainer has not consumed (None: no trainer)."""
        consumed = self.loop.consumed_samples()
        return None if consumed is None else self.pending_samples + self.emitted_samples - consumed

    def _within_budget(self) -> bool:
        ahead = self.samples_ahead()
        # Below one step's worth the trainer cannot fill its next step from what is ahead (a step filled by
        # token_budget or a dropped sample leaves a count that is no multiple of the group): never starve it.
        return ahead is None or ahead < self.per_step or ahead + self.loop.config.num_generations <= self.sample_budget

    async def _wait_for_room(self) -> ServerSlot | None:
        """The server for the next group, once one has a free slot not already promised to a created-but-unadmitted
        rollout, the trainer's queue takes what finished groups produce, and a new group stays within the staleness
        budget; None when the run stops."""
        assert self.fleet is not None
        router = self.fleet.router
        async with self._room:
            await self._room.wait_for(
                lambda: self.stop_event.is_set()
                or self.failure is not None
                or (router.pick() is not None and self.blocked_groups == 0 and self._within_budget())
            )
            return None if self.stop_event.is_set() else router.pick()

    async def _admit(self, route: GroupRoute) -> None:
        assert self.fleet is not None
        router = self.fleet.router
        async with self._room:
            await self._room.wait_for(lambda: self.failure is not None or router.can_admit(route))
            self._raise_failure()
            router.admit(route)

    def _completions_per_request(self) -> float:
        """Completions per generation request so far (above 1 when a group's first turns were coalesced)."""
        client = self.loop.client
        sent = getattr(client, "requests_sent", 0)
        return float(getattr(client, "completions_received", 0)) / sent if sent else 0.0

    async def _released(self, route: GroupRoute) -> None:
        assert self.fleet is not None
        self.fleet.router.release(route)
        async with self._room:
            self._room.notify_all()

    # ---- one group ----------------------------------------------------------------------------------
    async def _run_rollout(self, route: GroupRoute, row_index: int, row: dict[str, Any], i: int):
        await self._admit(route)
        try:
            return await self.loop.generate_one(row_index, row, i)
        finally:
            await self._released(route)

    async def _run_group(self, route: GroupRoute, position: int, row_index: int, row: dict[str, Any], epoch: int) -> None:
        loop = self.loop
        g = loop.config.num_generations
        ROUTE.set(route)  # this task's context: every request of the group's rollouts goes to its server
        try:
            rollouts = await asyncio.gather(*(self._run_rollout(route, row_index, row, i) for i in range(g)))
        finally:
            self.fleet.router.close(route)
        group = RolloutGroup(row_index=row_index, epoch=epoch, prompt=as_messages(row["prompt"]), rollouts=list(rollouts), row=row)
        self.scoring_groups += 1
        try:
            await loop.score(group)
        finally:
            self.scoring_groups -= 1
        advantages = loop.compute_advantages(group)
        dropped = should_drop_group(group.rewards)
        # Reconciled for dropped groups too: fork and realign rates describe the rollouts, kept or not.
        reconciled = [loop.reconcile(r) for r in group.rollouts]
        samples = [] if dropped else loop.samples_of(group, advantages, position, reconciled)
        # Counted before they are emitted: from here on they are ahead of the trainer as queued samples.
        self.pending_samples -= g
        self.emitted_samples += len(samples)
        rewards_per_func = {n: group.rewards_per_func[:, j] for j, n in enumerate(group.reward_func_names)}
        own = rollout_rewards(group)
        if not np.isnan(own).all():
            rewards_per_func["rollout_reward"] = own
        lengths = np.array([sum(len(t.output_ids) for t in r.turns) for r in group.rollouts], dtype=np.float64)
        now = time.perf_counter()
        report = GroupReport(
            position=position,
            row_index=row_index,
            epoch=epoch,
            rewards=group.rewards,
            rewards_per_func=rewards_per_func,
            num_samples=len(samples),
            dropped=dropped,
            generated_tokens=int(lengths.sum()),
            completion_lengths=lengths,
            metrics={
                "rollout/backpressure_s": self.backpressure_s,
                "rollout/concurrency_cap": float(sum(s.controller.cap for s in self.fleet.router.serving() if s.controller)),
                "rollout/concurrency": float(self.fleet.router.in_flight),
                "rollout/resent_requests": float(route.resent),
                f"rollout/server/{route.server}/groups": 1.0,
                "rollout/report_interval_s": now - self.last_report_time,
                "rollout/score_queue_size": float(self.scoring_groups),
                "rollout/samples_ahead": float(self.samples_ahead() if self.samples_ahead() is not None else -1),
                "rollout/completions_per_request": self._completions_per_request(),
                **merge_counters([r.metrics for r in group.rollouts]),
                **reconcile_metrics(reconciled),
            },
            completions=[r.completion_text for r in group.rollouts],
            server=route.server,
            fleet=self.fleet.snapshot(),
            prompt_text=str(group.prompt[-1].get("content") or "") if group.prompt else "",
        )
        self.last_report_time = now
        self.backpressure_s = 0.0
        # An emit that finds room returns without suspending, so the count is only ever seen above
        # zero while a group really waits on a full queue.
        self.blocked_groups += 1
        try:
            self.backpressure_s += await loop.emit(report)
            for sample in samples:
                self.backpressure_s += await loop.emit(sample)
        finally:
            self.blocked_groups -= 1
            async with self._room:
                self._room.notify_all()


def _filtered_report(position: int, row_index: int, epoch: int) -> GroupReport:
    return GroupReport(
        position=position, row_index=row_index, epoch=epoch, rewards=np.zeros(0), rewards_per_func={},
        num_samples=0, dropped=True, filtered=True,
    )


async def _gather_or_raise(tasks: set[asyncio.Task[None]]) -> None:
    done, pending = await asyncio.wait(set(tasks), return_when=asyncio.FIRST_EXCEPTION)
    for task in done:
        if task.exception() is not None:
            for other in pending:
                other.cancel()
            raise task.exception()  # type: ignore[misc]
    if pending:
        await asyncio.gather(*pending)

"""Trainer side of the queue: pull samples, drop or keep stale ones, fill one optimizer step's rows.

``StepCollector.collect(versions)`` returns the next ``StepBatch``: the packing plan for every rank and
micro-batch, plus the group reports that arrived meanwhile (rewards are logged per group, kept or
dropped). A sample's staleness is the number of weight updates pushed to the server since the
version that sampled it (``WeightVersions``): with ``weight_sync_steps > 1`` that is fewer than the
optimizer steps in between, and ``max_staleness`` counts updates. A sample past it is dropped
(``stale_samples="drop"``) or trained in the step it arrives for (``"keep"``: the importance ratio against the
sampler's log-probs corrects it as it corrects every sample, and it is counted as late). It also tracks the *training frontier*: the first prompt position whose samples have not
all been trained. That, not the worker's position, is what a checkpoint records, because the
worker runs ahead by the queue's depth and those buffered samples die with the process.
"""

from __future__ import annotations

import bisect
import logging
import math
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from grpo_core.packing.planner import Planner, StepPlan
from grpo_core.rollout.scheduler import END_OF_DATA
from grpo_core.rollout.types import GroupReport, RolloutSample

log = logging.getLogger(__name__)

COLLECTION_INTERRUPTED = "collection-interrupted"
"""What a source hands the collector, and ``collect`` returns, when the step must wait for something else
first (the server restarted and needs the trainer's weights again, ``grpo_core.vllm_server.watch``); the
samples gathered so far stay for the next ``collect``."""

CHECK_WHILE_WAITING_S = 5.0
"""How often the server is checked while a step's collection waits for samples: a restart while the
trainer waits would otherwise leave it waiting (every new sample is dropped) until the request timeout."""


NO_SIGNAL_WARN_EVERY_S = 60.0
"""While only groups without learning signal arrive, the trainer says so this often."""


STALE_SAMPLE_POLICIES = ("drop", "keep")
"""What ``AsyncGRPOConfig.stale_samples`` may name: what the collector does with a sample past ``max_staleness``."""


def trained_positions(sample: RolloutSample) -> int:
    """The tokens of ``sample`` that training would read: its sampled (completion) tokens."""
    return int(np.count_nonzero(sample.completion_mask))


class NoLearningSignalError(RuntimeError):
    """Every group for ``no_signal_patience_steps`` steps' worth scored one reward for all its rollouts: the run has
    nothing left to train, and a resume would find the same policy (the flow does not resume it)."""


def no_signal_groups(patience_steps: int, samples_per_step: int, num_generations: int) -> int:
    """``patience_steps`` steps' worth of groups (0: no limit)."""
    return math.ceil(patience_steps * samples_per_step / num_generations)


class SignalWatch:
    """Counts the groups dropped in a row because their rollouts all scored the same (``should_drop_group``): a
    warning every ``NO_SIGNAL_WARN_EVERY_S`` while they keep the trainer waiting, ``NoLearningSignalError`` at
    ``limit`` of them (0: never). A kept group starts the count again; a prompt ``filter_prompt`` rejected counts
    for nothing."""

    def __init__(self, limit: int, steps: int, clock: Any = time.monotonic):
        self.limit = limit
        self.steps = steps  # the limit in steps (no_signal_patience_steps), for the message
        self.clock = clock
        self.in_a_row = 0
        self.rewards: Counter[float] = Counter()  # each dropped group's reward, rounded for the message
        self.since: float | None = None
        self.warned_at: float | None = None

    def on_report(self, report: GroupReport) -> None:
        if report.filtered:
            return
        if not report.dropped:
            self.in_a_row, self.since, self.warned_at = 0, None, None
            self.rewards.clear()
            return
        scored = report.rewards[~np.isnan(report.rewards)]
        self.rewards[round(float(scored[0]), 3) if scored.size else math.nan] += 1
        self.in_a_row += 1
        now = self.clock()
        self.since = now if self.since is None else self.since
        if self.limit and self.in_a_row >= self.limit:
            raise NoLearningSignalError(
                f"the last {self.in_a_row} groups ({self.steps} steps' worth: no_signal_patience_steps={self.steps}) "
                f"each scored one reward for all their rollouts ({self.describe()}): there is nothing left to train. "
                "The policy samples one answer per prompt, all right or all wrong (it collapsed: see the reward and "
                "mismatch charts before this point; a lower learning rate, or an earlier checkpoint, may help), or "
                "it solves every prompt (harder data). no_signal_patience_steps=0 waits instead."
            )
        if now - self.since >= NO_SIGNAL_WARN_EVERY_S and (self.warned_at is None
                                                         or now - self.warned_at >= NO_SIGNAL_WARN_EVERY_S):
            self.warned_at = now
            log.warning("no trainable group for %.0f s: the last %d groups each scored one reward for all their "
                        "rollouts (%s), so the step waits%s", now - self.since, self.in_a_row, self.describe(),
                        f"; the run stops at {self.limit}" if self.limit else "")

    def describe(self) -> str:
        return ", ".join(f"reward {value:g} in {n}" for value, n in self.rewards.most_common(3)) + \
            (", ..." if len(self.rewards) > 3 else "")


class WeightVersions:
    """The weight versions pushed to the server, oldest first (a version is the step it was pushed at)."""

    def __init__(self, pushed: list[int] | None = None):
        self.pushed: list[int] = sorted(pushed or [])

    def record(self, version: int) -> None:
        if not self.pushed or version > self.pushed[-1]:
            self.pushed.append(version)

    @property
    def current(self) -> int:
        return self.pushed[-1] if self.pushed else 0

    def was_pushed(self, version: int) -> bool:
        """Whether this trainer pushed ``version``: a sample of any other (a restarted server's start-up
        ``"default"``, see ``rollout.stages.UNKNOWN_VERSION``) comes from weights it never trained."""
        index = bisect.bisect_left(self.pushed, version)
        return index < len(self.pushed) and self.pushed[index] == version

    def staleness(self, sample_version: int) -> int:
        """Weight updates pushed after ``sample_version``: how far the sampling policy lags the served one."""
        return len(self.pushed) - bisect.bisect_right(self.pushed, sample_version)


class TrainingFrontier:
    """Prompt positions done (trained, dropped or filtered); ``position`` is the first one not done, and
    ``done_ahead`` the positions past it that are done already (groups finish out of order)."""

    def __init__(self, start: int = 0):
        self.position = start
        self._pending: dict[int, int] = {}
        self._done_ahead: set[int] = set()

    @property
    def done_ahead(self) -> list[int]:
        """Positions past ``position`` whose prompts are done: a run resumed from here must not admit them again,
        or the model it resumes would learn from them twice."""
        return sorted(self._done_ahead)

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position, "done_ahead": self.done_ahead}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Start again at a checkpoint's position, with the positions past it that its model has trained on."""
        self.position = int(state["position"])
        self._pending.clear()
        self._done_ahead = {int(p) for p in state.get("done_ahead", ()) if int(p) >= self.position}

    def on_report(self, report: GroupReport) -> None:
        if report.num_samples == 0:
            self._mark_done(report.position)
        else:
            self._pending[report.position] = report.num_samples

    def on_consumed(self, sample: RolloutSample) -> None:
        """A sample was trained in a finished step, or dropped as stale (its prompt is not retried)."""
        left = self._pending.get(sample.position, 0) - 1
        if left <= 0:
            self._pending.pop(sample.position, None)
            self._mark_done(sample.position)
        else:
            self._pending[sample.position] = left

    def _mark_done(self, position: int) -> None:
        if position < self.position:
            return
        self._done_ahead.add(position)
        while self.position in self._done_ahead:
            self._done_ahead.remove(self.position)
            self.position += 1


@dataclass
class StepBatch:
    """What one optimizer step trains, and what arrived while it was collected."""

    plan: StepPlan
    samples: list[RolloutSample]
    reports: list[GroupReport]
    stale_dropped: int
    staleness: list[int]
    wait_s: float
    end_of_data: bool = False
    extra: dict[str, Any] = field(default_factory=dict)
    foreign_dropped: int = 0  # samples of weight versions this trainer never pushed (a restarted server's)
    stale_dropped_tokens: int = 0  # trained-position tokens of the samples dropped as stale (their sampled tokens)
    late_kept: int = 0  # samples past max_staleness trained all the same (stale_samples="keep")


class StepCollector:
    """Pulls from the rollout worker until one step's rows are full (or the data ends)."""

    def __init__(
        self,
        source: Any,
        world_size: int,
        gradient_accumulation_steps: int,
        token_budget: int,
        max_samples_per_step: int,
        max_staleness: int,
        flat: bool,
        frontier: TrainingFrontier,
        timeout_s: float,
        signal: SignalWatch | None = None,
        stale_samples: str = "drop",
    ):
        self.source = source  # RolloutWorker-like: get(timeout_s) -> item
        self.signal = signal or SignalWatch(limit=0, steps=0)
        self.planner = Planner(
            world_size=world_size,
            gradient_accumulation_steps=gradient_accumulation_steps,
            token_budget=token_budget,
            flat=flat,
        )
        self.max_samples_per_step = max_samples_per_step
        self.max_staleness = max_staleness
        if stale_samples not in STALE_SAMPLE_POLICIES:
            raise ValueError(f"AsyncGRPOConfig.stale_samples={stale_samples!r}: use one of {STALE_SAMPLE_POLICIES}")
        self.keep_stale = stale_samples == "keep"
        self.frontier = frontier
        self.timeout_s = timeout_s
        self._carried: RolloutSample | None = None
        self._interrupted: tuple[Any, ...] | None = None  # what an interrupted collect had gathered
        self.stale_dropped_total = 0
        self.foreign_dropped_total = 0
        self.consumed_total = 0  # samples trained or dropped (the rollout scheduler's staleness budget reads it)
        self.end_of_data = False

    def collect(self, versions: WeightVersions) -> StepBatch | str | None:
        """Samples for the next step, trained on the weights after ``versions.current``; None once the
        data has ended and nothing is left; ``COLLECTION_INTERRUPTED`` when the source says so (the
        next call carries on with what this one gathered)."""
        samples: list[RolloutSample]
        reports: list[GroupReport]
        staleness: list[int]
        samples, reports, staleness, stale, stale_tokens, foreign, wait_s = self._interrupted or ([], [], [], 0, 0, 0, 0.0)
        self._interrupted = None
        while not self.planner.full() and len(samples) < self.max_samples_per_step:
            if self._carried is not None:
                item, self._carried = self._carried, None
            elif self.end_of_data:
                break
            else:
                start = time.perf_counter()
                item = self.source.get(self.timeout_s)
                wait_s += time.perf_counter() - start
            if isinstance(item, str) and item == END_OF_DATA:
                self.end_of_data = True
                continue
            if isinstance(item, str) and item == COLLECTION_INTERRUPTED:
                self._interrupted = (samples, reports, staleness, stale, stale_tokens, foreign, wait_s)
                return COLLECTION_INTERRUPTED
            if isinstance(item, GroupReport):
                self.frontier.on_report(item)
                reports.append(item)
                self.signal.on_report(item)
                continue
            if not versions.was_pushed(item.policy_version):
                foreign += 1  # sampled from weights this trainer never pushed: never trained
                self.frontier.on_consumed(item)
                continue
            lag = versions.staleness(item.policy_version)
            if lag > self.max_staleness and not self.keep_stale:
                stale += 1
                stale_tokens += trained_positions(item)
                self.frontier.on_consumed(item)
                continue
            placed_before = len(self.planner)
            if not self.planner.offer(item):
                self._carried = item  # the step is full: first sample of the next one
                break
            if len(self.planner) == placed_before:
                # Longer than token_budget: the planner dropped it with a warning and counted it.
                self.frontier.on_consumed(item)
                self.consumed_total += 1
                continue
            item.staleness = lag
            samples.append(item)
            staleness.append(lag)
        plan = self.planner.finish()
        if not samples and self.end_of_data:
            return None
        self.stale_dropped_total += stale
        self.foreign_dropped_total += foreign
        self.consumed_total += len(samples) + stale + foreign
        return StepBatch(
            plan=plan,
            samples=samples,
            reports=reports,
            stale_dropped=stale,
            staleness=staleness,
            wait_s=wait_s,
            end_of_data=self.end_of_data,
            foreign_dropped=foreign,
            stale_dropped_tokens=stale_tokens,
            late_kept=sum(lag > self.max_staleness for lag in staleness),
        )

    def mark_trained(self, batch: StepBatch) -> None:
        for sample in batch.samples:
            self.frontier.on_consumed(sample)


class WatchedSource:
    """The collector's source on rank 0: the rollout worker, with the servers checked while it waits.

    ``get`` returns the worker's next item, or ``COLLECTION_INTERRUPTED`` when a server restarted or is ready to
    serve again (``fleet.servers.RunServers.needs_tending``; the collector keeps what it gathered; the trainer
    pushes and collects on).
    """

    def __init__(self, worker: Any, fleet: Any, check_every_s: float = CHECK_WHILE_WAITING_S):
        self.worker = worker
        self.fleet = fleet
        self.check_every_s = check_every_s

    def get(self, timeout_s: float) -> Any:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                return self.worker.get(max(0.01, min(self.check_every_s, deadline - time.monotonic())))
            except TimeoutError:
                waited_from = time.monotonic()
                if self.fleet.needs_tending():
                    return COLLECTION_INTERRUPTED
                deadline += time.monotonic() - waited_from  # time spent waiting for the server is not the worker's
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"no rollout arrived within {timeout_s:.0f} s") from None

"""The planner: places samples, as they arrive, into rows of micro-batches of one optimizer step.

A micro-batch is one ``TreeRow`` per data-parallel rank; ``gradient_accumulation_steps`` of them make
a step. Each sample goes, in this order of preference:

1. to a row that already holds its group (its prompt is there, so it costs only its completion),
   while it fits in ``token_budget`` unique tokens;
2. to an empty row, so that no rank idles;
3. to the fitting row with the lowest attention cost after adding it, if that does not raise the
   micro-batch's most-loaded row (the one that sets how long the micro-batch takes); before any row
   has run out of room, the micro-batch's length is not fixed yet and the lowest-cost row is taken
   even if that raises the maximum;
4. otherwise the micro-batch closes and the sample opens the next one; when the step already has
   ``gradient_accumulation_steps`` micro-batches, the step is full and the sample is carried over.

A sample with more forwarded positions than ``token_budget`` can never fit: it is dropped with a
warning and counted. The planner is deterministic, so every rank computes the same plan from the
same samples in the same order.

The trainer pulls from its queue until the step is full::

    planner = Planner(world_size=ws, gradient_accumulation_steps=gas, token_budget=budget)
    while not planner.full():
        sample = carried or queue.get(); carried = None
        if not planner.offer(sample):
            carried = sample          # first sample of the next step
    plan = planner.finish()           # StepPlan; the planner is empty again

Run its tests: ``.venv/bin/python -m pytest tests/test_packing_planner.py``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field

from grpo_core.packing.trie import TreeRow, forwarded_positions
from grpo_core.rollout.types import RolloutSample

log = logging.getLogger(__name__)


@dataclass
class StepPlan:
    """The rows of one optimizer step: ``microbatches[m][rank]``."""

    microbatches: list[list[TreeRow]]
    token_budget: int
    world_size: int
    gradient_accumulation_steps: int
    dropped_too_long: int = 0
    leftover: list[RolloutSample] = field(default_factory=list)  # ``plan_step`` only: for the next step

    def rows_for_rank(self, rank: int) -> list[TreeRow]:
        """The rows rank ``rank`` forwards, one per micro-batch (an empty row packs to a dummy)."""
        return [mb[rank] for mb in self.microbatches]

    @property
    def rows(self) -> list[TreeRow]:
        return [row for mb in self.microbatches for row in mb]

    @property
    def num_samples(self) -> int:
        return sum(row.num_samples for row in self.rows)

    def metrics(self) -> dict[str, float]:
        return plan_metrics(self)


class Planner:
    """Incremental planner for one step at a time (see the module docstring)."""

    def __init__(
        self, *, world_size: int, gradient_accumulation_steps: int, token_budget: int, flat: bool = False
    ) -> None:
        for name, value in (("world_size", world_size), ("gradient_accumulation_steps", gradient_accumulation_steps),
                            ("token_budget", token_budget)):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        self.world_size = world_size
        self.gradient_accumulation_steps = gradient_accumulation_steps
        self.token_budget = token_budget
        self.flat = flat
        self._reset()

    def _reset(self) -> None:
        self._microbatches: list[list[TreeRow]] = []
        self._saturated = False  # some row of the open micro-batch has run out of room
        self._full = False
        self._dropped = 0

    def full(self) -> bool:
        """True once a sample was refused because every micro-batch of the step is closed."""
        return self._full

    def __len__(self) -> int:
        """Samples placed so far in this step."""
        return sum(row.num_samples for mb in self._microbatches for row in mb)

    def offer(self, sample: RolloutSample) -> bool:
        """Take the sample into this step. True: placed, or dropped as too long (and counted).

        False: the step is full; keep the sample and offer it first to the next step.
        """
        if self._full:
            return False
        n = forwarded_positions(sample)
        if n > self.token_budget:
            self._dropped += 1
            log.warning(
                "dropping sample %s: %d forwarded tokens exceed token_budget=%d",
                sample.rollout_id, n, self.token_budget,
            )
            return True
        if self._microbatches and self._place(self._microbatches[-1], sample):
            return True
        if len(self._microbatches) == self.gradient_accumulation_steps:
            self._full = True
            return False
        self._microbatches.append([TreeRow(flat=self.flat) for _ in range(self.world_size)])
        self._saturated = False
        placed = self._place(self._microbatches[-1], sample)
        assert placed, "a sample within token_budget always fits an empty micro-batch"
        return True

    def _place(self, rows: list[TreeRow], sample: RolloutSample) -> bool:
        budget = self.token_budget
        previews: dict[int, tuple[int, int]] = {}

        def preview(i: int) -> tuple[int, int]:
            if i not in previews:
                previews[i] = rows[i].preview(sample)
            return previews[i]

        def fits(i: int) -> bool:
            ok = rows[i].num_unique_tokens + preview(i)[0] <= budget
            self._saturated |= not ok
            return ok

        if not self.flat:
            same_group = [i for i, row in enumerate(rows) if sample.group_id in row.group_ids and fits(i)]
            if same_group:
                rows[min(same_group, key=lambda i: preview(i)[1])].add(sample)
                return True
        for i, row in enumerate(rows):
            if row.num_samples == 0:
                row.add(sample)
                return True
        candidates = [i for i in range(len(rows)) if fits(i)]
        if not candidates:
            return False
        best = min(candidates, key=lambda i: preview(i)[1])
        if preview(best)[1] <= max(row.attention_cost for row in rows) or not self._saturated:
            rows[best].add(sample)
            return True
        return False

    def finish(self) -> StepPlan:
        """The plan of the step so far; the planner starts the next step empty."""
        plan = StepPlan(
            microbatches=self._microbatches,
            token_budget=self.token_budget,
            world_size=self.world_size,
            gradient_accumulation_steps=self.gradient_accumulation_steps,
            dropped_too_long=self._dropped,
        )
        self._reset()
        return plan


def plan_step(
    samples: Iterable[RolloutSample],
    *,
    world_size: int,
    gradient_accumulation_steps: int,
    token_budget: int,
    flat: bool = False,
) -> StepPlan:
    """Plan one step from ``samples`` in order; those that did not fit are in ``plan.leftover``."""
    planner = Planner(world_size=world_size, gradient_accumulation_steps=gradient_accumulation_steps,
                      token_budget=token_budget, flat=flat)
    samples = list(samples)
    taken = 0
    for sample in samples:
        if not planner.offer(sample):
            break
        taken += 1
    plan = planner.finish()
    plan.leftover = samples[taken:]
    return plan


# ---- the step's batch/* metrics -------------------------------------------------------------------------
def plan_metrics(plan: StepPlan) -> dict[str, float]:
    """The ``batch/*`` metrics of one step, read off its plan before anything is forwarded.

    ``*_per_step`` values are sums over the whole step (all micro-batches, all ranks); ``batch/row_*`` and
    ``batch/samples_per_row`` are means over the step's row slots (micro-batches x world size), so that
    ``samples_per_step == row slots x samples_per_row`` holds exactly.
    """
    rows = plan.rows
    slots = max(len(rows), 1)
    samples = sum(r.num_samples for r in rows)
    forwarded = sum(r.num_unique_tokens for r in rows)
    raw = sum(r.num_raw_tokens for r in rows)
    imbalance = [
        max(r.attention_cost for r in mb) / (sum(r.attention_cost for r in mb) / len(mb))
        for mb in plan.microbatches
        if any(r.attention_cost for r in mb)
    ]
    return {
        "batch/samples_per_row": samples / slots,
        "batch/row_tokens_mean": forwarded / slots,
        "batch/row_fill_frac": forwarded / (slots * plan.token_budget),
        # positions the samples would forward one by one / positions forwarded: 1.0 in flat mode
        "batch/packing_ratio": raw / forwarded if forwarded else 1.0,
        "batch/forwarded_tokens_per_step": float(forwarded),
        "batch/trained_tokens_per_step": float(sum(r.num_trained_tokens for r in rows)),
        "batch/microbatches_per_step": float(len(plan.microbatches)),
        "batch/samples_per_step": float(samples),
        "batch/dropped_too_long": float(plan.dropped_too_long),
        # max / mean attention cost of the rows of a micro-batch, averaged: 1.0 = ranks in step
        "batch/row_cost_imbalance": sum(imbalance) / len(imbalance) if imbalance else 1.0,
    }

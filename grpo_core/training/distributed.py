"""Rank roles of a torchrun launch: rank 0 collects every step, the other ranks receive it.

Rank 0 owns the rollout worker and its ``StepCollector`` (staleness, training frontier, planner).
``StepFeed.collect`` sends the step to the other ranks as **the step's samples plus its layout**
(``layout[m][r]`` = indices of the samples in rank ``r``'s row of micro-batch ``m``, in insertion
order). Every rank rebuilds every ``TreeRow`` by inserting those samples in that order, which gives
the trie rank 0 built, so all ranks hold the same ``StepPlan``:

* the trainer reads ``plan.rows_for_rank(rank)``, the step's trained-token count (the loss
  normaliser) and the plan metrics the same way on every rank, with no further collective;
* nothing depends on re-running the planner's placement heuristics elsewhere (only the trie insert,
  which is a pure function of the sample order);
* the payload is the raw samples (about 9 bytes per token, plus 8 bytes x top-N per trained token),
  pickled once on rank 0 and broadcast over gloo, on the CPU, also on GPU runs.

The alternative, scattering each rank only its own rows, moves ``world_size`` times fewer bytes
per rank but leaves the other ranks without the step's totals; at the sizes we run the broadcast is a
small fraction of a step (benchmarks/README.md, "FSDP2 and MFU", step broadcast).

``gather_step_results`` merges the per-rank loss and metric parts after the backward passes, so
the logged loss is the step's, not rank 0's share.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from grpo_core.packing.planner import Planner, StepPlan
from grpo_core.packing.trie import TreeRow
from grpo_core.ranks import active_world_size, broadcast_object
from grpo_core.rollout.types import GroupReport, RolloutSample
from grpo_core.training.collector import StepBatch, StepCollector, WeightVersions
from grpo_core.training.loss import reduce_metric_parts


# ------------------------------------------------------------------------------------------ step feed
@dataclass
class StepMessage:
    """What a rank needs of one step, besides the model: samples, row layout, and the log-only fields."""

    samples: list[RolloutSample]
    layout: list[list[list[int]]]  # [micro-batch][rank] -> indices into ``samples``
    reports: list[GroupReport]
    stale_dropped: int
    stale_dropped_total: int
    staleness: list[int]
    wait_s: float
    end_of_data: bool
    dropped_too_long: int
    stale_dropped_tokens: int = 0
    late_kept: int = 0


def step_message(batch: StepBatch, stale_dropped_total: int) -> StepMessage:
    index = {id(s): i for i, s in enumerate(batch.samples)}
    layout = [[[index[id(s)] for s in row.samples] for row in mb] for mb in batch.plan.microbatches]
    return StepMessage(
        samples=batch.samples, layout=layout, reports=batch.reports, stale_dropped=batch.stale_dropped,
        stale_dropped_total=stale_dropped_total, staleness=batch.staleness, wait_s=batch.wait_s,
        end_of_data=batch.end_of_data, dropped_too_long=batch.plan.dropped_too_long,
        stale_dropped_tokens=batch.stale_dropped_tokens, late_kept=batch.late_kept,
    )


def rebuild_batch(msg: StepMessage, planner: Planner) -> StepBatch:
    """The ``StepBatch`` rank 0 collected, rebuilt from its message (tries inserted in the same order)."""
    microbatches = []
    for mb in msg.layout:
        rows = []
        for indices in mb:
            row = TreeRow(flat=planner.flat)
            for i in indices:
                row.add(msg.samples[i])
            rows.append(row)
        microbatches.append(rows)
    plan = StepPlan(
        microbatches=microbatches, token_budget=planner.token_budget, world_size=planner.world_size,
        gradient_accumulation_steps=planner.gradient_accumulation_steps,
        dropped_too_long=msg.dropped_too_long,
    )
    return StepBatch(
        plan=plan, samples=msg.samples, reports=msg.reports, stale_dropped=msg.stale_dropped,
        staleness=msg.staleness, wait_s=msg.wait_s, end_of_data=msg.end_of_data,
        stale_dropped_tokens=msg.stale_dropped_tokens, late_kept=msg.late_kept,
    )


class StepFeed:
    """``StepCollector``'s interface on every rank: rank 0 collects and broadcasts, the others receive.

    With one rank it is the collector itself, with no copy.
    """

    def __init__(self, collector: StepCollector, rank: int, world_size: int):
        self.collector = collector
        self.rank = rank
        self.world_size = world_size
        self._stale_dropped_total = 0

    @property
    def stale_dropped_total(self) -> int:
        return self.collector.stale_dropped_total if self.rank == 0 else self._stale_dropped_total

    def collect(self, versions: WeightVersions) -> StepBatch | str | None:
        if self.world_size == 1:
            return self.collector.collect(versions)
        if self.rank == 0:
            batch = self.collector.collect(versions)
            # None: the data has ended, every rank stops; a str (COLLECTION_INTERRUPTED): every rank
            # goes back to the top of its loop.
            msg = batch if batch is None or isinstance(batch, str) else step_message(batch, self.collector.stale_dropped_total)
            broadcast_object(msg)
            return batch
        msg = broadcast_object(None)
        if msg is None or isinstance(msg, str):
            return msg
        self._stale_dropped_total = msg.stale_dropped_total
        return rebuild_batch(msg, self.collector.planner)

    def mark_trained(self, batch: StepBatch) -> None:
        if self.rank == 0:  # the training frontier is rank 0's (it owns the worker and the data order)
            self.collector.mark_trained(batch)


# ------------------------------------------------------------------------------------------ step results
def gather_step_results(
    parts: list[dict[str, torch.Tensor]], loss: float, fwd_bwd_s: float
) -> tuple[list[dict[str, torch.Tensor]], float, float]:
    """Every rank's metric parts, the step's loss (sum over ranks) and the slowest rank's fwd+bwd time.

    Unchanged with one rank. With several, one object all-gather over gloo (the parts are a few
    scalars), so ``finalize_metrics`` on the result describes the whole step on every rank.
    """
    if active_world_size() == 1:
        return parts, loss, fwd_bwd_s
    local = {k: v.detach().cpu() for k, v in reduce_metric_parts(parts).items()}
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (local, loss, fwd_bwd_s))
    merged = [p for p, _, _ in gathered if p]
    return merged, float(sum(l for _, l, _ in gathered)), float(max(t for _, _, t in gathered))

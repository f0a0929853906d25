"""The ``batch/*`` metrics of one step, read off its plan before anything is forwarded.

``*_per_step`` values are sums over the whole step (all micro-batches, all ranks); ``batch/row_*`` and
``batch/samples_per_row`` are means over the step's row slots (micro-batches x world size), so that
``samples_per_step == row slots x samples_per_row`` holds exactly.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from grpo_core.packing.planner import StepPlan


def plan_metrics(plan: StepPlan) -> dict[str, float]:
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

"""One optimizer step over a collected STEP: every ROW of this rank through forward, loss and backward, then
clip, step and schedule; the loss and metrics gathered over all ranks."""

from __future__ import annotations

import time
from typing import Any

import torch

from grpo_core.models.fsdp import before_micro_batch, full_value
from grpo_core.models.moe.policy import finalize_moe_metrics
from grpo_core.packing.collator import pack_row
from grpo_core.training.collector import StepBatch
from grpo_core.training.distributed import gather_step_results
from grpo_core.training.loss import finalize_metrics, reduce_metric_parts
from grpo_core.training.micro_batch import MicroBatch
from grpo_core.training.perf import synchronize


def optimizer_step(batch: StepBatch, rank: int, device: torch.device, micro_batch: MicroBatch, model: Any,
                   optimizer: torch.optim.Optimizer, lr_scheduler: Any, grad_scaler: Any,
                   max_grad_norm: float, keep_weights: bool = False) -> dict[str, float]:
    """Train ``batch``'s rows for ``rank`` and step; the step's ``loss``, ``grad_norm``, ``learning_rate``,
    ``perf/fwd_bwd_s`` (the slowest rank's) and the loss's metrics over all ranks. ``keep_weights``: one rank keeps
    the gathered weights between the step's micro-batches (``fsdp.before_micro_batch``)."""
    rows = [pack_row(row) for row in batch.plan.rows_for_rank(rank)]
    num_tokens = max(1, sum(row.num_trained_tokens for row in batch.plan.rows))
    step_positions = sum(row.num_unique_tokens for row in batch.plan.rows)
    parts: list[dict[str, torch.Tensor]] = []
    losses = []
    start = time.perf_counter()
    for i, row in enumerate(rows):
        before_micro_batch(model, last_micro_batch=i == len(rows) - 1, keep_weights=keep_weights)
        loss, part = micro_batch.run(row.to(device), num_tokens, step_positions)
        losses.append(loss)
        parts.append(part)
    synchronize(device)  # kernels still queued belong to the forward/backward time
    fwd_bwd_s = time.perf_counter() - start
    if grad_scaler is not None:
        grad_scaler.unscale_(optimizer)
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm if max_grad_norm > 0 else float("inf"))
    if grad_scaler is not None:
        grad_scaler.step(optimizer)
        grad_scaler.update()
    else:
        optimizer.step()
    lr_scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    # The step's loss and metrics over all ranks, and the slowest rank's time.
    parts, loss_sum, fwd_bwd_s = gather_step_results(parts, float(sum(losses)), fwd_bwd_s)
    metrics = finalize_metrics(parts)
    metrics.update(finalize_moe_metrics({k: v.item() for k, v in reduce_metric_parts(parts).items()}))
    metrics.update({"loss": loss_sum, "grad_norm": float(full_value(grad_norm)),
                    "learning_rate": lr_scheduler.get_last_lr()[0], "perf/fwd_bwd_s": fwd_bwd_s})
    return metrics

"""One micro-batch of the trainer: a packed row forward, the GRPO loss (and a mixture-of-experts policy's part), backward.

``MicroBatch.run(row, num_tokens, step_positions)`` is what the trainer's step calls for each of its rank's
rows: the row's log-probs through ``grpo_core.training.forward.row_logprobs`` (with the server's candidate
sets where it returns them), ``grpo_core.training.loss.grpo_loss`` over the step's trained tokens, and
backward (scaled for fp16). For a mixture-of-experts policy (``moe``) the row's sampler routes go into the
routers before the forward and stay there through backward (activation checkpointing recomputes the
layers), the routing-mismatch parts join the loss's metric parts, and the balancing-loss term, when on,
joins the loss (``grpo_core.models.moe.policy``). Each token's sample and that sample's staleness go to the loss
for the sequence-level corrections and the per-staleness mismatch metrics (``grpo_core.training.mismatch``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from grpo_core.models.head.reference import candidate_mask_from_ids
from grpo_core.models.moe.policy import MoEPolicy
from grpo_core.packing.collator import PackedRow
from grpo_core.training.forward import row_logprobs
from grpo_core.training.loss import LossConfig, LossInputs, grpo_loss


@dataclass
class MicroBatch:
    model: torch.nn.Module
    args: Any
    """The run's ``AsyncGRPOConfig``."""
    loss_config: LossConfig
    vocab_size: int
    moe: MoEPolicy | None = None
    grad_scaler: torch.amp.GradScaler | None = None
    candidate_sets: bool = False
    """The server returns each token's top-k/top-p candidate set (``ServerCapabilities.candidate_sets``)."""

    def run(self, row: PackedRow, num_tokens: int, step_positions: int) -> tuple[float, dict[str, torch.Tensor]]:
        """Forward and backward of ``row`` (on the model's device); its loss and metric parts.

        ``num_tokens``: trained tokens of the whole step (the loss's normaliser); ``step_positions``: its
        forwarded positions (the balancing loss's row weights)."""
        if self.moe is None:
            return self._loss_backward(row, num_tokens, step_positions)
        self.moe.before_forward(row.routes)
        try:
            return self._loss_backward(row, num_tokens, step_positions)
        finally:
            self.moe.after_backward()

    def _loss_backward(self, row: PackedRow, num_tokens: int, step_positions: int) -> tuple[float, dict[str, torch.Tensor]]:
        top_ids = None
        if self.loss_config.score_centering and row.sampler_top_ids is not None:
            top_ids = row.sampler_top_ids.clamp(min=0)
        head = row_logprobs(
            self.model, row, self.args.temperature, top_ids=top_ids, candidate_masks=self._candidate_masks(row),
            chunk_size=self.args.resolved_logprob_chunk_size(row.num_trained, self.vocab_size),
        )
        moe_loss, moe_parts = None, {}
        if self.moe is not None:
            moe_loss, moe_parts = self.moe.after_forward(row.routes, row.logit_index, row.route_conflicts,
                                                         row.num_tokens, step_positions)
        if row.num_trained == 0:
            # Every rank runs forward and backward so that sharded collectives stay in step.
            (head.anchor if moe_loss is None else head.anchor + moe_loss).backward()
            return 0.0, moe_parts
        inputs = LossInputs(
            logprobs=head.logprobs,
            sampler_logprobs=row.sampler_logprobs,
            advantages=row.advantages,
            top_logprobs=head.top_logprobs,
            sampler_top_logprobs=row.sampler_top_logprobs if top_ids is not None else None,
            top_valid=row.top_valid if top_ids is not None else None,
            sample_index=row.sample_index,
            sample_staleness=row.sample_staleness,
            **self._route_flags(),
        )
        loss, part = grpo_loss(inputs, self.loss_config, num_tokens)
        if moe_loss is not None:
            loss = loss + moe_loss
        (self.grad_scaler.scale(loss) if self.grad_scaler is not None else loss).backward()
        return float(loss.detach()), {**part, **moe_parts}

    def _route_flags(self) -> dict[str, torch.Tensor]:
        """The row's per-token routing comparison, where the MoE policy made one (the mismatch metrics)."""
        if self.moe is None or self.moe.token_routes is None:
            return {}
        differs, known = self.moe.token_routes
        return {"route_differs": differs, "route_known": known}

    def _candidate_masks(self, row: PackedRow) -> torch.Tensor | None:
        if not self.candidate_sets or row.sampling_mask_ids is None:
            return None
        offsets = row.sampling_mask_offsets.tolist()
        ids = [row.sampling_mask_ids[offsets[t] : offsets[t + 1]] for t in range(row.num_trained)]
        return candidate_mask_from_ids(ids, self.vocab_size, device=row.target_ids.device)

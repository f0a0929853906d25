"""The forward half of the trainer's micro-batch: a packed row through the policy to its trained tokens' log-probs.

``row_logprobs(model, row, temperature, ..., chunk_size=None)`` (``benchmarks/trainer/fsdp_mfu.py`` calls it too,
so its figures are the trainer's):

* ``chunk_size=None``: ``model(..., logits_to_keep=row.logit_index)`` gives ``[T, V]`` logits at the
  positions that predict trained tokens, and ``fused_token_logprobs`` their log-probs;
* ``chunk_size=c``: for the length of that one forward, the LM head is handed no positions, and
  ``fused_head_logprobs`` projects and reduces the hidden states it was given ``c`` tokens at a time
  (recomputed in backward), so no ``[T, V]`` tensor exists (``grpo_core.models.head.lm_head``). The model
  returns the ``[1, T, 1 + N]`` log-probs (sampled token, then the top-N ids) in place of its logits.

Both are ``grpo_core.models.head.fused``'s: the reference functions (``models.head.reference``:
``token_logprobs``, ``head_token_logprobs``) with the backward written out and compiled, on CUDA; elsewhere,
and with ``fused=False``, the reference functions run (``fused.fused_by_default``; the benchmarks time
both). Which ``chunk_size`` a row gets is ``AsyncGRPOConfig.resolved_logprob_chunk_size``.

A push's log-prob check runs the unchunked forward with the reference head on a probe sequence
(``fleet.probe.probe_logprobs``): a change to that path here changes what the check compares with.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from grpo_core.models.head.fused import fused_by_default, fused_head_logprobs, fused_token_logprobs
from grpo_core.models.head.lm_head import head_computes_logprobs, output_head
from grpo_core.models.head.reference import head_token_logprobs, token_logprobs
from grpo_core.packing.collator import PackedRow


@dataclass
class RowLogprobs:
    """Log-probs of one row's trained tokens (views of the model's output)."""

    logprobs: Tensor
    """[T] log-probs of the sampled tokens (``token_logprobs``)."""
    top_logprobs: Tensor | None
    """[T, N] log-probs of the sampler's top-N ids, or None."""
    anchor: Tensor | None
    """For a row that trains nothing: an exact 0 computed from the model's output, to backpropagate so that
    every rank's backward runs the same collectives; None otherwise."""


def row_logprobs(
    model: torch.nn.Module,
    row: PackedRow,
    temperature: float,
    *,
    top_ids: Tensor | None = None,
    candidate_masks: Tensor | None = None,
    chunk_size: int | None = None,
    fused: bool | None = None,
) -> RowLogprobs:
    """Forward ``row`` through ``model`` and return its trained tokens' log-probs (module docstring);
    ``fused``: None for ``fused_by_default`` of the row's device."""
    if fused is None:
        fused = fused_by_default(row.input_ids.device)
    hidden_logprobs = fused_head_logprobs if fused else head_token_logprobs
    if chunk_size is None:
        logits = model(**row.model_inputs(), logits_to_keep=row.logit_index).logits[0]
        if fused:  # the logits are this function's own: their gradient may take their place
            logprobs, top = fused_token_logprobs(logits, row.target_ids, temperature, top_ids=top_ids,
                                                 candidate_masks=candidate_masks, overwrite_logits=True)
        else:
            logprobs, top = token_logprobs(logits, row.target_ids, temperature, top_ids=top_ids,
                                           candidate_masks=candidate_masks)
        # A row without trained tokens has [0, V] logits: their sum ties backward to the model for free.
        return RowLogprobs(logprobs, top, logits.sum() if row.num_trained == 0 else None)

    def logprobs_of(hidden: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        lp, top = hidden_logprobs(hidden[0], weight, row.target_ids, temperature, top_ids, candidate_masks,
                                  chunk_size=chunk_size, head_bias=bias)
        return torch.cat([lp[:, None], top], 1)[None] if top is not None else lp[None, :, None]

    with head_computes_logprobs(output_head(model), logprobs_of) as made:
        outputs = model(**row.model_inputs(), logits_to_keep=row.logit_index)
    if len(made) != 1 or outputs.logits is not made[0]:
        raise ValueError(f"AsyncGRPOConfig.logprob_chunk_size: {type(model).__name__} changes its head's output before "
                         "returning it as logits, which the chunked head cannot follow: set logprob_chunk_size=None")
    out = outputs.logits[0]
    return RowLogprobs(out[:, 0], out[:, 1:] if top_ids is not None else None, None)

"""The policy's log-probs of a packed row's trained tokens: through the model's LM head, or in chunks.

``row_logprobs(model, row, temperature, ..., chunk_size=None)`` is the forward half of the trainer's
micro-batch (``benchmarks/fsdp_mfu.py`` calls it too, so its figures are the trainer's):

* ``chunk_size=None``: ``model(..., logits_to_keep=row.logit_index)`` gives ``[T, V]`` logits at the
  positions that predict trained tokens, and ``fused_token_logprobs`` their log-probs;
* ``chunk_size=c``: for the length of that one forward, the LM head is handed no positions, and
  ``fused_head_logprobs`` projects and reduces the hidden states it was given ``c`` tokens at a time
  (recomputed in backward), so no ``[T, V]`` tensor exists. The model returns the ``[1, T, 1 + N]``
  log-probs (sampled token, then the top-N ids) in place of its logits.

Both are ``grpo_core.models.fused_logprobs``'s: the reference functions of ``grpo_core.loss``
(``token_logprobs``, ``head_token_logprobs``) with the backward written out and compiled, on CUDA; elsewhere,
and with ``fused=False``, the reference functions run (``fused_logprobs.fused_by_default``; the benchmarks
time both).

Why inside the forward, through hooks on the head: under FSDP2 the head's weight is gathered only
while the root unit (embeddings, final norm, head) runs, and is freed after it; its backward gathers
it again when the gradient reaches the root unit's output. Computed there and returned as that
output, the chunks use the gathered weight in forward and find it gathered again when backward
recomputes them. Which ``chunk_size`` a row gets is ``AsyncGRPOConfig.resolved_logprob_chunk_size``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import Tensor

from grpo_core.loss import head_token_logprobs, token_logprobs
from grpo_core.models.fused_logprobs import fused_by_default, fused_head_logprobs, fused_token_logprobs
from grpo_core.packing.collator import PackedRow

LOGIT_RESCALING = ("final_logit_softcapping", "logit_scale", "logits_scaling")
"""Config fields of models whose forward changes the logits after the head (Gemma 2/3, Cohere, Granite):
the chunked head projects hidden states itself and would miss that step."""


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


def output_head(model: torch.nn.Module) -> torch.nn.Linear:
    """The model's LM head; refused for ``logprob_chunk_size`` where the model is not head-then-logits."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    name = type(model).__name__
    if not isinstance(head, torch.nn.Linear):
        raise ValueError(f"AsyncGRPOConfig.logprob_chunk_size needs a linear LM head; {name}'s output embeddings are "
                         f"{type(head).__name__}: set logprob_chunk_size=None")
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    rescaled = [f for f in LOGIT_RESCALING if getattr(text, f, None) not in (None, 1, 1.0)]
    if rescaled:
        raise ValueError(f"AsyncGRPOConfig.logprob_chunk_size: {name} rescales its logits after the head "
                         f"(config.{rescaled[0]}), which the chunked head does not: set logprob_chunk_size=None")
    return head


def vocab_size(model: torch.nn.Module) -> int:
    """Width of the model's logits: its head's outputs (the config's vocab_size can differ), else the config's."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if isinstance(head, torch.nn.Linear):
        return int(head.out_features)
    config = model.config
    return int((config.get_text_config() if hasattr(config, "get_text_config") else config).vocab_size)


@contextmanager
def _head_computes_logprobs(head: torch.nn.Linear, logprobs_of: Callable[[Tensor, Tensor, Tensor | None], Tensor]
                            ) -> Iterator[list[Tensor]]:
    """While open, the head's output is ``logprobs_of(hidden, weight, bias)`` of the hidden states it is
    handed (it projects none itself); the outputs made are listed in the yielded list."""
    made: list[Tensor] = []
    handed: list[Tensor] = []

    def take_hidden(module: torch.nn.Module, args: tuple) -> tuple:
        handed.append(args[0])
        return (args[0][..., :0, :], *args[1:])

    def give_logprobs(module: torch.nn.Module, args: tuple, output: Tensor) -> Tensor:
        made.append(logprobs_of(handed.pop(), module.weight, module.bias))
        return made[-1]

    handles = [head.register_forward_pre_hook(take_hidden), head.register_forward_hook(give_logprobs)]
    try:
        yield made
    finally:
        for handle in handles:
            handle.remove()


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

    with _head_computes_logprobs(output_head(model), logprobs_of) as made:
        outputs = model(**row.model_inputs(), logits_to_keep=row.logit_index)
    if len(made) != 1 or outputs.logits is not made[0]:
        raise ValueError(f"AsyncGRPOConfig.logprob_chunk_size: {type(model).__name__} changes its head's output before "
                         "returning it as logits, which the chunked head cannot follow: set logprob_chunk_size=None")
    out = outputs.logits[0]
    return RowLogprobs(out[:, 0], out[:, 1:] if top_ids is not None else None, None)

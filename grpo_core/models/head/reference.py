"""The policy's log-probs of the sampled tokens, as plain tensor code: the reference of the fused head.

``token_logprobs`` turns the policy's logits into log-probs of the sampled tokens (and of the sampler's
top-N ids), with the same temperature and the same top-k/top-p candidate set the sampler used
(``candidate_mask_from_ids``), so that the loss's ratio against the sampler compares like with like;
``head_token_logprobs`` does the same from the final hidden states and the LM head, a chunk of tokens
at a time, for rows whose ``[T, V]`` logits would not fit. ``fused.py`` computes the same with the
backward written out; its tests compare against these. Pure functions: no model, no process group.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint


def candidate_mask_from_ids(
    ids_per_row: list[Tensor], vocab_size: int, device: torch.device | str | None = None
) -> Tensor:
    """[T, V] bool mask, True where a token id is in that row's top-k/top-p candidate set.

    ``ids_per_row[t]`` is the 1-D tensor of ids that survived the sampler's filters at position t.
    """
    if device is None:
        device = ids_per_row[0].device if ids_per_row else "cpu"
    mask = torch.zeros(len(ids_per_row), vocab_size, dtype=torch.bool, device=device)
    if not ids_per_row:
        return mask
    cols = torch.cat([ids.reshape(-1).to(device=device, dtype=torch.long) for ids in ids_per_row])
    lengths = torch.tensor([ids.numel() for ids in ids_per_row], device=device)
    rows = torch.repeat_interleave(torch.arange(len(ids_per_row), device=device), lengths)
    mask[rows, cols] = True
    return mask


def _token_logprobs_dense(
    logits: Tensor,
    target_ids: Tensor,
    temperature: float,
    top_ids: Tensor | None,
    candidate_masks: Tensor | None,
) -> tuple[Tensor, Tensor | None]:
    # At least fp32 for the normaliser: a bf16 logsumexp over 10^5 entries is off by more than
    # the policy drift the ratio is meant to measure. fp64 stays fp64 (exact tests).
    scaled = logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature
    if candidate_masks is not None:
        # masked_fill's backward zeroes the gradient of filled entries, so an id outside the set
        # yields a -inf log-prob with a finite (zero) gradient, never NaN.
        scaled = scaled.masked_fill(~candidate_masks, float("-inf"))
    log_z = torch.logsumexp(scaled, dim=-1)
    target = scaled.gather(-1, target_ids.long().unsqueeze(-1)).squeeze(-1) - log_z
    top = None if top_ids is None else scaled.gather(-1, top_ids.long()) - log_z.unsqueeze(-1)
    return target, top


def token_logprobs(
    logits: Tensor,
    target_ids: Tensor,
    temperature: float,
    top_ids: Tensor | None = None,
    candidate_masks: Tensor | None = None,
    *,
    chunk_size: int | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Log-probs of the sampled tokens [T] and of the sampler's top-N ids [T, N].

    Args:
        logits: [T, V] the policy's logits at the positions that predict the trained tokens.
        target_ids: [T] the sampled token ids.
        temperature: the sampler's temperature; logits are divided by it, as vLLM does before
            filtering and before reporting processed log-probs.
        top_ids: [T, N] the sampler's top-N ids, or None.
        candidate_masks: [T, V] bool, the top-k/top-p set each token was drawn from. The softmax
            is renormalised over it (outside ids get -inf); None normalises over the whole
            vocabulary. The sampled token is always inside its own set.
        chunk_size: rows per chunk. T x V floats are large (32k tokens x 152k vocab is 19 GB in
            fp32, and the softmax needs a few such buffers), so with a chunk size each chunk's
            intermediates are recomputed in backward instead of kept: peak memory becomes about
            chunk_size x V x 4 bytes x a few, on top of the logits themselves.

    Returns:
        ``(logprobs [T], top_logprobs [T, N] or None)``, fp32 (fp64 for fp64 logits). Ids
        outside the candidate set get -inf with a zero gradient; ``grpo_loss`` leaves them out of
        centering.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if candidate_masks is not None and candidate_masks.dtype != torch.bool:
        raise TypeError(f"candidate_masks must be bool, got {candidate_masks.dtype}")
    t = logits.shape[0]
    if chunk_size is None or t <= chunk_size:
        return _token_logprobs_dense(logits, target_ids, temperature, top_ids, candidate_masks)
    recompute = torch.is_grad_enabled() and logits.requires_grad
    targets: list[Tensor] = []
    tops: list[Tensor] = []
    for start in range(0, t, chunk_size):
        rows = slice(start, start + chunk_size)
        args = (
            logits[rows],
            target_ids[rows],
            temperature,
            None if top_ids is None else top_ids[rows],
            None if candidate_masks is None else candidate_masks[rows],
        )
        if recompute:
            target, top = checkpoint(_token_logprobs_dense, *args, use_reentrant=False)
        else:
            target, top = _token_logprobs_dense(*args)
        targets.append(target)
        if top is not None:
            tops.append(top)
    return torch.cat(targets), (torch.cat(tops) if top_ids is not None else None)


def head_token_logprobs(
    hidden: Tensor,
    head_weight: Tensor,
    target_ids: Tensor,
    temperature: float,
    top_ids: Tensor | None = None,
    candidate_masks: Tensor | None = None,
    *,
    chunk_size: int,
    head_bias: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """``token_logprobs(hidden @ head_weight.T + head_bias, ...)`` without the [T, V] logits.

    Args:
        hidden: [T, d] the final hidden states at the positions that predict the trained tokens.
        head_weight: [V, d] the LM head (``head_bias``: [V] or None).
        chunk_size: rows per chunk. Each chunk's logits and log-softmax are computed, reduced to
            its [rows] and [rows, N] log-probs, and dropped; backward recomputes them, so the
            head's matmul runs once more and peak memory holds one chunk's [chunk, V], not [T, V].
        The rest: as in ``token_logprobs``.

    Each row's arithmetic is the dense head's; only the weight gradient's sum over rows is split
    into one partial sum per chunk.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    t = hidden.shape[0]

    def chunk_logprobs(h: Tensor, w: Tensor, b: Tensor | None, targets: Tensor, tops: Tensor | None,
                       masks: Tensor | None) -> tuple[Tensor, Tensor | None]:
        return _token_logprobs_dense(torch.nn.functional.linear(h, w, b), targets, temperature, tops, masks)

    recompute = torch.is_grad_enabled() and (hidden.requires_grad or head_weight.requires_grad)
    targets: list[Tensor] = []
    tops: list[Tensor] = []
    for start in range(0, t, chunk_size):
        rows = slice(start, start + chunk_size)
        args = (
            hidden[rows],
            head_weight,
            head_bias,
            target_ids[rows],
            None if top_ids is None else top_ids[rows],
            None if candidate_masks is None else candidate_masks[rows],
        )
        target, top = checkpoint(chunk_logprobs, *args, use_reentrant=False) if recompute else chunk_logprobs(*args)
        targets.append(target)
        if top is not None:
            tops.append(top)
    if not targets:  # no trained token: empty log-probs of the dense head's shapes and dtypes
        return _token_logprobs_dense(hidden.new_zeros(0, head_weight.shape[0]), target_ids, temperature, top_ids,
                                     candidate_masks)
    return torch.cat(targets), (torch.cat(tops) if top_ids is not None else None)

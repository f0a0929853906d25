"""Log-probs of trained tokens with a hand-written backward: the trainer's log-prob head, fused.

``grpo_core.models.head.reference.token_logprobs`` and ``head_token_logprobs`` are the reference: plain tensor code whose
backward autograd derives. Autograd keeps an fp32 copy of the ``[T, V]`` logits for the normaliser's
backward and runs about ten passes over ``[T, V]`` fp32 tensors per row (casts, the division by the
temperature, ``logsumexp`` forward and backward, two gathers' backward into zero tensors, casts back).
At a 152k vocabulary that is the slowest part of a GPU step per FLOP: the head is a few percent of a flat
row's FLOPs but about a tenth of a tree row's, which shares its prompts' layers but not its trained tokens.

Here the backward is written out. For ``z = logits / T`` (ids outside a candidate set at ``-inf``), the
log-prob of id ``j`` is ``z_j − lse(z)``, and a loss with upstream gradients ``g`` (sampled token) and
``g_n`` (the sampler's top ids) has

    ∂L/∂logits = (scatter(g, sampled) + scatter_add(g_n, top ids) − (g + Σ_n g_n) · softmax(z)) / T

zeroed outside the candidate set (the reference's ``masked_fill`` backward does the same). Forward keeps
only the per-token ``lse`` (fp32) besides its inputs; backward rebuilds ``softmax(z) = exp(z − lse)``
from them. Two entry points:

* ``fused_token_logprobs(logits, ...)``: from the model's logits (the dense head). Saves the logits in
  their own dtype (bf16: half the reference's saved fp32 copy).
* ``fused_head_logprobs(hidden, weight, ...)``: from hidden states and the LM head, ``chunk_size`` tokens
  at a time; no ``[T, V]`` tensor exists, and backward recomputes each chunk's logits (one more head
  matmul, as the reference's checkpointed chunks do) and adds the chunks' weight gradients.

The per-chunk arithmetic (``chunk_stats``, ``chunk_grad``) is plain tensor code; on CUDA the statistics' log-normaliser
is a Triton kernel (``stats_triton``), one read of the chunk's logits, and the gradient is ``chunk_grad`` as a
Triton kernel (``grad_triton``), one read and one write. Rounding follows the reference: the normaliser and the gradient in fp32 (fp64 stays fp64), the
gradient rounded once to the logits' dtype.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import once_differentiable

from grpo_core.models.head import grad_triton, stats_triton


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    # At least fp32 for the normaliser (see reference._token_logprobs_dense); fp64 stays fp64.
    return torch.promote_types(dtype, torch.float32)


def chunk_stats(logits: Tensor, target_ids: Tensor, temperature: float, top_ids: Tensor | None,
                candidate_masks: Tensor | None) -> tuple[Tensor, Tensor, Tensor | None]:
    """``(lse [c], sampled log-probs [c], top log-probs [c, N] or None)`` of one chunk's ``[c, V]`` logits."""
    scaled = logits.to(_compute_dtype(logits.dtype)) / temperature
    if candidate_masks is not None:
        scaled = scaled.masked_fill(~candidate_masks, float("-inf"))
    lse = torch.logsumexp(scaled, dim=-1)
    target = scaled.gather(-1, target_ids.long().unsqueeze(-1)).squeeze(-1) - lse
    top = None if top_ids is None else scaled.gather(-1, top_ids.long()) - lse.unsqueeze(-1)
    return lse, target, top


def chunk_grad(logits: Tensor, lse: Tensor, target_ids: Tensor, grad_target: Tensor, top_ids: Tensor | None,
               grad_top: Tensor | None, candidate_masks: Tensor | None, temperature: float) -> Tensor:
    """``∂L/∂logits`` of one chunk (module docstring), in the logits' dtype.

    The one-hot terms are comparisons with the column index rather than scatters: a scatter into the
    ``[c, V]`` gradient would make the compiler keep it in fp32 between two kernels; compared, the whole
    gradient is one elementwise pass (``N + 1`` comparisons per entry for ``N`` top ids)."""
    scaled = logits.to(_compute_dtype(logits.dtype)) / temperature
    if candidate_masks is not None:
        scaled = scaled.masked_fill(~candidate_masks, float("-inf"))
    upstream = grad_target.to(scaled.dtype).unsqueeze(-1)  # [c, 1]
    column = torch.arange(logits.shape[-1], device=logits.device)
    onehot = torch.where(column == target_ids.long().unsqueeze(-1), upstream, 0.0)
    total = upstream
    if top_ids is not None:
        tops = grad_top.to(scaled.dtype)
        total = total + tops.sum(-1, keepdim=True)
        for n in range(top_ids.shape[-1]):
            onehot = onehot + torch.where(column == top_ids[:, n : n + 1].long(), tops[:, n : n + 1], 0.0)
    grad = onehot - torch.exp(scaled - lse.unsqueeze(-1)) * total
    if candidate_masks is not None:
        grad = grad.masked_fill(~candidate_masks, 0.0)
    return (grad / temperature).to(logits.dtype)


def fused_by_default(device: torch.device) -> bool:
    """Whether the trainer's head takes this module's functions on ``device``: where they are compiled (CUDA,
    with Triton for ``torch.compile`` to generate kernels with).

    Uncompiled, the written-out backward is slower than autograd's (benchmarks/README.md, "The log-prob head's
    share of the remaining gap"; ``benchmarks/models/logprob_head.py``): its comparisons with the column index cost a
    pass each."""
    if device.type != "cuda":
        return False
    from torch.utils._triton import has_triton  # private, but the check torch.compile itself makes

    return has_triton()


_compiled: dict[str, Callable] = {}


def chunk_grad_into_logits(logits: Tensor, lse: Tensor, target_ids: Tensor, grad_target: Tensor,
                           top_ids: Tensor | None, grad_top: Tensor | None, candidate_masks: Tensor | None,
                           temperature: float) -> None:
    """``chunk_grad`` written over the chunk's logits (compiled: one read and one write of each entry, and no
    second ``[c, V]`` buffer)."""
    logits.copy_(chunk_grad(logits, lse, target_ids, grad_target, top_ids, grad_top, candidate_masks, temperature))


def _kernels(device: torch.device) -> tuple[Callable, Callable, Callable]:
    """``chunk_stats``, ``chunk_grad`` and ``chunk_grad_into_logits`` as they run on ``device``: on CUDA the
    statistics with the log-normaliser by the Triton kernel of ``stats_triton`` and the gradient by that of
    ``grad_triton`` (each compiled from its PyTorch form where its kernel does not take the logits: fp64), as
    written elsewhere."""
    if device.type != "cuda":
        return chunk_stats, chunk_grad, chunk_grad_into_logits
    if not _compiled:
        _compiled["stats"] = torch.compile(chunk_stats, dynamic=True)
        _compiled["grad"] = torch.compile(chunk_grad, dynamic=True)
        _compiled["grad_into"] = torch.compile(chunk_grad_into_logits, dynamic=True)

    def stats(logits: Tensor, *args) -> tuple[Tensor, Tensor, Tensor | None]:
        if grad_triton.available(logits):  # the statistics' kernel takes the same logits
            return stats_triton.triton_chunk_stats(logits, *args)
        return _compiled["stats"](logits, *args)

    def grad(logits: Tensor, *args) -> Tensor:
        if grad_triton.available(logits):
            return grad_triton.triton_chunk_grad(torch.empty_like(logits), logits, *args)
        return _compiled["grad"](logits, *args)

    def grad_into(logits: Tensor, *args) -> None:
        if grad_triton.available(logits):
            grad_triton.triton_chunk_grad(logits, logits, *args)
        else:
            _compiled["grad_into"](logits, *args)

    return stats, grad, grad_into


def _check(temperature: float, candidate_masks: Tensor | None, chunk_size: int | None) -> None:
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if candidate_masks is not None and candidate_masks.dtype != torch.bool:
        raise TypeError(f"candidate_masks must be bool, got {candidate_masks.dtype}")
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")


def _chunks(t: int, chunk_size: int | None) -> list[slice]:
    step = max(1, t if chunk_size is None else chunk_size)
    return [slice(start, start + step) for start in range(0, t, step)]


def _outputs(t: int, top_ids: Tensor | None, dtype: torch.dtype, device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
    lse = torch.empty(t, dtype=dtype, device=device)
    target = torch.empty(t, dtype=dtype, device=device)
    top = torch.empty(t, 0 if top_ids is None else top_ids.shape[1], dtype=dtype, device=device)
    return lse, target, top


def _pick(x: Tensor | None, rows: slice) -> Tensor | None:
    return None if x is None else x[rows]


class _LogitsToLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: Tensor, target_ids: Tensor, top_ids: Tensor | None, candidate_masks: Tensor | None,
                temperature: float, chunk_size: int | None, overwrite_logits: bool) -> tuple[Tensor, Tensor]:
        stats, _, _ = _kernels(logits.device)
        lse, target, top = _outputs(logits.shape[0], top_ids, _compute_dtype(logits.dtype), logits.device)
        for rows in _chunks(logits.shape[0], chunk_size):
            lse[rows], target[rows], chunk_top = stats(logits[rows], target_ids[rows], temperature,
                                                       _pick(top_ids, rows), _pick(candidate_masks, rows))
            if chunk_top is not None:
                top[rows] = chunk_top
        ctx.save_for_backward(logits, lse, target_ids, top_ids, candidate_masks)
        ctx.temperature, ctx.chunk_size, ctx.overwrite_logits = temperature, chunk_size, overwrite_logits
        return target, top

    @staticmethod
    @once_differentiable  # a second derivative would need the softmax's own backward, not written here
    def backward(ctx, grad_target: Tensor | None, grad_top: Tensor | None):
        logits, lse, target_ids, top_ids, candidate_masks = ctx.saved_tensors
        _, grad_of, grad_into = _kernels(logits.device)
        grad_target, grad_top = _upstream(grad_target, grad_top, lse, top_ids)
        args = lambda rows: (lse[rows], target_ids[rows], grad_target[rows], _pick(top_ids, rows),  # noqa: E731
                             _pick(grad_top, rows), _pick(candidate_masks, rows), ctx.temperature)
        if ctx.overwrite_logits:
            # The logits are read for the last time here: their gradient takes their place, one [T, V] tensor
            # less at the step's peak, which is here (benchmarks/README.md, "The fused head and in-place level
            # calls").
            for rows in _chunks(logits.shape[0], ctx.chunk_size):
                grad_into(logits[rows], *args(rows))
            return logits, None, None, None, None, None, None
        grad = torch.empty_like(logits)
        for rows in _chunks(logits.shape[0], ctx.chunk_size):
            grad[rows] = grad_of(logits[rows], *args(rows))
        return grad, None, None, None, None, None, None


def _upstream(grad_target: Tensor | None, grad_top: Tensor | None, lse: Tensor,
              top_ids: Tensor | None) -> tuple[Tensor, Tensor | None]:
    """Upstream gradients with the ones autograd left out (an unused output) as zeros."""
    if grad_target is None:
        grad_target = torch.zeros_like(lse)
    if top_ids is not None and grad_top is None:
        grad_top = torch.zeros(top_ids.shape, dtype=lse.dtype, device=lse.device)
    return grad_target, (grad_top if top_ids is not None else None)


class _HeadToLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, bias: Tensor | None, target_ids: Tensor,
                top_ids: Tensor | None, candidate_masks: Tensor | None, temperature: float,
                chunk_size: int) -> tuple[Tensor, Tensor]:
        stats, _, _ = _kernels(hidden.device)
        lse, target, top = _outputs(hidden.shape[0], top_ids, _compute_dtype(hidden.dtype), hidden.device)
        for rows in _chunks(hidden.shape[0], chunk_size):
            logits = F.linear(hidden[rows], weight, bias)
            lse[rows], target[rows], chunk_top = stats(logits, target_ids[rows], temperature, _pick(top_ids, rows),
                                                       _pick(candidate_masks, rows))
            if chunk_top is not None:
                top[rows] = chunk_top
            del logits  # one chunk's [c, V] at a time
        ctx.save_for_backward(hidden, weight, bias, lse, target_ids, top_ids, candidate_masks)
        ctx.temperature, ctx.chunk_size = temperature, chunk_size
        return target, top

    @staticmethod
    @once_differentiable  # a second derivative would need the softmax's own backward, not written here
    def backward(ctx, grad_target: Tensor | None, grad_top: Tensor | None):
        hidden, weight, bias, lse, target_ids, top_ids, candidate_masks = ctx.saved_tensors
        _, grad_of, _ = _kernels(hidden.device)
        grad_target, grad_top = _upstream(grad_target, grad_top, lse, top_ids)
        want_hidden, want_weight, want_bias = ctx.needs_input_grad[:3]
        grad_hidden = torch.empty_like(hidden) if want_hidden else None  # every row is written below
        grad_weight = grad_bias = None
        for rows in _chunks(hidden.shape[0], ctx.chunk_size):
            h = hidden[rows]
            grad = grad_of(F.linear(h, weight, bias), lse[rows], target_ids[rows], grad_target[rows],
                           _pick(top_ids, rows), _pick(grad_top, rows), _pick(candidate_masks, rows), ctx.temperature)
            if want_hidden:
                grad_hidden[rows] = grad @ weight
            if want_weight:
                # One rounding per chunk, as autograd's sum of the reference's per-chunk weight gradients.
                grad_weight = grad.T @ h if grad_weight is None else grad_weight.addmm_(grad.T, h)
            if want_bias:
                part = grad.sum(0)
                grad_bias = part if grad_bias is None else grad_bias + part
        if want_weight and grad_weight is None:  # no token: the weight's gradient is zero
            grad_weight = torch.zeros_like(weight)
        if want_bias and grad_bias is None:
            grad_bias = torch.zeros_like(bias)
        return grad_hidden, grad_weight, grad_bias, None, None, None, None, None


def fused_token_logprobs(logits: Tensor, target_ids: Tensor, temperature: float, top_ids: Tensor | None = None,
                         candidate_masks: Tensor | None = None, *, chunk_size: int | None = None,
                         overwrite_logits: bool = False) -> tuple[Tensor, Tensor | None]:
    """``grpo_core.models.head.reference.token_logprobs`` (same arguments and results) with the backward written out.

    ``chunk_size`` bounds the temporaries of the per-chunk arithmetic where it is not compiled (the CPU);
    the saved tensor is the logits themselves either way. ``overwrite_logits``: backward writes the logits'
    gradient over the logits, for a caller that owns them (nothing else reads them after this backward;
    another backward that saved them would fail autograd's in-place check rather than read the gradient)."""
    _check(temperature, candidate_masks, chunk_size)
    target, top = _LogitsToLogprobs.apply(logits, target_ids, top_ids, candidate_masks, temperature, chunk_size,
                                          overwrite_logits)
    return target, (top if top_ids is not None else None)


def fused_head_logprobs(hidden: Tensor, head_weight: Tensor, target_ids: Tensor, temperature: float,
                        top_ids: Tensor | None = None, candidate_masks: Tensor | None = None, *, chunk_size: int,
                        head_bias: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
    """``grpo_core.models.head.reference.head_token_logprobs`` (same arguments and results) with the backward written out."""
    _check(temperature, candidate_masks, chunk_size)
    target, top = _HeadToLogprobs.apply(hidden, head_weight, head_bias, target_ids, top_ids, candidate_masks,
                                        temperature, chunk_size)
    return target, (top if top_ids is not None else None)

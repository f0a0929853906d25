"""A permutation of a tensor's rows whose backward is a gather too.

``x.index_select(0, perm)`` is the forward of a permutation, but its backward is written for any index: a zero
tensor of the input's size and an accumulating scatter into it (atomics, on the GPU). A permutation takes each
row once, so its gradient is the inverse permutation's gather: no zero fill, no accumulation, deterministic.
The delta rule's segment tree (``grpo_core.models.attention.gated_delta``) reorders rows this way; the sorted
experts (``grpo_core.models.moe.experts``) unsort theirs inside their weighted sum over a token's slots.
"""

from __future__ import annotations

import torch


class _PermuteRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, perm: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(inverse)
        return x.index_select(0, perm)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (inverse,) = ctx.saved_tensors
        return grad.index_select(0, inverse), None, None


def permute_rows(x: torch.Tensor, perm: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
    """``x[perm]`` for a permutation ``perm`` of ``x``'s rows, ``inverse`` its inverse (``inverse[perm] = arange``);
    the backward gathers the gradient with ``inverse``."""
    return _PermuteRows.apply(x, perm, inverse)

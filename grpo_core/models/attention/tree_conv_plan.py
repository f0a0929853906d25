"""Index tables of the short convolution over a packed prefix trie: the path context every backend reads
(``conv_context``, ``conv_indices``) and the tables the Triton kernels read (``tree_conv_plan``, ``tree_conv_triton``).

The tree convolution (``short_conv``) reads, for output ``t`` and tap ``j`` of ``K``, the token ``K - 1 - j`` steps
back along ``t``'s path (tap ``K - 1`` is ``t`` itself). Inside a segment that is the row position
``t - (K - 1 - j)``; for a segment's first ``K - 1`` tokens it is a token of an ancestor segment (its path context,
``conv_context``), or nothing above a root. So:

- the forward reads ``taps[t, j]`` (a gather per tap, -1 for zeros);
- the input gradient of token ``s`` sums the output gradients of every token that read it. The readers inside
  ``s``'s own segment are ``succ[s, j] = s + K - 1 - j`` while that is in the segment: at most one per tap, a
  gather again. The readers in other segments (children reading a parent's last tokens: a prompt's last tokens
  are read by every completion that forks from it) are few, ``K (K - 1) / 2`` per segment at most, and are
  summed apart: ``cross_table`` lists, per token read that way, its ``(reader, tap)`` pairs, so the sum is a
  gather and a reduction in a fixed order, never an atomic add (the gradient is the same bit for bit on every
  run).

``taps_conv`` and ``taps_conv_input_grad`` compute the convolution and its input gradient from the tables in
PyTorch: the tests check the tables with them against ``short_conv.tree_causal_conv1d`` and autograd, where no
Triton is installed.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from grpo_core.models.attention.metadata import TreeAttentionMetadata


def conv_context(meta: TreeAttentionMetadata, kernel: int) -> np.ndarray:
    """int64 ``[G, kernel - 1]``: per segment, the path positions just before its own tokens, oldest first
    (-1 above the root): what the short convolution reads before a segment's first token."""
    cu_q, cu_k, kv = meta.host_arrays()
    ctx = kernel - 1
    out = np.full((len(cu_q) - 1, ctx), -1, dtype=np.int64)
    if kv is None or ctx == 0:
        return out
    for g in range(len(cu_q) - 1):
        q = int(cu_q[g + 1] - cu_q[g])
        before = kv[cu_k[g] : cu_k[g + 1]][: int(cu_k[g + 1] - cu_k[g]) - q][-ctx:]
        out[g, ctx - len(before):] = before
    return out


def conv_indices(meta: TreeAttentionMetadata, kernel: int) -> tuple[np.ndarray, np.ndarray]:
    """``(source, keep)`` for ``tree_causal_conv1d``.

    ``source`` (int64): per segment, the ``kernel - 1`` path positions before its own tokens (-1 above
    the root, ``conv_context``) followed by its own positions. ``keep`` (int64 [U]): for each row position,
    the index of its output among the valid convolution outputs over ``source``.
    """
    cu_q = meta.host_arrays()[0]
    context = conv_context(meta, kernel)
    ctx, parts, keep, offset = kernel - 1, [], [], 0
    for g in range(len(cu_q) - 1):
        q = int(cu_q[g + 1] - cu_q[g])
        parts.append(np.concatenate([context[g], np.arange(cu_q[g], cu_q[g + 1])]))
        # Valid output j covers source[j : j + kernel], so own token i (at source ctx + i) is output i.
        keep.append(offset + np.arange(q))
        offset += ctx + q
    return np.concatenate(parts), np.concatenate(keep)


@dataclass(frozen=True)
class TreeConvPlan:
    """The tables of one row for a kernel of ``K`` taps (module docstring). Tensors on one device."""

    taps: torch.Tensor
    """int32 ``[U, K]``: the row position tap ``j`` of output ``t`` reads, -1 for zeros above a root."""
    succ: torch.Tensor
    """int32 ``[U, K]``: the output in the same segment whose tap ``j`` reads position ``s``, -1 where none."""
    cross_reader: torch.Tensor
    """int64 ``[P]``: outputs whose tap reads a token of another segment (an ancestor)."""
    cross_tap: torch.Tensor
    """int64 ``[P]``: which tap of that output it is."""
    cross_table: torch.Tensor
    """int64 ``[S, F]``: per token read across segments, its pairs as indices into ``cross_reader``, padded with
    ``P`` (a zero row)."""
    cross_row: torch.Tensor
    """int32 ``[U]``: each row position's line of ``cross_table``, -1 for a token no other segment reads."""

    @property
    def kernel(self) -> int:
        return int(self.taps.shape[1])

    @property
    def has_cross(self) -> bool:
        return self.cross_reader.numel() > 0


def tree_conv_plan(meta: TreeAttentionMetadata, kernel: int, device: torch.device | str) -> TreeConvPlan:
    """The tables of ``meta``'s row for a convolution of ``kernel`` taps, built on the host once and moved to
    ``device``."""
    cu_q = meta.host_arrays()[0]
    lengths = np.diff(cu_q)
    u = int(cu_q[-1])
    source, keep = conv_indices(meta, kernel)
    if u == 0:
        taps = np.zeros((0, kernel), dtype=np.int64)
    else:
        # Valid output i of the per-segment layout covers source[i : i + kernel] (``conv_indices``).
        taps = np.lib.stride_tricks.sliding_window_view(source, kernel)[keep]
    start = np.repeat(cu_q[:-1], lengths)  # each position's segment start
    end = np.repeat(cu_q[1:], lengths)
    positions = np.arange(u)
    back = kernel - 1 - np.arange(kernel)  # tap j reads K - 1 - j steps back
    reader = positions[:, None] + back[None, :]
    succ = np.where(reader < end[:, None], reader, -1)
    crossing = (taps >= 0) & (taps < start[:, None])
    cross_reader, cross_tap = np.nonzero(crossing)
    read = taps[cross_reader, cross_tap]
    order = np.argsort(read, kind="stable")  # pairs grouped by the token they read, readers in row order
    cross_reader, cross_tap, read = cross_reader[order], cross_tap[order], read[order]
    tokens, first, counts = np.unique(read, return_index=True, return_counts=True)
    width = int(counts.max()) if len(counts) else 0
    table = np.full((len(tokens), width), len(read), dtype=np.int64)
    for i, (f, c) in enumerate(zip(first, counts)):
        table[i, :c] = np.arange(f, f + c)
    cross_row = np.full(u, -1, dtype=np.int64)
    cross_row[tokens] = np.arange(len(tokens))
    as_tensor = lambda a, dtype: torch.as_tensor(np.ascontiguousarray(a), dtype=dtype).to(device)  # noqa: E731
    return TreeConvPlan(
        taps=as_tensor(taps, torch.int32), succ=as_tensor(succ, torch.int32),
        cross_reader=as_tensor(cross_reader, torch.int64), cross_tap=as_tensor(cross_tap, torch.int64),
        cross_table=as_tensor(table, torch.int64), cross_row=as_tensor(cross_row, torch.int32),
    )


def cross_input_grad(grad_pre: torch.Tensor, weight: torch.Tensor, plan: TreeConvPlan) -> torch.Tensor:
    """``[S, C]`` in ``grad_pre``'s dtype (fp32 from the kernels): per token read across segments (``cross_table``'s
    lines), the sum over its readers of the reader's pre-activation gradient times the tap's weight; ``grad_pre``
    ``[U, C]``, ``weight`` ``[C, K]``."""
    taps = weight.to(grad_pre.dtype).t().index_select(0, plan.cross_tap)
    contrib = grad_pre.index_select(0, plan.cross_reader) * taps
    contrib = torch.cat([contrib, contrib.new_zeros(1, contrib.shape[1])])  # index P: the padding's zeros
    return contrib[plan.cross_table].sum(1)


def taps_conv(rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, plan: TreeConvPlan) -> torch.Tensor:
    """The pre-activation convolution from the tables, in PyTorch: ``rows`` ``[U, C]``, ``weight`` ``[C, K]``,
    accumulated in fp32 (or wider), returned in that width."""
    wide = torch.promote_types(rows.dtype, torch.float32)
    padded = torch.cat([rows.new_zeros(1, rows.shape[1]), rows]).to(wide)  # row 0: the zeros above a root
    taps = plan.taps.long() + 1
    out = sum(padded[taps[:, j]] * weight[:, j].to(wide) for j in range(plan.kernel))
    return out + bias.to(wide) if bias is not None else out


def taps_conv_input_grad(grad_pre: torch.Tensor, weight: torch.Tensor, plan: TreeConvPlan) -> torch.Tensor:
    """The input gradient from the pre-activation gradient ``grad_pre`` ``[U, C]``, as the kernels compute it: the
    readers in the token's own segment through ``succ``, the others through ``cross_input_grad``."""
    padded = torch.cat([grad_pre.new_zeros(1, grad_pre.shape[1]), grad_pre])
    succ = plan.succ.long() + 1
    out = sum(padded[succ[:, j]] * weight[:, j].to(grad_pre.dtype) for j in range(plan.kernel))
    if plan.has_cross:
        rows = plan.cross_row.long()
        read = rows >= 0
        out[read] = out[read] + cross_input_grad(grad_pre, weight, plan).to(out.dtype)[rows[read]]
    return out

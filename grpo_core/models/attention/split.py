"""Tree attention split by ancestor level: no gathered K/V, the partial results merged by log-sum-exp.

The gather plan (``tree._gather_backend``) copies every root-to-segment path's keys into one
tensor and runs one causal varlen call. At high packing ratios that copy is several times the row
(a prompt shared by 16 completions is copied 16 times), and so is the work that scales with it: the
gather, the fp32 sum of the copies' gradients, the kernel's dK/dV at the gathered length.

A segment's keys are its ancestors' segments, whole, and then its own tokens causally. So its
attention is the softmax over a union of disjoint key sets, and can be computed one set at a time
and merged with each part's log-sum-exp (LSE):

- the **self call**: every segment attends to its own tokens, causally, in place (one varlen call with
  the segments as sequences: exactly a flat row's call);
- one **level call** per ancestor depth ``d``: the queries of every segment deeper than ``d`` attend,
  without a mask, to the keys of their depth-``d`` ancestor. Ancestors at one depth own disjoint
  subtrees, so one varlen call covers the level: sequence ``a`` is (descendants of ancestor ``a``)
  × (ancestor ``a``'s tokens). A shared prompt's keys appear once, in one sequence, whatever the number
  of completions below it.

``out = Σ_p exp(lse_p − lse) · out_p`` with ``lse = log Σ_p exp(lse_p)``. Backward gives each call the
merged output and LSE: the kernel rebuilds its part of the merged softmax from them, ``P = exp(S − lse)``
and ``D = rowsum(dO ∘ O)``, so the per-call gradients add up to the gradient of the whole attention
(the way ring attention splits keys across devices). Saved for backward: the row's q, k, v, the merged
output and its LSE, nothing of gathered length. The kernels need two entry points, forward returning
the LSE and backward taking output and LSE (``LSEKernel``); ``backends.load_lse_kernel`` loads
them where a backend has them.

The row layout is the collator's, depth-first, so a subtree is one run of the row: ancestor ``a``'s
descendants follow its own tokens contiguously. A kernel that takes each sequence as a window of the row
(a start and a used length: FlashAttention's ``seqused``, ``LSEKernel.in_place``) runs a level call on the
row's q, k, v as they are; its output, LSE and gradients come back at row positions and are merged or added
there. Other kernels get the level's queries and keys gathered (each token at most once per level) and their
results scattered back. Levels are planned on the host with the row (``plan_levels``), so running them
needs no device-to-host read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import numpy as np
import torch


# ---- the plan -----------------------------------------------------------------------------------------
@dataclass
class AncestorLevel:
    """One level call: the queries below every depth-``d`` ancestor against that ancestor's keys.

    ``A`` ancestors with descendants; sequence ``a`` pairs ``q_index[cu_q[a]:cu_q[a+1]]`` (row positions
    of every query below ancestor ``a``) with ``k_index[cu_k[a]:cu_k[a+1]]`` (ancestor ``a``'s own tokens).

    The same sequences as windows of the row, for kernels that read them in place: the queries of sequence
    ``a`` are row positions ``q_starts[a] : q_starts[a] + q_lengths[a]``, its keys ``k_starts[a] : k_starts[a]
    + k_lengths[a]`` (``*_starts`` end with the row's length, as varlen offsets do). None where a sequence's
    queries are not one run of the row (a layout other than depth-first)."""

    q_index: torch.Tensor  # int64 [Qd]
    k_index: torch.Tensor  # int64 [Kd]
    cu_q: torch.Tensor  # int32 [A + 1]
    cu_k: torch.Tensor  # int32 [A + 1]
    max_q: int
    max_k: int
    q_starts: torch.Tensor | None = None  # int32 [A + 1]
    q_lengths: torch.Tensor | None = None  # int32 [A]
    k_starts: torch.Tensor | None = None  # int32 [A + 1]
    k_lengths: torch.Tensor | None = None  # int32 [A]

    def to(self, device: torch.device | str, non_blocking: bool = True) -> AncestorLevel:
        move = lambda t: None if t is None else t.to(device, non_blocking=non_blocking)  # noqa: E731
        return AncestorLevel(move(self.q_index), move(self.k_index), move(self.cu_q), move(self.cu_k),
                             self.max_q, self.max_k, move(self.q_starts), move(self.q_lengths),
                             move(self.k_starts), move(self.k_lengths))

    @property
    def has_windows(self) -> bool:
        return self.q_starts is not None

    @property
    def num_pairs(self) -> int:
        """Query-key pairs of this call (all unmasked)."""
        q = np.diff(self.cu_q.cpu().numpy().astype(np.int64))
        k = np.diff(self.cu_k.cpu().numpy().astype(np.int64))
        return int((q * k).sum())


def _int32_cumsum(lengths: Sequence[int]) -> torch.Tensor:
    return torch.as_tensor(np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)]), dtype=torch.int32)


def plan_levels(seg_lens: Sequence[int], parents: Sequence[int | None]) -> tuple[AncestorLevel, ...]:
    """The level calls of a row whose segments (depth-first, each parent before its children) have
    ``seg_lens`` tokens and parent segment ``parents[g]`` (None for a root). Host tensors."""
    offsets = np.concatenate([[0], np.cumsum(seg_lens, dtype=np.int64)])
    ancestors: list[list[int]] = []  # root first
    for g, p in enumerate(parents):
        ancestors.append([] if p is None else [*ancestors[p], p])
    levels = []
    for depth in range(max((len(a) for a in ancestors), default=0)):
        below: dict[int, list[int]] = {}  # ancestor -> its descendants, in row order
        for g, anc in enumerate(ancestors):
            if len(anc) > depth:
                below.setdefault(anc[depth], []).append(g)
        heads = sorted(below)
        q_parts = [np.arange(offsets[g], offsets[g + 1]) for a in heads for g in below[a]]
        q_lens = [sum(seg_lens[g] for g in below[a]) for a in heads]
        k_lens = [seg_lens[a] for a in heads]
        # Windows: each ancestor's descendants one run of the row (always so depth-first), runs in row order.
        q_first = [int(offsets[below[a][0]]) for a in heads]
        runs = all(offsets[g + 1] == offsets[h] for a in heads for g, h in zip(below[a], below[a][1:]))
        ordered = all(q_first[i] + q_lens[i] <= q_first[i + 1] for i in range(len(heads) - 1))
        windows = {}
        if runs and ordered:
            total = int(offsets[-1])
            as_int32 = lambda x: torch.as_tensor(np.asarray(x, dtype=np.int64), dtype=torch.int32)  # noqa: E731
            windows = dict(q_starts=as_int32([*q_first, total]), q_lengths=as_int32(q_lens),
                           k_starts=as_int32([*(int(offsets[a]) for a in heads), total]), k_lengths=as_int32(k_lens))
        levels.append(AncestorLevel(
            q_index=torch.as_tensor(np.concatenate(q_parts), dtype=torch.int64),
            k_index=torch.as_tensor(np.concatenate([np.arange(offsets[a], offsets[a + 1]) for a in heads]),
                                    dtype=torch.int64),
            cu_q=_int32_cumsum(q_lens), cu_k=_int32_cumsum(k_lens), max_q=max(q_lens), max_k=max(k_lens),
            **windows,
        ))
    return tuple(levels)


def levels_from_paths(cu_seq_q: torch.Tensor, cu_seq_k: torch.Tensor, kv_index: torch.Tensor | None
                      ) -> tuple[AncestorLevel, ...]:
    """``plan_levels`` of a row given by its gather metadata (segment ranges and root-to-segment paths).
    Reads the tensors on the host: for metadata built without the collator (tests, the start-up probe)."""
    cq = cu_seq_q.cpu().numpy().astype(np.int64)
    seg_lens = np.diff(cq).tolist()
    if kv_index is None:
        return ()
    ck = cu_seq_k.cpu().numpy().astype(np.int64)
    kv = kv_index.cpu().numpy()
    seg_of = np.repeat(np.arange(len(seg_lens)), seg_lens)
    parents: list[int | None] = []
    for g, q_len in enumerate(seg_lens):
        ancestor_tokens = kv[ck[g] : ck[g + 1] - q_len]
        parents.append(int(seg_of[ancestor_tokens[-1]]) if len(ancestor_tokens) else None)
    return plan_levels(seg_lens, parents)


# ---- kernels ------------------------------------------------------------------------------------------
class LSEKernel(Protocol):
    """A varlen attention kernel with its LSE: ``forward`` and a ``backward`` that takes output and LSE.

    Shapes: q ``[Tq, H, D]``, k/v ``[Tk, Hk, D]`` (``H`` a multiple of ``Hk``), lse fp32 ``[H, Tq]``.
    ``causal``: bottom-right within each sequence (only used with equal q and k lengths here).
    ``in_place``: the entry points take ``used_q`` / ``used_k`` (int32 ``[A]``): sequence ``a`` is then
    ``cu[a] : cu[a] + used[a]``, a window, and rows outside every window of the results are undefined."""

    name: str
    in_place: bool

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor,
                max_q: int, max_k: int, scale: float, causal: bool, used_q: torch.Tensor | None = None,
                used_k: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]: ...

    def backward(self, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                 lse: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor, max_q: int, max_k: int, scale: float,
                 causal: bool, used_q: torch.Tensor | None = None, used_k: torch.Tensor | None = None,
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...


def _bounds(cu: torch.Tensor, used: torch.Tensor | None) -> list[tuple[int, int]]:
    starts = cu.tolist()
    ends = starts[1:] if used is None else [s + n for s, n in zip(starts, used.tolist())]
    return list(zip(starts, ends))


class EmulatedLSEKernel:
    """Both entry points in plain PyTorch, one sequence at a time, in fp32: the CPU test double of a
    fused kernel's (the arithmetic of FlashAttention's forward and backward, without the tiling).

    ``in_place``: windows (``used_q`` / ``used_k``) accepted, as FlashAttention's ``seqused``; rows outside
    every window come back as NaN, so that a caller reading them fails its tests."""

    name = "emulated"

    def __init__(self, in_place: bool = True):
        self.in_place = in_place

    @staticmethod
    def _scores(q, k, scale, causal):
        s = torch.einsum("qhd,khd->hqk", q.float(), k.float()) * scale
        if causal:
            ql, kl = q.shape[0], k.shape[0]
            keep = torch.ones(ql, kl, dtype=torch.bool, device=q.device).tril(kl - ql)
            s = s.masked_fill(~keep, float("-inf"))
        return s

    def _windows(self, cu_q, cu_k, used_q, used_k) -> list[tuple[int, int, int, int]]:
        if (used_q is not None or used_k is not None) and not self.in_place:
            raise TypeError("this kernel takes no windows (in_place=False)")
        return [(*a, *b) for a, b in zip(_bounds(cu_q, used_q), _bounds(cu_k, used_k))]

    @staticmethod
    def _undefined(shape, windowed: bool, device) -> torch.Tensor:
        return torch.full(shape, float("nan") if windowed else 0.0, dtype=torch.float32, device=device)

    def forward(self, q, k, v, cu_q, cu_k, max_q, max_k, scale, causal, used_q=None, used_k=None):
        heads, group = q.shape[1], q.shape[1] // k.shape[1]
        windowed = used_q is not None
        out = self._undefined(q.shape, windowed, q.device)
        lse = torch.full((heads, q.shape[0]), float("nan") if windowed else float("-inf"), device=q.device)
        for qs, qe, ks, ke in self._windows(cu_q, cu_k, used_q, used_k):
            if qe == qs:
                continue
            if ke == ks:
                out[qs:qe], lse[:, qs:qe] = 0.0, float("-inf")
                continue
            kk, vv = (x[ks:ke].repeat_interleave(group, dim=1).float() for x in (k, v))
            s = self._scores(q[qs:qe], kk, scale, causal)
            seq_lse = torch.logsumexp(s, dim=-1)  # [H, q]
            out[qs:qe] = torch.einsum("hqk,khd->qhd", torch.exp(s - seq_lse[..., None]), vv)
            lse[:, qs:qe] = seq_lse
        return out.to(q.dtype), lse

    def backward(self, dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, scale, causal, used_q=None, used_k=None):
        group = q.shape[1] // k.shape[1]
        windowed = used_q is not None
        dq = self._undefined(q.shape, windowed, q.device)
        dk = self._undefined(k.shape, windowed, q.device)
        dv = self._undefined(v.shape, windowed, q.device)
        for qs, qe, ks, ke in self._windows(cu_q, cu_k, used_q, used_k):
            dq[qs:qe], dk[ks:ke], dv[ks:ke] = 0.0, 0.0, 0.0
            if qe == qs or ke == ks:
                continue
            qq, do, oo = q[qs:qe].float(), dout[qs:qe].float(), out[qs:qe].float()
            kk, vv = (x[ks:ke].repeat_interleave(group, dim=1).float() for x in (k, v))
            p = torch.exp(self._scores(qq, kk, scale, causal) - lse[:, qs:qe, None])  # [H, q, k]
            d_v = torch.einsum("hqk,qhd->khd", p, do)
            dp = torch.einsum("qhd,khd->hqk", do, vv)
            ds = p * (dp - (do * oo).sum(-1).transpose(0, 1)[..., None])
            dq[qs:qe] = torch.einsum("hqk,khd->qhd", ds, kk) * scale
            d_k = torch.einsum("hqk,qhd->khd", ds, qq) * scale
            fold = lambda x: x.unflatten(1, (k.shape[1], group)).sum(2)  # noqa: E731 - grouped heads
            dk[ks:ke] += fold(d_k)
            dv[ks:ke] += fold(d_v)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


# ---- the split attention ------------------------------------------------------------------------------
def _merge_eager(acc: torch.Tensor, lse: torch.Tensor, rows: torch.Tensor, part_out: torch.Tensor,
                 part_lse: torch.Tensor, at_rows: bool = False) -> None:
    """Fold one call's result into the running output ``acc`` and LSE at ``rows`` (in place), the weights
    and the sum in fp32, rounded once to ``acc``'s dtype. ``at_rows``: the call's results are row-sized,
    read at ``rows`` too (an in-place call), else compact (entry ``i`` belongs to ``rows[i]``)."""
    if at_rows:
        part_out, part_lse = part_out.index_select(0, rows), part_lse.index_select(1, rows)
    old = lse.index_select(1, rows)
    new = torch.logaddexp(old, part_lse)
    keep = torch.exp(old - new).transpose(0, 1).unsqueeze(-1)  # [Qd, H, 1]
    take = torch.exp(part_lse - new).transpose(0, 1).unsqueeze(-1)
    merged = acc.index_select(0, rows).float() * keep + part_out.float() * take
    acc.index_copy_(0, rows, merged.to(acc.dtype))
    lse.index_copy_(1, rows, new)


_merge_kernel = None


def _triton_merge():
    """The merge as one Triton kernel (one read of each operand, one write), or None without Triton.

    In PyTorch ops the merge makes about ten passes over the merged rows (index, casts, products, sum,
    copy back); at a packing ratio of 1.35 nearly every token of a row has an ancestor, and those passes
    cost several percent of the step."""
    global _merge_kernel
    if _merge_kernel is not None:
        return _merge_kernel or None
    try:
        import triton
        import triton.language as tl
    except ImportError:
        _merge_kernel = False
        return None

    @triton.jit
    def merge(acc, lse, rows, part, part_lse, n_heads, n_rows_total, n_part_rows, dim,
              BLOCK_D: tl.constexpr, AT_ROWS: tl.constexpr):  # noqa: N803 - Triton's constexpr spelling
        i = tl.program_id(0)  # the i-th merged query
        h = tl.program_id(1)  # its head
        r = tl.load(rows + i)
        p = r if AT_ROWS else i  # where the call's result for this query is
        lo = tl.load(lse + h * n_rows_total + r)
        lp = tl.load(part_lse + h * n_part_rows + p)
        m = tl.maximum(lo, lp)
        new = m + tl.log(tl.exp(lo - m) + tl.exp(lp - m))
        d = tl.arange(0, BLOCK_D)
        inside = d < dim
        a_ptr = acc + (r * n_heads + h) * dim + d
        x = tl.load(a_ptr, mask=inside).to(tl.float32)
        y = tl.load(part + (p * n_heads + h) * dim + d, mask=inside).to(tl.float32)
        out = x * tl.exp(lo - new) + y * tl.exp(lp - new)
        tl.store(a_ptr, out.to(acc.dtype.element_ty), mask=inside)
        tl.store(lse + h * n_rows_total + r, new)

    def run(acc, lse, rows, part_out, part_lse, at_rows):
        n_rows = rows.shape[0]
        _, heads, dim = part_out.shape
        if n_rows == 0:
            return
        merge[(n_rows, heads)](acc, lse, rows, part_out.contiguous(), part_lse.contiguous(), heads, acc.shape[0],
                               part_out.shape[0], dim, BLOCK_D=triton.next_power_of_2(dim), AT_ROWS=at_rows)

    _merge_kernel = run
    return run


def _merge(acc: torch.Tensor, lse: torch.Tensor, rows: torch.Tensor, part_out: torch.Tensor,
           part_lse: torch.Tensor, at_rows: bool = False) -> None:
    fused = _triton_merge() if acc.is_cuda else None
    if fused is not None and acc.is_contiguous() and lse.is_contiguous():
        fused(acc, lse, rows, part_out, part_lse, at_rows)
    else:
        _merge_eager(acc, lse, rows, part_out, part_lse, at_rows)


_add_rows_kernel = None


def _triton_add_rows():
    """``dst[rows] += src[rows]`` as one Triton kernel (rows are distinct: no atomics), or None without Triton.

    ``index_add_`` of a gathered copy would read ``src`` twice and add with atomics; what that pair of kernels
    cost the level calls' dQ, dK and dV is in benchmarks/README.md, "The fused head and in-place level calls"."""
    global _add_rows_kernel
    if _add_rows_kernel is not None:
        return _add_rows_kernel or None
    try:
        import triton
        import triton.language as tl
    except ImportError:
        _add_rows_kernel = False
        return None

    @triton.jit
    def add_rows(dst, src, rows, width, BLOCK: tl.constexpr):  # noqa: N803 - Triton's constexpr spelling
        r = tl.load(rows + tl.program_id(0)).to(tl.int64)
        j = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        inside = j < width
        x = tl.load(dst + r * width + j, mask=inside).to(tl.float32)
        y = tl.load(src + r * width + j, mask=inside).to(tl.float32)
        tl.store(dst + r * width + j, (x + y).to(dst.dtype.element_ty), mask=inside)

    def run(dst, rows, src):
        if rows.shape[0] == 0:
            return
        width = dst[0].numel()
        block = min(1024, triton.next_power_of_2(width))
        add_rows[(rows.shape[0], triton.cdiv(width, block))](dst, src, rows, width, BLOCK=block)

    _add_rows_kernel = run
    return run


def _add_rows(dst: torch.Tensor, rows: torch.Tensor, src: torch.Tensor) -> None:
    """``dst[rows] += src[rows]`` in place (``src`` row-sized, as an in-place call's gradients are), the sum in
    fp32 and rounded once to ``dst``'s dtype."""
    fused = _triton_add_rows() if dst.is_cuda else None
    if fused is not None and dst.is_contiguous() and src.is_contiguous():
        fused(dst, rows, src)
    else:
        dst.index_add_(0, rows, src.index_select(0, rows).to(dst.dtype))


_level_windows = True


def set_level_windows(on: bool) -> None:
    """Level calls read the row in place where the kernel takes windows (``on``, the default), or always
    gathered (``benchmarks/packing/tree_packing.py`` times the two side by side)."""
    global _level_windows
    _level_windows = bool(on)


def _in_place(kernel: LSEKernel, level: AncestorLevel) -> bool:
    return _level_windows and getattr(kernel, "in_place", False) and level.has_windows


class _SplitTreeAttention(torch.autograd.Function):
    # Rounding: with one level (every tree of depth 1: prompts and their completions) the merged output
    # and every gradient get one rounding per part, as a fused kernel's would: the merge and the sums
    # are computed in fp32 from the parts and rounded once (``index_add_`` of two bf16 values rounds
    # their exact sum once). A key row is a key of the self call and of at most one level, its own
    # segment's depth, so dK/dV always sum two parts; a query at depth ``d`` sums ``d + 1``, so deeper
    # trees accumulate output and dQ in fp32.
    @staticmethod
    def forward(ctx, q, k, v, kernel: LSEKernel, cu_seq: torch.Tensor, max_seg: int,
                levels: tuple[AncestorLevel, ...], scale: float) -> torch.Tensor:
        out, lse = kernel.forward(q, k, v, cu_seq, cu_seq, max_seg, max_seg, scale, True)
        if levels:
            out = out.float() if len(levels) > 1 else out.contiguous()
            lse = lse.contiguous().clone()
            for lv in levels:
                if _in_place(kernel, lv):
                    part_out, part_lse = kernel.forward(q, k, v, lv.q_starts, lv.k_starts, lv.max_q, lv.max_k, scale,
                                                        False, used_q=lv.q_lengths, used_k=lv.k_lengths)
                    _merge(out, lse, lv.q_index, part_out, part_lse, at_rows=True)
                    continue
                part_out, part_lse = kernel.forward(
                    q.index_select(0, lv.q_index), k.index_select(0, lv.k_index), v.index_select(0, lv.k_index),
                    lv.cu_q, lv.cu_k, lv.max_q, lv.max_k, scale, False)
                _merge(out, lse, lv.q_index, part_out, part_lse)
            out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, cu_seq)
        ctx.kernel, ctx.levels, ctx.max_seg, ctx.scale = kernel, levels, max_seg, scale
        return out

    @staticmethod
    def backward(ctx, dout: torch.Tensor):
        q, k, v, out, lse, cu_seq = ctx.saved_tensors
        kernel, scale, levels = ctx.kernel, ctx.scale, ctx.levels
        dout = dout.contiguous()
        dq, dk, dv = kernel.backward(dout, q, k, v, out, lse, cu_seq, cu_seq, ctx.max_seg, ctx.max_seg, scale, True)
        if levels:
            dq = dq.float() if len(levels) > 1 else dq.contiguous()
            dk, dv = dk.contiguous(), dv.contiguous()
            for lv in levels:
                qi, ki = lv.q_index, lv.k_index
                if _in_place(kernel, lv):
                    part = kernel.backward(dout, q, k, v, out, lse, lv.q_starts, lv.k_starts, lv.max_q, lv.max_k,
                                           scale, False, used_q=lv.q_lengths, used_k=lv.k_lengths)
                    _add_rows(dq, qi, part[0])
                    _add_rows(dk, ki, part[1])
                    _add_rows(dv, ki, part[2])
                    continue
                part = kernel.backward(dout.index_select(0, qi), q.index_select(0, qi), k.index_select(0, ki),
                                       v.index_select(0, ki), out.index_select(0, qi), lse.index_select(1, qi),
                                       lv.cu_q, lv.cu_k, lv.max_q, lv.max_k, scale, False)
                dq.index_add_(0, qi, part[0].to(dq.dtype))
                dk.index_add_(0, ki, part[1])
                dv.index_add_(0, ki, part[2])
            dq = dq.to(q.dtype)
        return dq, dk, dv, None, None, None, None, None


def split_tree_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kernel: LSEKernel,
                         cu_seq: torch.Tensor, max_seg: int, levels: tuple[AncestorLevel, ...],
                         scale: float) -> torch.Tensor:
    """Tree attention of one row: q ``[U, H, D]``, k/v ``[U, Hk, D]`` in row order; segments ``cu_seq``
    (int32 ``[G + 1]``, longest ``max_seg``), their ancestors by ``levels`` (``plan_levels``)."""
    return _SplitTreeAttention.apply(q.contiguous(), k.contiguous(), v.contiguous(), kernel, cu_seq, max_seg,
                                     levels, scale)

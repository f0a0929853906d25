"""The fused log-prob head's logits gradient (``fused.chunk_grad``) as a hand-written Triton kernel.

``torch.compile`` fuses ``chunk_grad`` into one pass, but with the row count dynamic its kernel walks the
``[c, V]`` gradient as one flat index and divides it by ``V`` at every entry to find the row, far below the
memory bandwidth (the two side by side: benchmarks/README.md, "The fused head and in-place level calls"). Here a
program owns ``columns_per_program`` columns of one token's row and walks them in blocks, so the row's ``lse``,
sampled id and upstream gradients are loaded once per program and the column is the block's offset.

The sampler's top ids add a term at a few entries of each row. Compared at every entry (``inline_top``), they made
the pass bound by arithmetic rather than by memory; here a second, small kernel writes those entries again, with the
same sums in the same order, so the pass over the vocabulary does no per-entry work for them (benchmarks/README.md,
"The head's two passes"; ``benchmarks/models/logprob_kernels.py`` times the launches side by side). The arithmetic
is ``chunk_grad``'s, in fp32, rounded once to the output's dtype (the one difference: ``exp`` is Triton's, within a
few fp32 ulps).
"""

from __future__ import annotations

import torch
from torch import Tensor

_kernel = None


def _build():
    import triton
    import triton.language as tl

    @triton.jit
    def logits_grad(out, logits, lse, target_ids, grad_target, top_ids, grad_top, masks, vocab, row_stride,
                    out_stride, temperature, columns, N_TOP: tl.constexpr, INLINE_TOP: tl.constexpr,  # noqa: N803
                    HAS_MASK: tl.constexpr, BLOCK: tl.constexpr):  # noqa: N803 - Triton's constexpr spelling
        row = tl.program_id(0).to(tl.int64)
        first = tl.program_id(1).to(tl.int64) * columns
        last = tl.minimum(first + columns, vocab)
        row_lse = tl.load(lse + row)
        sampled = tl.load(target_ids + row)
        upstream = tl.load(grad_target + row).to(tl.float32)
        total = upstream
        for n in tl.static_range(N_TOP):
            total += tl.load(grad_top + row * N_TOP + n).to(tl.float32)
        for start in range(first, last, BLOCK):
            column = start + tl.arange(0, BLOCK)
            inside = column < last
            scaled = tl.load(logits + row * row_stride + column, mask=inside, other=0.0).to(tl.float32) / temperature
            grad = tl.where(column == sampled, upstream, 0.0) - tl.exp(scaled - row_lse) * total
            if INLINE_TOP:
                for n in tl.static_range(N_TOP):
                    grad += tl.where(column == tl.load(top_ids + row * N_TOP + n),
                                     tl.load(grad_top + row * N_TOP + n).to(tl.float32), 0.0)
            if HAS_MASK:
                keep = tl.load(masks + row * vocab + column, mask=inside, other=0).to(tl.int1)
                grad = tl.where(keep, grad, 0.0)
            tl.store(out + row * out_stride + column, (grad / temperature).to(out.dtype.element_ty), mask=inside)

    @triton.jit
    def top_entries(out, top_logits, lse, target_ids, grad_target, top_ids, grad_top, masks, vocab, out_stride,
                    temperature, N_TOP: tl.constexpr, HAS_MASK: tl.constexpr):  # noqa: N803
        # The entries of a row's top ids, written again with their top terms: the same sums in the same order as
        # the inline form, from the logits gathered before ``logits_grad`` ran (it may have overwritten them). The
        # row's terms are loaded as there: a jitted helper would have to live at module level, where Triton is not
        # imported (it is optional).
        row = tl.program_id(0).to(tl.int64)
        row_lse = tl.load(lse + row)
        sampled = tl.load(target_ids + row)
        upstream = tl.load(grad_target + row).to(tl.float32)
        total = upstream
        for n in tl.static_range(N_TOP):
            total += tl.load(grad_top + row * N_TOP + n).to(tl.float32)
        for n in tl.static_range(N_TOP):
            column = tl.load(top_ids + row * N_TOP + n)
            scaled = tl.load(top_logits + row * N_TOP + n).to(tl.float32) / temperature
            grad = tl.where(column == sampled, upstream, 0.0) - tl.exp(scaled - row_lse) * total
            for m in tl.static_range(N_TOP):
                grad += tl.where(column == tl.load(top_ids + row * N_TOP + m),
                                 tl.load(grad_top + row * N_TOP + m).to(tl.float32), 0.0)
            if HAS_MASK:
                keep = tl.load(masks + row * vocab + column).to(tl.int1)
                grad = tl.where(keep, grad, 0.0)
            tl.store(out + row * out_stride + column, (grad / temperature).to(out.dtype.element_ty))

    return logits_grad, top_entries


COLUMNS_PER_PROGRAM = 8192
"""Columns of a row one program writes (a 152k vocabulary: 19 programs per row); ``None``: the whole row."""
BLOCK = 2048
"""Columns a program loads and stores at once."""


def triton_chunk_grad(out: Tensor, logits: Tensor, lse: Tensor, target_ids: Tensor, grad_target: Tensor,
                      top_ids: Tensor | None, grad_top: Tensor | None, candidate_masks: Tensor | None,
                      temperature: float, columns_per_program: int | None = COLUMNS_PER_PROGRAM, block: int = BLOCK,
                      num_warps: int = 4, inline_top: bool = False) -> Tensor:
    """``chunk_grad``'s result written into ``out`` (``[c, V]``, rows contiguous; may be ``logits`` itself);
    CUDA tensors. The launch (``columns_per_program``, ``None`` for one program per row; ``block``, a power of two;
    ``num_warps``; ``inline_top``) is the benchmark's to vary: ``benchmarks/models/logprob_kernels.py`` times the
    choices side by side.

    The top ids' terms (``N`` per row) are added by a second kernel that writes those ``N`` entries of each row
    again; ``inline_top`` compares every entry with every top id instead, ``N`` comparisons per entry, which made
    the pass bound by arithmetic rather than memory with the sampler's 8 top ids. Returns ``out``."""
    global _kernel
    if _kernel is None:
        _kernel = _build()
    rows, vocab = logits.shape
    if rows == 0:
        return out
    if logits.stride(1) != 1 or out.stride(1) != 1:
        raise ValueError("triton_chunk_grad needs rows with contiguous columns")
    n_top = 0 if top_ids is None else top_ids.shape[1]
    # fp32 throughout, as chunk_grad (an fp64 chunk is never on this path: fused.py keeps it in PyTorch).
    lse = lse.float().contiguous()
    grad_target = grad_target.float().contiguous()
    ids = top_ids.long().contiguous() if n_top else target_ids  # placeholders when absent: never read
    tops = grad_top.float().contiguous() if n_top else grad_target
    masks = candidate_masks.contiguous() if candidate_masks is not None else target_ids
    columns = vocab if columns_per_program is None else columns_per_program
    if columns < 1:
        raise ValueError(f"columns_per_program={columns_per_program}: use a positive count, or None for whole rows")
    sampled = target_ids.long().contiguous()
    rows_kernel, top_kernel = _kernel
    fix_up = n_top > 0 and not inline_top
    top_logits = logits.gather(1, ids).contiguous() if fix_up else None  # before ``out`` may overwrite them
    grid = (rows, -(-vocab // columns))
    rows_kernel[grid](out, logits, lse, sampled, grad_target, ids, tops, masks, vocab, logits.stride(0),
                      out.stride(0), float(temperature), columns, N_TOP=n_top, INLINE_TOP=not fix_up,
                      HAS_MASK=candidate_masks is not None, BLOCK=block, num_warps=num_warps)
    if fix_up:
        top_kernel[(rows,)](out, top_logits, lse, sampled, grad_target, ids, tops, masks, vocab, out.stride(0),
                            float(temperature), N_TOP=n_top, HAS_MASK=candidate_masks is not None, num_warps=1)
    return out


def available(logits: Tensor) -> bool:
    """Whether the head's Triton kernels (``triton_chunk_grad``, ``stats_triton.triton_chunk_stats``) take these
    logits: CUDA with Triton, a 16- or 32-bit float, columns contiguous."""
    if logits.device.type != "cuda" or logits.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return False
    if logits.dim() != 2 or logits.stride(1) != 1:
        return False
    from torch.utils._triton import has_triton

    return has_triton()

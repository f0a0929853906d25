"""The fused head's forward statistics (``fused.chunk_stats``: each token's log-normaliser and the log-probs of its
sampled and top ids) with the log-normaliser from a hand-written Triton kernel.

Compiled with a dynamic row count, ``chunk_stats`` was bound by its own schedule rather than by memory: it took
the same time on an H100 as on an H200 (benchmarks/README.md, "The head's two passes"). Here each program reduces
``columns_per_program`` columns of one row in one pass: per block of columns, the block's maximum, then the sum of
``exp(x - max)`` rescaled to the running maximum (one ``exp`` per entry). The partial maxima and sums, a few per
row, are combined in PyTorch, and the sampled and top ids' logits are gathered there (one entry each).

The arithmetic is ``chunk_stats``'s in fp32: the logits divided by the temperature, candidate masks as ``-inf``.
The sum runs in another order than ``torch.logsumexp``'s, so the log-normaliser agrees with it to fp32 rounding,
not bit for bit (``tests/test_head_kernels.py``).
"""

from __future__ import annotations

import torch
from torch import Tensor

_kernel = None

COLUMNS_PER_PROGRAM = 8192
"""Columns of a row one program reduces (a 152k vocabulary: 19 partial results per row)."""
BLOCK = 2048
"""Columns a program loads at once."""


def _build():
    import triton
    import triton.language as tl

    @triton.jit
    def row_partials(part_max, part_sum, logits, masks, vocab, row_stride, parts, temperature, columns,
                     HAS_MASK: tl.constexpr, BLOCK: tl.constexpr):  # noqa: N803 - Triton's constexpr spelling
        row = tl.program_id(0).to(tl.int64)
        part = tl.program_id(1)
        first = part.to(tl.int64) * columns
        last = tl.minimum(first + columns, vocab)
        running_max = tl.full([], float("-inf"), tl.float32)
        running_sum = tl.zeros([], tl.float32)
        for start in range(first, last, BLOCK):
            column = start + tl.arange(0, BLOCK)
            inside = column < last
            scaled = tl.load(logits + row * row_stride + column, mask=inside, other=float("-inf")).to(tl.float32)
            scaled = scaled / temperature
            if HAS_MASK:
                keep = tl.load(masks + row * vocab + column, mask=inside, other=0).to(tl.int1)
                scaled = tl.where(keep, scaled, float("-inf"))
            new_max = tl.maximum(running_max, tl.max(scaled, 0))
            # a block (and all before it) masked out entirely: nothing to add, and -inf - -inf must not make a NaN
            shift = tl.where(new_max == float("-inf"), 0.0, new_max)
            running_sum = running_sum * tl.exp(running_max - shift) + tl.sum(tl.exp(scaled - shift), 0)
            running_max = new_max
        tl.store(part_max + row * parts + part, running_max)
        tl.store(part_sum + row * parts + part, running_sum)

    return row_partials


def triton_lse(logits: Tensor, temperature: float, candidate_masks: Tensor | None,
               columns_per_program: int = COLUMNS_PER_PROGRAM, block: int = BLOCK, num_warps: int = 4) -> Tensor:
    """``logsumexp(logits / temperature)`` per row (``-inf`` where ``candidate_masks`` is False), fp32 ``[c]``;
    ``logits`` ``[c, V]`` with contiguous columns, on a device Triton runs on. The launch (``columns_per_program``,
    ``block``, a power of two, and ``num_warps``) is the benchmark's to vary."""
    global _kernel
    if _kernel is None:
        _kernel = _build()
    rows, vocab = logits.shape
    if columns_per_program < 1:
        raise ValueError(f"columns_per_program={columns_per_program}: use a positive count")
    if logits.stride(1) != 1:
        raise ValueError("triton_lse needs rows with contiguous columns")
    parts = -(-vocab // columns_per_program)
    part_max = torch.empty(rows, parts, dtype=torch.float32, device=logits.device)
    part_sum = torch.empty_like(part_max)
    if rows:
        masks = candidate_masks.contiguous() if candidate_masks is not None else logits  # never read without masks
        _kernel[(rows, parts)](part_max, part_sum, logits, masks, vocab, logits.stride(0), parts, float(temperature),
                               columns_per_program, HAS_MASK=candidate_masks is not None, BLOCK=block,
                               num_warps=num_warps)
    row_max = part_max.amax(1)
    shift = torch.where(torch.isinf(row_max), torch.zeros_like(row_max), row_max)  # a row masked out entirely
    return shift + torch.log((part_sum * torch.exp(part_max - shift[:, None])).sum(1))


def triton_chunk_stats(logits: Tensor, target_ids: Tensor, temperature: float, top_ids: Tensor | None,
                       candidate_masks: Tensor | None) -> tuple[Tensor, Tensor, Tensor | None]:
    """``fused.chunk_stats``' results (``lse [c]``, sampled log-probs ``[c]``, top log-probs ``[c, N]`` or None) with
    the log-normaliser from ``triton_lse``; for the logits ``grad_triton.available`` takes (both kernels take the
    same: CUDA with Triton, 16- or 32-bit floats, contiguous columns)."""
    lse = triton_lse(logits, temperature, candidate_masks)

    def logprobs_of(ids: Tensor) -> Tensor:
        picked = logits.gather(-1, ids).float() / temperature
        if candidate_masks is not None:
            picked = picked.masked_fill(~candidate_masks.gather(-1, ids), float("-inf"))
        return picked - lse.unsqueeze(-1)

    target = logprobs_of(target_ids.long().unsqueeze(-1)).squeeze(-1)
    top = None if top_ids is None else logprobs_of(top_ids.long())
    return lse, target, top


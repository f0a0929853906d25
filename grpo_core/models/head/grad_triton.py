"""The fused log-prob head's logits gradient (``fused.chunk_grad``) as a hand-written Triton kernel.

``torch.compile`` fuses ``chunk_grad`` into one pass, but with the row count dynamic its kernel walks the
``[c, V]`` gradient as one flat index and divides it by ``V`` at every entry to find the row, far below the
memory bandwidth (the two side by side: benchmarks/README.md, "The fused head and in-place level calls";
``benchmarks/device/check_logprob_grad.py``). Here one
program owns one token's row and walks its vocabulary in blocks, so the row's ``lse``, sampled id and upstream
gradients are loaded once and the column is the block's offset. The arithmetic is ``chunk_grad``'s, in fp32,
rounded once to the output's dtype (the one difference: ``exp`` is Triton's, within a few fp32 ulps).
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
                    out_stride, temperature, N_TOP: tl.constexpr, HAS_MASK: tl.constexpr,  # noqa: N803
                    BLOCK: tl.constexpr):  # noqa: N803 - Triton's constexpr spelling
        row = tl.program_id(0).to(tl.int64)
        row_lse = tl.load(lse + row)
        sampled = tl.load(target_ids + row)
        upstream = tl.load(grad_target + row).to(tl.float32)
        total = upstream
        for n in tl.static_range(N_TOP):
            total += tl.load(grad_top + row * N_TOP + n).to(tl.float32)
        for start in range(0, vocab, BLOCK):
            column = start + tl.arange(0, BLOCK)
            inside = column < vocab
            scaled = tl.load(logits + row * row_stride + column, mask=inside, other=0.0).to(tl.float32) / temperature
            grad = tl.where(column == sampled, upstream, 0.0) - tl.exp(scaled - row_lse) * total
            for n in tl.static_range(N_TOP):
                grad += tl.where(column == tl.load(top_ids + row * N_TOP + n),
                                 tl.load(grad_top + row * N_TOP + n).to(tl.float32), 0.0)
            if HAS_MASK:
                keep = tl.load(masks + row * vocab + column, mask=inside, other=0).to(tl.int1)
                grad = tl.where(keep, grad, 0.0)
            tl.store(out + row * out_stride + column, (grad / temperature).to(out.dtype.element_ty), mask=inside)

    return logits_grad


def triton_chunk_grad(out: Tensor, logits: Tensor, lse: Tensor, target_ids: Tensor, grad_target: Tensor,
                      top_ids: Tensor | None, grad_top: Tensor | None, candidate_masks: Tensor | None,
                      temperature: float) -> Tensor:
    """``chunk_grad``'s result written into ``out`` (``[c, V]``, rows contiguous; may be ``logits`` itself);
    CUDA tensors. Returns ``out``."""
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
    _kernel[(rows,)](out, logits, lse, target_ids.long().contiguous(), grad_target, ids, tops, masks, vocab,
                     logits.stride(0), out.stride(0), float(temperature), N_TOP=n_top,
                     HAS_MASK=candidate_masks is not None, BLOCK=4096, num_warps=8)
    return out


def available(logits: Tensor) -> bool:
    """Whether ``triton_chunk_grad`` takes these logits: CUDA with Triton, a 16- or 32-bit float, columns
    contiguous."""
    if logits.device.type != "cuda" or logits.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return False
    if logits.dim() != 2 or logits.stride(1) != 1:
        return False
    from torch.utils._triton import has_triton

    return has_triton()

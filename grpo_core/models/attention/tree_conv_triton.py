"""The short convolution over a packed prefix trie as Triton kernels that read the trie's index tables.

Three kernels, each a pass over the row channel-last (``[U, C]``, in tiles of tokens by channels whose sizes are
timed on the first call, per channel count), with the activation (silu) fused:

- forward: ``y = act(bias + sum_j w[:, j] * x[taps[:, j]])``, accumulated in fp32;
- backward, first pass: recomputes the pre-activation, writes its gradient ``g`` (fp32) and, per tile of tokens,
  partial sums of the weight and bias gradients, summed afterwards in a fixed order;
- backward, second pass: ``dx[s] = sum_j w[:, j] * g[succ[s, j]]``, plus the few sums of readers in other
  segments (``tree_conv_plan.cross_input_grad``), added before the one rounding to ``x``'s dtype.

No atomics: the gradients are the same bit for bit on every run. Why these kernels next to flash-linear-attention's
varlen convolution: they take the trie as it is (no per-segment initial states gathered from the row and no
scatter of their gradients back), and every token's context is one table lookup. Which of the two is faster on a
machine is measured side by side (``benchmarks/models/qwen35_speed.py --parts conv``).

Importing this module needs Triton; ``short_conv`` imports it only when its ``triton`` backend runs. Its tests
run on a GPU, or on the CPU under Triton's interpreter (``TRITON_INTERPRET=1``; ``tests/test_gated_delta.py``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from grpo_core.models.attention.tree_conv_plan import TreeConvPlan, cross_input_grad

GRAD_BLOCK_T = 64
"""Tokens per tile of the first backward pass: each tile writes a partial weight gradient (``[C, K]`` fp32), so
longer tiles write fewer (at 16k tokens and 6144 channels, 25 MB)."""
FUSED_ACTIVATIONS = (None, "silu", "swish")
"""Activations the kernels apply themselves; others run after them."""

# Tiles (tokens x channels) and warps, picked per channel count by timing each on the first call. A gathered
# tile row is contiguous in channels, so wide tiles read whole cache lines.
_PASS_CONFIGS = [triton.Config({"BLOCK_T": t, "BLOCK_C": c}, num_warps=w)
                 for t, c, w in ((32, 128, 4), (64, 128, 8), (16, 256, 4), (64, 64, 4))]
_GRAD_CONFIGS = [triton.Config({"BLOCK_C": c}, num_warps=w) for c, w in ((64, 4), (128, 4), (128, 8))]


@triton.jit
def _pre_activation(x, w, b, taps, rt, rc, mt, mc, C, K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
                    HAS_BIAS: tl.constexpr):
    acc = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
    for j in tl.static_range(K):
        src = tl.load(taps + rt * K + j, mask=mt, other=-1)
        xv = tl.load(x + src.to(tl.int64)[:, None] * C + rc[None, :], mask=(src >= 0)[:, None] & mc[None, :], other=0.0)
        wj = tl.load(w + rc * K + j, mask=mc, other=0.0).to(tl.float32)
        acc += xv.to(tl.float32) * wj[None, :]
    if HAS_BIAS:
        acc += tl.load(b + rc, mask=mc, other=0.0).to(tl.float32)[None, :]
    return acc


@triton.autotune(configs=_PASS_CONFIGS, key=["C"])
@triton.jit
def _forward_kernel(x, w, b, taps, y, U, C, K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
                    HAS_BIAS: tl.constexpr, SILU: tl.constexpr):
    rt = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    rc = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mt, mc = rt < U, rc < C
    acc = _pre_activation(x, w, b, taps, rt, rc, mt, mc, C, K, BLOCK_T, BLOCK_C, HAS_BIAS)
    if SILU:
        acc = acc * tl.sigmoid(acc)
    tl.store(y + rt.to(tl.int64)[:, None] * C + rc[None, :], acc.to(y.dtype.element_ty), mask=mt[:, None] & mc[None, :])


@triton.autotune(configs=_GRAD_CONFIGS, key=["C"])
@triton.jit
def _grad_pre_kernel(x, w, b, taps, dy, g, dw_part, db_part, U, C, K: tl.constexpr, BLOCK_T: tl.constexpr,
                     BLOCK_C: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr):
    pid_t = tl.program_id(0)
    rt = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    rc = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mt, mc = rt < U, rc < C
    mask = mt[:, None] & mc[None, :]
    at = rt.to(tl.int64)[:, None] * C + rc[None, :]
    d = tl.load(dy + at, mask=mask, other=0.0).to(tl.float32)
    if SILU:
        pre = _pre_activation(x, w, b, taps, rt, rc, mt, mc, C, K, BLOCK_T, BLOCK_C, HAS_BIAS)
        s = tl.sigmoid(pre)
        d = d * s * (1.0 + pre * (1.0 - s))
    d = tl.where(mask, d, 0.0)
    tl.store(g + at, d, mask=mask)
    for j in tl.static_range(K):
        src = tl.load(taps + rt * K + j, mask=mt, other=-1)
        xv = tl.load(x + src.to(tl.int64)[:, None] * C + rc[None, :], mask=(src >= 0)[:, None] & mc[None, :], other=0.0)
        tl.store(dw_part + (pid_t * C + rc) * K + j, tl.sum(d * xv.to(tl.float32), 0), mask=mc)
    if HAS_BIAS:
        tl.store(db_part + pid_t * C + rc, tl.sum(d, 0), mask=mc)


@triton.autotune(configs=_PASS_CONFIGS, key=["C"])
@triton.jit
def _input_grad_kernel(g, w, succ, cross, cross_row, dx, U, C, K: tl.constexpr, BLOCK_T: tl.constexpr,
                       BLOCK_C: tl.constexpr, HAS_CROSS: tl.constexpr):
    rt = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    rc = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mt, mc = rt < U, rc < C
    acc = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
    for j in tl.static_range(K):
        reader = tl.load(succ + rt * K + j, mask=mt, other=-1)
        gv = tl.load(g + reader.to(tl.int64)[:, None] * C + rc[None, :], mask=(reader >= 0)[:, None] & mc[None, :],
                     other=0.0)
        acc += gv * tl.load(w + rc * K + j, mask=mc, other=0.0).to(tl.float32)[None, :]
    if HAS_CROSS:
        line = tl.load(cross_row + rt, mask=mt, other=-1)
        acc += tl.load(cross + line.to(tl.int64)[:, None] * C + rc[None, :], mask=(line >= 0)[:, None] & mc[None, :],
                       other=0.0)
    tl.store(dx + rt.to(tl.int64)[:, None] * C + rc[None, :], acc.to(dx.dtype.element_ty),
             mask=mt[:, None] & mc[None, :])


def _grid(u: int, c: int, block_t: int | None = None):
    return lambda meta: (triton.cdiv(u, block_t or meta["BLOCK_T"]), triton.cdiv(c, meta["BLOCK_C"]))


class TreeConvFunction(torch.autograd.Function):
    """``rows`` ``[U, C]`` (contiguous), ``weight`` ``[C, K]``, ``bias`` ``[C]`` or None -> ``[U, C]`` in ``rows``'
    dtype, silu applied when ``silu``."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, plan: TreeConvPlan,
                silu: bool) -> torch.Tensor:
        u, c = rows.shape
        weight = weight.contiguous()
        y = torch.empty_like(rows)
        if u:
            _forward_kernel[_grid(u, c)](rows, weight, weight if bias is None else bias, plan.taps, y, u, c,
                                         K=plan.kernel, HAS_BIAS=bias is not None, SILU=silu)
        ctx.save_for_backward(rows, weight, bias)
        ctx.plan, ctx.silu = plan, silu
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        rows, weight, bias = ctx.saved_tensors
        plan: TreeConvPlan = ctx.plan
        u, c = rows.shape
        k = plan.kernel
        tiles = triton.cdiv(u, GRAD_BLOCK_T)
        g = torch.empty(u, c, dtype=torch.float32, device=rows.device)
        dw_part = torch.empty(tiles, c, k, dtype=torch.float32, device=rows.device)
        db_part = torch.empty(tiles, c, dtype=torch.float32, device=rows.device) if bias is not None else dw_part
        dx = torch.empty_like(rows)
        if u:
            _grad_pre_kernel[_grid(u, c, GRAD_BLOCK_T)](rows, weight, weight if bias is None else bias, plan.taps,
                                                        dy.contiguous(), g, dw_part, db_part, u, c, K=k,
                                                        BLOCK_T=GRAD_BLOCK_T, HAS_BIAS=bias is not None, SILU=ctx.silu)
            cross = cross_input_grad(g, weight, plan) if plan.has_cross else g
            _input_grad_kernel[_grid(u, c)](g, weight, plan.succ, cross, plan.cross_row, dx, u, c, K=k,
                                            HAS_CROSS=plan.has_cross)
        dw = dw_part.sum(0).to(weight.dtype)
        db = db_part.sum(0).to(bias.dtype) if bias is not None else None
        return dx, dw, db, None, None


def tree_conv_triton(rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: str | None,
                     plan: TreeConvPlan) -> torch.Tensor:
    """The tree convolution of ``rows`` ``[U, C]`` with its activation, ``[U, C]`` in ``rows``' dtype."""
    if activation not in FUSED_ACTIVATIONS:
        raise ValueError(f"the Triton tree convolution fuses {FUSED_ACTIVATIONS[1:]} or none, not {activation!r}: "
                         "apply it after a call with activation=None")
    return TreeConvFunction.apply(rows.contiguous(), weight, bias, plan, activation is not None)

"""Gated DeltaNet over a packed prefix trie: the short convolution and the gated delta rule, exact per sample.

A packed row (``grpo_core.packing.collator``) is a list of segments laid out depth-first; segment ``g``
owns the row positions ``cu_seq_q[g]:cu_seq_q[g+1]`` and its root-to-segment path is listed in
``kv_index`` (``grpo_core.models.attention.metadata.TreeAttentionMetadata``). A Gated DeltaNet layer
mixes tokens in two places, and both must follow the trie instead of the row order:

* the depthwise causal convolution (kernel ``K``, 4 in Qwen3.5/Qwen3-Next) reads the ``K - 1``
  tokens before each token. For a segment's first tokens those are the last tokens of its *path*
  (its parent's tail, or further up when the parent is short), never the sibling laid out just
  before it. ``tree_causal_conv1d`` gathers, per segment, ``K - 1`` path tokens (zeros above a
  root) followed by the segment's own tokens, and runs one ungrouped-by-segment convolution over
  that gathered sequence, keeping the outputs of the own tokens;
* the recurrence ``S_t = a_t S_{t-1} + k_t b_t (v_t - a_t S_{t-1}^T k_t)^T``, ``o_t = S_t^T q_t``
  must start each segment from the state its parent ended in. Segments are grouped by depth in
  the trie of segments (roots first); every group is one batched (or varlen) call whose initial
  states are the final states of the parents, taken from the previous group.

Backends of the delta rule (picked by ``select_gdn_backend``, like the attention backends):

- ``reference``: plain PyTorch, a chunked (WY) form of the recurrence batched over the segments of a
  depth, padded to the longest. Runs anywhere, fp32 or fp64 state; the oracle of the tests.
- ``fla``: flash-linear-attention's varlen ``chunk_gated_delta_rule`` (``fla-core``, CUDA), one call per
  depth with ``cu_seqlens``, per-sequence ``initial_state`` and final states. fla runs its Triton kernels,
  or FlashQLA's fused TileLang kernels where the ``flash-qla`` package is installed and the heads are 128
  wide (``fla_kernel``). Accepted only if a probe on a small tree, at the model's head sizes, agrees with
  ``reference`` in output and gradients.

Backends of the convolution (picked with the delta rule's, ``select_conv_backend``): ``torch``, the gathered
channel-last multiply-adds of ``tree_causal_conv1d``, and with ``fla`` flash-linear-attention's varlen Triton
kernel, the row's segments as its sequences and each one's path context (``conv_context``) as its initial state;
accepted only if a probe at the layers' width agrees with ``torch``.

Run its tests: ``.venv/bin/python -m pytest tests/test_gated_delta.py``.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F

from grpo_core.models.attention.gather import gather_rows
from grpo_core.models.attention.metadata import TreeAttentionMetadata

log = logging.getLogger(__name__)

CHUNK = 64  # chunk length of the reference scan: matmul-sized blocks, a short sequential loop


# ---- the row's segments as a tree of segments -----------------------------------------------------
@dataclass
class Depth:
    """The segments at one depth of the segment tree, in row order."""

    rows: torch.Tensor  # int64 [T]: row positions of these segments' tokens, segment after segment
    padded: torch.Tensor  # int64 [N, L]: the same positions padded to the longest segment, -1 = pad
    cu_seqlens: torch.Tensor  # int64 [N + 1]: token ranges of the segments within ``rows``
    cu_seqlens_cpu: torch.Tensor  # the same on the host: kernels that plan on the host read it without a device sync
    parent: torch.Tensor | None  # int64 [N]: each segment's parent among the previous depth's segments
    whole_row: bool = False  # ``rows`` is the row in order (a row of roots only): the tensors are taken as they are


@dataclass
class SegmentTree:
    """What the delta rule needs of a row: segments by depth and the way back to row order."""

    depths: list[Depth]
    unsort: torch.Tensor | None  # int64 [U]: row position -> its place in the depth-by-depth concatenation
    # (None where that is the row order: one depth of roots, a row without shared prefixes)


def host_arrays(meta: TreeAttentionMetadata) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """int64 ``cu_seq_q``, ``cu_seq_k`` and ``kv_index`` (None for a flat row) as host arrays: from the collator's host
    copy where the row has one, else copied from the device (one sync)."""
    src = meta.on_host() or meta
    as_np = lambda t: t.cpu().numpy().astype(np.int64)  # noqa: E731
    return as_np(src.cu_seq_q), as_np(src.cu_seq_k), None if src.kv_index is None else as_np(src.kv_index)


def segment_parents(meta: TreeAttentionMetadata) -> np.ndarray:
    """int64 ``[G]``: the segment each segment continues (-1 for a root).

    A segment's path is its parent's path followed by its own tokens, so the path position just
    before its own tokens is the parent's last token.
    """
    cu_q, cu_k, kv = host_arrays(meta)
    q_len, k_len = np.diff(cu_q), np.diff(cu_k)
    parents = np.full(len(q_len), -1, dtype=np.int64)
    if kv is None:
        return parents
    for g in np.flatnonzero(k_len > q_len):
        last = int(kv[cu_k[g] + k_len[g] - q_len[g] - 1])
        p = int(np.searchsorted(cu_q, last, side="right")) - 1
        if p >= g or cu_q[p + 1] - 1 != last:
            raise ValueError(f"segment {g}: its path does not continue a segment at that segment's last token")
        parents[g] = p
    return parents


def build_segment_tree(meta: TreeAttentionMetadata, device: torch.device) -> SegmentTree:
    """Group the segments of ``meta`` by depth (parents are laid out before their children)."""
    cu_q = host_arrays(meta)[0]
    parents = segment_parents(meta)
    depth = np.zeros(len(parents), dtype=np.int64)
    for g, p in enumerate(parents):
        depth[g] = 0 if p < 0 else depth[p] + 1
    place = np.zeros(len(parents), dtype=np.int64)  # index of a segment among those of its depth
    depths, order = [], []
    for d in range(int(depth.max()) + 1 if len(depth) else 0):
        segs = np.flatnonzero(depth == d)
        place[segs] = np.arange(len(segs))
        lengths = cu_q[segs + 1] - cu_q[segs]
        width = int(lengths.max())
        padded = np.full((len(segs), width), -1, dtype=np.int64)
        for i, g in enumerate(segs):
            padded[i, : lengths[i]] = np.arange(cu_q[g], cu_q[g + 1])
        rows = padded[padded >= 0]
        order.append(rows)
        to = lambda a: torch.as_tensor(a, dtype=torch.int64).to(device)  # noqa: E731
        cu_seqlens = torch.as_tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int64)
        depths.append(Depth(
            rows=to(rows), padded=to(padded), cu_seqlens=cu_seqlens.to(device), cu_seqlens_cpu=cu_seqlens,
            parent=None if d == 0 else to(place[parents[segs]]),
            whole_row=len(rows) == int(cu_q[-1]) and bool((rows == np.arange(len(rows))).all()),
        ))
    total = int(cu_q[-1])
    concatenated = np.concatenate(order) if order else np.zeros(0, dtype=np.int64)
    if (concatenated == np.arange(total)).all():
        return SegmentTree(depths, None)
    unsort = np.empty(total, dtype=np.int64)
    unsort[concatenated] = np.arange(total)
    return SegmentTree(depths, torch.as_tensor(unsort).to(device))


def conv_context(meta: TreeAttentionMetadata, kernel: int) -> np.ndarray:
    """int64 ``[G, kernel - 1]``: per segment, the path positions just before its own tokens, oldest first
    (-1 above the root): what the short convolution reads before a segment's first token."""
    cu_q, cu_k, kv = host_arrays(meta)
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
    cu_q = host_arrays(meta)[0]
    context = conv_context(meta, kernel)
    ctx, parts, keep, offset = kernel - 1, [], [], 0
    for g in range(len(cu_q) - 1):
        q = int(cu_q[g + 1] - cu_q[g])
        parts.append(np.concatenate([context[g], np.arange(cu_q[g], cu_q[g + 1])]))
        # Valid output j covers source[j : j + kernel], so own token i (at source ctx + i) is output i.
        keep.append(offset + np.arange(q))
        offset += ctx + q
    return np.concatenate(parts), np.concatenate(keep)


def cached(meta: TreeAttentionMetadata, key: tuple, build: Callable[[], object]) -> object:
    """``build()`` once per row: every GDN layer of a forward reads the same plan."""
    if key not in meta.cache:
        meta.cache[key] = build()
    return meta.cache[key]


# ---- the short convolution --------------------------------------------------------------------------
def _conv_plan(x: torch.Tensor, kernel: int, meta: TreeAttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    return cached(
        meta, ("gdn_conv", kernel, x.device),
        lambda: tuple(torch.as_tensor(a).to(x.device) for a in conv_indices(meta, kernel)),
    )


def tree_causal_conv1d(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, meta: TreeAttentionMetadata
) -> torch.Tensor:
    """Depthwise causal convolution of ``x`` ``[1, C, U]`` along every sample's path; ``weight`` ``[C, K]``.

    Returns ``[1, C, U]`` in ``weight``'s dtype (the activation is the caller's). Computed channel-last
    as ``K`` shifted multiply-adds over the gathered ``[E, C]`` rows, accumulated in fp32 (what a
    convolution kernel does inside): element-wise work, which a compiled layer can fuse. Run eagerly it
    is slower than ``tree_causal_conv1d_grouped`` (benchmarks/README.md, "The Qwen3.5 family: hybrid against
    dense, MoE MFU, packed log-prob gap").
    """
    if x.shape[0] != 1:
        raise ValueError(f"a packed row is one sequence (batch 1), got batch {x.shape[0]}")
    kernel = weight.shape[-1]
    source, keep = _conv_plan(x, kernel, meta)
    rows = x[0].t().to(weight.dtype)  # [U, C]
    rows = torch.cat([rows.new_zeros(1, rows.shape[1]), rows])  # row 0: the zeros above a root
    gathered = gather_rows(rows, source + 1)  # [E, C]
    valid = gathered.shape[0] - kernel + 1  # output j covers gathered[j : j + kernel]
    wide = torch.promote_types(weight.dtype, torch.float32)
    taps = weight.to(wide).t()  # [K, C]
    out = gathered[:valid].to(wide) * taps[0]
    for i in range(1, kernel):
        out = out + gathered[i : i + valid].to(wide) * taps[i]
    out = out.index_select(0, keep)
    if bias is not None:
        out = out + bias.to(wide)
    return out.to(weight.dtype).t().unsqueeze(0)


def tree_causal_conv1d_grouped(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, meta: TreeAttentionMetadata
) -> torch.Tensor:
    """``tree_causal_conv1d`` as one grouped ``conv1d`` over the gathered, channel-first rows (the
    comparison of the tests and of the speed benchmark)."""
    kernel = weight.shape[-1]
    source, keep = _conv_plan(x, kernel, meta)
    rows = x[0].t().to(weight.dtype)
    rows = torch.cat([rows.new_zeros(1, rows.shape[1]), rows])
    gathered = gather_rows(rows, source + 1).t().unsqueeze(0)  # [1, C, E]
    out = F.conv1d(gathered, weight.unsqueeze(1), bias, groups=weight.shape[0])
    return out.index_select(2, keep)


# ---- the short convolution: backends ----------------------------------------------------------------
def activation_fn(name: str | None) -> Callable[[torch.Tensor], torch.Tensor]:
    """transformers' activation of that name (identity for None)."""
    if name is None:
        return lambda x: x
    from transformers.activations import ACT2FN

    return ACT2FN[name]


def _torch_conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: str | None,
                meta: TreeAttentionMetadata) -> torch.Tensor:
    return activation_fn(activation)(tree_causal_conv1d(x, weight, bias, meta)).to(x.dtype)


FLA_ACTIVATIONS = (None, "silu", "swish")
"""Activations flash-linear-attention's convolution applies inside its kernel; others run after it."""


def _fla_conv_plan(x: torch.Tensor, kernel: int, meta: TreeAttentionMetadata) -> tuple[torch.Tensor, ...]:
    """``(context, cu_seqlens, cu_seqlens_cpu, chunk_indices)`` of a row, once per row: the segments in row order
    are the kernel's variable-length sequences, and each one's context its initial state."""
    from fla.ops.utils.index import prepare_chunk_indices

    def build() -> tuple[torch.Tensor, ...]:
        cu_cpu = torch.from_numpy(host_arrays(meta)[0])
        cu = cu_cpu.to(x.device)
        context = torch.as_tensor(conv_context(meta, kernel)).to(x.device)
        return context, cu, cu_cpu, prepare_chunk_indices(cu, FLA_CONV_CHUNK, cu_seqlens_cpu=cu_cpu)

    return cached(meta, ("gdn_conv_fla", kernel, x.device), build)


FLA_CONV_CHUNK = 64
"""Tokens per program of flash-linear-attention's convolution (its default block)."""


def _fla_conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: str | None,
              meta: TreeAttentionMetadata) -> torch.Tensor:
    """flash-linear-attention's causal convolution (Triton; fused activation, fp32 accumulation) over the
    row's segments as variable-length sequences, each started from the ``kernel - 1`` path tokens before it as
    its initial state (zeros above a root). The state is gathered from the row, so gradients reach those
    tokens through it. Returns ``[1, C, U]`` in ``x``'s dtype."""
    from fla.modules.causal_conv1d import causal_conv1d

    if x.shape[0] != 1:
        raise ValueError(f"a packed row is one sequence (batch 1), got batch {x.shape[0]}")
    kernel = weight.shape[-1]
    context, cu, cu_cpu, chunks = _fla_conv_plan(x, kernel, meta)
    rows = x[0].t().contiguous()  # [U, C]: a layer hands over a transposed [1, U, C] projection, so no copy
    # [G, K - 1, C]: only the context is gathered (a padded copy of the whole row would cost a pass over it)
    before = rows[context.clamp(min=0)] * (context >= 0).unsqueeze(-1).to(rows.dtype)
    # fla's state holds the last ``kernel`` inputs, oldest first; the convolution reads the last kernel - 1
    state = torch.cat([before.new_zeros(before.shape[0], 1, before.shape[2]), before], 1).transpose(1, 2)
    fused = activation if activation in FLA_ACTIVATIONS else None
    y, _ = causal_conv1d(rows.unsqueeze(0), weight.to(rows.dtype), None if bias is None else bias.to(rows.dtype),
                         initial_state=state.contiguous(), activation=fused, cu_seqlens=cu, cu_seqlens_cpu=cu_cpu,
                         chunk_indices=chunks)
    out = y[0].t().unsqueeze(0)
    return out if fused == activation else activation_fn(activation)(out)


@dataclass
class ConvBackend:
    name: str
    run: Callable[..., torch.Tensor]
    """``(x [1, C, U], weight [C, K], bias, activation, meta) -> [1, C, U]`` in ``x``'s dtype, activation applied."""
    needs_cuda: bool


CONV_BACKENDS: dict[str, ConvBackend] = {
    "torch": ConvBackend("torch", _torch_conv, needs_cuda=False),
    # A compiled layer runs the kernel as it is: fla keeps its own dispatch out of graphs, and the gathered
    # context would otherwise be traced around a break.
    "fla": ConvBackend("fla", torch.compiler.disable(_fla_conv, recursive=True), needs_cuda=True),
}


def tree_conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: str | None,
              meta: TreeAttentionMetadata, backend: ConvBackend | None = None) -> torch.Tensor:
    """The short convolution of a Gated DeltaNet layer over a packed row, activation included, with ``backend``
    (default: the one ``register_gdn_backend`` chose)."""
    return (backend or _active_conv).run(x, weight, bias, activation, meta)


# ---- the gated delta rule: reference ---------------------------------------------------------------
def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def chunked_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state: torch.Tensor, chunk: int = CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule over ``[N, H, T, *]`` sequences from ``state`` ``[N, H, Dk, Dv]``.

    ``q`` (already scaled) and ``k`` are ``[N, H, T, Dk]``, ``v`` ``[N, H, T, Dv]``, ``g`` (log decay)
    and ``beta`` ``[N, H, T]``. Returns the outputs ``[N, H, T, Dv]`` and the final states.
    Zero padding at the end (``k = v = 0``, ``g = beta = 0``) leaves the state unchanged.

    Within a chunk, with ``c_t`` the cumulative log decay and ``D[t, s] = exp(c_t - c_s)`` for
    ``s <= t``, the corrections ``u_t = b_t (v_t - a_t S_{t-1}^T k_t)`` solve the unit lower
    triangular system ``(I + A) u = b v - b e^c k S_0`` with ``A[t, s] = b_t (k_t . k_s) D[t, s]``
    (``s < t``); then ``o = e^c q S_0 + ((q k^T) * D) u`` and ``S = e^{c_C} S_0 + sum_s e^{c_C - c_s} k_s u_s^T``.
    """
    n, h, t, dk = k.shape
    pad = (-t) % chunk
    if pad:
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = F.pad(g, (0, pad)), F.pad(beta, (0, pad))
    blocks = (t + pad) // chunk
    q, k, v = (x.reshape(n, h, blocks, chunk, x.shape[-1]) for x in (q, k, v))
    g, beta = g.reshape(n, h, blocks, chunk), beta.reshape(n, h, blocks, chunk)

    c = g.cumsum(-1)
    lower = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    decay = (c.unsqueeze(-1) - c.unsqueeze(-2)).masked_fill(~lower, float("-inf")).exp()  # D, zero above
    kb = k * beta.unsqueeze(-1)
    system = (kb @ k.transpose(-1, -2) * decay).tril(-1) + torch.eye(chunk, dtype=q.dtype, device=q.device)
    w = torch.linalg.solve_triangular(system, v * beta.unsqueeze(-1), upper=False, unitriangular=True)
    kd = torch.linalg.solve_triangular(system, kb * c.exp().unsqueeze(-1), upper=False, unitriangular=True)
    qk = q @ k.transpose(-1, -2) * decay
    q_in = q * c.exp().unsqueeze(-1)  # reads the state the chunk started from
    total = c[..., -1]  # [N, H, blocks]
    k_out = k * (total.unsqueeze(-1) - c).exp().unsqueeze(-1)  # writes, decayed to the chunk's end

    outs = []
    for i in range(blocks):
        u = w[:, :, i] - kd[:, :, i] @ state
        outs.append(q_in[:, :, i] @ state + qk[:, :, i] @ u)
        state = state * total[:, :, i].exp()[..., None, None] + k_out[:, :, i].transpose(-1, -2) @ u
    out = torch.stack(outs, 2).reshape(n, h, blocks * chunk, -1)[:, :, :t]
    return out, state


def _reference_depth(q, k, v, g, beta, depth: Depth, initial: torch.Tensor | None):
    """One depth as a padded batch: ``[U, H, *]`` row tensors in, ``[T, H, Dv]`` and final states out."""
    index = depth.padded.clamp(min=0)
    valid = (depth.padded >= 0).unsqueeze(-1)  # [N, L, 1]

    def take(x: torch.Tensor) -> torch.Tensor:  # [U, H, ...] -> [N, H, L, ...], zeros in the padding
        out = x[index]
        out = out * valid.view(*valid.shape[:2], *([1] * (out.dim() - 2)))
        return out.transpose(1, 2)

    qs, ks, vs, gs, bs = (take(x) for x in (q, k, v, g, beta))
    n, h, _, dk = ks.shape
    if initial is None:
        initial = qs.new_zeros(n, h, dk, vs.shape[-1])
    # Short segments (most of a trie's) get a chunk of their own length rather than 64 padded slots.
    out, final = chunked_delta_rule(qs, ks, vs, gs, bs, initial, chunk=min(CHUNK, ks.shape[2]))
    return out.transpose(1, 2)[valid.squeeze(-1)], final


def take_rows(x: torch.Tensor, depth: Depth) -> torch.Tensor:
    """``x``'s rows of ``depth``'s segments: ``x`` itself where they are the whole row in order (a gather and its
    scatter in the backward would cost a pass over the row each), else a gather. A flag, not a slice by offsets,
    so that a compiled layer does not specialise on a row's length."""
    return x if depth.whole_row else x.index_select(0, depth.rows)


def _fla_depth(q, k, v, g, beta, depth: Depth, initial: torch.Tensor | None):
    """One depth as one varlen call of flash-linear-attention (q already normalised and scaled)."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    take = lambda x: take_rows(x, depth).unsqueeze(0)  # noqa: E731
    out, final = chunk_gated_delta_rule(
        take(q), take(k), take(v), take(g), take(beta), scale=1.0, initial_state=initial,
        output_final_state=True, cu_seqlens=depth.cu_seqlens, cu_seqlens_cpu=depth.cu_seqlens_cpu,
    )
    return out[0], final


@dataclass
class GDNBackend:
    name: str
    run_depth: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    needs_cuda: bool


GDN_BACKENDS: dict[str, GDNBackend] = {
    "reference": GDNBackend("reference", _reference_depth, needs_cuda=False),
    "fla": GDNBackend("fla", _fla_depth, needs_cuda=True),
}


def tree_gated_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    meta: TreeAttentionMetadata, l2norm: bool = True, backend: GDNBackend | None = None,
) -> torch.Tensor:
    """The gated delta rule of one packed row, each segment starting from its parent's final state.

    ``q``, ``k`` ``[U, H, Dk]`` (heads already repeated to the value heads), ``v`` ``[U, H, Dv]``,
    ``g``, ``beta`` ``[U, H]``. Returns ``[U, H, Dv]`` in ``v``'s dtype. The state is kept in fp32
    (fp64 for fp64 inputs) on the reference path, as the kernels do.
    """
    backend = backend or active_gdn_backend()
    out_dtype = v.dtype
    # Normalise in fp32 (or wider); the fused kernel then takes the inputs in their own dtype.
    wide = torch.promote_types(v.dtype, torch.float32)
    work = v.dtype if backend.needs_cuda else wide
    q, k = q.to(wide), k.to(wide)
    if l2norm:
        q, k = l2_normalize(q), l2_normalize(k)
    q = q * q.shape[-1] ** -0.5
    q, k, v, beta, g = q.to(work), k.to(work), v.to(work), beta.to(work), g.to(wide)
    tree: SegmentTree = cached(meta, ("gdn_tree", q.device), lambda: build_segment_tree(meta, q.device))
    outs, finals = [], None
    for depth in tree.depths:
        initial = None if depth.parent is None else finals.index_select(0, depth.parent)
        out, finals = backend.run_depth(q, k, v, g, beta, depth, initial)
        outs.append(out)
    out = outs[0] if len(outs) == 1 else torch.cat(outs)
    return (out if tree.unsort is None else out.index_select(0, tree.unsort)).to(out_dtype)


# ---- choosing the backend ---------------------------------------------------------------------------
PROBE_TREES = {
    # a root of 70 tokens (two chunks), children of 9 and 40, a grandchild of 3 under the first
    "short": [70, 9, 3, 40],
    # the same tree under a root of 4,000 tokens: long enough for a kernel to split one sequence over the
    # GPU (FlashQLA's intra-card context parallelism), a path the short tree never takes
    "long": [4000, 9, 3, 400],
}


def _probe_meta(device: torch.device, q_lens: list[int] = PROBE_TREES["short"]) -> TreeAttentionMetadata:
    """Segments of ``q_lens`` tokens: a root, two children, a grandchild under the first child."""
    parents = [None, 0, 1, 0]
    offsets = np.concatenate([[0], np.cumsum(q_lens)])
    paths: list[np.ndarray] = []
    for i, p in enumerate(parents):
        own = np.arange(offsets[i], offsets[i + 1])
        paths.append(own if p is None else np.concatenate([paths[p], own]))
    cu = lambda xs: torch.tensor(np.concatenate([[0], np.cumsum(xs)]), dtype=torch.int32)  # noqa: E731
    return TreeAttentionMetadata(cu(q_lens), cu([len(p) for p in paths]), max(q_lens), max(len(p) for p in paths),
                                 torch.as_tensor(np.concatenate(paths), dtype=torch.int64)).to(device)


def probe_gdn(backend: GDNBackend, device: torch.device, heads: int = 4, dk: int = 64, dv: int = 64,
              tree: str = "short") -> float:
    """Largest relative error of output and input gradients against ``reference`` on a small tree.

    ``dk``/``dv`` should be the model's head sizes: flash-linear-attention dispatches by shape (its FlashQLA
    kernels take heads of 128 only, other sizes its Triton kernels), so the probe checks the kernel the layers
    will run. ``tree``: a key of ``PROBE_TREES``."""
    meta = _probe_meta(device, PROBE_TREES[tree])
    u = int(meta.cu_seq_q[-1])
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(u, heads, dk, generator=gen), torch.randn(u, heads, dk, generator=gen)
    v = torch.randn(u, heads, dv, generator=gen)
    g = -F.softplus(torch.randn(u, heads, generator=gen))
    beta = torch.rand(u, heads, generator=gen)
    grad = torch.randn(u, heads, dv, generator=gen)
    results = []
    for be, dtype in ((backend, torch.bfloat16), (GDN_BACKENDS["reference"], torch.float32)):
        xs = [t.to(device, dtype if t is not g else torch.float32).requires_grad_() for t in (q, k, v, g, beta)]
        out = tree_gated_delta_rule(*xs, meta, l2norm=True, backend=be)
        out.backward(grad.to(device, dtype))
        results.append([out.detach().float()] + [x.grad.float() for x in xs])
    return max(float((a - b).norm() / b.norm()) for a, b in zip(*results))


def fla_kernel(dk: int, dv: int) -> str:
    """Which of flash-linear-attention's kernels serve heads of ``dk``/``dv`` here: ``flash_qla`` (the fused
    TileLang kernels of the ``flash-qla`` package, which fla dispatches to on Hopper and Blackwell for heads of
    128 unless ``FLA_FLASH_QLA=0``) or ``triton`` (fla's own). A label for reports; fla decides per call."""
    if importlib.util.find_spec("flash_qla") is None or os.environ.get("FLA_FLASH_QLA", "1") == "0":
        return "triton"
    return "flash_qla" if dk == dv == 128 else "triton"


def _probe_fla(device: torch.device, dk: int, dv: int) -> str | None:
    """None where fla passes ``probe_gdn`` at these head sizes on both probe trees, else why not."""
    try:
        err = max(probe_gdn(GDN_BACKENDS["fla"], device, dk=dk, dv=dv, tree=tree) for tree in PROBE_TREES)
    except Exception as exc:  # noqa: BLE001 - not importable, no Triton, or a kernel that fails its backward
        return f"{type(exc).__name__}: {exc}"
    log.info("gated-delta probe of fla (%s kernels, heads of %d/%d): error %.2e", fla_kernel(dk, dv), dk, dv, err)
    return None if err < 2e-2 else f"probe error {err:.2e}"


def probe_conv(backend: ConvBackend, device: torch.device, channels: int = 64, kernel: int = 4,
               tree: str = "short") -> float:
    """Largest relative error of ``backend``'s convolution (bf16, silu) in output and gradients of input, weight
    and bias against the PyTorch form in fp32, on a probe tree (``PROBE_TREES``) at the layers' width."""
    meta = _probe_meta(device, PROBE_TREES[tree])
    u = int(meta.cu_seq_q[-1])
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, u, channels, generator=gen).transpose(1, 2)  # as a layer hands it over
    weight, bias = torch.randn(channels, kernel, generator=gen) / kernel, torch.randn(channels, generator=gen)
    grad = torch.randn(1, channels, u, generator=gen)
    results = []
    for be, dtype in ((backend, torch.bfloat16), (CONV_BACKENDS["torch"], torch.float32)):
        xs = [t.to(device, dtype).requires_grad_() for t in (x, weight, bias)]
        out = tree_conv(*xs, "silu", meta, backend=be)
        out.backward(grad.to(device, dtype))
        results.append([out.detach().float()] + [t.grad.float() for t in xs])
    return max(float((a - b).norm() / b.norm()) for a, b in zip(*results))


def select_conv_backend(gdn: GDNBackend, device: torch.device, channels: int, kernel: int) -> ConvBackend:
    """``fla`` where the delta rule runs flash-linear-attention and its convolution passes ``probe_conv`` on both
    probe trees at the layers' width, else the PyTorch form (``tree_causal_conv1d``)."""
    if gdn.name != "fla":
        return CONV_BACKENDS["torch"]
    try:
        err = max(probe_conv(CONV_BACKENDS["fla"], device, channels, kernel, tree) for tree in PROBE_TREES)
    except Exception as exc:  # noqa: BLE001 - an fla without the module, or a kernel that fails
        err, failure = float("nan"), f"{type(exc).__name__}: {exc}"
    else:
        failure = None if err < 2e-2 else f"probe error {err:.2e}"
    if failure is None:
        log.info("short-convolution probe of fla (%d channels, kernel %d): error %.2e", channels, kernel, err)
        return CONV_BACKENDS["fla"]
    log.warning("flash-linear-attention's convolution is not usable here (%s); the short convolutions run the "
                "PyTorch form", failure)
    return CONV_BACKENDS["torch"]


def resolve_device(device: torch.device | str | None) -> torch.device:
    """``device``, or the CUDA device where there is one and the CPU otherwise."""
    return torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")


_active: GDNBackend = GDN_BACKENDS["reference"]
_active_conv: ConvBackend = CONV_BACKENDS["torch"]


def select_gdn_backend(name: str = "auto", device: torch.device | str | None = None,
                       dk: int = 64, dv: int = 64) -> GDNBackend:
    """``reference``, ``fla``, or with ``auto`` fla where it is importable on CUDA and passes the probe at
    head sizes ``dk``/``dv`` (the model's)."""
    if name not in ("auto", *GDN_BACKENDS):
        raise ValueError(f"unknown gated-delta backend {name!r}; known: {['auto', *GDN_BACKENDS]}")
    device = resolve_device(device)
    if name == "reference" or (name == "auto" and device.type != "cuda"):
        return GDN_BACKENDS["reference"]
    failure = _probe_fla(device, dk, dv)
    if failure is not None and fla_kernel(dk, dv) == "flash_qla":
        # fla's own kernels may still pass where FlashQLA's do not: switch its dispatch off (the switch fla
        # reads at every call) and probe again
        log.warning("FlashQLA's kernels failed the gated-delta probe (%s); setting FLA_FLASH_QLA=0", failure)
        os.environ["FLA_FLASH_QLA"] = "0"
        failure = _probe_fla(device, dk, dv)
    if failure is None:
        return GDN_BACKENDS["fla"]
    if name == "fla":
        raise RuntimeError(f"gated-delta backend 'fla' is not usable here: {failure}")
    log.warning("flash-linear-attention is not usable here (%s); Gated DeltaNet layers run the PyTorch reference", failure)
    return GDN_BACKENDS["reference"]


def register_gdn_backend(name: str = "auto", device: torch.device | str | None = None,
                         dk: int = 64, dv: int = 64, channels: int = 64, kernel: int = 4) -> str:
    """Make ``name`` (see ``select_gdn_backend``) the delta-rule backend of every patched GDN layer, and the
    convolution backend that goes with it (``select_conv_backend``, at the layers' ``channels`` and ``kernel``);
    returns the delta rule's."""
    global _active, _active_conv
    device = resolve_device(device)
    _active = select_gdn_backend(name, device, dk, dv)
    _active_conv = select_conv_backend(_active, device, channels, kernel)
    return _active.name


def active_gdn_backend() -> GDNBackend:
    return _active


def active_conv_backend() -> ConvBackend:
    return _active_conv

"""Gated DeltaNet's delta rule over a packed prefix trie, exact per sample.

A packed row (``grpo_core.packing.collator``) is a list of segments laid out depth-first; segment ``g``
owns the row positions ``cu_seq_q[g]:cu_seq_q[g+1]`` and its root-to-segment path is listed in
``kv_index`` (``grpo_core.models.attention.metadata.TreeAttentionMetadata``). A Gated DeltaNet layer
mixes tokens in two places, and both must follow the trie instead of the row order: its short convolution
(``grpo_core.models.attention.short_conv``) and the recurrence
``S_t = a_t S_{t-1} + k_t b_t (v_t - a_t S_{t-1}^T k_t)^T``, ``o_t = S_t^T q_t``, which must start each
segment from the state its parent ended in. Segments are grouped by depth in the trie of segments (roots
first); every group is one batched (or varlen) call whose initial states are the final states of the
parents, taken from the previous group.

Backends of the delta rule (picked by ``select_gdn_backend``, like the attention backends):

- ``reference``: plain PyTorch, a chunked (WY) form of the recurrence batched over the segments of a
  depth, padded to the longest. Runs anywhere, fp32 or fp64 state; the oracle of the tests.
- ``fla``: flash-linear-attention's varlen ``chunk_gated_delta_rule`` (``fla-core``, CUDA), one call per
  depth with ``cu_seqlens``, per-sequence ``initial_state`` and final states. fla runs its Triton kernels,
  or FlashQLA's fused TileLang kernels where the ``flash-qla`` package is installed and the heads are 128
  wide (``fla_kernel``). Accepted only if a probe on a small tree, at the model's head sizes, agrees with
  ``reference`` in output and gradients.

The convolution's backend is picked with the delta rule's (``register_gdn_backend``,
``short_conv.select_conv_backend``).

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

from grpo_core.models.attention import short_conv
from grpo_core.models.attention.metadata import TreeAttentionMetadata
from grpo_core.models.attention.probe_rows import PROBE_TREES, probe_meta
from grpo_core.models.permute import permute_rows

log = logging.getLogger(__name__)

CHUNK = 64  # chunk length of the reference scan: matmul-sized blocks, a short sequential loop


# ---- the row's segments as a tree of segments -----------------------------------------------------
@dataclass
class Depth:
    """The segments at one depth of the segment tree, in row order. A backend gets the depth's tokens as one
    ``[T, H, *]`` slice of the row put in depth order (``SegmentTree.order``), segment after segment."""

    padded: torch.Tensor  # int64 [N, L]: positions within the depth's slice, per segment, padded to the longest: -1
    cu_seqlens: torch.Tensor  # int64 [N + 1]: token ranges of the segments within the depth's slice
    cu_seqlens_cpu: torch.Tensor  # the same on the host: kernels that plan on the host read it without a device sync
    parent: torch.Tensor | None  # int64 [N]: each segment's parent among the previous depth's segments


@dataclass
class SegmentTree:
    """What the delta rule needs of a row: segments by depth, and the permutation between row and depth order."""

    depths: list[Depth]
    order: torch.Tensor | None  # int64 [U]: depth order's row positions, depth after depth (``x[order]`` sorts a row)
    unsort: torch.Tensor | None  # int64 [U]: the inverse, row position -> its place in depth order (unsorts)
    # (both None where depth order is the row order: one depth of roots, a row without shared prefixes)
    sizes: list[int]  # tokens per depth: the depths' slices of a row in depth order



def segment_parents(meta: TreeAttentionMetadata) -> np.ndarray:
    """int64 ``[G]``: the segment each segment continues (-1 for a root).

    A segment's path is its parent's path followed by its own tokens, so the path position just
    before its own tokens is the parent's last token.
    """
    cu_q, cu_k, kv = meta.host_arrays()
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


def plan_varlen_chunks(cu_seqlens: torch.Tensor, cu_seqlens_cpu: torch.Tensor) -> torch.Tensor:
    """``cu_seqlens`` with FlashQLA's chunk plan attached, where ``flash-qla`` is installed and it is on CUDA.

    FlashQLA's kernels find each sequence's chunks from a plan that they take from the ``cu_seqlens`` tensor itself
    where one is attached, and otherwise compute it on the GPU and read it back (a host wait each) into caches of
    four entries keyed by tensor identity: a miss at each row's first layer, and at every layer in a row of more than
    four depths, whose ``cu_seqlens`` tensors take turns. Made here once per row from the host's copy, the plan costs
    no wait."""
    if cu_seqlens.device.type != "cuda" or importlib.util.find_spec("flash_qla") is None:
        return cu_seqlens
    try:
        from flash_qla.utils.index import prepare_varlen_metadata
    except ImportError:  # a FlashQLA without plans: its kernels compute them as before
        return cu_seqlens
    return prepare_varlen_metadata(cu_seqlens, cu_seqlens_cpu)


def build_segment_tree(meta: TreeAttentionMetadata, device: torch.device, plan_chunks: bool = True) -> SegmentTree:
    """Group the segments of ``meta`` by depth (parents are laid out before their children). ``plan_chunks``: attach
    FlashQLA's chunk plans to each depth's ``cu_seqlens`` (``plan_varlen_chunks``; False leaves its kernels to plan
    on the GPU, for a side-by-side measurement)."""
    cu_q = meta.host_arrays()[0]
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
        starts = np.concatenate([[0], np.cumsum(lengths)])
        padded = np.full((len(segs), width), -1, dtype=np.int64)
        for i, g in enumerate(segs):
            padded[i, : lengths[i]] = np.arange(starts[i], starts[i + 1])
        rows = np.concatenate([np.arange(cu_q[g], cu_q[g + 1]) for g in segs])
        order.append(rows)
        to = lambda a: torch.as_tensor(a, dtype=torch.int64).to(device)  # noqa: E731
        cu_seqlens = torch.as_tensor(starts, dtype=torch.int64)
        depths.append(Depth(
            padded=to(padded),
            cu_seqlens=plan_varlen_chunks(cu_seqlens.to(device), cu_seqlens) if plan_chunks else cu_seqlens.to(device),
            cu_seqlens_cpu=cu_seqlens,
            parent=None if d == 0 else to(place[parents[segs]]),
        ))
    total = int(cu_q[-1])
    sizes = [len(rows) for rows in order]
    concatenated = np.concatenate(order) if order else np.zeros(0, dtype=np.int64)
    if (concatenated == np.arange(total)).all():
        return SegmentTree(depths, None, None, sizes)
    unsort = np.empty(total, dtype=np.int64)
    unsort[concatenated] = np.arange(total)
    return SegmentTree(depths, torch.as_tensor(concatenated).to(device), torch.as_tensor(unsort).to(device), sizes)


def depth_slices(x: torch.Tensor, tree: SegmentTree) -> tuple[torch.Tensor, ...]:
    """``x``'s rows ``[U, ...]`` as one slice per depth, in depth order: one permutation of the row (none where depth
    order is the row order) and a split, whose backward is one concatenation. Gathering each depth's rows from the
    row instead costs, in the backward, a zero tensor and a scatter-add of the whole row per depth, and the sum of
    the depths' gradients."""
    if tree.order is not None:
        x = permute_rows(x, tree.order, tree.unsort)
    return torch.split(x, tree.sizes)



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
    """One depth as a padded batch: the depth's ``[T, H, *]`` slices in, ``[T, H, Dv]`` and final states out."""
    index = depth.padded.clamp(min=0)
    valid = (depth.padded >= 0).unsqueeze(-1)  # [N, L, 1]

    def take(x: torch.Tensor) -> torch.Tensor:  # [T, H, ...] -> [N, H, L, ...], zeros in the padding
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


def _fla_depth(q, k, v, g, beta, depth: Depth, initial: torch.Tensor | None):
    """One depth (its ``[T, H, *]`` slices) as one varlen call of flash-linear-attention (q already normalised and
    scaled)."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    out, final = chunk_gated_delta_rule(
        q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), g.unsqueeze(0), beta.unsqueeze(0), scale=1.0, initial_state=initial,
        output_final_state=True, cu_seqlens=depth.cu_seqlens, cu_seqlens_cpu=depth.cu_seqlens_cpu,
    )
    # squeeze, not ``out[0]``: a select's backward writes a zero tensor of the whole output, then copies into it
    return out.squeeze(0), final


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
    # Normalise in fp32 (or wider); the fused kernel then takes the inputs in their own dtype. These element-wise
    # steps stay in the compiled layer's graph, fused with the projections around them.
    wide = torch.promote_types(v.dtype, torch.float32)
    work = v.dtype if backend.needs_cuda else wide
    q, k = q.to(wide), k.to(wide)
    if l2norm:
        q, k = l2_normalize(q), l2_normalize(k)
    q = q * q.shape[-1] ** -0.5
    q, k, v, beta, g = q.to(work), k.to(work), v.to(work), beta.to(work), g.to(wide)
    if backend.needs_cuda:
        # The kernels take contiguous tensors, and the value heads are a strided slice of the convolution's channels:
        # copied here, in the compiled layer's graph, rather than by the kernel's own guard, eagerly.
        q, k, v, beta, g = (t.contiguous() for t in (q, k, v, beta, g))
    return run_segment_tree(q, k, v, g, beta, meta, backend).to(out_dtype)


def segment_tree(meta: TreeAttentionMetadata, device: torch.device, plan_chunks: bool = True) -> SegmentTree:
    """The row's segment tree on ``device``, built once per row (``TreeAttentionMetadata.cached``): every layer's delta
    rule reads the first call's, so ``plan_chunks`` (``build_segment_tree``) counts only where that call is first."""
    return meta.cached(("gdn_tree", device), lambda: build_segment_tree(meta, device, plan_chunks))


@torch.compiler.disable
def run_segment_tree(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     meta: TreeAttentionMetadata, backend: GDNBackend) -> torch.Tensor:
    """The depths of the row's segment tree in turn (prepared inputs, as ``tree_gated_delta_rule`` hands them), each
    depth's initial states the final states of its parents. Kept out of compiled graphs as one call: the kernels
    inside break a graph anyway, and a break inside this loop would make the compiler give up the whole calling
    frame (the input preparation above with it) and run it eagerly."""
    tree = segment_tree(meta, q.device)
    slices = [depth_slices(x, tree) for x in (q, k, v, g, beta)]
    outs, finals = [], None
    for i, depth in enumerate(tree.depths):
        initial = None if depth.parent is None else finals.index_select(0, depth.parent)
        out, finals = backend.run_depth(*(s[i] for s in slices), depth, initial)
        outs.append(out)
    out = outs[0] if len(outs) == 1 else torch.cat(outs)
    return out if tree.order is None else permute_rows(out, tree.unsort, tree.order)


# ---- choosing the backend ---------------------------------------------------------------------------

def probe_gdn(backend: GDNBackend, device: torch.device, heads: int = 4, dk: int = 64, dv: int = 64,
              tree: str = "short") -> float:
    """Largest relative error of output and input gradients against ``reference`` on a small tree.

    ``dk``/``dv`` should be the model's head sizes: flash-linear-attention dispatches by shape (its FlashQLA
    kernels take heads of 128 only, other sizes its Triton kernels), so the probe checks the kernel the layers
    will run. ``tree``: a key of ``PROBE_TREES``."""
    meta = probe_meta(device, PROBE_TREES[tree])
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
        with torch.enable_grad():  # the probe checks the backward too, also when its caller runs under no_grad
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


def _probe_fla(device: torch.device, dk: int, dv: int, heads: int) -> str | None:
    """None where fla passes ``probe_gdn`` at these head sizes and count on both probe trees, else why not."""
    try:
        err = max(probe_gdn(GDN_BACKENDS["fla"], device, heads=heads, dk=dk, dv=dv, tree=tree) for tree in PROBE_TREES)
    except Exception as exc:  # noqa: BLE001 - not importable, no Triton, or a kernel that fails its backward
        return f"{type(exc).__name__}: {exc}"
    log.info("gated-delta probe of fla (%s kernels, heads of %d/%d): error %.2e", fla_kernel(dk, dv), dk, dv, err)
    return None if err < 2e-2 else f"probe error {err:.2e}"


def resolve_device(device: torch.device | str | None) -> torch.device:
    """``device``, or the CUDA device where there is one and the CPU otherwise."""
    return torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")


_active: GDNBackend = GDN_BACKENDS["reference"]


def select_gdn_backend(name: str = "auto", device: torch.device | str | None = None,
                       dk: int = 64, dv: int = 64, heads: int = 4) -> GDNBackend:
    """``reference``, ``fla``, or with ``auto`` fla where it is importable on CUDA and passes the probe at
    head sizes ``dk``/``dv`` and ``heads`` value heads (the model's). The head count matters for time, not for the
    verdict: FlashQLA compiles a kernel per head count, on first use, so a probe at the model's count compiles the
    kernels the layers then run, where one at another count would add a set of its own to a fresh machine's start."""
    if name not in ("auto", *GDN_BACKENDS):
        raise ValueError(f"unknown gated-delta backend {name!r}; known: {['auto', *GDN_BACKENDS]}")
    device = resolve_device(device)
    if name == "reference" or (name == "auto" and device.type != "cuda"):
        return GDN_BACKENDS["reference"]
    failure = _probe_fla(device, dk, dv, heads)
    if failure is not None and fla_kernel(dk, dv) == "flash_qla":
        # fla's own kernels may still pass where FlashQLA's do not: switch its dispatch off (the switch fla
        # reads at every call) and probe again
        log.warning("FlashQLA's kernels failed the gated-delta probe (%s); setting FLA_FLASH_QLA=0", failure)
        os.environ["FLA_FLASH_QLA"] = "0"
        failure = _probe_fla(device, dk, dv, heads)
    if failure is None:
        return GDN_BACKENDS["fla"]
    if name == "fla":
        raise RuntimeError(f"gated-delta backend 'fla' is not usable here: {failure}")
    log.warning("flash-linear-attention is not usable here (%s); Gated DeltaNet layers run the PyTorch reference", failure)
    return GDN_BACKENDS["reference"]


def register_gdn_backend(name: str = "auto", device: torch.device | str | None = None,
                         dk: int = 64, dv: int = 64, channels: int = 64, kernel: int = 4, heads: int = 4) -> str:
    """Make ``name`` (see ``select_gdn_backend``, probed at ``heads`` value heads of ``dk``/``dv``) the delta-rule
    backend of every patched GDN layer, and the convolution backend that goes with it (``select_conv_backend``, at
    the layers' ``channels`` and ``kernel``); returns the delta rule's."""
    global _active
    device = resolve_device(device)
    _active = select_gdn_backend(name, device, dk, dv, heads)
    short_conv.set_active_conv_backend(short_conv.select_conv_backend(_active.name, device, channels, kernel))
    return _active.name


def active_gdn_backend() -> GDNBackend:
    return _active


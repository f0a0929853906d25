"""The short causal convolution of Gated DeltaNet layers over a packed prefix trie, exact per sample.

A Gated DeltaNet layer (``grpo_core.models.attention.gated_delta``) runs a depthwise causal convolution (kernel
``K``, 4 in Qwen3.5/Qwen3-Next) before its delta rule. It reads the ``K - 1`` tokens before each token. For a
segment's first tokens those are the last tokens of its *path* (its parent's tail, or further up when the parent
is short), never the sibling laid out just before it in the row (``tree_conv_plan.conv_context``).

Backends (picked with the delta rule's, ``select_conv_backend``; the active one is ``active_conv_backend``):

- ``torch``: ``tree_causal_conv1d``, the row gathered per segment with its path context and run as channel-last
  multiply-adds, which a compiled layer fuses;
- ``fla``: flash-linear-attention's varlen Triton kernel, the row's segments as its sequences and each one's
  path context as its initial state; accepted only if a probe at the layers' width agrees with ``torch``;
- ``triton``: the project's own Triton kernels over the trie's index tables (``tree_conv_triton``), deterministic;
  tried before ``fla`` (``CONV_PREFERENCE``: faster in the measurement named there), on the same probe.

Run its tests: ``.venv/bin/python -m pytest tests/test_gated_delta.py``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from grpo_core.models.attention.gather import gather_rows
from grpo_core.models.attention.metadata import TreeAttentionMetadata
from grpo_core.models.attention.probe_rows import PROBE_TREES, probe_meta
from grpo_core.models.attention.tree_conv_plan import conv_context, conv_indices, tree_conv_plan

log = logging.getLogger(__name__)


# ---- the short convolution --------------------------------------------------------------------------
def _conv_plan(x: torch.Tensor, kernel: int, meta: TreeAttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    return meta.cached(
        ("gdn_conv", kernel, x.device),
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
    rows = x.squeeze(0).t().to(weight.dtype)  # [U, C] (a view: a select would cost a zero-fill and a copy in backward)
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


def _torch_conv(rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: str | None,
                meta: TreeAttentionMetadata) -> torch.Tensor:
    out = activation_fn(activation)(tree_causal_conv1d(rows.t().unsqueeze(0), weight, bias, meta)).to(rows.dtype)
    return out.squeeze(0).t()


FLA_ACTIVATIONS = (None, "silu", "swish")
"""Activations flash-linear-attention's convolution applies inside its kernel; others run after it."""


def _fla_conv_plan(x: torch.Tensor, kernel: int, meta: TreeAttentionMetadata) -> tuple[torch.Tensor, ...]:
    """``(context, cu_seqlens, cu_seqlens_cpu, chunk_indices)`` of a row, once per row: the segments in row order
    are the kernel's variable-length sequences, and each one's context its initial state."""
    from fla.ops.utils.index import prepare_chunk_indices

    def build() -> tuple[torch.Tensor, ...]:
        cu_cpu = torch.from_numpy(meta.host_arrays()[0])
        cu = cu_cpu.to(x.device)
        context = torch.as_tensor(conv_context(meta, kernel)).to(x.device)
        return context, cu, cu_cpu, prepare_chunk_indices(cu, FLA_CONV_CHUNK, cu_seqlens_cpu=cu_cpu)

    return meta.cached(("gdn_conv_fla", kernel, x.device), build)


FLA_CONV_CHUNK = 64
"""Tokens per program of flash-linear-attention's convolution (its default block)."""


def _fla_conv(rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: str | None,
              meta: TreeAttentionMetadata) -> torch.Tensor:
    """flash-linear-attention's causal convolution (Triton; fused activation, fp32 accumulation) over the
    row's segments as variable-length sequences, each started from the ``kernel - 1`` path tokens before it as
    its initial state (zeros above a root). The state is gathered from the row, so gradients reach those
    tokens through it."""
    from fla.modules.causal_conv1d import causal_conv1d

    kernel = weight.shape[-1]
    context, cu, cu_cpu, chunks = _fla_conv_plan(rows, kernel, meta)
    rows = rows.contiguous()
    # [G, K - 1, C]: only the context is gathered (a padded copy of the whole row would cost a pass over it)
    before = rows[context.clamp(min=0)] * (context >= 0).unsqueeze(-1).to(rows.dtype)
    # fla's state holds the last ``kernel`` inputs, oldest first; the convolution reads the last kernel - 1
    state = torch.cat([before.new_zeros(before.shape[0], 1, before.shape[2]), before], 1).transpose(1, 2)
    fused = activation if activation in FLA_ACTIVATIONS else None
    y, _ = causal_conv1d(rows.unsqueeze(0), weight.to(rows.dtype), None if bias is None else bias.to(rows.dtype),
                         initial_state=state.contiguous(), activation=fused, cu_seqlens=cu, cu_seqlens_cpu=cu_cpu,
                         chunk_indices=chunks)
    out = y.squeeze(0)
    return out if fused == activation else activation_fn(activation)(out)


def _triton_conv(rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: str | None,
                 meta: TreeAttentionMetadata) -> torch.Tensor:
    """The project's Triton kernels (``tree_conv_triton``), reading the trie's index tables (``tree_conv_plan``,
    built once per row)."""
    # Deferred: Triton is optional, and this backend is only chosen where it imports (``probe_failure``).
    from grpo_core.models.attention.tree_conv_triton import FUSED_ACTIVATIONS, tree_conv_triton

    kernel = weight.shape[-1]
    plan = meta.cached(("gdn_conv_triton", kernel, rows.device), lambda: tree_conv_plan(meta, kernel, rows.device))
    fused = activation if activation in FUSED_ACTIVATIONS else None
    y = tree_conv_triton(rows, weight.to(rows.dtype), None if bias is None else bias.to(rows.dtype), fused, plan)
    return y if fused == activation else activation_fn(activation)(y)


@dataclass
class ConvBackend:
    name: str
    run: Callable[..., torch.Tensor]
    """``(rows [U, C], weight [C, K], bias, activation, meta) -> [U, C]`` in ``rows``' dtype, activation applied:
    channel-last, as the layer's projection produced them."""
    needs_cuda: bool


CONV_BACKENDS: dict[str, ConvBackend] = {
    "torch": ConvBackend("torch", _torch_conv, needs_cuda=False),
    # A compiled layer runs the kernel as it is: fla keeps its own dispatch out of graphs, and the gathered
    # context would otherwise be traced around a break.
    "fla": ConvBackend("fla", torch.compiler.disable(_fla_conv, recursive=True), needs_cuda=True),
    "triton": ConvBackend("triton", torch.compiler.disable(_triton_conv, recursive=True), needs_cuda=True),
}


def tree_conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: str | None,
              meta: TreeAttentionMetadata, backend: ConvBackend | None = None) -> torch.Tensor:
    """The short convolution of a Gated DeltaNet layer over a packed row, activation included, with ``backend``
    (default: the one ``register_gdn_backend`` chose): ``x`` ``[1, C, U]`` (the layer's transposed projection) in,
    the same layout out."""
    if x.shape[0] != 1:
        raise ValueError(f"a packed row is one sequence (batch 1), got batch {x.shape[0]}")
    # The backends take and give channel-last rows [U, C]; the views to and from them are taken here, in the calling
    # (compiled) layer's graph, so that what crosses into a kernel backend, and its gradient back, is a plain [U, C]
    # tensor (the projection's own layout), not a transposed view whose gradient could come back channel-first and
    # leave the projection's backward matmuls reading a tensor whose leading dimension is the row's length. That holds
    # where the graph ends here, at the kernel call: with nested graph breaks (``AsyncGRPOConfig.compile_graph_breaks``);
    # by PyTorch's default it ends at the layer's own call of this function, and the transposed view crosses instead.
    # Squeezes rather than ``x[0]``: a select's backward writes a zero tensor of the whole row, then copies into it.
    rows = x.squeeze(0).t()
    return (backend or _active).run(rows, weight, bias, activation, meta).t().unsqueeze(0)


# ---- choosing the backend ---------------------------------------------------------------------------
def probe_conv(backend: ConvBackend, device: torch.device, channels: int = 64, kernel: int = 4,
               tree: str = "short") -> float:
    """Largest relative error of ``backend``'s convolution (bf16, silu) in output and gradients of input, weight
    and bias against the PyTorch form in fp32, on a probe tree (``PROBE_TREES``) at the layers' width."""
    meta = probe_meta(device, PROBE_TREES[tree])
    u = int(meta.cu_seq_q[-1])
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, u, channels, generator=gen).transpose(1, 2)  # as a layer hands it over
    weight, bias = torch.randn(channels, kernel, generator=gen) / kernel, torch.randn(channels, generator=gen)
    grad = torch.randn(1, channels, u, generator=gen)
    results = []
    for be, dtype in ((backend, torch.bfloat16), (CONV_BACKENDS["torch"], torch.float32)):
        xs = [t.to(device, dtype).requires_grad_() for t in (x, weight, bias)]
        with torch.enable_grad():  # the probe checks the backward too, also when its caller runs under no_grad
            out = tree_conv(*xs, "silu", meta, backend=be)
            out.backward(grad.to(device, dtype))
        results.append([out.detach().float()] + [t.grad.float() for t in xs])
    return max(float((a - b).norm() / b.norm()) for a, b in zip(*results))


CONV_PREFERENCE = ("triton", "fla")
"""The kernels tried in turn where the delta rule runs flash-linear-attention (a GPU): the project's Triton kernels
first, which measured faster than fla's at the same probe error (benchmarks/README.md, "The Qwen3.5 family: hybrid
against dense, MoE MFU, packed log-prob gap")."""


def probe_failure(name: str, device: torch.device, channels: int, kernel: int) -> str | None:
    """None where ``name``'s convolution passes ``probe_conv`` on both probe trees at the layers' width, else why not."""
    try:
        err = max(probe_conv(CONV_BACKENDS[name], device, channels, kernel, tree) for tree in PROBE_TREES)
    except Exception as exc:  # noqa: BLE001 - a package missing, or a kernel that fails
        return f"{type(exc).__name__}: {exc}"
    if not err < 2e-2:
        return f"probe error {err:.2e}"
    log.info("short-convolution probe of %s (%d channels, kernel %d): error %.2e", name, channels, kernel, err)
    return None


def select_conv_backend(gdn_backend: str, device: torch.device, channels: int, kernel: int) -> ConvBackend:
    """Where the delta rule runs flash-linear-attention (``gdn_backend``: the delta rule's backend name), the first of
    ``CONV_PREFERENCE`` whose convolution passes ``probe_conv`` on both probe trees at the layers' width; else, and
    where none passes, the PyTorch form (``tree_causal_conv1d``). A delta rule on its reference keeps the
    convolution on its PyTorch form too."""
    if gdn_backend != "fla":
        return CONV_BACKENDS["torch"]
    failures = []
    for name in CONV_PREFERENCE:
        failure = probe_failure(name, device, channels, kernel)
        if failure is None:
            if failures:
                log.warning("short convolutions run %s: %s", name, "; ".join(failures))
            return CONV_BACKENDS[name]
        failures.append(f"{name}'s kernels are not usable here ({failure})")
    log.warning("%s; the short convolutions run the PyTorch form", "; ".join(failures))
    return CONV_BACKENDS["torch"]


_active: ConvBackend = CONV_BACKENDS["torch"]


def set_active_conv_backend(backend: ConvBackend) -> None:
    """Make ``backend`` the one ``tree_conv`` runs by default (``gated_delta.register_gdn_backend`` picks it)."""
    global _active
    _active = backend


def active_conv_backend() -> ConvBackend:
    return _active

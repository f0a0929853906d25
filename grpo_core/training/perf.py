"""Throughput and model FLOPs utilisation (MFU) of the trainer, on two time bases.

Per optimizer step (all micro-batches, all ranks):

* ``perf/tokens_per_s_fwd_bwd`` / ``perf/tokens_per_s_wall_clock``: forwarded (unique) tokens of
  the step over the forward+backward time, or over the whole step's wall clock (optimizer, weight
  sync, waiting for rollouts included);
* ``perf/mfu_fwd_bwd`` / ``perf/mfu_wall_clock``: the step's model FLOPs over
  ``time x world_size x peak``, only where the device's dense bf16 peak is known and training runs
  in bf16; omitted otherwise (training is unaffected).

**FLOPs of a tree-packed row** (model FLOPs: recomputation by activation checkpointing or by the
attention kernel's backward is not counted, norms and element-wise ops are ignored)::

    6 * P_layers * U  +  6 * P_head * T  +  12 * L * (H * d_head) * pairs  +  3 * L_gdn * H_v * sum_chunks F(c)

``P_layers`` = weights of the linear layers of all decoder layers that a token runs through (of a
mixture-of-experts block: its router and ``k`` of its experts, ``grpo_core.models.moe.experts``; of a
Gated DeltaNet layer: its projections and its depthwise short convolution, whose every weight is used
once per token), ``U`` = forwarded (unique) positions, ``P_head`` = the LM head's weights
(``d_model x vocab``), ``T`` = trained tokens (the head runs only where a trained token is predicted),
``L`` = decoder layers with softmax attention, ``H * d_head`` = query width, and ``pairs`` = the
query-key pairs attention really computes: a segment of ``q`` queries starting at depth ``s`` sees its
``s`` ancestors and its own causal past, ``q*s + q*(q+1)/2`` pairs. Per pair and layer the forward does
2 FLOPs for ``QK^T`` and 2 for ``PV`` per query channel; the backward twice that, hence 12. The common
``6N + 12 L d n`` per token counts all ``n`` keys for every query; counting the causal pairs exactly
gives ``6 L d (n + 1)`` per token of an unshared sequence of length ``n``, about half.

**Gated DeltaNet's chunked form** (``grpo_core.models.attention.gated_delta.chunked_delta_rule``):
each segment of a row starts a scan of its own (from its parent's state), cut into chunks of
``C = 64`` tokens, the last one shorter. A chunk of ``c`` tokens of one value head (key width ``K``,
value width ``V``) costs in the forward::

    F(c) = 6 c K V  +  c (c - 1) (2 K + V)  +  c (c + 1) (K + V)

``6cKV``: the three products with the ``K x V`` state (the corrections read it, ``k S_0``; the outputs
read it, ``q S_0``; the update writes it, ``k^T u``). ``c(c-1)(2K+V)``: the strictly lower triangle
of ``(beta k) k^T`` (``c(c-1)/2`` dot products of length ``K``) and the unit-triangular solve for the
corrections' two right-hand sides (``beta v``, ``V`` columns, and the decayed ``beta k``, ``K``
columns). ``c(c+1)(K+V)``: the causal (diagonal included) ``q k^T`` inside the chunk and its product
with the corrections. Triangular products count their triangle, as the attention term counts its
causal pairs; a kernel that computes full tiles does more. ``L_gdn`` = Gated DeltaNet layers,
``H_v`` = their value heads (queries and keys are repeated to them); the backward counts twice the
forward, as for the other terms, hence the 3. Per token of a long segment this is about ``6KV + C(3K + 2V)``.

**Peaks** are dense (no sparsity) bf16 tensor-core datasheet figures.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from grpo_core.models.fsdp import decoder_layers
from grpo_core.models.moe.experts import active_expert_params
from grpo_core.packing.trie import TreeRow

# Most specific first: "H100 PCIe" must not read as the SXM part.
_BF16_DENSE_PEAK_TFLOPS: tuple[tuple[str, float], ...] = (
    (r"\bH100\b.*\bNVL\b", 835.0),
    (r"\bH100\b.*\bPCIe\b", 756.0),
    (r"\bH100\b", 989.0),  # SXM
    (r"\bH200\b.*\bNVL\b", 835.0),
    (r"\bH200\b", 989.0),  # SXM
    (r"\bA100\b", 312.0),
    (r"\bB200\b", 2250.0),
)


def peak_bf16_flops(device_name: str) -> float | None:
    """Dense bf16 peak in FLOP/s of a device by its CUDA name, or None when not in the table."""
    for pattern, tflops in _BF16_DENSE_PEAK_TFLOPS:
        if re.search(pattern, device_name, flags=re.IGNORECASE):
            return tflops * 1e12
    return None


def device_peak_flops(device: torch.device, bf16: bool) -> float | None:
    """The peak MFU is measured against: known CUDA devices training in bf16 only."""
    if not bf16 or device.type != "cuda":
        return None
    return peak_bf16_flops(torch.cuda.get_device_name(device))


GDN_CHUNK = 64  # the chunk length of the delta rule's kernels (fla's and the reference's)


def gdn_chunk_flops(c: int, key_dim: int, value_dim: int) -> int:
    """Forward FLOPs of the gated delta rule over one chunk of ``c`` tokens of one head, ``F(c)`` above."""
    k, v = key_dim, value_dim
    return 6 * c * k * v + c * (c - 1) * (2 * k + v) + c * (c + 1) * (k + v)


def gdn_segment_flops(n: int, key_dim: int, value_dim: int, chunk: int = GDN_CHUNK) -> int:
    """Forward FLOPs of the chunked scan of one segment of ``n`` tokens of one head: full chunks and a rest."""
    full, rest = divmod(n, chunk)
    return full * gdn_chunk_flops(chunk, key_dim, value_dim) + gdn_chunk_flops(rest, key_dim, value_dim)


def gdn_row_flops(row: TreeRow, key_dim: int, value_dim: int, chunk: int = GDN_CHUNK) -> int:
    """Forward FLOPs of one head's delta rule over a packed row: every segment is a scan of its own."""
    return sum(gdn_segment_flops(seg.num_nodes, key_dim, value_dim, chunk) for seg in row.segments())


def causal_pairs(row: TreeRow) -> int:
    """Query-key pairs attention computes for the row (each segment: ancestors + causal past)."""
    total = 0
    for seg in row.segments():
        q, s = seg.num_nodes, seg.start
        total += q * s + q * (q + 1) // 2
    return total


@dataclass(frozen=True)
class ModelFlops:
    """The sizes the FLOP formula needs (module docstring), read off the model once."""

    layer_params: int
    head_params: int
    num_layers: int
    """Decoder layers with softmax attention."""
    query_width: int
    gdn_layers: int = 0
    """Gated DeltaNet (linear attention) layers."""
    gdn_heads: int = 0
    """Value heads of a Gated DeltaNet layer."""
    gdn_key_dim: int = 0
    gdn_value_dim: int = 0

    @classmethod
    def from_model(cls, model: torch.nn.Module) -> ModelFlops:
        layers = decoder_layers(model)
        linear = sum(m.weight.numel() for m in layers.modules() if isinstance(m, (torch.nn.Linear, torch.nn.Conv1d)))
        experts, _ = active_expert_params(layers)
        head = model.get_output_embeddings()
        config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        kinds = getattr(config, "layer_types", None) or ()
        attention_layers = sum(kind != "linear_attention" for kind in kinds) if kinds else len(layers)
        gdn_layers = sum(kind == "linear_attention" for kind in kinds)
        return cls(
            layer_params=int(linear + experts),
            head_params=int(head.weight.numel()),
            num_layers=attention_layers,
            query_width=int(config.num_attention_heads * head_dim),
            gdn_layers=gdn_layers,
            gdn_heads=int(getattr(config, "linear_num_value_heads", 0) or 0) if gdn_layers else 0,
            gdn_key_dim=int(getattr(config, "linear_key_head_dim", 0) or 0) if gdn_layers else 0,
            gdn_value_dim=int(getattr(config, "linear_value_head_dim", 0) or 0) if gdn_layers else 0,
        )

    def row_flops(self, row: TreeRow) -> float:
        return float(
            6 * self.layer_params * row.num_unique_tokens
            + 6 * self.head_params * row.num_trained_tokens
            + 12 * self.num_layers * self.query_width * causal_pairs(row)
            + self.gdn_flops(row)
        )

    def gdn_flops(self, row: TreeRow) -> float:
        """Forward+backward FLOPs of the Gated DeltaNet layers' delta rule over ``row`` (3 x forward)."""
        if not self.gdn_layers:
            return 0.0
        per_head = gdn_row_flops(row, self.gdn_key_dim, self.gdn_value_dim)
        return float(3 * self.gdn_layers * self.gdn_heads * per_head)

    def rows_flops(self, rows: Iterable[TreeRow]) -> float:
        return sum(self.row_flops(r) for r in rows)


def perf_metrics(
    flops: float, tokens: int, fwd_bwd_s: float, wall_s: float, world_size: int, peak_flops: float | None
) -> dict[str, float]:
    """The ``perf/*`` throughput and MFU metrics of one step (see the module docstring)."""
    out: dict[str, float] = {}
    for base, seconds in (("fwd_bwd", fwd_bwd_s), ("wall_clock", wall_s)):
        if seconds <= 0:
            continue
        out[f"perf/tokens_per_s_{base}"] = tokens / seconds
        if peak_flops:
            out[f"perf/mfu_{base}"] = flops / (seconds * world_size * peak_flops)
    return out


class PerfMeter:
    """Per-step ``perf/*`` metrics for one trainer: FLOPs from the step's plan, peak from the device."""

    def __init__(self, model: torch.nn.Module, device: torch.device, bf16: bool, world_size: int):
        self.flops = ModelFlops.from_model(model)
        self.peak = device_peak_flops(device, bf16)
        self.world_size = world_size

    def metrics(self, rows: list[TreeRow], fwd_bwd_s: float, wall_s: float) -> dict[str, float]:
        tokens = sum(r.num_unique_tokens for r in rows)
        return perf_metrics(self.flops.rows_flops(rows), tokens, fwd_bwd_s, wall_s, self.world_size, self.peak)


def synchronize(device: torch.device) -> None:
    """Wait for queued device work, so that a host clock read after it is a real duration."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)

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

    6 * P_layers * U  +  6 * P_head * T  +  12 * L * (H * d_head) * pairs

``P_layers`` = weights of the linear layers of all decoder layers that a token runs through (of a
mixture-of-experts block: its router and ``k`` of its experts, ``grpo_core.models.moe.experts``),
``U`` = forwarded (unique) positions, ``P_head`` = the LM head's weights (``d_model x vocab``),
``T`` = trained tokens (the head runs only where a trained token is predicted), ``L`` = decoder
layers with softmax attention (a Gated DeltaNet layer's recurrence is not counted, its projections
are), ``H * d_head`` = query width, and ``pairs`` = the query-key pairs attention really computes: a segment of ``q`` queries
starting at depth ``s`` sees its ``s`` ancestors and its own causal past, ``q*s + q*(q+1)/2`` pairs.
Per pair and layer the forward does 2 FLOPs for ``QK^T`` and 2 for ``PV`` per query channel; the
backward twice that, hence 12. The common ``6N + 12 L d n`` per token counts all ``n`` keys for
every query; counting the causal pairs exactly gives ``6 L d (n + 1)`` per token of an unshared
sequence of length ``n``, about half.

**Peaks** are dense (no sparsity) bf16 tensor-core datasheet figures.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

import torch

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

    @classmethod
    def from_model(cls, model: torch.nn.Module) -> ModelFlops:
        from grpo_core.models.fsdp import decoder_layers
        from grpo_core.models.moe.experts import active_expert_params

        layers = decoder_layers(model)
        linear = sum(m.weight.numel() for m in layers.modules() if isinstance(m, torch.nn.Linear))
        experts, _ = active_expert_params(layers)
        head = model.get_output_embeddings()
        config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        kinds = getattr(config, "layer_types", None) or ()
        attention_layers = sum(kind != "linear_attention" for kind in kinds) if kinds else len(layers)
        return cls(
            layer_params=int(linear + experts),
            head_params=int(head.weight.numel()),
            num_layers=attention_layers,
            query_width=int(config.num_attention_heads * head_dim),
        )

    def row_flops(self, row: TreeRow) -> float:
        return float(
            6 * self.layer_params * row.num_unique_tokens
            + 6 * self.head_params * row.num_trained_tokens
            + 12 * self.num_layers * self.query_width * causal_pairs(row)
        )

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

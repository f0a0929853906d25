"""Train-inference mismatch: the importance-sampling correction of each mode, and the mismatch metrics.

The sampler (vLLM, often in bf16) and the trainer compute different probabilities for the same token with the
same weights. Per trained token t the trainer sees its log-ratio ``log r_t = log pi(a_t) - log q(a_t)`` (the
trainer's log-prob now against the sampler's). Two pure pieces, both used by ``grpo_core.training.loss``:

1. ``correction_factors``: per token, the detached factor ``c_t`` by which the correction multiplies the clipped
   surrogate, so that an unclipped token's gradient weight is ``w_t = c_t r_t`` (the mode's importance weight):

   ===================  ================================================  ==========================
   mode                 w_t                                               c_t = w_t / r_t
   ===================  ================================================  ==========================
   correction off       r_t                                               1
   token_mask           r_t if lo <= r_t <= hi, else 0                    1 or 0
   token_truncate       min(r_t, C)                                       min(1, C / r_t)
   sequence_mask        R_s if lo <= R_s <= hi, else 0                    R_s / r_t or 0
   sequence_truncate    min(R_s, C)                                       min(R_s, C) / r_t
   ===================  ================================================  ==========================

   with ``R_s = exp(mean of log r over the trained tokens of the token's sample s)`` (the geometric mean of its
   ratios), ``lo, hi`` the mask bounds and ``C`` the cap. A token without a finite ratio (the sampler's -9999
   stand-in for an impossible token, a -inf under the trainer's candidate set) has ``c_t = 0`` in every mode and
   stays out of its sample's mean.

2. ``mismatch_parts`` / ``finalize_mismatch``: the metrics of ``docs/mismatch.md`` per staleness, as metric parts
   (device scalars summed over micro-batches and ranks like the loss's; no host sync here).

A token shared by several samples of a tree row is listed once per sample in the row's trained tokens (each with
its own sampler log-prob, advantage and ``sample_index``, ``grpo_core.packing.collator``), so every quantity here
is per sample by construction: a sequence weight reaches exactly the tokens of its own sample.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from grpo_core.staleness import versions_in_flight

CorrectionMode = Literal["token_mask", "token_truncate", "sequence_mask", "sequence_truncate"]
CORRECTION_MODES: tuple[str, ...] = ("token_mask", "token_truncate", "sequence_mask", "sequence_truncate")

# vLLM serialises -inf log-probs as -9999.0 (tokens outside top-k/top-p in processed_logprobs mode),
# so anything at or below this is "impossible under the sampler", never a real log-probability.
VLLM_NEG_INF = -9999.0


@dataclass(frozen=True)
class Correction:
    """The importance-sampling correction's settings (the ``vllm_importance_sampling_*`` fields of the config)."""

    enabled: bool
    mode: CorrectionMode
    clip_min: float
    """Lower mask bound on the ratio (``*_mask`` modes)."""
    clip_max: float
    """Upper mask bound on the ratio (``*_mask`` modes)."""
    cap: float
    """Truncation cap (``*_truncate`` modes)."""

    def __post_init__(self) -> None:
        if self.mode not in CORRECTION_MODES:
            raise ValueError(f"unknown vllm_importance_sampling_mode {self.mode!r}; use one of {CORRECTION_MODES}")
        if not 0.0 <= self.clip_min <= 1.0 <= self.clip_max:
            raise ValueError(
                "need 0 <= vllm_importance_sampling_clip_min <= 1"
                f" <= vllm_importance_sampling_clip_max, got [{self.clip_min}, {self.clip_max}]"
            )
        if not self.cap > 1.0:
            raise ValueError(f"vllm_importance_sampling_cap must be > 1, got {self.cap}")

    @property
    def sequence_level(self) -> bool:
        return self.enabled and self.mode.startswith("sequence")


@dataclass
class Factors:
    """What the correction did to one call's T tokens (all detached)."""

    factor: Tensor
    """[T] c_t >= 0: multiplies the token's clipped surrogate (value and gradient)."""
    weight: Tensor
    """[T] w_t = c_t r_t >= 0, computed directly (no product that could overflow): an unclipped token's weight."""
    measurable: Tensor
    """[T] bool: the token has a finite log-ratio and a real sampler log-prob."""
    masked: Tensor
    """[T] bool: the correction gave the token weight 0 (a mask, or no finite ratio)."""
    truncated: Tensor
    """[T] bool: the token's (or its sequence's) ratio was above the cap and its weight truncated."""
    sample_log_ratio: Tensor
    """[S] mean log-ratio over each sample's measurable tokens (log R_s; 0 for a sample with none)."""


def sample_sums(values: Tensor, sample_index: Tensor, num_samples: int) -> Tensor:
    """[S, ...] sums of ``values`` ([T, ...]) over each sample's tokens (one ``index_add``, no host sync)."""
    out = values.new_zeros((num_samples, *values.shape[1:]))
    return out.index_add_(0, sample_index, values)


def correction_factors(
    log_ratio: Tensor, sampler_logprobs: Tensor, correction: Correction, sample_index: Tensor, num_samples: int
) -> Factors:
    """The correction's per-token factors (table in the module docstring) from detached ``log_ratio`` [T]."""
    measurable = torch.isfinite(log_ratio) & (sampler_logprobs > VLLM_NEG_INF)
    safe = torch.where(measurable, log_ratio, torch.zeros_like(log_ratio))
    counts = sample_sums(measurable.to(log_ratio.dtype), sample_index, num_samples)
    seq_log_ratio = sample_sums(safe, sample_index, num_samples) / counts.clamp(min=1.0)
    none = torch.zeros_like(measurable)
    if not correction.enabled:
        keep, log_weight, truncated = measurable, safe, none
    elif correction.mode == "token_mask":
        ratio = torch.exp(safe)
        keep = measurable & (ratio >= correction.clip_min) & (ratio <= correction.clip_max)
        log_weight, truncated = safe, none
    elif correction.mode == "token_truncate":
        log_cap = math.log(correction.cap)
        truncated = measurable & (safe > log_cap)
        keep, log_weight = measurable, safe.clamp(max=log_cap)
    else:
        seq = seq_log_ratio.index_select(0, sample_index)  # each token's own sample's log R_s
        if correction.mode == "sequence_mask":
            seq_ratio = torch.exp(seq)
            keep = measurable & (seq_ratio >= correction.clip_min) & (seq_ratio <= correction.clip_max)
            log_weight, truncated = seq, none
        else:
            log_cap = math.log(correction.cap)
            truncated = measurable & (seq > log_cap)
            keep, log_weight = measurable, seq.clamp(max=log_cap)
    zero = torch.zeros_like(safe)
    weight = torch.where(keep, torch.exp(log_weight), zero)
    if not correction.enabled or correction.mode == "token_mask":
        # w_t = r_t exactly: the factor is the keep indicator, so the clipped surrogate is not rescaled at all.
        factor = keep.to(log_ratio.dtype)
    else:
        factor = torch.where(keep, torch.exp(log_weight - safe), zero)
    return Factors(factor=factor, weight=weight, measurable=measurable, masked=~keep, truncated=truncated,
                   sample_log_ratio=seq_log_ratio)


# ---------------------------------------------------------------------------------------------
# Metrics
# ---------------------------------------------------------------------------------------------
# Per-staleness sums, one scalar part each (the step's reduction calls .item() on every part):
# ``mismatch/s<k>/<name>_sum`` and ``mismatch/s<k>/gap_max``. Token sums are over trained tokens, sequence
# sums over samples with at least one trained token.
STALENESS_BUCKETS_MAX = 8
"""Most staleness buckets of the ``mismatch/*`` metrics: staleness 0..6 each their own, the last holds 7 and older.
A bound, not one per version in flight: the parts are a handful of tensors per bucket and micro-batch, and a run with
an unbounded ``max_staleness`` (10^6) would otherwise build millions of them every step."""


def staleness_buckets(max_staleness: int) -> int:
    """How many staleness buckets the metrics keep for a run allowing ``max_staleness``."""
    return min(versions_in_flight(max_staleness), STALENESS_BUCKETS_MAX)  # one per staleness a sample can have


TOKEN_SUMS = ("tokens", "measured", "k1", "k3", "masked", "truncated", "routed", "route_differs")
SEQ_SUMS = ("seqs", "k1_seq", "k3_seq", "masked_seq", "truncated_seq")


def mismatch_parts(
    log_ratio: Tensor,
    factors: Factors,
    sample_index: Tensor,
    sample_staleness: Tensor,
    num_buckets: int,
    route_differs: Tensor | None = None,
    route_known: Tensor | None = None,
) -> dict[str, Tensor]:
    """Metric parts of one call: per staleness bucket 0..num_buckets-1 (staleness past the last counts in it).

    ``log_ratio`` [T] detached; ``sample_index`` [T]; ``sample_staleness`` [S] int; ``route_differs`` and
    ``route_known`` [T] bool (a mixture-of-experts policy with sampler routes): the trainer's own top-k differs
    from the sampler's route in some layer, and the token's position has a route to compare with.
    """
    dtype = torch.float32
    num_samples = int(sample_staleness.numel())
    measured = factors.measurable
    lr = torch.where(measured, log_ratio, torch.zeros_like(log_ratio)).to(dtype)
    # Estimators of KL(sampler || trainer) from tokens drawn by the sampler: k1 = -log r, k3 = r - 1 - log r.
    k1 = -lr
    k3 = torch.expm1(lr) - lr
    zero = torch.zeros_like(lr)
    routed = route_known.to(dtype) if route_known is not None else zero
    differs = (route_differs & route_known).to(dtype) if route_differs is not None and route_known is not None \
        else zero
    token_stats = torch.stack([
        torch.ones_like(lr), measured.to(dtype), k1, k3, factors.masked.to(dtype), factors.truncated.to(dtype),
        routed, differs,
    ], dim=1)  # [T, len(TOKEN_SUMS)]
    per_sample = sample_sums(token_stats, sample_index, num_samples)  # [S, len(TOKEN_SUMS)]
    has_tokens = per_sample[:, 0] > 0
    seq_stats = torch.stack([
        has_tokens.to(dtype), per_sample[:, 2], per_sample[:, 3],
        (per_sample[:, 4] > 0).to(dtype), (per_sample[:, 5] > 0).to(dtype),
    ], dim=1) * has_tokens.unsqueeze(1).to(dtype)  # [S, len(SEQ_SUMS)]
    bucket_of_sample = sample_staleness.to(device=lr.device, dtype=torch.int64).clamp(0, num_buckets - 1)
    bucket_of_token = bucket_of_sample.index_select(0, sample_index)
    token_by_bucket = lr.new_zeros((num_buckets, len(TOKEN_SUMS))).index_add_(0, bucket_of_token, token_stats)
    seq_by_bucket = lr.new_zeros((num_buckets, len(SEQ_SUMS))).index_add_(0, bucket_of_sample, seq_stats)
    gap = torch.where(measured, log_ratio.abs().to(dtype), zero)
    gap_by_bucket = lr.new_zeros(num_buckets).scatter_reduce_(0, bucket_of_token, gap, "amax", include_self=True)
    parts: dict[str, Tensor] = {}
    for b in range(num_buckets):
        for j, name in enumerate(TOKEN_SUMS):
            parts[f"mismatch/s{b}/{name}_sum"] = token_by_bucket[b, j]
        for j, name in enumerate(SEQ_SUMS):
            parts[f"mismatch/s{b}/{name}_sum"] = seq_by_bucket[b, j]
        parts[f"mismatch/s{b}/gap_max"] = gap_by_bucket[b]
    return parts


def _published(sums: Mapping[str, float], gap: float) -> dict[str, float]:
    """The published values of one staleness bucket (or of all of them), from its sums."""
    out: dict[str, float] = {}
    tokens, measured, seqs = sums["tokens"], sums["measured"], sums["seqs"]
    if tokens > 0:
        out["masked_token_share"] = sums["masked"] / tokens
        out["truncated_token_share"] = sums["truncated"] / tokens
        out["tokens"] = tokens
    if measured > 0:
        out["k1_token"] = sums["k1"] / measured
        out["k3_token"] = sums["k3"] / measured
        out["max_token_gap"] = gap
    if seqs > 0:
        out["k1_seq"] = sums["k1_seq"] / seqs
        out["k3_seq"] = sums["k3_seq"] / seqs
        out["masked_seq_share"] = sums["masked_seq"] / seqs
        out["truncated_seq_share"] = sums["truncated_seq"] / seqs
    if sums["routed"] > 0:
        out["route_mismatch_share"] = sums["route_differs"] / sums["routed"]
    return out


def finalize_mismatch(merged: Mapping[str, float]) -> dict[str, float]:
    """Published ``mismatch/*`` metrics from the step's merged parts (host floats).

    ``mismatch/<name>`` over the whole step and ``mismatch/<name>/staleness_<k>`` for each staleness k that
    trained a token; nothing for a step without tokens.
    """
    buckets = sorted({int(key.split("/")[1][1:]) for key in merged if key.startswith("mismatch/s")})
    names = TOKEN_SUMS + SEQ_SUMS
    total = dict.fromkeys(names, 0.0)
    total_gap = 0.0
    out: dict[str, float] = {}
    for b in buckets:
        sums = {name: merged.get(f"mismatch/s{b}/{name}_sum", 0.0) for name in names}
        gap = merged.get(f"mismatch/s{b}/gap_max", 0.0)
        for name in names:
            total[name] += sums[name]
        if sums["measured"] > 0:
            total_gap = max(total_gap, gap)
        out.update({f"mismatch/{name}/staleness_{b}": v for name, v in _published(sums, gap).items()})
    out.update({f"mismatch/{name}": v for name, v in _published(total, total_gap).items()})
    return out

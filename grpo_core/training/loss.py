"""The GRPO objective as pure functions: tensors in, loss + metrics out.

Two pieces, in the order the trainer calls them, after the policy's log-probs of the sampled tokens
(and of the sampler's top-N ids) are computed by ``grpo_core.models.head`` (``reference.token_logprobs``
and its fused twins), with the same temperature and top-k/top-p candidate set the sampler used:

1. ``grpo_loss`` computes the clipped, off-policy-corrected surrogate for one micro-batch, already
   divided by the number of trained tokens in the whole optimizer step.
2. ``finalize_metrics`` turns the per-call metric sums of a step into the published numbers.

Nothing here touches a model, a process group or a device: every function is checked on its own
by ``tests/test_loss.py`` (``.venv/bin/python -m pytest tests/test_loss.py -q``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor

from grpo_core.training.mismatch import (
    VLLM_NEG_INF,
    Correction,
    CorrectionMode,
    correction_factors,
    finalize_mismatch,
    mismatch_parts,
    staleness_buckets,
)

__all__ = ["VLLM_NEG_INF", "LossConfig", "LossInputs", "finalize_metrics", "grpo_loss", "reduce_metric_parts"]


@dataclass(frozen=True)
class LossConfig:
    """Knobs of the GRPO objective, taken from the run's ``AsyncGRPOConfig`` (``from_config``), where
    each is declared, bounded and documented once. Checked again here because the functions below
    are also called on their own (tests, benchmarks)."""

    epsilon: float
    """Lower PPO clip: for a negative advantage the ratio is not pushed below ``1 - epsilon``."""
    epsilon_high: float
    """Upper PPO clip: for a positive advantage the ratio is not pushed above ``1 + epsilon_high``."""
    score_centering: bool
    """Subtract the expected score over the sampler's top-N at each trained position (see
    ``grpo_loss``). Skipped for a call whose inputs carry no top-N log-probs."""
    score_centering_weights: Literal["sampler", "importance"]
    """Weights of the centering baseline. ``"sampler"``: the sampler's top-N probabilities
    renormalised; exact when the per-token weight is the same for every candidate (e.g. the sampler
    draws from top-k of the trainer's own distribution and the trainer normalises over the full
    vocabulary), biased by O(pi - q) when the ratio is already an exact full-support importance
    weight. ``"importance"``: those probabilities times each candidate's own clipped/masked ratio
    (equivalently the trainer's probabilities over the eligible top-N), exact in both cases.
    Derivation in ``grpo_loss``; both behaviours are measured by the Monte-Carlo tests in
    ``tests/test_loss.py``."""
    vllm_importance_sampling_clip_min: float
    """Tokens whose ratio trainer/sampler is below this are dropped from the loss. It lies outside
    the PPO clip so that the clip stays the trust region."""
    vllm_importance_sampling_clip_max: float
    """Tokens whose ratio is above this are dropped. The PPO clip never binds for a negative
    advantage above 1, so without this bound such a token would be weighted by an unbounded ratio."""
    vllm_importance_sampling_correction: bool
    """False: every token with a finite ratio weighs its raw ratio (no mask, no truncation)."""
    vllm_importance_sampling_mode: CorrectionMode
    """Which weight the correction gives each token (``grpo_core.training.mismatch``)."""
    vllm_importance_sampling_cap: float
    """The ``*_truncate`` modes' largest weight."""
    max_staleness: int
    """Samples are at most this stale: the mismatch metrics keep one bucket per staleness 0..max_staleness."""
    mismatch_metrics: bool = True
    """Whether ``grpo_loss`` returns the ``mismatch/*`` metric parts. The trainer always asks for them; False
    serves a benchmark that measures what they cost a step (``benchmarks/trainer/fsdp_mfu.py --mismatch-metrics
    both``)."""

    def __post_init__(self) -> None:
        if not 0.0 < self.epsilon < 1.0:
            raise ValueError(f"epsilon must be in (0, 1), got {self.epsilon}")
        if self.epsilon_high < 0.0:
            raise ValueError(f"epsilon_high must be >= 0, got {self.epsilon_high}")
        if self.score_centering_weights not in ("sampler", "importance"):
            raise ValueError(f"unknown score_centering_weights {self.score_centering_weights!r}")
        self.correction  # checks the mode, the mask bounds and the cap  # noqa: B018

    @property
    def correction(self) -> Correction:
        return Correction(
            enabled=self.vllm_importance_sampling_correction, mode=self.vllm_importance_sampling_mode,
            clip_min=self.vllm_importance_sampling_clip_min, clip_max=self.vllm_importance_sampling_clip_max,
            cap=self.vllm_importance_sampling_cap,
        )

    @classmethod
    def from_config(cls, config: Any) -> LossConfig:
        """The objective's settings of an ``AsyncGRPOConfig``; centering needs top-N sampler log-probs."""
        return cls(
            epsilon=config.epsilon,
            epsilon_high=config.epsilon_high,
            score_centering=config.score_centering and config.num_sampler_logprobs > 0,
            score_centering_weights=config.score_centering_weights,
            vllm_importance_sampling_clip_min=config.vllm_importance_sampling_clip_min,
            vllm_importance_sampling_clip_max=config.vllm_importance_sampling_clip_max,
            vllm_importance_sampling_correction=config.vllm_importance_sampling_correction,
            vllm_importance_sampling_mode=config.vllm_importance_sampling_mode,
            vllm_importance_sampling_cap=config.vllm_importance_sampling_cap,
            max_staleness=config.max_staleness,
        )


@dataclass
class LossInputs:
    """The trained tokens of one micro-batch, flattened to T positions."""

    logprobs: Tensor
    """[T] trainer log-probs of the sampled tokens (requires grad), temperature-scaled and
    renormalised like the sampler's (``token_logprobs``)."""
    sampler_logprobs: Tensor
    """[T] the sampler's log-probs of the same tokens: the old policy of the ratio."""
    advantages: Tensor
    """[T] per-token advantage (the group advantage broadcast to the sample's tokens)."""
    top_logprobs: Tensor | None = None
    """[T, N] trainer log-probs of the sampler's top-N ids (requires grad)."""
    sampler_top_logprobs: Tensor | None = None
    """[T, N] the sampler's log-probs of those ids."""
    top_valid: Tensor | None = None
    """[T, N] bool, False for padding slots where fewer than N ids came back. None: all valid."""
    sample_index: Tensor | None = None
    """[T] int64: the sample (sequence) of the row each token belongs to, 0..S-1 (``PackedRow.sample_index``).
    None: the T tokens are one sequence."""
    sample_staleness: Tensor | None = None
    """[S] int64: each sample's staleness (weight updates behind the trainer), for the per-staleness metrics.
    None: every sample counts as staleness 0."""
    route_differs: Tensor | None = None
    """[T] bool, mixture-of-experts policies: the trainer's own top-k differs from the sampler's route at the
    position predicting the token (``grpo_core.models.moe.routing.routing_mismatch_tokens``)."""
    route_known: Tensor | None = None
    """[T] bool: the position has sampler routes in every MoE layer (where ``route_differs`` means something)."""

    def __post_init__(self) -> None:
        (t,) = self.logprobs.shape
        for name in ("sampler_logprobs", "advantages", "sample_index", "route_differs", "route_known"):
            value = getattr(self, name)
            shape = tuple(value.shape) if value is not None else (t,)
            if shape != (t,):
                raise ValueError(f"{name} has shape {shape}, want ({t},)")
        if (self.route_differs is None) != (self.route_known is None):
            raise ValueError("route_differs and route_known come together or not at all")
        if self.sample_staleness is not None and self.sample_index is None:
            raise ValueError("sample_staleness needs sample_index (which sample each token belongs to)")
        tops = (self.top_logprobs, self.sampler_top_logprobs)
        if (tops[0] is None) != (tops[1] is None):
            raise ValueError("top_logprobs and sampler_top_logprobs come together or not at all")
        if tops[0] is not None:
            if tops[0].dim() != 2 or tops[0].shape[0] != t or tops[1].shape != tops[0].shape:
                raise ValueError(
                    f"top log-probs must both be [T={t}, N], got {tuple(tops[0].shape)}"
                    f" and {tuple(tops[1].shape)}"
                )
            if self.top_valid is not None and self.top_valid.shape != tops[0].shape:
                raise ValueError(f"top_valid has shape {tuple(self.top_valid.shape)}")


# ---------------------------------------------------------------------------------------------
# The objective
# ---------------------------------------------------------------------------------------------


def _centering_weights(inputs: LossInputs, config: LossConfig, advantages: Tensor) -> Tensor:
    """[T, N] detached baseline weights per position (rows sum to 1, or 0 where none is usable)."""
    assert inputs.top_logprobs is not None and inputs.sampler_top_logprobs is not None
    dtype = torch.promote_types(inputs.top_logprobs.dtype, torch.float32)
    trainer = inputs.top_logprobs.detach().to(dtype)
    sampler = inputs.sampler_top_logprobs.detach().to(dtype)
    usable = torch.isfinite(trainer) & torch.isfinite(sampler) & (sampler > VLLM_NEG_INF)
    if inputs.top_valid is not None:
        usable &= inputs.top_valid.bool()
    if config.score_centering_weights == "sampler":
        # Renormalise q over the usable slots. A slot whose id the trainer's candidate set excludes
        # has no finite score to average, so it leaves the average rather than poisoning it.
        log_w = sampler
    else:
        # q_j * w_j, with w_j the weight candidate j would have had if it had been sampled (the
        # correction's weight and the same not-clipped indicator as the sampled token). Token
        # weights r_j give q_j r_j = pi_j: in log space the trainer's log-prob, which also avoids
        # 0 * inf for tiny q_j; a truncated one min(pi_j, C q_j). A sequence weight is the same for
        # every candidate of the position (to first order in 1/length) and cancels: q_j.
        ratio = torch.exp(trainer - sampler)
        adv = advantages.unsqueeze(-1)
        correction = config.correction
        log_w = trainer
        if correction.enabled and correction.mode == "token_mask":
            usable &= ratio >= correction.clip_min
            usable &= ratio <= correction.clip_max
        elif correction.enabled and correction.mode == "token_truncate":
            log_w = torch.minimum(trainer, sampler + math.log(correction.cap))
        elif correction.sequence_level:
            log_w = sampler
        usable &= ~((ratio < 1.0 - config.epsilon) & (adv < 0))
        usable &= ~((ratio > 1.0 + config.epsilon_high) & (adv > 0))
    log_w = log_w.masked_fill(~usable, float("-inf"))
    log_norm = torch.logsumexp(log_w, dim=-1, keepdim=True)
    # A row with no usable slot has log_norm = -inf; where() keeps its weights at exactly 0.
    return torch.where(usable, torch.exp(log_w - log_norm), torch.zeros_like(log_w))


def grpo_loss(
    inputs: LossInputs, config: LossConfig, num_tokens_in_step: int | Tensor
) -> tuple[Tensor, dict[str, Tensor]]:
    r"""Clipped, off-policy-corrected GRPO loss of one micro-batch, and its metric parts.

    **Objective.** Per trained token t with ratio r = exp(logprobs - sampler_logprobs) (the sampler
    is the old policy) and advantage A, the surrogate is min(r A, clip(r, 1 - epsilon,
    1 + epsilon_high) A) and the token's loss is its negative. Its gradient is -A w ∇log π(a_t)
    with the weight w = r where the clip does not bind and w = 0 where it does (r < 1 - epsilon
    with A < 0, or r > 1 + epsilon_high with A > 0).

    **Importance-sampling correction** (``config.correction``, ``grpo_core.training.mismatch``). Each
    token's clipped surrogate is multiplied by a detached factor c >= 0 such that an unclipped
    token's gradient weight becomes the mode's importance weight w = c r: the raw ratio (correction
    off), r inside [vllm_importance_sampling_clip_min, vllm_importance_sampling_clip_max] and 0
    outside (``token_mask``, the default), min(r, cap) (``token_truncate``), or the same on the
    geometric mean R_s of the token's own sample's ratios (``sequence_mask``, ``sequence_truncate``).
    The PPO clip is decided on the token's own r in every mode. A token with c = 0 contributes
    exactly 0 (value and gradient; its log-prob never reaches the graph, so an extreme or -inf
    log-prob cannot leak NaN into the gradient). It is **still counted** in
    ``num_tokens_in_step``: the denominator is fixed before the step's forward passes (no extra
    all-reduce of mask counts), and dropping a token must not up-weight the step's other tokens.

    **Normalisation.** The return value is sum over this call's tokens of the per-token loss,
    divided by ``num_tokens_in_step``: the number of trained tokens in the whole optimizer step,
    over all micro-batches and all data-parallel ranks. Summing the returned losses over a step's
    micro-batches and ranks (what gradient accumulation and a DP gradient sum do) gives the
    per-token mean over the step. Each token weighs the same whatever its sequence length or
    micro-batch. ``num_tokens_in_step`` must be >= 1 (a Tensor is not checked, to avoid a sync).

    **Score centering** (``config.score_centering`` and top-N given). At one position let q be
    the distribution the sampler drew from and π the trainer's. For the part of the advantage that
    does not depend on which token was drawn (a constant A), an update should move nothing. Its
    expectation is -A E_{a~q}[w(a) ∇log π(a)]. With a constant weight w = c this is
    -A c Σ_a q(a) ∇log π(a) = A c ∇_θ KL(q ‖ π), non-zero whenever π differs from q on q's support
    (e.g. the sampler truncated with top-k while the trainer normalises over the full vocabulary),
    so every step with A > 0 also descends KL(q ‖ π), pulling π toward q. The fix subtracts a
    baseline that depends on the position only, b = Σ_j ũ_j ∇log π(a_j) over the sampler's top-N
    ids, with the same coefficient -A w as the sampled token:

        gradient_t = -A w (∇log π(a_t) - b),   E_{a~q}[gradient] = -A (E_q[w ∇log π] - E_q[w] b).

    - ``"sampler"`` weights ũ = q̃, the sampler's top-N probabilities renormalised: b = E_q[∇log π]
      when the top-N covers q's support, so the expectation is exactly 0 when w is the same for
      every candidate, and -A Cov_q(w, ∇log π) otherwise. Caveat: when q has full support and w is
      the exact ratio π/q, the plain term is already unbiased (E_q[r ∇log π] = Σ π ∇log π = 0) and
      this baseline adds A E_q[r] b = A (q - π) in logit space.
    - ``"importance"`` weights ũ_j ∝ q_j w(a_j) (each candidate's own clipped/masked ratio,
      computed from the top-N log-probs as the correction would weigh it: q_j r_j = π_j, truncated
      min(π_j, C q_j), a sequence weight q_j): b = E_q[w ∇log π] / E_q[w], so the
      expectation is exactly 0 for any w, and b = 0 when the top-N covers the vocabulary unclipped.

    Both use stop-gradient weights. Top-N slots that are padding, -9999/-inf under the sampler, or
    -inf under the trainer (outside its candidate set) are left out and the rest renormalised; a
    position with none left is not centered. The centering term is added as
    coef · Σ_j ũ_j (x_j - sg(x_j)), which is exactly 0 in value: **the returned loss value is the
    corrected clipped surrogate; centering changes only the gradient.** Without top-N inputs the call
    is not centered; the caller is expected to say so once in its logs.

    Args:
        inputs: the micro-batch's T trained tokens (see ``LossInputs``).
        config: clip, mask and centering settings.
        num_tokens_in_step: trained tokens in the whole optimizer step, all micro-batches and ranks.

    Returns:
        ``(loss, parts)``: a scalar loss with gradient, and detached scalar metric parts of this
        call (sums, minima, maxima over its tokens) for ``finalize_metrics``.
    """
    if isinstance(num_tokens_in_step, int) and num_tokens_in_step < 1:
        raise ValueError(f"num_tokens_in_step must be >= 1, got {num_tokens_in_step}")
    logprobs = inputs.logprobs
    sampler = inputs.sampler_logprobs.to(logprobs.dtype)
    adv = inputs.advantages.to(logprobs.dtype)
    sample_index, num_samples = _samples(inputs)

    with torch.no_grad():
        log_ratio = logprobs.detach() - sampler
        ratio = torch.exp(log_ratio)
        factors = correction_factors(log_ratio, inputs.sampler_logprobs, config.correction, sample_index, num_samples)
        keep = ~factors.masked
        low = keep & (ratio < 1.0 - config.epsilon) & (adv < 0)
        high = keep & (ratio > 1.0 + config.epsilon_high) & (adv > 0)
        clipped = low | high
        factor, weight = factors.factor.to(logprobs.dtype), factors.weight.to(logprobs.dtype)
        clipped_ratio = ratio.clamp(1.0 - config.epsilon, 1.0 + config.epsilon_high)
        # The corrected surrogate c min(r A, clip(r) A) is w A where the clip does not bind and the
        # constant c clip(r) A where it does: its factor of A per token.
        scale = torch.where(clipped, factor * clipped_ratio, weight)
        active_weight = torch.where(keep & ~clipped, weight, torch.zeros_like(weight))

    # The advantages stay on the graph (the loss is linear in A per token; callers may differentiate in A).
    value = scale * adv
    # d(surrogate)/d(logprob) of an unclipped token: A c r = A w (the mode's importance weight).
    coef = active_weight * adv
    # The graph carries only coef * (x - sg(x)): 0 in value, gradient coef. A dropped token's log-prob
    # is replaced by 0 first, so an extreme or -inf one cannot leak NaN into the gradient.
    live = torch.where(keep & ~clipped, logprobs, torch.zeros_like(logprobs))
    surrogate = value + coef * (live - live.detach())
    per_token = -surrogate

    centered = config.score_centering and inputs.top_logprobs is not None
    if centered:
        assert inputs.top_logprobs is not None
        weights = _centering_weights(inputs, config, adv).to(logprobs.dtype)
        top = inputs.top_logprobs.to(logprobs.dtype)
        top = torch.where(weights > 0, top, torch.zeros_like(top))  # no -inf on the graph
        # -d(surrogate)/d(logprob) is -A w; the baseline enters with the opposite sign.
        per_token = per_token + coef * (weights * (top - top.detach())).sum(-1)

    per_token = torch.where(keep, per_token, torch.zeros_like(per_token))
    loss = per_token.sum() / num_tokens_in_step

    parts = _metric_parts(log_ratio, ratio, keep, low, high, inputs)
    if config.mismatch_metrics:
        staleness = inputs.sample_staleness if inputs.sample_staleness is not None \
            else torch.zeros(num_samples, dtype=torch.int64, device=log_ratio.device)
        parts.update(mismatch_parts(log_ratio, factors, sample_index, staleness,
                                    staleness_buckets(config.max_staleness), inputs.route_differs, inputs.route_known))
    return loss, parts


def _samples(inputs: LossInputs) -> tuple[Tensor, int]:
    """Each token's sample index and the number of samples (one sequence when the inputs do not say)."""
    if inputs.sample_index is None:
        t = inputs.logprobs.shape[0]
        return torch.zeros(t, dtype=torch.int64, device=inputs.logprobs.device), 1
    if inputs.sample_staleness is not None:
        return inputs.sample_index, int(inputs.sample_staleness.numel())
    # Without the per-sample tensor the count comes from the indices: a sync, for callers outside the trainer.
    return inputs.sample_index, int(inputs.sample_index.max().item()) + 1 if inputs.sample_index.numel() else 0


# ---------------------------------------------------------------------------------------------
# Metrics: per-call parts (sums / extremes) -> published step means
# ---------------------------------------------------------------------------------------------
# Keys of the parts end in _sum, _min or _max and reduce across micro-batches and ranks with
# sum, min and max respectively (``reduce_metric_parts``; a DP all-reduce uses the same rule).


def _metric_parts(
    log_ratio: Tensor, ratio: Tensor, keep: Tensor, low: Tensor, high: Tensor, inputs: LossInputs
) -> dict[str, Tensor]:
    f32 = torch.float32
    empty = ratio.numel() == 0  # .min() of an empty tensor raises; use the reduction identities
    parts = {
        "tokens_sum": torch.tensor(float(ratio.numel()), dtype=f32, device=ratio.device),
        "masked_sum": (~keep).sum().to(f32),
        "ratio_sum": ratio.sum().to(f32),
        "ratio_min": ratio.new_tensor(math.inf, dtype=f32) if empty else ratio.min().to(f32),
        "ratio_max": ratio.new_tensor(-math.inf, dtype=f32) if empty else ratio.max().to(f32),
        "logprob_diff_sum": log_ratio.sum().to(f32),
        "clip_low_sum": low.sum().to(f32),
        "clip_high_sum": high.sum().to(f32),
        "clip_region_sum": (low | high).sum().to(f32),
    }
    if inputs.sampler_top_logprobs is not None:
        with torch.no_grad():
            probs = torch.exp(inputs.sampler_top_logprobs.detach().float())  # -9999 -> 0
            if inputs.top_valid is not None:
                probs = probs * inputs.top_valid
            parts["sampler_mass_sum"] = probs.sum()
            parts["top_tokens_sum"] = parts["tokens_sum"].clone()
    return parts


def reduce_metric_parts(parts: list[dict[str, Tensor]]) -> dict[str, Tensor]:
    """Merge per-call parts into one dict by key suffix: _min -> min, _max -> max, else sum."""
    if _same_layout(parts):
        # The usual step: every call has the same scalar parts on one device. One stack per call and three
        # reductions, instead of one kernel per part and call (a step has ~100 parts per call).
        keys = list(parts[0])
        table = torch.stack([torch.stack([p[k].detach().reshape(()) for k in keys]) for p in parts])
        sums, mins, maxs = table.sum(0), table.amin(0), table.amax(0)
        return {k: (mins if k.endswith("_min") else maxs if k.endswith("_max") else sums)[i]
                for i, k in enumerate(keys)}
    merged: dict[str, Tensor] = {}
    for part in parts:
        for key, value in part.items():
            value = value.detach()
            if key not in merged:
                merged[key] = value.clone()
            elif key.endswith("_min"):
                merged[key] = torch.minimum(merged[key], value)
            elif key.endswith("_max"):
                merged[key] = torch.maximum(merged[key], value)
            else:
                merged[key] = merged[key] + value
    return merged


def _same_layout(parts: list[dict[str, Tensor]]) -> bool:
    if len(parts) < 2 or not parts[0]:
        return False
    first = parts[0]
    keys = first.keys()
    kinds = {(v.dtype, v.device, v.numel()) for p in parts for v in p.values()}
    return all(p.keys() == keys for p in parts) and len(kinds) == 1 and next(iter(kinds))[2] == 1


def finalize_metrics(parts: list[dict[str, Tensor]]) -> dict[str, float]:
    """Published step metrics from the parts of every ``grpo_loss`` call of the step.

    Means are over all trained tokens of the step (dropped ones included), so they do not depend
    on how tokens were split into micro-batches. ``clip_ratio/*`` count only tokens the IS mask
    kept: masked_mean + region_mean is the share of tokens with no gradient from a nonzero
    advantage. ``sampling/sampler_mass`` appears only when some call had top-N log-probs; nothing
    is published for a step without tokens.
    """
    merged = reduce_metric_parts(parts)
    # One device-to-host copy for every part of the step, not one sync per part.
    values = torch.stack([v.float().reshape(()) for v in merged.values()]).tolist() if merged else []
    m = dict(zip(merged, values))
    n = m.get("tokens_sum", 0.0)
    if n == 0:
        return {}
    out = {
        "sampling/masked_mean": m["masked_sum"] / n,
        "sampling/ratio_mean": m["ratio_sum"] / n,
        "sampling/ratio_min": m["ratio_min"],
        "sampling/ratio_max": m["ratio_max"],
        "sampling/logprob_diff_mean": m["logprob_diff_sum"] / n,
        "clip_ratio/low_mean": m["clip_low_sum"] / n,
        "clip_ratio/high_mean": m["clip_high_sum"] / n,
        "clip_ratio/region_mean": m["clip_region_sum"] / n,
    }
    if m.get("top_tokens_sum", 0.0) > 0:
        out["sampling/sampler_mass"] = m["sampler_mass_sum"] / m["top_tokens_sum"]
    out.update(finalize_mismatch(m))
    return out

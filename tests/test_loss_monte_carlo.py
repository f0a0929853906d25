"""Score centering of the GRPO loss against Monte-Carlo expectations on a tiny vocabulary: a constant
advantage must not move the policy where the centering is unbiased, and does where it is not.

    .venv/bin/python -m pytest -q tests/test_loss_monte_carlo.py
"""

from __future__ import annotations

import math

import pytest
import torch

from grpo_core.models.head.reference import token_logprobs
from grpo_core.training.loss import VLLM_NEG_INF, LossConfig, LossInputs, grpo_loss
from tests.test_loss import F64, loss_config, t64
from tests.tolerances import gamma


# ---------------------------------------------------------------------------------------------
# Monte-Carlo: does a constant advantage move the policy?
# ---------------------------------------------------------------------------------------------
# For softmax logits theta, grad_theta log pi(a) = e_a - pi. Each test draws M tokens from the
# sampler q with a seeded generator, gives every token advantage A = +1, and takes the gradient
# of grpo_loss with respect to a per-sample copy of the logits: row i times M is sample i's
# gradient, and their mean is the gradient of the loss over the batch. The mean is compared with
# the analytic expectation per coordinate within Z standard errors of that mean.
Z = 5.0


def _mc_gradients(
    theta: torch.Tensor,
    sampler_logp: torch.Tensor,
    top_ids: torch.Tensor,
    config: LossConfig,
    m: int,
    seed: int,
) -> torch.Tensor:
    """[m, V] per-sample loss gradients w.r.t. the trainer's logits (full-vocabulary softmax)."""
    gen = torch.Generator().manual_seed(seed)
    sampled = torch.multinomial(sampler_logp.exp(), m, replacement=True, generator=gen)
    logits = theta.expand(m, -1).clone().requires_grad_()
    top = top_ids.expand(m, -1)
    lp, top_lp = token_logprobs(logits, sampled, 1.0, top)
    sampler_top = sampler_logp[top].clamp_min(VLLM_NEG_INF)  # vLLM's -inf stand-in
    inputs = LossInputs(lp, sampler_logp[sampled], torch.ones(m, dtype=F64), top_lp, sampler_top)
    loss, _ = grpo_loss(inputs, config, m)
    loss.backward()
    return logits.grad * m


def _assert_mean(grads: torch.Tensor, expected: torch.Tensor) -> None:
    mean = grads.mean(0)
    se = grads.std(0) / math.sqrt(grads.shape[0])
    # Z standard errors (statistics), plus fp64 rounding where every sample agrees (se ~ 0): a
    # per-sample coordinate is A·r·(score − baseline), terms of size <= 2·r·|A| <= 4 (A = 1, r <= 2
    # by the IS mask) that cancel to 0 where centering is exact; γ of that for the per-sample and
    # analytic arithmetic (64 roundings) and the mean over m samples.
    rounding = gamma(grads.shape[0] + 64, F64) * 4.0
    assert (mean - expected).abs().le(Z * se + rounding).all(), (mean, expected, se)


def _assert_clearly_nonzero(grads: torch.Tensor, expected: torch.Tensor) -> None:
    se = grads.std(0) / math.sqrt(grads.shape[0])
    assert expected.abs().max() > 2 * Z * se.max(), (expected, se)  # far outside the "~0" band
    _assert_mean(grads, expected)


THETA = t64([2.0, 1.5, 1.0, 0.2, -0.5, -1.0])


@pytest.mark.parametrize("weights", ["sampler", "importance"])
def test_mc_top_k_sampler_full_vocab_trainer(weights):
    """Setting: trainer pi = softmax(theta) over the full vocabulary (no candidate set, as when the
    server cannot return its sampling mask); the sampler draws from q = top-3 of that same
    distribution renormalised and reports processed log-probs (so -9999 outside the top-3). N = 4
    top slots: the three candidates and one id at -9999. Every ratio is pi(a)/q(a) = pi(S) ~ 0.87,
    inside the mask and, with A > 0, never clipped. Plain: E = -A pi(S) (q - pi), non-zero; it
    raises the trainer's mass on S, i.e. drags pi toward q. Centered (both weightings coincide
    here): E = -A pi(S) E_q[e_a - q] = 0.
    """
    pi = torch.softmax(THETA, -1)
    support = torch.tensor([0, 1, 2])
    q = torch.zeros(6, dtype=F64)
    q[support] = pi[support] / pi[support].sum()
    top_ids = torch.tensor([0, 1, 2, 3])
    mass = pi[support].sum()
    assert 0.8 < mass < 1.0  # the setting: ratio inside the mask, not clipped for A > 0

    plain = _mc_gradients(THETA, q.log(), top_ids, loss_config(score_centering=False), 50_000, 0)
    _assert_clearly_nonzero(plain, -mass * (q - pi))
    centered = _mc_gradients(
        THETA, q.log(), top_ids, loss_config(score_centering_weights=weights), 50_000, 0
    )
    _assert_mean(centered, torch.zeros(6, dtype=F64))


@pytest.mark.parametrize("weights", ["sampler", "importance"])
def test_mc_sanity_on_policy_full_top_n(weights):
    """Setting: pi == q exactly, N = V. Score has mean zero under q: both updates ~ 0."""
    logp = torch.log_softmax(THETA, -1)
    top_ids = torch.arange(6)
    for config in (loss_config(score_centering=False), loss_config(score_centering_weights=weights)):
        grads = _mc_gradients(THETA, logp, top_ids, config, 20_000, 1)
        _assert_mean(grads, torch.zeros(6, dtype=F64))


def _stale(delta: list[float]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    theta_old = t64([1.0, 0.5, 0.0, -0.5, -1.0, 0.3])
    theta = theta_old + t64(delta)
    q, pi = torch.softmax(theta_old, -1), torch.softmax(theta, -1)
    return theta, q, pi, pi / q


def test_mc_stale_sampler_full_support_is_where_sampler_centering_is_biased():
    """Honest limitation. Setting: the sampler is a stale policy with full support,
    q = softmax(theta_old), pi = softmax(theta_old + delta), N = V, all ratios inside the clip
    region. Here the ratio is the exact importance weight: plain E = -A E_q[r (e_a - pi)] = 0.
    "sampler" centering subtracts b = q - pi with coefficient A r, so E = A E_q[r] (q - pi) =
    A (q - pi): non-zero (it pushes pi away from q for A > 0). "importance" centering uses
    b = sum_j pi_j (e_j - pi) = 0 and stays unbiased."""
    theta, q, pi, ratio = _stale([0.18, -0.18, 0.08, -0.05, 0.1, -0.05])
    assert (ratio > 0.8).all() and (ratio < 1.28).all()  # the setting: nothing clipped or masked
    top_ids, m = torch.arange(6), 50_000
    plain = _mc_gradients(theta, q.log(), top_ids, loss_config(score_centering=False), m, 2)
    _assert_mean(plain, torch.zeros(6, dtype=F64))
    sampler = _mc_gradients(theta, q.log(), top_ids, loss_config(), m, 2)
    _assert_clearly_nonzero(sampler, q - pi)
    importance_config = loss_config(score_centering_weights="importance")
    importance = _mc_gradients(theta, q.log(), top_ids, importance_config, m, 2)
    _assert_mean(importance, torch.zeros(6, dtype=F64))


def test_mc_clip_binding_importance_centering_stays_unbiased():
    """Setting: stale full-support sampler as above, but token 0's ratio exceeds 1 + epsilon_high,
    so with A > 0 its weight is 0 (clip binds). Plain: E = -A sum_{a unclipped} pi_a (e_a - pi),
    non-zero. "sampler": E = -A [sum_u pi_a (e_a - pi) - pi(U) (q - pi)], U the unclipped tokens.
    "importance": 0, since its baseline is renormalised over exactly the unclipped tokens."""
    theta, q, pi, ratio = _stale([0.6, -0.1, 0.0, 0.0, 0.0, 0.0])
    unclipped = ratio <= 1.28
    # the setting: only token 0 clipped; for A > 0 the low clip never binds, and all are >= 0.5
    assert not unclipped[0] and unclipped[1:].all() and (ratio >= 0.5).all()
    top_ids, m = torch.arange(6), 50_000
    eye = torch.eye(6, dtype=F64)
    weighted_score = (pi[unclipped, None] * (eye[unclipped] - pi)).sum(0)
    plain = _mc_gradients(theta, q.log(), top_ids, loss_config(score_centering=False), m, 3)
    _assert_clearly_nonzero(plain, -weighted_score)
    sampler = _mc_gradients(theta, q.log(), top_ids, loss_config(), m, 3)
    _assert_mean(sampler, -(weighted_score - pi[unclipped].sum() * (q - pi)))
    importance_config = loss_config(score_centering_weights="importance")
    importance = _mc_gradients(theta, q.log(), top_ids, importance_config, m, 3)
    _assert_mean(importance, torch.zeros(6, dtype=F64))

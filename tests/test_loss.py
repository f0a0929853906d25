"""The GRPO objective: every term against hand-computed values, gradients against autograd and
an independent formula. Score centering against Monte-Carlo expectations: ``test_loss_monte_carlo.py``;
log-probs over the sampler's candidate sets: ``test_logprob_renormalisation.py``.

Expected values are written out as numbers (or computed with ``math``/numpy from the definitions),
never with the code under test.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from grpo_core.models.head.reference import token_logprobs
from grpo_core.training.loss import (
    VLLM_NEG_INF,
    LossConfig,
    LossInputs,
    finalize_metrics,
    grpo_loss,
    reduce_metric_parts,
)
from tests.tolerances import gamma, log_softmax_grad_magnitude, reorder_bound, unit_roundoff

F64 = torch.float64
NEG_INF = float("-inf")
U64 = unit_roundoff(F64)


def fp64_rel(ops: int, *exponents: float) -> float:
    """Relative fp64 error of a value reached through at most ``ops`` rounded operations (both sides
    of the comparison counted) that passes through exp() of log-probs: an exponent x carries an
    absolute error of about u·|x| per rounding, which exp turns into a relative one, hence the
    factor 1 + max|x| (bounds from the arithmetic: tests/tolerances.py)."""
    return gamma(ops, F64) * (1.0 + max((abs(x) for x in exponents), default=0.0))

# The settings the hand-computed values below were derived with (the run's defaults, except the
# centering weights, which most hand examples compute with the sampler's probabilities alone).
HAND = dict(
    epsilon=0.2,
    epsilon_high=0.28,
    score_centering=True,
    score_centering_weights="sampler",
    vllm_importance_sampling_clip_min=0.5,
    vllm_importance_sampling_clip_max=2.0,
    vllm_importance_sampling_correction=True,
    vllm_importance_sampling_mode="token_mask",
    vllm_importance_sampling_cap=2.0,
    max_staleness=4,
)


def loss_config(**overrides) -> LossConfig:
    return LossConfig(**{**HAND, **overrides})


def t64(values) -> torch.Tensor:
    return torch.tensor(values, dtype=F64)


# ---------------------------------------------------------------------------------------------
# Config and inputs
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [
        {"epsilon": 0.0},
        {"epsilon": 1.0},
        {"epsilon_high": -0.1},
        {"vllm_importance_sampling_clip_min": 1.1},
        {"vllm_importance_sampling_clip_max": 0.9},
        {"vllm_importance_sampling_clip_min": -0.1},
        {"score_centering_weights": "uniform"},
    ],
)
def test_config_rejects_bad_values(kwargs):
    with pytest.raises(ValueError):
        loss_config(**kwargs)


def test_default_mask_contains_the_clip_region():
    from grpo_core.config import AsyncGRPOConfig

    c = LossConfig.from_config(AsyncGRPOConfig())
    assert c.vllm_importance_sampling_clip_min < 1 - c.epsilon
    assert c.vllm_importance_sampling_clip_max > 1 + c.epsilon_high
    # symmetric in log space
    lo, hi = c.vllm_importance_sampling_clip_min, c.vllm_importance_sampling_clip_max
    assert math.isclose(math.log(hi), -math.log(lo), rel_tol=4 * U64)  # each libm log within 1 ulp (2u)


def test_inputs_check_shapes():
    z = torch.zeros(3)
    with pytest.raises(ValueError):
        LossInputs(z, torch.zeros(2), z)
    with pytest.raises(ValueError):
        LossInputs(z, z, z, top_logprobs=torch.zeros(3, 2))  # sampler side missing
    with pytest.raises(ValueError):
        LossInputs(z, z, z, torch.zeros(3, 2), torch.zeros(3, 3))
    with pytest.raises(ValueError):
        LossInputs(z, z, z, torch.zeros(3, 2), torch.zeros(3, 2), torch.ones(3, 1, dtype=bool))
    with pytest.raises(ValueError):
        grpo_loss(LossInputs(z, z, z), loss_config(), 0)


# ---------------------------------------------------------------------------------------------
# Ratio, both clips, IS mask, normalisation: one hand-built micro-batch
# ---------------------------------------------------------------------------------------------
# epsilon 0.2, epsilon_high 0.28 -> clip region [0.8, 1.28]; IS mask [0.5, 2.0].
#  tok  ratio  A     min(rA, clip(r)A)                    state                    d(loss_t)/d lp_t
#   0   1.1   +1    min(1.1, 1.1)    = 1.1              inside                     -1.1
#   1   1.5   +2    min(3.0, 2.56)   = 2.56             high clip binds            0
#   2   1.5   -1    min(-1.5, -1.28) = -1.5             high active, not binding   +1.5
#   3   0.7   -1    min(-0.7, -0.8)  = -0.8             low clip binds             0
#   4   0.7   +0.5  min(0.35, 0.4)   = 0.35             low active, not binding    -0.35
#   5   3.0   +1    dropped (ratio > 2.0)                                          0
#   6   0.4   -1    dropped (ratio < 0.5; the low clip would bind, not counted)   0
HAND_RATIOS = [1.1, 1.5, 1.5, 0.7, 0.7, 3.0, 0.4]
HAND_ADV = [1.0, 2.0, -1.0, -1.0, 0.5, 1.0, -1.0]
HAND_SAMPLER = [-1.0, -0.5, -2.0, -1.5, -0.3, -2.5, -0.7]
HAND_LOSS_PER_TOKEN = [-1.1, -2.56, 1.5, 0.8, -0.35, 0.0, 0.0]
HAND_GRAD_PER_TOKEN = [-1.1, 0.0, 1.5, 0.0, -0.35, 0.0, 0.0]
# fp64 rounding of a hand token's value: log r, s + log r, − s, exp, ×A (and ×/÷ the normaliser), the
# sum over 7 tokens, and the hand side's own sum and division: at most 13 roundings, with exponents
# up to |s| + |log r|.
HAND_REL = fp64_rel(13, *(abs(s) + abs(math.log(r)) for s, r in zip(HAND_SAMPLER, HAND_RATIOS)))


def _hand_inputs(**extra) -> LossInputs:
    sampler = t64(HAND_SAMPLER)
    logprobs = (sampler + torch.log(t64(HAND_RATIOS))).requires_grad_()
    return LossInputs(logprobs, sampler, t64(HAND_ADV), **extra)


@pytest.mark.parametrize("centering", [True, False])  # no top-N given: centering is skipped
def test_surrogate_clips_and_mask_hand_computed(centering):
    inputs = _hand_inputs()
    loss, _ = grpo_loss(inputs, loss_config(score_centering=centering), num_tokens_in_step=10)
    hand_bound = HAND_REL * sum(map(abs, HAND_LOSS_PER_TOKEN)) / 10  # γ·Σ|terms|/n (HAND_REL)
    assert loss.item() == pytest.approx(sum(HAND_LOSS_PER_TOKEN) / 10, abs=hand_bound)
    assert loss.item() == pytest.approx(-0.171, abs=hand_bound)
    loss.backward()
    # relative per token; the zeros (clip binds, dropped) are exact: a detached clip, where()'s zeros
    torch.testing.assert_close(inputs.logprobs.grad, t64(HAND_GRAD_PER_TOKEN) / 10, rtol=HAND_REL, atol=0)


def test_metrics_hand_computed():
    _, parts = grpo_loss(_hand_inputs(), loss_config(), num_tokens_in_step=10)
    m = finalize_metrics([parts])
    expected = {
        "sampling/masked_mean": 2 / 7,
        "sampling/ratio_mean": (1.1 + 1.5 + 1.5 + 0.7 + 0.7 + 3.0 + 0.4) / 7,
        "sampling/ratio_min": 0.4,
        "sampling/ratio_max": 3.0,
        "sampling/logprob_diff_mean": math.log(1.1 * 1.5 * 1.5 * 0.7 * 0.7 * 3.0 * 0.4) / 7,
        "clip_ratio/low_mean": 1 / 7,  # token 3 only; token 6 is masked
        "clip_ratio/high_mean": 1 / 7,  # token 1 only; token 2 has A < 0
        "clip_ratio/region_mean": 2 / 7,
    }
    # no top-N -> no sampler_mass; the mismatch/* metrics: tests/test_mismatch.py
    assert {k for k in m if not k.startswith("mismatch/")} == expected.keys()
    for key, value in expected.items():
        if key == "sampling/masked_mean" or key.startswith("clip_ratio/"):
            assert m[key] == value, key  # counts, exact in fp32, over 7: the same division as the hand side
        else:  # one fp32 rounding of an fp64 sum or extreme (u32), on top of its fp64 error (HAND_REL,
            # absolute for the log-ratio sum, whose terms cancel)
            tol = (unit_roundoff(torch.float32) + HAND_REL) * abs(value) + HAND_REL
            assert m[key] == pytest.approx(value, abs=tol), key
    assert all(v.requires_grad is False and v.dim() == 0 for v in parts.values())


def test_dropped_tokens_count_in_the_denominator():
    """Dropping tokens neither changes the denominator nor re-weights the kept tokens."""
    kept = [0, 1, 2, 3, 4]
    sampler = t64(HAND_SAMPLER)[kept]
    logprobs = (sampler + torch.log(t64(HAND_RATIOS)[kept])).requires_grad_()
    only_kept = LossInputs(logprobs, sampler, t64(HAND_ADV)[kept])
    loss_all, _ = grpo_loss(_hand_inputs(), loss_config(), 7)
    loss_kept, _ = grpo_loss(only_kept, loss_config(), 7)
    # The same kept terms bit for bit (dropped ones add exact zeros); only the sum's grouping may differ.
    assert loss_all.item() == pytest.approx(loss_kept.item(), abs=reorder_bound(7, sum(map(abs, HAND_LOSS_PER_TOKEN)) / 7, F64))
    # With no mask the PPO clip alone would handle them: token 5 (ratio 3, A > 0) is high-clipped
    # to -(1.28 * 1) = -1.28; token 6 (ratio 0.4, A < 0) low-clipped to -(0.8 * -1) = +0.8.
    wide = loss_config(vllm_importance_sampling_clip_min=0.0, vllm_importance_sampling_clip_max=10.0)
    loss_wide, _ = grpo_loss(_hand_inputs(), wide, 7)
    expected = (sum(HAND_LOSS_PER_TOKEN) - 1.28 + 0.8) / 7
    assert loss_wide.item() == pytest.approx(expected, abs=HAND_REL * (sum(map(abs, HAND_LOSS_PER_TOKEN)) + 1.28 + 0.8) / 7)


def test_extreme_log_ratios_are_dropped_with_finite_gradients():
    logprobs = t64([NEG_INF, 0.0, -200.0, -1.0]).requires_grad_()
    sampler = t64([-1.0, -150.0, -1.0, -1.0])  # ratios 0, e^150, e^-199, 1
    inputs = LossInputs(logprobs, sampler, t64([1.0, -1.0, 1.0, 2.0]))
    loss, parts = grpo_loss(inputs, loss_config(), 4)
    loss.backward()
    assert torch.isfinite(logprobs.grad).all()
    # Exact: the kept token's log-ratio is (−1) − (−1) = 0, exp(0) = 1, and −2/4 is a binary fraction;
    # the dropped ones get where()'s zeros.
    torch.testing.assert_close(logprobs.grad, t64([0.0, 0.0, 0.0, -2.0 / 4]), rtol=0, atol=0)
    assert loss.item() == -2.0 / 4
    assert finalize_metrics([parts])["sampling/masked_mean"] == 0.75


def test_gradcheck_without_centering():
    """Without centering the gradient is the true derivative of the loss value: finite differences
    agree (ratios chosen away from the clip and mask boundaries)."""
    sampler = t64(HAND_SAMPLER)
    adv = t64(HAND_ADV)

    def f(logprobs):
        inputs = LossInputs(logprobs, sampler, adv)
        return grpo_loss(inputs, loss_config(score_centering=False), 7)[0]

    assert torch.autograd.gradcheck(f, (_hand_inputs().logprobs.detach().requires_grad_(),))


# ---------------------------------------------------------------------------------------------
# Score centering term
# ---------------------------------------------------------------------------------------------
# Four positions, N = 3 top slots, num_tokens_in_step = 5.
#  pos  sampler top probs         valid      ratio A    coef = A*r*[not clipped]*[kept]
#   0   0.5, 0.3, 0.1             T T T      1.1  +1    1.1   q~ = (5/9, 3/9, 1/9)
#   1   0.6, -9999, pad           T T F      0.9  -2    -1.8  q~ = (1, 0, 0); trainer slot 1 -inf
#   2   0.4, 0.4, 0.2             T T T      1.5  +1    0     (high clip binds)
#   3   0.4, 0.4, 0.2             T T T      3.0  +1    0     (dropped by the IS mask)
# d loss / d top_lp[t, j] = coef_t * q~_tj / 5 ; d loss / d lp_t = -coef_t / 5.


def _centering_inputs() -> LossInputs:
    sampler_lp = torch.log(t64([0.5, 0.6, 0.4, 0.4]))
    ratios = t64([1.1, 0.9, 1.5, 3.0])
    logprobs = (sampler_lp + torch.log(ratios)).requires_grad_()
    sampler_top = torch.log(
        t64([[0.5, 0.3, 0.1], [0.6, 1.0, 1.0], [0.4, 0.4, 0.2], [0.4, 0.4, 0.2]])
    )
    sampler_top[1, 1] = VLLM_NEG_INF
    sampler_top[1, 2] = 0.0  # padding slot: any value, ignored
    trainer_top = torch.log(
        t64([[0.55, 0.25, 0.1], [0.54, 1.0, 1.0], [0.6, 0.3, 0.05], [0.9, 0.05, 0.02]])
    )
    trainer_top[1, 1] = NEG_INF  # outside the trainer's candidate set
    trainer_top[1, 2] = 0.3
    valid = torch.ones(4, 3, dtype=torch.bool)
    valid[1, 2] = False
    adv = t64([1.0, -2.0, 1.0, 1.0])
    return LossInputs(logprobs, sampler_lp, adv, trainer_top.requires_grad_(), sampler_top, valid)


# fp64: sampler log-probs, log-ratios and the baseline's logsumexp of log-probs pass through exp; each
# value takes at most 16 roundings on either side; exponents up to twice the largest |log| here.
CENTER_REL = fp64_rel(16, 2 * max(abs(math.log(x)) for x in (0.5, 0.3, 0.1, 0.6, 0.4, 0.2, 1.1, 0.9, 1.5, 3.0)))


def test_centering_gradient_hand_computed_and_value_unchanged():
    inputs = _centering_inputs()
    loss, parts = grpo_loss(inputs, loss_config(), 5)
    loss.backward()
    expected_top = (
        t64([[1.1 * 5 / 9, 1.1 * 3 / 9, 1.1 * 1 / 9], [-1.8, 0.0, 0.0], [0.0] * 3, [0.0] * 3]) / 5
    )
    # relative; zeros are exact (coefficient 0 where clipped or dropped, weight 0 for unusable slots)
    torch.testing.assert_close(inputs.top_logprobs.grad, expected_top, rtol=CENTER_REL, atol=0)
    torch.testing.assert_close(inputs.logprobs.grad, t64([-1.1, 1.8, 0.0, 0.0]) / 5, rtol=CENTER_REL, atol=0)
    # per-token surrogate: -1.1, -(0.9 * -2) = 1.8, -1.28, 0 (dropped)
    assert loss.item() == pytest.approx((-1.1 + 1.8 - 1.28) / 5, abs=CENTER_REL * (1.1 + 1.8 + 1.28) / 5)

    plain = _centering_inputs()
    plain_loss, _ = grpo_loss(plain, loss_config(score_centering=False), 5)
    assert loss.item() == plain_loss.item()  # centering changes the gradient only
    plain_loss.backward()
    assert plain.top_logprobs.grad is None or (plain.top_logprobs.grad == 0).all()
    # sampler mass covered by the valid top-N: 0.9, 0.6 (the -9999 slot is 0), 1.0, 1.0
    m = finalize_metrics([parts])
    # fp32: each slot is exp of an fp32-rounded log-prob (relative u32·(1 + |log q|)), then a sum of
    # 12 non-negative terms (γ_12); the mean's division is fp64.
    mass_rel = gamma(12, torch.float32) + unit_roundoff(torch.float32) * (1 + abs(math.log(0.1)))
    assert m["sampling/sampler_mass"] == pytest.approx((0.9 + 0.6 + 1.0 + 1.0) / 4, rel=mass_rel, abs=0)


def test_importance_centering_weights_hand_computed():
    """Importance weights: q_j * w_j = pi_j over the candidates whose own ratio is kept and not
    clipped for this position's advantage sign, renormalised.

    pos 0 (A=+1): q = (.5, .3, .2), pi = (.45, .36, .08) -> r = (.9, 1.2, .4): slot 2 dropped
        (0.4 < 0.5) -> weights (.45, .36, 0) / .81 ; sampled slot 0, ratio .9, coef .9
    pos 1 (A=-1): q = (.5, .3, .2), pi = (.5, .21, .3) -> r = (1, .7, 1.5): slot 1 low-clipped
        (0.7 < 0.8 with A < 0); slot 2 kept (the high clip binds only for A > 0)
        -> weights (.5, 0, .3) / .8 ; sampled slot 0, ratio 1, coef -1
    """
    q = t64([[0.5, 0.3, 0.2], [0.5, 0.3, 0.2]])
    pi = t64([[0.45, 0.36, 0.08], [0.5, 0.21, 0.3]])
    logprobs = torch.log(pi[:, 0]).requires_grad_()
    top = torch.log(pi).requires_grad_()
    inputs = LossInputs(logprobs, torch.log(q[:, 0]), t64([1.0, -1.0]), top, torch.log(q))
    loss, _ = grpo_loss(inputs, loss_config(score_centering_weights="importance"), 2)
    loss.backward()
    expected = t64([[0.9 * 0.45 / 0.81, 0.9 * 0.36 / 0.81, 0.0], [-0.5 / 0.8, 0.0, -0.3 / 0.8]]) / 2
    # fp64 (as CENTER_REL, exponents the log-probs here); excluded slots' weights are exact zeros
    rel = fp64_rel(16, 2 * max(abs(math.log(x)) for x in (0.5, 0.3, 0.2, 0.45, 0.36, 0.08, 0.21)))
    torch.testing.assert_close(top.grad, expected, rtol=rel, atol=0)


def test_position_without_usable_top_slots_is_not_centered():
    logprobs = t64([-1.0]).requires_grad_()
    top = t64([[NEG_INF, -2.0]]).requires_grad_()
    inputs = LossInputs(
        logprobs, t64([-1.0]), t64([1.0]), top, t64([[-0.5, -1.0]]), torch.tensor([[True, False]])
    )
    loss, _ = grpo_loss(inputs, loss_config(), 1)
    loss.backward()
    assert torch.isfinite(top.grad).all() and (top.grad == 0).all()
    assert logprobs.grad.item() == -1.0


# ---------------------------------------------------------------------------------------------
# Gradient through logits vs. an independent formula
# ---------------------------------------------------------------------------------------------


def test_gradient_through_logits_matches_formula():
    """logits -> token_logprobs (temperature, candidate sets) -> centered loss: autograd equals
    -(1/n) sum_t c_t (grad lp(a_t) - sum_j q~_tj grad lp(a_j)), with grad_x lp(a) = (e_a - p~)/T
    and p~ the softmax at temperature T renormalised over the candidate set (numpy, by hand)."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(3, 5))
    temp = 0.8
    sets = np.array([[1, 1, 1, 1, 1], [1, 1, 0, 1, 0], [0, 1, 1, 1, 1]], dtype=bool)
    target = np.array([0, 3, 2])
    top_ids = np.array([[0, 1, 2], [0, 1, 3], [1, 2, 4]])
    adv = np.array([1.0, -1.0, 1.0])
    log_ratio = np.log([1.1, 0.9, 1.5])  # token 2: high clip binds -> coefficient 0
    n = 4

    z = np.where(sets, x / temp, -np.inf)
    p = np.exp(z - np.log(np.exp(z).sum(-1, keepdims=True)))
    lp = np.log(p[np.arange(3), target])
    sampler_top = np.log(np.array([[0.5, 0.3, 0.2], [0.6, 0.3, 0.1], [0.2, 0.5, 0.3]]))
    q_tilde = np.exp(sampler_top) / np.exp(sampler_top).sum(-1, keepdims=True)
    coef = adv * np.exp(log_ratio) * np.array([1.0, 1.0, 0.0])

    def grad_lp(t, a):
        return (np.eye(5)[a] - p[t]) / temp

    expected = np.zeros_like(x)
    for t in range(3):
        baseline = sum(q_tilde[t, j] * grad_lp(t, top_ids[t, j]) for j in range(3))
        expected[t] = -coef[t] * (grad_lp(t, target[t]) - baseline) / n

    logits = torch.tensor(x, requires_grad=True)
    lp_t, top_t = token_logprobs(
        logits, torch.tensor(target), temp, torch.tensor(top_ids), torch.tensor(sets)
    )
    sampler_lp = torch.tensor(lp - log_ratio)
    inputs = LossInputs(lp_t, sampler_lp, torch.tensor(adv), top_t, torch.tensor(sampler_top))
    loss, _ = grpo_loss(inputs, loss_config(), n)
    loss.backward()
    # fp64, each entry a sum of score terms that cancel off the targets (exactly 0 outside the sets):
    # within γ of their magnitude |g| + p̃·Σ|g| (log_softmax_grad_magnitude), exponents z and logsumexp.
    scores = np.zeros_like(x)
    for t in range(3):
        scores[t, target[t]] += abs(coef[t]) / n / temp
        np.add.at(scores[t], top_ids[t], abs(coef[t]) * q_tilde[t] / n / temp)
    magnitude = log_softmax_grad_magnitude(torch.tensor(z), torch.tensor(scores)).numpy()
    bound = fp64_rel(24, np.abs(z[sets]).max() + np.abs(np.log(np.exp(z).sum(-1))).max()) * magnitude
    assert (np.abs(logits.grad.numpy() - expected) <= bound).all()


# ---------------------------------------------------------------------------------------------
# Normalisation across micro-batches
# ---------------------------------------------------------------------------------------------


def test_two_micro_batches_equal_one_call():
    gen = torch.Generator().manual_seed(1)
    t, n_top = 10, 4
    sampler = -torch.rand(t, generator=gen, dtype=F64) * 3
    logprobs = (sampler + (torch.rand(t, generator=gen, dtype=F64) - 0.5) * 1.6).requires_grad_()
    adv = torch.randn(t, generator=gen, dtype=F64)
    sampler_top = torch.log_softmax(torch.randn(t, n_top, generator=gen, dtype=F64), -1)
    top = (sampler_top + torch.randn(t, n_top, generator=gen, dtype=F64) * 0.1).requires_grad_()
    valid = torch.rand(t, n_top, generator=gen) > 0.2
    config = loss_config()

    def run(rows):
        inputs = LossInputs(
            logprobs[rows], sampler[rows], adv[rows], top[rows], sampler_top[rows], valid[rows]
        )
        return grpo_loss(inputs, config, t)

    big_loss, big_parts = run(slice(0, t))
    big_loss.backward()
    big_grads = (logprobs.grad.clone(), top.grad.clone())
    logprobs.grad, top.grad = None, None

    (loss_a, parts_a), (loss_b, parts_b) = run(slice(0, 4)), run(slice(4, t))
    (loss_a + loss_b).backward()
    one_token = [run(slice(i, i + 1))[0].item() * t for i in range(t)]  # undo run()'s 1/t
    terms = sum(map(abs, one_token)) / t  # Σ|terms|/t, the magnitude the loss's sums scale with
    # fp64, the same per-token arithmetic summed in another grouping (4 + 6 vs 10): 2·γ_t·Σ|terms|/t
    assert (loss_a + loss_b).item() == pytest.approx(big_loss.item(), abs=reorder_bound(t, terms, F64))
    # per-token gradients: the same row-wise arithmetic; each within fp64_rel (exponents: log-probs,
    # log-ratios) of exact, so of each other within twice that; zeros (clipped, dropped) are exact
    rel = 2 * fp64_rel(2 * n_top + 8, max(sampler_top.abs().max().item(), top.detach().abs().max().item()) + 0.8)
    torch.testing.assert_close(logprobs.grad, big_grads[0], rtol=rel, atol=0)
    torch.testing.assert_close(top.grad, big_grads[1], rtol=rel, atol=0)
    # fp32 parts: the split's sums are two fp32 roundings and an fp32 add against one rounding: γ_3 of
    # the magnitude (Σ|log-ratio|/t for the log-ratio mean, whose terms cancel); counts and extremes
    # are exact.
    split, whole = finalize_metrics([parts_a, parts_b]), finalize_metrics([big_parts])
    log_ratio_terms = (logprobs - sampler).detach().abs().sum().item() / t
    assert split.keys() == whole.keys()
    for key, value in whole.items():
        if key.startswith("mismatch/"):
            continue  # without sample_index each call is one sequence; the split test: tests/test_mismatch.py
        magnitude = log_ratio_terms if key == "sampling/logprob_diff_mean" else abs(value)
        assert split[key] == pytest.approx(value, abs=gamma(3, torch.float32) * magnitude), key
    # the step's loss is the plain mean of the one-token losses (centering adds no value); each
    # one-token value is ℓ/t·t (2 roundings), then a Python sum and /t: 2·γ_{t+2}·Σ|terms|/t
    assert big_loss.item() == pytest.approx(sum(one_token) / t, abs=reorder_bound(t + 2, terms, F64))


def test_empty_call_and_metric_reduction():
    empty = torch.zeros(0, dtype=F64, requires_grad=True)
    zeros = torch.zeros(0, dtype=F64)
    loss, parts = grpo_loss(LossInputs(empty, zeros, zeros), loss_config(), 5)
    loss.backward()  # a rank with nothing to train still takes part in the backward
    assert loss.item() == 0.0
    assert finalize_metrics([parts]) == {}
    assert finalize_metrics([]) == {}
    _, hand_parts = grpo_loss(_hand_inputs(), loss_config(), 10)
    assert finalize_metrics([parts, hand_parts]) == finalize_metrics([hand_parts])
    merged = reduce_metric_parts([parts, hand_parts])
    # one fp32 rounding (u32) of an fp64 ratio (HAND_REL)
    assert merged["ratio_min"].item() == pytest.approx(0.4, rel=unit_roundoff(torch.float32) + HAND_REL, abs=0)
    assert merged["ratio_max"].item() == pytest.approx(3.0, rel=unit_roundoff(torch.float32) + HAND_REL, abs=0)

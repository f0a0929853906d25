"""Trainer log-probs with the sampler's temperature and top-k/top-p candidate set, against the exact
truncated softmax written out with ``math`` (``grpo_core.models.head.reference.token_logprobs``), and what
the loss makes of a token outside its set.

    .venv/bin/python -m pytest -q tests/test_logprob_renormalisation.py
"""

from __future__ import annotations

import math

import pytest
import torch

from grpo_core.models.head.reference import candidate_mask_from_ids, token_logprobs
from grpo_core.training.loss import LossInputs, finalize_metrics, grpo_loss
from tests.test_loss import F64, NEG_INF, fp64_rel, loss_config, t64
from tests.tolerances import gamma, log_softmax_grad_magnitude


# ---------------------------------------------------------------------------------------------
# token_logprobs: temperature and top-k / top-p renormalisation
# ---------------------------------------------------------------------------------------------
RENORM_LOGITS = [2.0, 1.0, 0.5, 0.0, -1.0, 1.5]
RENORM_T = 0.7
# At T = 0.7 the full softmax is about (.522, .125, .061, .030, .007, .255) (checked below).
#   top-k = 3        -> {0, 5, 1}
#   top-p = 0.7      -> sorted 0 (.522), 5 (cum .777 >= .7) -> {0, 5}
#   top-k = 4 + top-p = 0.95 -> top-4 {0, 5, 1, 2}; cum .522, .777, .902, .963 -> {0, 5, 1, 2}
#   no filter        -> all 6
RENORM_SETS = [[0, 5, 1], [0, 5], [0, 5, 1, 2], [0, 1, 2, 3, 4, 5]]
RENORM_TARGETS = [5, 0, 2, 4]
RENORM_TOP_IDS = [0, 5, 1, 2]
# fp64 on both sides (token_logprobs; math below): z = x/T, exp, a sum over <= 6 ids, log, a
# subtraction: each log-prob within γ_12·(|z_a| + |logsumexp| + max|z|) <= γ_12·(3·max|z| + log 6)
RENORM_ABS = 2 * gamma(12, F64) * (3 * max(abs(v) for v in RENORM_LOGITS) / RENORM_T + math.log(6))


def _truncated_logprob(token: int, support: list[int]) -> float:
    z = [v / RENORM_T for v in RENORM_LOGITS]
    return z[token] - math.log(sum(math.exp(z[j]) for j in support))


def test_candidate_sets_follow_top_k_top_p_rules():
    full = [math.exp(_truncated_logprob(j, range(6))) for j in range(6)]
    order = sorted(range(6), key=lambda j: -full[j])
    assert order[:3] == RENORM_SETS[0]

    def nucleus(ids, top_p):
        kept, cum = [], 0.0
        for j in ids:
            kept.append(j)
            cum += full[j] / sum(full[i] for i in ids)
            if cum >= top_p:
                return kept
        return kept

    assert nucleus(order, 0.7) == RENORM_SETS[1]
    assert nucleus(order[:4], 0.95) == RENORM_SETS[2]


def test_candidate_mask_from_ids():
    ids = [torch.tensor([0, 2]), torch.tensor([1]), torch.tensor([], dtype=torch.long)]
    mask = candidate_mask_from_ids(ids, 4)
    expected = torch.tensor([[1, 0, 1, 0], [0, 1, 0, 0], [0, 0, 0, 0]], dtype=torch.bool)
    assert torch.equal(mask, expected)
    assert candidate_mask_from_ids([], 4).shape == (0, 4)


@pytest.mark.parametrize("chunk_size", [None, 1, 3])
def test_renormalisation_matches_exact_truncated_softmax(chunk_size):
    logits = torch.tensor([RENORM_LOGITS] * 4, dtype=F64, requires_grad=True)
    masks = candidate_mask_from_ids([torch.tensor(s) for s in RENORM_SETS], 6)
    top_ids = torch.tensor([RENORM_TOP_IDS] * 4)
    targets = torch.tensor(RENORM_TARGETS)
    lp, top = token_logprobs(logits, targets, RENORM_T, top_ids, masks, chunk_size=chunk_size)
    for t, support in enumerate(RENORM_SETS):
        expected = _truncated_logprob(RENORM_TARGETS[t], support)
        assert lp[t].item() == pytest.approx(expected, abs=RENORM_ABS)
        for j, token in enumerate(RENORM_TOP_IDS):
            if token in support:
                expected = _truncated_logprob(token, support)
                assert top[t, j].item() == pytest.approx(expected, abs=RENORM_ABS)
            else:
                assert top[t, j].item() == NEG_INF
    # ids outside the set: -inf values but no NaN anywhere in the gradient, even summed directly
    (lp.sum() + top.sum()).backward()
    assert torch.isfinite(logits.grad).all()
    # gradient of one truncated log-prob: (e_a - p~) / T on the set, exactly 0 off it
    row1 = token_logprobs(logits, targets, RENORM_T, None, masks)[0][1]
    g = torch.autograd.grad(row1, logits)[0]
    support = RENORM_SETS[1]
    p_tilde = [math.exp(_truncated_logprob(j, support)) if j in support else 0.0 for j in range(6)]
    expected = [((1.0 if j == 0 else 0.0) - p_tilde[j]) / RENORM_T for j in range(6)]
    torch.testing.assert_close(g[1], t64(expected), rtol=0, atol=RENORM_ABS / RENORM_T)  # p̃ = exp(log-prob)
    assert (g[[0, 2, 3]] == 0).all()


def test_full_vocabulary_and_dtype():
    logits = torch.randn(5, 7, dtype=torch.bfloat16)
    lp, top = token_logprobs(logits, torch.tensor([0, 1, 2, 3, 4]), 1.3)
    assert top is None and lp.dtype == torch.float32
    expected = torch.log_softmax(logits.float() / 1.3, -1).diagonal()
    # fp32, two implementations of z_a − logsumexp(z) over 7 logits: 2·γ_11·(|z_a| + |lse| + max|z|)
    z = logits.float() / 1.3
    bound = 2 * gamma(11) * (z.diagonal().abs() + torch.logsumexp(z, -1).abs() + z.abs().amax(-1))
    assert ((lp - expected).abs() <= bound).all()
    with pytest.raises(ValueError):
        token_logprobs(logits, torch.zeros(5, dtype=torch.long), 0.0)


def test_chunked_gradients_match_dense():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(7, 11, generator=gen, dtype=F64)
    masks = torch.rand(7, 11, generator=gen) > 0.4
    targets = torch.tensor([int(torch.nonzero(row)[0]) for row in masks])
    top_ids = torch.randint(0, 11, (7, 3), generator=gen)
    weights = torch.randn(7, 3, generator=gen, dtype=F64)
    grads = []
    for chunk in (None, 2):
        leaf = logits.clone().requires_grad_()
        lp, top = token_logprobs(leaf, targets, 0.9, top_ids, masks, chunk_size=chunk)
        (lp.sum() + torch.where(torch.isfinite(top), top * weights, 0.0).sum()).backward()
        grads.append(leaf.grad)
    # The same per-row arithmetic in blocks of rows: fp64, each entry within γ of its score terms'
    # magnitude (target and weighted top ids, log_softmax_grad_magnitude), exponents z and logsumexp.
    z = (logits / 0.9).masked_fill(~masks, float("-inf"))
    scores = torch.zeros_like(logits).scatter_add_(1, targets[:, None], torch.ones(7, 1, dtype=F64))
    scores.scatter_add_(1, top_ids, weights.abs() * masks.gather(1, top_ids))
    magnitude = log_softmax_grad_magnitude(z, scores) / 0.9
    exponent = z[masks].abs().max().item() + torch.logsumexp(z, -1).abs().max().item()
    assert ((grads[0] - grads[1]).abs() <= 2 * fp64_rel(11 + 8, exponent) * magnitude).all()


def test_sampled_token_outside_its_set_is_dropped_not_nan():
    logits = torch.tensor([[1.0, 2.0, 3.0]], dtype=F64, requires_grad=True)
    mask = torch.tensor([[False, True, True]])
    lp, _ = token_logprobs(logits, torch.tensor([0]), 1.0, None, mask)
    assert lp.item() == NEG_INF
    loss, parts = grpo_loss(LossInputs(lp, t64([-1.0]), t64([1.0])), loss_config(), 1)
    loss.backward()
    assert torch.isfinite(logits.grad).all() and loss.item() == 0.0
    assert finalize_metrics([parts])["sampling/masked_mean"] == 1.0

"""The fused log-prob head (``grpo_core.models.head.fused``) gives the reference's log-probs and gradients.

* ``fused_token_logprobs`` against ``grpo_core.models.head.reference.token_logprobs`` (fp64: temperature, the sampler's top
  ids with duplicates and ids outside the candidate set, candidate sets, chunks): values and the logits'
  gradient, within the first-order rounding bounds of ``tests/test_logprob_head.head_bounds``;
* ``fused_head_logprobs`` against ``head_token_logprobs`` the same way, for the hidden states', weight's
  and bias's gradients, one chunk and several;
* bf16 logits: the same log-probs and a gradient within one bf16 rounding of the reference's (both round
  an fp32 gradient once);
* the gradient written over the logits (``overwrite_logits``, as the trainer's dense head runs it): the same
  gradients, the logits' storage reused, and a second reader of the logits refused by autograd;
* an unused output, no token, bad arguments;
* ``chunk_grad`` and ``chunk_grad_into_logits`` compiled by ``torch.compile`` (as on CUDA) equal them uncompiled.

    .venv/bin/python -m pytest -q tests/test_fused_logprobs.py
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from grpo_core.models.head.fused import (
    chunk_grad,
    chunk_grad_into_logits,
    chunk_stats,
    fused_head_logprobs,
    fused_token_logprobs,
)
from grpo_core.models.head.reference import head_token_logprobs, token_logprobs
from tests.test_logprob_head import assert_heads_agree, head_case, weighted


def _with_duplicate_and_outside_top_ids(top_ids, masks, targets):
    top_ids = top_ids.clone()
    top_ids[0, 1] = top_ids[0, 0]  # a duplicate: both entries' gradients land on one id
    top_ids[1, 0] = targets[1]  # the sampled id among the top ids
    outside = torch.nonzero(~masks[2])
    if outside.numel():
        top_ids[2, 2] = int(outside[0])  # an id outside the candidate set: -inf, no gradient
    return top_ids


@pytest.mark.parametrize("overwrite", [False, True])
@pytest.mark.parametrize("chunk", [None, 1, 4, 11, 20])
def test_fused_logits_head_equals_the_reference(chunk, overwrite):
    hidden, weight, bias, targets, top_ids, masks, scores = head_case()
    top_ids = _with_duplicate_and_outside_top_ids(top_ids, masks, targets)
    temperature = 0.7
    results = []
    for fused in (False, True):
        h, w, b = (x.clone().requires_grad_() for x in (hidden, weight, bias))
        logits = F.linear(h, w, b)
        if fused:
            lp, top = fused_token_logprobs(logits, targets, temperature, top_ids, masks, chunk_size=chunk,
                                           overwrite_logits=overwrite)
        else:
            lp, top = token_logprobs(logits, targets, temperature, top_ids, masks, chunk_size=chunk)
        weighted(lp, top, scores).backward()
        results.append((lp.detach(), top.detach(), h.grad, w.grad, b.grad))
    assert (~masks.gather(1, top_ids)).any()  # the case holds a top id outside its set
    assert_heads_agree(results, (hidden, weight, bias, targets, top_ids, masks, scores), temperature)


@pytest.mark.parametrize("chunk", [1, 3, 11, 20])
@pytest.mark.parametrize("with_bias", [True, False])
def test_fused_hidden_head_equals_the_reference(chunk, with_bias):
    hidden, weight, bias, targets, top_ids, masks, scores = head_case(seed=1)
    top_ids = _with_duplicate_and_outside_top_ids(top_ids, masks, targets)
    if not with_bias:
        bias = torch.zeros_like(bias)
    temperature = 1.3
    results = []
    for fused in (False, True):
        h, w, b = (x.clone().requires_grad_() for x in (hidden, weight, bias))
        logprobs = fused_head_logprobs if fused else head_token_logprobs
        lp, top = logprobs(h, w, targets, temperature, top_ids, masks, chunk_size=chunk,
                           head_bias=b if with_bias else None)
        weighted(lp, top, scores).backward()
        results.append((lp.detach(), top.detach(), h.grad, w.grad, b.grad))
    if not with_bias:
        assert results[1][4] is None
    assert_heads_agree(results, (hidden, weight, bias, targets, top_ids, masks, scores), temperature,
                       num_grads=3 if with_bias else 2)


def test_bf16_logits_round_like_the_reference():
    gen = torch.Generator().manual_seed(3)
    logits = (torch.randn(64, 1000, generator=gen) * 4).to(torch.bfloat16)
    targets = torch.randint(0, 1000, (64,), generator=gen)
    upstream = torch.randn(64, generator=gen)
    results = []
    for logprobs in (token_logprobs, fused_token_logprobs):
        x = logits.clone().requires_grad_()
        lp, _ = logprobs(x, targets, 0.9)
        (lp * upstream).sum().backward()
        results.append((lp.detach(), x.grad))
    (lp0, g0), (lp1, g1) = results
    assert lp1.dtype == torch.float32 and g1.dtype == torch.bfloat16
    # fp32 arithmetic on the same bf16 inputs: log-probs agree to fp32 rounding of a 1000-term sum
    assert (lp0 - lp1).abs().max() <= 1e-4 * lp0.abs().max()
    # each side rounds an fp32 gradient once to bf16 (relative 2^-8): differences within two such roundings
    assert ((g0.float() - g1.float()).abs() <= 2 * 2**-8 * g0.float().abs() + 1e-30).all()


def test_the_gradient_written_over_the_logits():
    hidden, weight, bias, targets, top_ids, masks, scores = head_case(t=7, seed=4)
    logits = F.linear(hidden, weight, bias).requires_grad_()
    seen = logits.detach().clone()
    lp, top = fused_token_logprobs(logits.clone(), targets, 1.0, top_ids, masks)  # the control: a fresh buffer
    weighted(lp, top, scores).backward()
    control = logits.grad.clone()

    owned = F.linear(hidden, weight, bias).requires_grad_()  # a leaf standing for the model's head output
    source = owned * 1.0  # a non-leaf, as the head's output is
    lp, top = fused_token_logprobs(source, targets, 1.0, top_ids, masks, overwrite_logits=True)
    weighted(lp, top, scores).backward()
    assert torch.equal(owned.grad, control)
    assert torch.equal(source.detach(), control)  # the gradient took the logits' place
    assert not torch.equal(seen, control)

    # Another backward that saved the same logits and runs after this one is refused, not fed the gradient.
    x = F.linear(hidden, weight, bias).requires_grad_()
    source = x * 1.0
    square = (source * source).sum()  # saves ``source``; created first, so its backward runs last
    lp, _ = fused_token_logprobs(source, targets, 1.0, overwrite_logits=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        (lp.sum() + square).backward()


def test_an_unused_top_output_and_no_token():
    hidden, weight, bias, targets, top_ids, masks, scores = head_case(t=5)
    logits = F.linear(hidden, weight, bias).requires_grad_()
    lp, top = fused_token_logprobs(logits, targets, 1.0, top_ids, masks)
    (lp * scores[0][:5]).sum().backward()  # the top log-probs take no part: zero upstream
    ref = logits.detach().clone().requires_grad_()
    lp_ref, _ = token_logprobs(ref, targets, 1.0, top_ids, masks)
    (lp_ref * scores[0][:5]).sum().backward()
    assert torch.allclose(logits.grad, ref.grad, rtol=1e-12, atol=1e-14)

    w = weight.clone().requires_grad_()
    lp, top = fused_head_logprobs(hidden[:0], w, targets[:0], 1.0, top_ids[:0], masks[:0], chunk_size=2)
    assert lp.shape == (0,) and top.shape == (0, 3)
    (lp.sum() + top.sum()).backward()
    assert torch.equal(w.grad, torch.zeros_like(weight))
    lp, top = fused_token_logprobs(logits.detach()[:0], targets[:0], 1.0)
    assert lp.shape == (0,) and top is None


def test_bad_arguments_are_refused():
    hidden, weight, _, targets, _, masks, _ = head_case(t=3)
    logits = hidden @ weight.T
    with pytest.raises(ValueError, match="temperature"):
        fused_token_logprobs(logits, targets, 0.0)
    with pytest.raises(TypeError, match="candidate_masks must be bool"):
        fused_token_logprobs(logits, targets, 1.0, candidate_masks=masks.long())
    with pytest.raises(ValueError, match="chunk_size"):
        fused_head_logprobs(hidden, weight, targets, 1.0, chunk_size=0)


def test_compiled_chunk_arithmetic_equals_eager():
    """The compiled kernels (what CUDA runs) against the same code uncompiled, here on the CPU."""
    hidden, weight, bias, targets, top_ids, masks, scores = head_case(t=9, v=40, seed=2)
    top_ids = _with_duplicate_and_outside_top_ids(top_ids, masks, targets)
    logits = F.linear(hidden, weight, bias).float()
    eager_stats = chunk_stats(logits, targets, 0.8, top_ids, masks)
    compiled_stats = torch.compile(chunk_stats, dynamic=True)(logits, targets, 0.8, top_ids, masks)
    for a, b in zip(eager_stats, compiled_stats):
        finite = torch.isfinite(a)
        assert torch.equal(finite, torch.isfinite(b)) and torch.allclose(a[finite], b[finite], rtol=1e-5, atol=1e-5)
    lse = eager_stats[0]
    args = (logits, lse, targets, scores[0].float(), top_ids, scores[1].float(), masks, 0.8)
    assert torch.allclose(torch.compile(chunk_grad, dynamic=True)(*args), chunk_grad(*args), rtol=1e-5, atol=1e-6)
    written = logits.clone()
    torch.compile(chunk_grad_into_logits, dynamic=True)(written, *args[1:])
    assert torch.allclose(written, chunk_grad(*args), rtol=1e-5, atol=1e-6)

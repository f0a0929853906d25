"""The tolerance helpers (``tests/tolerances.py``) against what they claim to bound, each check also
shown able to fail: a bound that a worst case nearly reaches, a prediction that a wrong
hyper-parameter breaks."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.tolerances import (
    GradientMagnitudes,
    adam_direction,
    adamw_first_step,
    adamw_first_step_rounding,
    adamw_first_step_sensitivity,
    gamma,
    log_softmax_grad_magnitude,
    reorder_bound,
    sum_bound,
    unit_roundoff,
)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16])
def test_unit_roundoff_is_half_the_machine_epsilon(dtype):
    assert unit_roundoff(dtype) == torch.finfo(dtype).eps / 2
    if dtype in (torch.float64, torch.float32, torch.float16):
        assert unit_roundoff(np.dtype(str(dtype).removeprefix("torch."))) == unit_roundoff(dtype)
    assert unit_roundoff(float) == unit_roundoff(torch.float64)
    assert gamma(0, dtype) == 0.0 and gamma(1, dtype) > unit_roundoff(dtype)
    with pytest.raises(ValueError):
        gamma(int(1 / unit_roundoff(dtype)) + 1, dtype)


@pytest.mark.parametrize("k", [10, 1000, 100_000])
@pytest.mark.parametrize("kind", ["normal", "lognormal", "positive"])
def test_gamma_bounds_fp32_sums_in_any_order(k, kind):
    rng = np.random.default_rng(k)
    x = {"normal": rng.normal(size=k), "lognormal": rng.lognormal(0, 3, k) * rng.choice([-1, 1], k),
         "positive": rng.uniform(0, 1, k)}[kind].astype(np.float32)
    exact = float(np.sum(x.astype(np.float64)))
    magnitude = float(np.sum(np.abs(x.astype(np.float64))))
    reference_error = sum_bound(k, magnitude, torch.float64)  # the fp64 reference's own rounding
    orders = {
        "sequential": np.cumsum(x, dtype=np.float32)[-1],
        "reversed": np.cumsum(x[::-1], dtype=np.float32)[-1],
        "sorted": np.cumsum(np.sort(x), dtype=np.float32)[-1],
        "pairwise (numpy)": np.sum(x, dtype=np.float32),
        "blocked (torch)": torch.from_numpy(x).sum().item(),
    }
    for name, value in orders.items():
        assert abs(float(value) - exact) <= sum_bound(k, magnitude) + reference_error, name
    values = [float(v) for v in orders.values()]
    assert max(values) - min(values) <= reorder_bound(k, magnitude)


def test_gamma_is_nearly_reached_so_a_tenth_of_it_fails():
    # 1 followed by k-1 terms just under half an ulp of 1: sequential fp32 summation rounds every
    # addition back to 1, losing (k-1)·u·(1 - 2^-10) of a magnitude of about 1.
    k = 1000
    delta = np.float32(unit_roundoff() * (1 - 2.0**-10))
    x = np.array([1.0] + [delta] * (k - 1), dtype=np.float32)
    computed = float(np.cumsum(x, dtype=np.float32)[-1])
    exact = 1.0 + (k - 1) * float(delta)
    magnitude = exact
    error = abs(computed - exact)
    assert computed == 1.0
    assert error <= sum_bound(k, magnitude)
    assert error > 0.9 * sum_bound(k, magnitude)  # so sum_bound / 10 would fail here


@pytest.mark.parametrize("lr, scale", [(1e-2, 0.02), (1e-4, 1.0), (3e-1, 1e-3)])
def test_adamw_first_step_prediction_within_rounding_and_wrong_hyperparameters_break_it(lr, scale):
    gen = torch.Generator().manual_seed(0)
    # gradients from 0 and far below eps (g² underflows) through eps to large, both signs
    mags = torch.tensor([0.0, 1e-40, 1e-30, 1e-20, 1e-12, 3e-9, 1e-8, 3e-8, 1e-6, 1e-3, 1.0, 1e3])
    g = torch.cat([mags, -mags, torch.randn(4000, generator=gen) * 10 ** (torch.rand(4000, generator=gen) * 14 - 12)])
    w0 = torch.randn(g.shape, generator=gen) * scale
    param = torch.nn.Parameter(w0.clone())
    optimizer = torch.optim.AdamW([param], lr=lr)
    param.grad = g.clone()
    optimizer.step()
    group = optimizer.param_groups[0]
    eps, wd = group["eps"], group["weight_decay"]
    bound = adamw_first_step_rounding(w0, g, lr, eps, group["betas"])
    error = (param.detach().double() - adamw_first_step(w0, g, lr, eps, wd)).abs()
    assert (error <= bound).all(), float((error / bound).max())
    for wrong in (adamw_first_step(w0, g, lr, 10 * eps, wd), adamw_first_step(w0, g, lr, eps, 0.0),
                  adamw_first_step(w0, g, lr * (1 + 1e-5), eps, wd)):
        assert ((param.detach().double() - wrong).abs() > bound).any()


def test_adamw_sensitivity_is_the_largest_change_within_dg():
    gen = torch.Generator().manual_seed(1)
    lr, eps = 1e-2, 1e-8
    g = torch.randn(2000, generator=gen, dtype=torch.float64) * 10 ** (torch.rand(2000, generator=gen, dtype=torch.float64) * 8 - 12)
    dg = g.abs() * torch.rand(2000, generator=gen, dtype=torch.float64) * 3
    bound = adamw_first_step_sensitivity(g, dg, lr, eps)
    largest = torch.zeros_like(g)
    for t in torch.linspace(-1, 1, 41, dtype=torch.float64):
        change = lr * (adam_direction(g + t * dg, eps) - adam_direction(g, eps)).abs()
        assert (change <= bound * (1 + 1e-12)).all()
        largest = torch.maximum(largest, change)
    assert torch.allclose(largest, bound, rtol=1e-12, atol=0)  # reached at an end: no slack
    near_eps = (g.abs() < eps) & (dg < eps / 10)
    assert near_eps.any() and (bound[near_eps] > 0.2 * lr * dg[near_eps] / eps).all()  # ~lr·dg/eps there


class _Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(7, 5)
        self.norm = torch.nn.RMSNorm(5)
        self.proj = torch.nn.Linear(5, 3, bias=False)
        self.head = torch.nn.Linear(3, 7, bias=False)

    def forward(self, ids):
        return self.head(self.proj(self.norm(self.embed(ids))))


def test_gradient_magnitudes_bound_every_gradient_and_equal_it_without_cancellation():
    torch.manual_seed(0)
    model = _Tiny()
    ids = torch.tensor([[1, 2, 2, 5, 1, 0]])
    with GradientMagnitudes(model, logits_module=model.head) as mags:
        model(ids).pow(2).sum().backward()
    for name, p in model.named_parameters():
        assert (mags.result()[name] >= p.grad.double().abs() * (1 - 1e-6)).all(), name
    # All inputs, weights and output gradients positive: no term of the norm's, projection's and
    # head's sums cancels, so magnitude = |gradient|; an embedding row used once is a single term.
    with torch.no_grad():
        for p in model.parameters():
            p.abs_()
    model.zero_grad()
    with GradientMagnitudes(model) as mags:
        model(ids).sum().backward()
    result = mags.result()
    for name in ("norm.weight", "proj.weight", "head.weight"):
        torch.testing.assert_close(result[name], model.get_parameter(name).grad.double(), rtol=1e-6, atol=0, msg=name)
    once, unused = [0, 5], [3, 4, 6]
    torch.testing.assert_close(result["embed.weight"][once], model.embed.weight.grad[once].double().abs(), rtol=1e-6, atol=0)
    assert (result["embed.weight"][unused] == 0).all()
    with pytest.raises(TypeError, match="Conv1d"):
        GradientMagnitudes(torch.nn.Sequential(torch.nn.Conv1d(2, 2, 1))).__enter__()


def test_log_softmax_grad_magnitude_keeps_what_centering_cancels():
    # A sampled token's score minus the expected score over two candidates: Σ_j g_j = 0, so the
    # logits' gradient outside the candidates is exactly 0, yet each of its two terms is p_v.
    logits = torch.tensor([[1.0, 0.5, -0.3, 2.0]], dtype=torch.float64, requires_grad=True)
    grad = torch.tensor([[1.0, -0.25, -0.75, 0.0]], dtype=torch.float64)
    (torch.log_softmax(logits, -1) * grad).sum().backward()
    p = torch.softmax(logits.detach(), -1)
    assert logits.grad[0, 3].abs() < 1e-15
    mag = log_softmax_grad_magnitude(logits, grad.abs())
    assert (mag >= logits.grad.abs()).all()
    torch.testing.assert_close(mag[0, 3], 2.0 * p[0, 3], rtol=1e-15, atol=0)

"""Test tolerances derived from floating-point arithmetic, not from one machine's measurement.

A bound measured on one CPU (or one BLAS, one thread count) does not hold on the next: the same
sums in another order round differently. Each bound here is an a-priori error bound of the
computation, in the standard model of floating-point arithmetic, fl(a op b) = (a op b)(1 + d)
with |d| <= u:

* ``unit_roundoff(dtype)``: u, half the distance from 1 to the next number (fp64 2^-53, fp32
  2^-24, fp16 2^-11, bf16 2^-8).
* ``gamma(k, dtype)``: the classic accumulation constant k·u / (1 − k·u). A sum of k terms in any
  order (sequential, pairwise, blocked, split over ranks) is within ``gamma(k)`` × Σ|terms| of the
  exact sum; a dot product of length k within ``gamma(k)`` × Σ|a_i b_i|. The magnitude is the sum
  of absolute values, not the sum: with cancellation the relative error of the result is
  unbounded, which is why every bound below carries its magnitude.
* Two computations of the same quantity in different orders are each within the bound of the
  exact value, so they differ by at most twice it (``reorder_bound``).
* A chain of operations: to first order the errors of successive steps add, so a result computed
  through n rounded operations on exact inputs is within ``gamma(n)`` of its magnitude.

For networks, ``GradientMagnitudes`` measures Σ|terms| of each weight gradient's last reduction
(over the tokens of the step) with hooks, and ``log_softmax_grad_magnitude`` the magnitude of
the logits' gradient before the log-softmax backward cancels its terms.

For AdamW's first step (``adamw_first_step*``): with bias correction m̂ = g and v̂ = g², so the
update per element is lr·g/(|g| + eps) (after the decoupled decay w·(1 − lr·wd)). Its derivative
in g is lr·eps/(|g| + eps)²: where |g| is near or below eps a tiny gradient difference (a
reduction order) moves the weight by up to lr·|Δg|/eps, so weights after a step are compared
through the gradients they were computed from, not with a fixed relative tolerance.

Self-tests: ``tests/test_tolerances.py``.
"""

from __future__ import annotations

import math

import torch

_UNIT_ROUNDOFF = {
    torch.float64: 2.0**-53,
    torch.float32: 2.0**-24,
    torch.float16: 2.0**-11,
    torch.bfloat16: 2.0**-8,
}


def unit_roundoff(dtype=torch.float32) -> float:
    """u of ``dtype`` (a torch dtype, or ``float`` / a numpy float type for Python's and numpy's):
    every rounding to it has relative error at most u (normal range)."""
    if not isinstance(dtype, torch.dtype):
        import numpy as np

        dtype = {np.dtype(np.float64): torch.float64, np.dtype(np.float32): torch.float32,
                 np.dtype(np.float16): torch.float16}.get(np.dtype(dtype), dtype)
    try:
        return _UNIT_ROUNDOFF[dtype]
    except KeyError:
        raise ValueError(f"no unit roundoff for {dtype}") from None


def gamma(k: int, dtype=torch.float32) -> float:
    """γ_k = k·u/(1 − k·u): relative error bound of k rounded operations in a row (a sum or dot of k
    terms, in any order, relative to Σ|terms|). Refuses k·u >= 1, where no such bound exists."""
    ku = k * unit_roundoff(dtype)
    if k < 0 or ku >= 1.0:
        raise ValueError(f"γ_{k} is undefined in {dtype} (k·u = {ku})")
    return ku / (1.0 - ku)


def sum_bound(k: int, magnitude: float | torch.Tensor, dtype=torch.float32):
    """|computed − exact| of a sum (or dot product) of k terms whose absolute values sum to
    ``magnitude``, in any order."""
    return gamma(k, dtype) * magnitude


def reorder_bound(k: int, magnitude: float | torch.Tensor, dtype=torch.float32):
    """|one order − another order| of the same k-term sum: each is within ``sum_bound``."""
    return 2.0 * sum_bound(k, magnitude, dtype)


# ------------------------------------------------------------------------------------------ networks
def log_softmax_grad_magnitude(logits: torch.Tensor, grad_abs: torch.Tensor) -> torch.Tensor:
    """Magnitude of the logits' gradient through log_softmax: |g_v| + p_v·Σ_j|g_j| per entry.

    ``grad_abs`` is |dloss/dlog_softmax| (e.g. the gathered log-probs' gradients scattered back).
    The backward computes g_v − p_v·Σ_j g_j; where Σ_j g_j cancels (GRPO's score centering makes it
    exactly 0 in exact arithmetic) the computed value is rounding noise of this size, so bounds on
    anything reduced from it must scale with this, not with the cancelled result.
    """
    p = torch.softmax(logits.detach().double(), dim=-1)
    grad_abs = grad_abs.double()
    return grad_abs + p * grad_abs.sum(-1, keepdim=True)


def logprob_error_magnitude(hidden: torch.Tensor, head_weight: torch.Tensor, logits: torch.Tensor,
                            targets: torch.Tensor) -> torch.Tensor:
    """Per position, the magnitude λ of a log-prob z_a − logsumexp(z) with z = hidden · head_weightᵀ.

    Each logit is a dot product, within γ of (|h|·|W|ᵀ)_v; the log-prob takes the target's logit
    and, through logsumexp, at most the largest logit error, then subtracts two numbers of sizes
    |z_a| and |logsumexp(z)|. So λ = |z_a| + |logsumexp z| + (|h|·|W|ᵀ)_a + max_v (|h|·|W|ᵀ)_v and
    the log-prob is within γ_k·λ (k the longest reduction before it), to first order.
    """
    z = logits.detach().double()
    dots = hidden.detach().double().abs() @ head_weight.detach().double().abs().T
    a = targets.long().reshape(-1, 1)
    return (z.gather(-1, a)[:, 0].abs() + torch.logsumexp(z, -1).abs() + dots.gather(-1, a)[:, 0]
            + dots.max(-1).values)


class GradientMagnitudes:
    """Per weight element, Σ|terms| of the last reduction of its gradient, summed over backwards.

    A weight gradient is a sum over tokens: Linear W: Σ_t δ_t x_tᵀ; Embedding row i: Σ_{t: id_t = i}
    δ_t; RMSNorm w: Σ_t δ_t ∘ x̂_t. The hooks add Σ_t |δ_t| |x_t|ᵀ (resp. the others) in fp64,
    so ``gamma(K) * magnitude`` bounds the rounding of that sum for any order of its K terms. For
    the module producing the logits, pass the magnitude of the logits' gradient before its
    cancellation with ``logits_magnitude`` (see ``log_softmax_grad_magnitude``) before each backward;
    otherwise |grad_output| is used.

    Module types other than Linear, Embedding and *RMSNorm that own a trained weight raise, so a
    model with other parameter kinds is not silently given a zero magnitude.

    Use as ``with GradientMagnitudes(model, logits_module=model.lm_head) as mags: ...`` then
    ``mags.result()`` (name -> fp64 tensor, names as in ``model.named_parameters()``).
    """

    def __init__(self, model: torch.nn.Module, logits_module: torch.nn.Module | None = None):
        self.model, self.logits_module = model, logits_module
        self._acc = {id(p): torch.zeros(p.shape, dtype=torch.float64) for p in model.parameters()}
        self._handles: list = []
        self._logit_mags: list[torch.Tensor] = []

    def logits_magnitude(self, magnitude: torch.Tensor) -> None:
        self._logit_mags.append(magnitude.detach().double())

    def __enter__(self) -> GradientMagnitudes:
        for module in self.model.modules():
            weight = getattr(module, "weight", None)
            if not isinstance(weight, torch.nn.Parameter) or id(weight) not in self._acc:
                continue
            acc = self._acc[id(weight)]
            if module is self.logits_module:
                hook = self._logits_hook(acc)
            elif isinstance(module, torch.nn.Linear):
                hook = self._linear_hook(acc)
            elif isinstance(module, torch.nn.Embedding):
                hook = self._embedding_hook(acc)
            elif type(module).__name__.endswith("RMSNorm"):
                hook = self._rms_norm_hook(acc)
            else:
                raise TypeError(f"no gradient magnitude rule for {type(module).__name__}")
            self._handles.append(module.register_forward_hook(hook))
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def result(self) -> dict[str, torch.Tensor]:
        return {name: self._acc[id(p)] for name, p in self.model.named_parameters()}

    @staticmethod
    def _on_grad(out: torch.Tensor, fn) -> None:
        def hook(grad: torch.Tensor) -> None:  # returns None: the gradient itself is untouched
            fn(grad.detach().double().abs())

        out.register_hook(hook)

    def _linear_hook(self, acc):
        def hook(module, inputs, out):
            x = inputs[0].detach().double().abs().reshape(-1, inputs[0].shape[-1])
            self._on_grad(out, lambda g: acc.add_(g.reshape(-1, g.shape[-1]).T @ x))

        return hook

    def _logits_hook(self, acc):
        def hook(module, inputs, out):
            x = inputs[0].detach().double().abs().reshape(-1, inputs[0].shape[-1])

            def add(g):
                mag = self._logit_mags.pop(0) if self._logit_mags else g
                acc.add_(mag.reshape(-1, mag.shape[-1]).T @ x)

            self._on_grad(out, add)

        return hook

    def _embedding_hook(self, acc):
        def hook(module, inputs, out):
            ids = inputs[0].reshape(-1)
            self._on_grad(out, lambda g: acc.index_add_(0, ids, g.reshape(-1, g.shape[-1])))

        return hook

    def _rms_norm_hook(self, acc):
        def hook(module, inputs, out):
            x = inputs[0].detach().double()
            eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
            eps = torch.finfo(inputs[0].dtype).eps if eps is None else eps  # torch.nn.RMSNorm's default
            normed = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)).abs()
            self._on_grad(out, lambda g: acc.add_((g * normed).reshape(-1, normed.shape[-1]).sum(0)))

        return hook


# ------------------------------------------------------------------------------------------ AdamW
# Rounded operations of torch's single-tensor AdamW on the update term lr·m̂/(sqrt(v̂) + eps), step 1
# (torch/optim/adam.py, non-capturable path): m = lerp(0, g, 1 − β1): weight cast, product (2);
# v = addcmul(0, g, g, 1 − β2): value cast, square, product (3), of which sqrt keeps half (1.5),
# sqrt (1), / sqrt(bias_correction2): cast, division (2), + eps: cast of eps, sum (2);
# addcdiv: value cast, division, product (3). 13.5 in all: γ_14 of the update. The weight: decay
# factor cast and product (2 roundings of |w0|) and the final sum (1 of |w_new| <= |w0| + lr).
ADAMW_UPDATE_OPS = 14
ADAMW_WEIGHT_OPS = 3


def adam_direction(g: torch.Tensor, eps: float) -> torch.Tensor:
    """u(g) = g/(|g| + eps): the first step's update per unit of lr (m̂ = g, v̂ = g²), in fp64."""
    g = g.double()
    return g / (g.abs() + eps)


def adamw_first_step(w0: torch.Tensor, g: torch.Tensor, lr: float, eps: float, weight_decay: float) -> torch.Tensor:
    """The weights after AdamW's first step from ``w0`` with gradient ``g``, in exact arithmetic
    (fp64): w0·(1 − lr·wd) − lr·u(g). The betas cancel through the bias correction."""
    return w0.double() * (1.0 - lr * weight_decay) - lr * adam_direction(g, eps)


def adamw_first_step_rounding(
    w0: torch.Tensor, g: torch.Tensor, lr: float, eps: float, betas: tuple[float, float] = (0.9, 0.999),
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Per element, |the step computed in ``dtype`` − ``adamw_first_step``| (see ADAMW_*_OPS).

    Plus underflow, where the relative model fails: m and v (g² may be far below the smallest
    normal) carry absolute errors of at most the smallest subnormal s, so the denominator is off by
    <= sqrt(s)/sqrt(1 − β2) and m̂ by <= s/(1 − β1), both against a denominator >= eps.
    """
    update = lr * adam_direction(g, eps).abs()
    tiny = torch.finfo(dtype).smallest_normal * torch.finfo(dtype).eps  # the smallest subnormal
    underflow = lr / eps * (math.sqrt(tiny) / math.sqrt(1.0 - betas[1]) + tiny / (1.0 - betas[0]))
    return gamma(ADAMW_WEIGHT_OPS, dtype) * (w0.double().abs() + update) + gamma(ADAMW_UPDATE_OPS, dtype) * update + underflow


def adamw_first_step_sensitivity(g: torch.Tensor, dg: torch.Tensor, lr: float, eps: float) -> torch.Tensor:
    """Per element, the largest |Δw| = lr·|u(g') − u(g)| over all |g' − g| <= dg (exact arithmetic).

    u is increasing, so the largest change is at g ± dg. Near |g| ~ eps this is ~lr·dg/eps; for
    |g| >> eps it is ~lr·eps·dg/g², which is why a step hides gradient noise except near eps.
    """
    g, dg = g.double(), dg.double()
    base = adam_direction(g, eps)
    return lr * torch.maximum((adam_direction(g + dg, eps) - base).abs(), (adam_direction(g - dg, eps) - base).abs())

"""The load-balancing auxiliary loss of a mixture-of-experts policy, over the positions of a packed row.

Switch-Transformer style, per MoE layer: ``num_experts * sum_e f_e * P_e``, where ``f_e`` is the share
of the layer's (position, slot) assignments that went to expert ``e`` (what was dispatched: the
sampler's routes where they were replayed) and ``P_e`` the mean router probability of ``e``; the
layers' values are averaged. Uniform assignments and probabilities give 1; only ``P`` carries a
gradient, so the term pushes probability away from overloaded experts.

**Under tree packing** every position of a row is one forwarded token: a prompt shared by a group's
samples is counted once, as it is computed once, and a sample's weight in the loss is that of the
tokens it adds to the row. Since ``f * P`` is not a sum over tokens, a step's loss cannot be the loss
of all its rows' tokens at once without a second pass; each row's loss is weighted by its share of the
step's forwarded positions (``row_weight``), which makes the step's loss the position-weighted mean of
its rows' losses, independent of how the rows were split over ranks.

**Under RL it is off by default** (``AsyncGRPOConfig.moe_aux_loss_coef = 0``): the policy-gradient
objective is computed on sampled tokens, and a term that moves the router for a reason other than the
reward changes the policy the samples were drawn from; with routing replay the router's choice is the
sampler's anyway, so the term would only shift the gate weights. A pretrained MoE arrives balanced.

Tests: ``tests/test_moe_routing.py``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


def load_balancing_loss(probs: Sequence[Tensor], dispatched: Sequence[Tensor], num_experts: int) -> Tensor:
    """The mean over layers of ``num_experts * sum_e f_e * P_e`` (module docstring).

    ``probs``: per layer, router probabilities ``[positions, num_experts]``; ``dispatched``: per layer, the
    experts each position was sent to, ``[positions, k]``. A row without positions gives 0 (with a graph
    to the probabilities, so every rank's backward runs alike)."""
    if len(probs) != len(dispatched) or not probs:
        raise ValueError(f"need one dispatch per layer of probabilities, got {len(probs)} and {len(dispatched)}")
    per_layer = []
    for p, idx in zip(probs, dispatched, strict=True):
        n = p.shape[0]
        if n == 0:
            per_layer.append(p.sum() * 0.0)
            continue
        counts = torch.zeros(num_experts, dtype=torch.float32, device=p.device)
        counts.scatter_add_(0, idx.reshape(-1).long(), torch.ones(idx.numel(), dtype=torch.float32, device=p.device))
        f = counts / idx.numel()
        per_layer.append(num_experts * (f * p.float().mean(0)).sum())
    return torch.stack(per_layer).mean()


def row_weight(row_positions: int, step_positions: int) -> float:
    """A row's share of the step's forwarded positions: its weight in the step's balancing loss."""
    return row_positions / max(step_positions, 1)

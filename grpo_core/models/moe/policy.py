"""A mixture-of-experts policy's part of each micro-batch: replayed routes, the mismatch metric, the balancing loss.

The trainer builds one ``MoEPolicy`` for a model with sparse MoE blocks (``MoEPolicy.for_model``; None
for a dense model) and calls, per packed row:

    moe.before_forward(row)     # the row's sampler routes into the routers (replay), or free routing
    ... forward ...
    extra, parts = moe.after_forward(row, step_positions)   # balancing loss term, metric parts
    ... backward ...
    moe.after_backward()        # routes cleared (kept until here for activation-checkpoint recompute)

Metric parts (summed over micro-batches and ranks like the loss's, ``grpo_core.training.loss.reduce_metric_parts``):
``routed_tokens_sum`` trained tokens whose predicting position has sampler routes, ``routing_mismatch_sum``
those where the trainer's own top-k set differs from the sampler's in some MoE layer,
``route_conflicts_sum`` shared positions whose samples disagree on routes, and the balancing loss.
``finalize_moe_metrics`` publishes ``sampling/routing_mismatch`` (their share) and the others.

Without replay the trainer's own top-k is its routing, and the metric is the share of trained tokens
whose log-prob the trainer computed through other experts than the sampler did. With replay the
routers still compute their own top-k (at no extra cost), and the metric is the share replay overrode.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from grpo_core.models.moe.balance import load_balancing_loss, row_weight
from grpo_core.models.moe.routing import NO_ROUTE, RoutingReplay, moe_layers, routing_mismatch_tokens


@dataclass
class MoEPolicy:
    routing: RoutingReplay
    replay: bool
    """Force the sampler's routes where a row carries them."""
    aux_loss_coef: float
    token_routes: tuple[Tensor, Tensor] | None = None
    """Of the last ``after_forward`` with routes: per trained token, whether the trainer's own top-k differed from
    the sampler's route, and whether there was a route to compare with (bool ``[T]`` each; the per-staleness
    ``mismatch/route_mismatch_share``). Cleared by ``after_backward``."""

    @classmethod
    def for_model(cls, model: torch.nn.Module, replay: bool, aux_loss_coef: float = 0.0) -> MoEPolicy | None:
        """Switch the model's routers over (``RoutingReplay.install``); None for a model without MoE blocks."""
        if not moe_layers(model):
            return None
        config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        routing = RoutingReplay.install(model, int(config.num_hidden_layers))
        routing.keep_probs(aux_loss_coef > 0)
        return cls(routing=routing, replay=replay, aux_loss_coef=aux_loss_coef)

    def before_forward(self, routes: Tensor | None) -> None:
        """``routes``: the row's ``PackedRow.routes`` (on the model's device), or None."""
        self.routing.set_row(routes if self.replay else None)

    def after_forward(self, routes: Tensor | None, logit_index: Tensor, route_conflicts: int, row_positions: int,
                      step_positions: int) -> tuple[Tensor | None, dict[str, Tensor]]:
        """The balancing-loss term to add to the row's loss (None when off) and the row's metric parts."""
        device = logit_index.device
        parts: dict[str, Tensor] = {}
        self.token_routes = None
        if routes is not None:
            differs, known = routing_mismatch_tokens(self.routing.own_topk(), routes, logit_index,
                                                     [m.layer for m in self.routing.layers])
            self.token_routes = (differs, known)
            parts["routed_tokens_sum"] = known.sum().float()
            parts["routing_mismatch_sum"] = differs.sum().float()
            parts["route_conflicts_sum"] = torch.tensor(float(route_conflicts), device=device)
        extra = None
        if self.aux_loss_coef > 0:
            aux = load_balancing_loss(self.routing.probs(), self.routing.dispatched(), self.routing.num_experts)
            weight = row_weight(row_positions, step_positions)
            extra = self.aux_loss_coef * weight * aux
            parts["moe_aux_loss_sum"] = (weight * aux).detach().float()
        return extra, parts

    def after_backward(self) -> None:
        self.routing.clear()
        self.token_routes = None


def finalize_moe_metrics(merged: dict[str, float]) -> dict[str, float]:
    """Published MoE metrics from the step's merged parts (empty for a dense model or a server without routes)."""
    out: dict[str, float] = {}
    counted = merged.get("routed_tokens_sum", 0.0)
    if counted > 0:
        out["sampling/routing_mismatch"] = merged["routing_mismatch_sum"] / counted
        out["sampling/route_conflicts"] = merged.get("route_conflicts_sum", 0.0)
    if "moe_aux_loss_sum" in merged:
        out["moe/aux_loss"] = merged["moe_aux_loss_sum"]
    return out


__all__ = ["MoEPolicy", "NO_ROUTE", "finalize_moe_metrics"]

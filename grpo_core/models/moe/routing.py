"""Mixture-of-experts routers that can replay the sampler's routes: found, checked, switched over.

A sparse MoE block of transformers (Qwen3-MoE, Qwen3.5/3.6-MoE, Qwen3-Next, OLMoE, Mixtral-style)
asks its router ``gate`` for ``(router_logits, weights, indices)``: a softmax over the experts in
fp32, its top-k, and (where the model says so) the top-k probabilities renormalised to sum to 1. The
experts then run each token through its ``indices`` and mix their outputs with ``weights``.

``RoutingReplay.install(model)`` switches every such router to a subclass whose forward does the
same, except that where a row's routes are set (``set_row``) the indices are the sampler's: the
weights are still the trainer's softmax, gathered at the forced experts and renormalised as the
model does, so the router keeps its gradient and keeps learning. Each router also keeps its own
top-k of the last forward (``own_topk``), which is what the routing-mismatch metric compares with
the sampler's, and, when asked, its probabilities for the load-balancing loss.

Install checks each router class against its own forward on a probe input (same weights, same
indices) and refuses a class it does not reproduce, naming it: a router of another kind (sigmoid
scores, grouped top-k) is never silently replaced.

Routes stay set until the next ``set_row`` or ``clear``, not only for the forward: activation
checkpointing recomputes each layer in backward and must route the recompute the same way.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

NO_ROUTE = -1
"""A route entry meaning "route this position yourself" (a sample without routes in a row with some)."""

_REPLAY_CLASSES: dict[type, type] = {}
_LAYER_INDEX = re.compile(r"\.(\d+)\.")


@dataclass(frozen=True)
class MoELayer:
    """One sparse MoE block: the decoder layer it sits in and its router."""

    layer: int
    """Index of the decoder layer (the routes' layer axis, as vLLM counts: all decoder layers)."""
    name: str
    """The router's module name (``model.layers.3.mlp.gate``)."""
    router: torch.nn.Module


def _is_router(module: torch.nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    return (
        isinstance(weight, torch.nn.Parameter)
        and weight.dim() == 2
        and isinstance(getattr(module, "top_k", None), int)
        and getattr(module, "num_experts", None) == weight.shape[0]
    )


def moe_layers(model: torch.nn.Module) -> list[MoELayer]:
    """The model's sparse MoE routers in layer order: a module named ``gate`` holding a ``[experts,
    hidden]`` weight, ``top_k`` and ``num_experts``, beside an ``experts`` module."""
    found = []
    for name, module in model.named_modules():
        parent_name, _, leaf = name.rpartition(".")
        if leaf != "gate" or not _is_router(module):
            continue
        parent = model.get_submodule(parent_name) if parent_name else model
        if not hasattr(parent, "experts"):
            continue
        match = _LAYER_INDEX.search(name)
        if match is None:
            raise ValueError(f"router {name}: no decoder layer index in its name")
        found.append(MoELayer(int(match.group(1)), name, module))
    return found


def is_moe(model: torch.nn.Module) -> bool:
    return bool(moe_layers(model))


class _ReplayRouter:
    """Mixed into a router class (before it): the forward described in the module docstring."""

    _grpo_forced: Tensor | None = None
    _grpo_own_topk: Tensor | None = None
    _grpo_dispatched: Tensor | None = None
    _grpo_probs: Tensor | None = None
    _grpo_keep_probs: bool = False
    _grpo_renormalize: bool = True

    def forward(self, hidden_states: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        weight = self.weight
        hidden = hidden_states.reshape(-1, weight.shape[1])
        logits = F.linear(hidden, weight)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        own = torch.topk(probs, self.top_k, dim=-1)
        indices = own.indices
        forced = self._grpo_forced
        if forced is not None:
            forced = forced.long()
            # A position without routes (NO_ROUTE) keeps its own top-k; no host sync either way.
            indices = torch.where((forced >= 0).all(-1, keepdim=True), forced, indices)
            top = probs.gather(-1, indices)
        else:
            top = own.values
        if self._grpo_renormalize:
            top = top / top.sum(-1, keepdim=True)
        self._grpo_own_topk = own.indices.detach()
        self._grpo_dispatched = indices.detach()
        self._grpo_probs = probs if self._grpo_keep_probs else None
        return logits, top.to(logits.dtype), indices


def _replay_class(cls: type) -> type:
    if issubclass(cls, _ReplayRouter):
        return cls
    if cls not in _REPLAY_CLASSES:
        _REPLAY_CLASSES[cls] = type(f"Replay{cls.__name__}", (_ReplayRouter, cls), {"__module__": __name__})
    return _REPLAY_CLASSES[cls]


def _check_against_stock(router: torch.nn.Module, replay_cls: type) -> bool:
    """Switch ``router`` to ``replay_cls`` if its forward reproduces the stock one; returns the
    renormalisation that did (raises if neither does)."""
    stock_cls = type(router)
    weight = router.weight
    gen = torch.Generator(device="cpu").manual_seed(0)
    probe = torch.randn(16, weight.shape[1], generator=gen, dtype=torch.float32).to(weight.device, weight.dtype)
    with torch.no_grad():
        want_logits, want_top, want_idx = stock_cls.forward(router, probe)
        router.__class__ = replay_cls
        for renormalize in (True, False):
            router._grpo_renormalize = renormalize
            router._grpo_forced = want_idx
            logits, top, idx = router.forward(probe)
            router._grpo_forced = None
            if torch.equal(idx, want_idx) and torch.allclose(top, want_top, rtol=1e-5, atol=1e-7) \
                    and torch.allclose(logits, want_logits):
                return renormalize
        router.__class__ = stock_cls
    raise ValueError(
        f"routing replay: {stock_cls.__name__} does not route as softmax-then-top-k (renormalised or not), "
        "which is what replay reproduces; set routing_replay=False for this model"
    )


class RoutingReplay:
    """The routers of one model, switched to replay (see the module docstring)."""

    def __init__(self, layers: list[MoELayer], num_layers: int):
        self.layers = layers
        self.num_layers = num_layers
        """Decoder layers in the model: the width of the routes' layer axis."""
        self.top_k = layers[0].router.top_k
        self.num_experts = layers[0].router.num_experts

    @classmethod
    def install(cls, model: torch.nn.Module, num_layers: int) -> RoutingReplay:
        layers = moe_layers(model)
        if not layers:
            raise ValueError(f"{type(model).__name__} has no sparse MoE router to replay")
        for moe in layers:
            renormalize = _check_against_stock(moe.router, _replay_class(type(moe.router)))
            moe.router._grpo_renormalize = renormalize
        return cls(layers, num_layers)

    def set_row(self, routes: Tensor | None) -> None:
        """Force ``routes`` (int ``[positions, num_layers, top_k]``, ``NO_ROUTE`` where a position has
        none) from the next forward on, or route freely (None)."""
        if routes is not None and (routes.dim() != 3 or routes.shape[1:] != (self.num_layers, self.top_k)):
            raise ValueError(f"routes of shape {tuple(routes.shape)}: expected [positions, {self.num_layers}, {self.top_k}]")
        for moe in self.layers:
            moe.router._grpo_forced = None if routes is None else routes[:, moe.layer]

    def clear(self) -> None:
        self.set_row(None)
        for moe in self.layers:
            moe.router._grpo_own_topk = None
            moe.router._grpo_dispatched = None
            moe.router._grpo_probs = None

    def keep_probs(self, keep: bool) -> None:
        """Record each router's probabilities (with their graph) for the load-balancing loss."""
        for moe in self.layers:
            moe.router._grpo_keep_probs = keep

    def own_topk(self) -> Tensor:
        """The routers' own top-k of the last forward, ``[positions, num_layers, top_k]`` (int64;
        ``NO_ROUTE`` in layers without a router)."""
        first = self.layers[0].router._grpo_own_topk
        if first is None:
            raise RuntimeError("own_topk: no forward since the routes were cleared")
        out = torch.full((first.shape[0], self.num_layers, self.top_k), NO_ROUTE, dtype=torch.long, device=first.device)
        for moe in self.layers:
            out[:, moe.layer] = moe.router._grpo_own_topk
        return out

    def dispatched(self) -> list[Tensor]:
        """Each router's experts of the last forward, ``[positions, top_k]``: the forced ones where replayed."""
        return [moe.router._grpo_dispatched for moe in self.layers]

    def probs(self) -> list[Tensor]:
        """Each router's probabilities ``[positions, experts]`` of the last forward (``keep_probs``)."""
        return [moe.router._grpo_probs for moe in self.layers]


def routing_mismatch_tokens(own: Tensor, sampler: Tensor, positions: Tensor, layers: list[int]) -> tuple[Tensor, Tensor]:
    """``(differs, known)``, bool ``[T]`` over ``positions`` (int ``[T]``): ``known`` where the position has sampler
    routes in every MoE layer, ``differs`` where it has and some MoE layer's trainer top-k set (``own``,
    ``[positions, layers, k]``) differs from the sampler's (``sampler``, same shape; order within a set does not
    matter). Device tensors, no host sync."""
    index = torch.as_tensor(layers, device=own.device)
    mine = own.index_select(0, positions).index_select(1, index).sort(-1).values
    theirs = sampler.index_select(0, positions).index_select(1, index).long().sort(-1).values
    known = (theirs != NO_ROUTE).all(-1).all(-1)
    differs = (mine != theirs).any(-1).any(-1) & known
    return differs, known


def routing_mismatch(own: Tensor, sampler: Tensor, positions: Tensor, layers: list[int]) -> tuple[Tensor, Tensor]:
    """``(mismatched, counted)``: the counts of ``routing_mismatch_tokens``'s ``differs`` and ``known``."""
    differs, known = routing_mismatch_tokens(own, sampler, positions, layers)
    return differs.sum(), known.sum()

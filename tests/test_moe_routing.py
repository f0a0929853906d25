"""Mixture-of-experts routers on the CPU: routing replay, the mismatch count, the balancing loss, active weights.

* replay: a router switched to replay computes exactly what the stock one does when it routes freely
  or is forced onto its own choice; forced onto other experts it changes the output, keeps a
  gradient in the router, and a position without routes (``NO_ROUTE``) routes itself; a router of
  another kind is refused at install, by name;
* the mismatch count and the balancing loss (uniform = 1, a shared position counted once) on tensors
  built by hand; the experts run as grouped GEMMs and their active weights are counted.

Tiny random Qwen3-MoE and Qwen3.5-MoE models (``tiny_moe``) are shared with ``tests/test_moe_routes.py``
and ``tests/test_moe_policy.py``. Run: ``.venv/bin/python -m pytest tests/test_moe_routing.py``.
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig, Qwen3MoeConfig, Qwen3MoeForCausalLM

from grpo_core.models.moe.balance import load_balancing_loss
from grpo_core.models.moe.experts import SORTED_GROUPED_MM, active_expert_params, expert_modules, use_grouped_experts
from grpo_core.models.moe.routing import NO_ROUTE, RoutingReplay, routing_mismatch

VOCAB = 96
EXPERTS, TOP_K = 6, 2
COMMON = dict(vocab_size=VOCAB, hidden_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
              num_experts=EXPERTS, num_experts_per_tok=TOP_K, moe_intermediate_size=48, max_position_embeddings=256)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def tiny_moe(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "qwen3_moe":
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**COMMON, intermediate_size=96, num_hidden_layers=2, norm_topk_prob=True))
    else:
        model = Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(
            **COMMON, num_hidden_layers=2, shared_expert_intermediate_size=48, layer_types=["linear_attention", "full_attention"],
            linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=32, linear_value_head_dim=32))
    with torch.no_grad():  # wider than the default init: log-probs far from uniform, experts that differ
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.15)
    return model.float().eval()


KINDS = ("qwen3_moe", "qwen3_5_moe")


# ---- replay ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
def test_replay_reproduces_the_stock_router_and_forces_others(kind):
    model = tiny_moe(kind)
    stock = copy.deepcopy(model)
    ids = torch.randint(0, VOCAB, (1, 30), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = stock(input_ids=ids).logits
    replay = RoutingReplay.install(model, model.config.num_hidden_layers)
    assert [m.layer for m in replay.layers] == [0, 1]
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, want)  # free routing: the stock forward
        own = replay.own_topk()
        replay.set_row(own)
        assert torch.equal(model(input_ids=ids).logits, want)  # forced onto its own choice
        replay.set_row((own + 1) % EXPERTS)
        shifted = model(input_ids=ids).logits
        assert (shifted - want).abs().max() > 0.1
        assert torch.equal(replay.dispatched()[0], (own[:, 0] + 1) % EXPERTS)
        partial = ((own + 1) % EXPERTS).clone()
        partial[:10] = NO_ROUTE  # the first ten positions route themselves
        replay.set_row(partial)
        mixed = model(input_ids=ids).logits
    # Causal: positions before the first forced one are the stock ones.
    assert torch.equal(mixed[0, :10], want[0, :10]) and (mixed[0, 10:] - want[0, 10:]).abs().max() > 0.1
    replay.set_row((own + 1) % EXPERTS)
    model.zero_grad()
    model(input_ids=ids).logits.square().mean().backward()
    assert all(m.router.weight.grad.abs().sum() > 0 for m in replay.layers)
    replay.clear()
    with pytest.raises(RuntimeError, match="no forward"):
        replay.own_topk()


def test_replay_refuses_a_router_it_does_not_reproduce():
    model = tiny_moe("qwen3_moe")
    router = model.model.layers[0].mlp.gate

    class SigmoidRouter(type(router)):
        def forward(self, hidden_states):  # sigmoid scores: not softmax-then-top-k
            logits = torch.nn.functional.linear(hidden_states.reshape(-1, self.hidden_dim), self.weight)
            top = torch.topk(logits.sigmoid(), self.top_k, dim=-1)
            return logits, top.values, top.indices

    router.__class__ = SigmoidRouter
    with pytest.raises(ValueError, match="SigmoidRouter does not route as softmax-then-top-k"):
        RoutingReplay.install(model, 2)
    assert type(router) is SigmoidRouter  # left as it was


def test_routing_mismatch_counts_sets_not_orders():
    own = torch.tensor([[[0, 1], [2, 3]], [[0, 1], [2, 3]], [[4, 5], [2, 3]], [[0, 1], [2, 3]]])
    sampler = torch.tensor([[[1, 0], [3, 2]], [[0, 1], [2, 4]], [[4, 5], [2, 3]], [[NO_ROUTE] * 2] * 2], dtype=torch.int16)
    mismatched, counted = routing_mismatch(own, sampler, torch.tensor([0, 1, 2, 3]), [0, 1])
    assert (int(mismatched), int(counted)) == (1, 3)  # position 1 differs in layer 1; position 3 has no routes
    mismatched, counted = routing_mismatch(own, sampler, torch.tensor([1]), [0])  # layer 0 only
    assert (int(mismatched), int(counted)) == (0, 1)


def test_load_balancing_loss():
    n, e = 8, 4
    uniform = torch.full((n, e), 1 / e)
    spread = torch.arange(n * 2).reshape(n, 2) % e
    assert load_balancing_loss([uniform], [spread], e).item() == pytest.approx(1.0)
    probs = torch.softmax(torch.randn(n, e), -1).requires_grad_()
    skewed = torch.zeros(n, 2, dtype=torch.long)  # everything dispatched to expert 0
    loss = load_balancing_loss([probs, uniform], [skewed, spread], e)
    assert loss.item() == pytest.approx((e * probs[:, 0].mean().item() + 1.0) / 2)
    loss.backward()
    assert probs.grad[:, 0].gt(0).all() and probs.grad[:, 1:].eq(0).all()  # only P carries a gradient
    # A position forwarded once counts once: the same two tokens twice over is another loss than once.
    p = torch.tensor([[0.9, 0.1], [0.2, 0.8]])
    once = load_balancing_loss([p], [torch.tensor([[0], [1]])], 2)
    twice_first = load_balancing_loss([p[[0, 0, 1]]], [torch.tensor([[0], [0], [1]])], 2)
    assert once.item() != pytest.approx(twice_first.item())


def test_active_params_and_grouped_experts():
    model = tiny_moe("qwen3_moe")
    assert use_grouped_experts(model) == SORTED_GROUPED_MM  # the default, where the experts are gated without biases
    biased = tiny_moe("qwen3_moe")
    for _, experts in expert_modules(biased):
        experts.has_bias = True  # as GPT-OSS's experts: the sorted forward refuses them, transformers' runs them
    assert use_grouped_experts(biased) == "grouped_mm"
    per_expert = 3 * 64 * 48
    active, total = active_expert_params(model.model.layers)
    router = EXPERTS * 64
    assert (active, total) == (2 * (TOP_K * per_expert + router), 2 * (EXPERTS * per_expert + router))
    assert use_grouped_experts(torch.nn.Linear(2, 2)) is None


def _logits_and_grads(kind: str, implementation: str, dtype: torch.dtype):
    ids = torch.randint(0, VOCAB, (1, 40), generator=torch.Generator().manual_seed(3))
    model = tiny_moe(kind).to(dtype).train()
    assert use_grouped_experts(model, implementation) == implementation
    logits = model(input_ids=ids).logits
    (logits.float() * torch.linspace(-1, 1, logits.shape[-1])).sum().backward()
    return logits.detach().float(), {n: p.grad.float() for n, p in model.named_parameters()}


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).norm() / want.norm())


@pytest.mark.parametrize("kind", KINDS)
def test_sorted_experts_equal_transformers_grouped_experts(kind):
    """In fp32 the gather-only permutations give transformers' grouped_mm outputs and the same gradients of every
    weight (routers, experts) and of the input embeddings; in bf16, where the two round differently (the sorted
    experts sum a token's slots in fp32, transformers' in the weights' dtype), each output and gradient is as close
    to the fp32 model's as transformers' own (within 10%); an unknown implementation is refused by name."""
    want, want_grads = _logits_and_grads(kind, "grouped_mm", torch.float32)
    got, got_grads = _logits_and_grads(kind, SORTED_GROUPED_MM, torch.float32)
    tol = dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got, want, **tol)
    assert want_grads.keys() == got_grads.keys()
    assert any("gate_up_proj" in n for n in got_grads) and any("mlp.gate.weight" in n for n in got_grads)
    for name in want_grads:
        torch.testing.assert_close(got_grads[name], want_grads[name], **tol, msg=lambda m, n=name: f"{n}: {m}")
    theirs, theirs_grads = _logits_and_grads(kind, "grouped_mm", torch.bfloat16)
    ours, ours_grads = _logits_and_grads(kind, SORTED_GROUPED_MM, torch.bfloat16)
    assert _relative_error(ours, want) <= 1.1 * _relative_error(theirs, want) + 1e-4
    for name in want_grads:
        ours_error, theirs_error = (_relative_error(g[name], want_grads[name]) for g in (ours_grads, theirs_grads))
        assert ours_error <= 1.1 * theirs_error + 1e-4, (name, ours_error, theirs_error)
    with pytest.raises(ValueError, match="experts implementation 'fast'"):
        use_grouped_experts(tiny_moe(kind), "fast")


def test_slot_sums_compile_without_graph_breaks_and_match_eager():
    """The sorted experts' gathers and slot sums (``_ExpandToSlots``, ``_CombineSlots``) trace into one graph, as a
    compiled decoder layer runs them, with the eager outputs and gradients; the combine's gradients are the
    dense computation's (a [T, k, H] gather weighted and summed over k)."""
    from grpo_core.models.moe.experts import _CombineSlots, _ExpandToSlots

    gen = torch.Generator().manual_seed(0)
    tokens, k, hidden = 7, 3, 5
    top_k = torch.stack([torch.randperm(6, generator=gen)[:k] for _ in range(tokens)])
    perm = torch.sort(top_k.reshape(-1)).indices
    slot_rows = torch.empty_like(perm)
    slot_rows[perm] = torch.arange(perm.numel())
    slot_rows = slot_rows.view(tokens, k)
    x = torch.randn(tokens, hidden, generator=gen, dtype=torch.float64)
    w = torch.rand(tokens, k, generator=gen, dtype=torch.float64)
    scale = torch.randn(tokens * k, hidden, generator=gen, dtype=torch.float64)

    def block(x, w):
        sorted_rows = _ExpandToSlots.apply(x, perm, slot_rows) * scale  # stands in for the experts' GEMMs
        return _CombineSlots.apply(sorted_rows, w, perm, slot_rows)

    def dense(x, w):
        sorted_rows = x[perm // k] * scale
        return (sorted_rows[slot_rows] * w.unsqueeze(-1)).sum(1)

    results = []
    for fn in (dense, block, torch.compile(block, fullgraph=True, dynamic=True)):
        xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
        out = fn(xs, ws)
        out.backward(torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out))
        results.append((out.detach(), xs.grad, ws.grad))
    for got in results[1:]:
        for a, b in zip(got, results[0]):
            torch.testing.assert_close(a, b)

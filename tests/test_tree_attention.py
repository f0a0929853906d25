"""Tree attention is exact: one packed forward gives every trained token the log-prob (and gradient)
it gets when its sample is forwarded alone. Tiny random Qwen3 and Llama, fp32, CPU."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from grpo_core.models import tree_attention as ta
from grpo_core.packing.trie import TreeRow
from tests.test_packing_trie import make_sample, sample_sets

VOCAB = 8


def tiny(kind: str):
    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    torch.manual_seed(0)
    if kind == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(head_dim=8, **common))
    else:
        model = LlamaForCausalLM(LlamaConfig(**common))
    with torch.no_grad():  # larger than the default init so that log-probs are far from uniform
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.3)
    alone = copy.deepcopy(model)
    alone.set_attn_implementation("sdpa")
    ta.enable_tree_attention(model, backend="reference")
    return model.float().eval(), alone.float().eval()


MODELS = {kind: tiny(kind) for kind in ("qwen3", "llama")}


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits.float(), -1).gather(-1, targets[:, None])[:, 0]


def packed_logprobs(model, samples, backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    ta.register_tree_attention(backend)
    row = TreeRow()
    for s in samples:
        row.add(s)
    p = row.pack()
    out = model(**p.model_inputs(), logits_to_keep=p.logit_index)
    return token_logprobs(out.logits[0], p.target_ids), p.sample_index


def alone_logprobs(model, samples) -> list[torch.Tensor]:
    result = []
    for s in samples:
        trained = np.flatnonzero(s.completion_mask)
        ids = torch.as_tensor(s.token_ids, dtype=torch.long)
        if not len(trained):
            result.append(torch.zeros(0))
            continue
        logits = model(input_ids=ids[None]).logits[0]
        result.append(token_logprobs(logits[trained - 1], ids[trained]))
    return result


def flat_grad(model) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


@pytest.mark.parametrize("kind", ["qwen3", "llama"])
@given(samples=sample_sets(vocab_max=VOCAB))
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_packed_equals_alone(kind, samples):
    model, alone = MODELS[kind]
    model.zero_grad()
    alone.zero_grad()
    packed, owner = packed_logprobs(model, samples, "reference")
    singles = alone_logprobs(alone, samples)
    expected = torch.cat(singles)
    assert packed.shape == expected.shape
    if not len(expected):
        return
    assert (packed - expected).abs().max().item() <= 1e-5
    # gradients of a GRPO-like loss: each token weighted by its sample's advantage (+ a token term)
    adv = torch.tensor([s.advantage for s in samples], dtype=torch.float32)
    weight = adv[owner] + 0.01 * torch.arange(len(owner))
    (packed * weight).sum().backward()
    (expected * weight).sum().backward()
    g1, g2 = flat_grad(model), flat_grad(alone)
    cos = torch.nn.functional.cosine_similarity(g1, g2, dim=0).item()
    assert cos >= 0.9999 or g2.norm() < 1e-8
    assert (g1 - g2).norm() <= 1e-4 * max(g2.norm(), 1.0)


@given(samples=sample_sets(vocab_max=VOCAB))
@settings(max_examples=15, deadline=None)
def test_gather_path_equals_reference(samples):
    """The fused-kernel path (K/V gathered along paths, one varlen call) with the kernel emulated."""
    model, _ = MODELS["qwen3"]
    with torch.no_grad():
        ref, _ = packed_logprobs(model, samples, "reference")
        emu, _ = packed_logprobs(model, samples, "varlen_emulated")
    ta.register_tree_attention("reference")
    assert (ref - emu).abs().max().item() <= 1e-5 if len(ref) else True


def test_diagram_attention_rows():
    """Query rows of the diagram's segment S2 see p1 p2 and their own causal past only."""
    row = TreeRow()
    row.add(make_sample([1, 2, 3, 4, 5], 2))
    row.add(make_sample([1, 2, 3, 6, 7], 2))
    mask = row.pack().attention.dense_mask(torch.device("cpu")).int().tolist()
    assert mask == [
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0],
        [1, 1, 1, 1, 0, 0],
        [1, 1, 0, 0, 1, 0],
        [1, 1, 0, 0, 1, 1],
    ]


def test_probe_accepts_a_correct_kernel():
    assert ta._probe(ta.BACKENDS["varlen_emulated"], torch.device("cpu")) < 2e-2
    assert ta.select_backend("auto", "cpu").name == "reference"


def test_missing_metadata_is_a_clear_error():
    model, _ = MODELS["llama"]
    with pytest.raises(ValueError, match="tree_attention"):
        model(input_ids=torch.tensor([[1, 2, 3]]))


def test_check_supported_architecture():
    for model, _ in MODELS.values():
        ta.check_supported_architecture(model)

    class Hybrid(torch.nn.Module):  # a layer with a token-mixing module other than attention
        def __init__(self):
            super().__init__()
            base = copy.deepcopy(MODELS["llama"][0])
            base.model.layers[1].add_module("linear_attn", torch.nn.Conv1d(4, 4, 3))
            self.model, self.config = base.model, base.config

    with pytest.raises(ta.UnsupportedArchitectureError, match="linear_attn"):
        ta.check_supported_architecture(Hybrid())

    config = Qwen3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                         layer_types=["full_attention", "sliding_attention"])
    config_holder = type("M", (torch.nn.Module,), {})()
    config_holder.config = config
    # Gated DeltaNet (linear_attention) layers are supported (tests/test_gated_delta.py); windows are not.
    with pytest.raises(ta.UnsupportedArchitectureError, match="sliding_attention"):
        ta.check_supported_architecture(config_holder)


@given(samples=sample_sets(vocab_max=VOCAB))
@settings(max_examples=15, deadline=None)
def test_gather_path_gradients_equal_reference(samples):
    """Output and q/k/v gradients of the gather path (fp32 accumulation of shared K/V) vs reference."""
    row = TreeRow()
    for s in samples:
        row.add(s)
    p = row.pack()
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(p.num_tokens, h, 8, generator=gen) for h in (4, 2, 2))
    grad = torch.randn(p.num_tokens, 4, 8, generator=gen)
    results = []
    for name in ("reference", "varlen_emulated"):
        xs = [t.clone().requires_grad_() for t in (q, k, v)]
        out = ta.BACKENDS[name].run(*xs, p.attention, 8**-0.5)
        out.backward(grad)
        results.append([out.detach()] + [x.grad for x in xs])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)

"""Mixture-of-experts policies in the trainer's other parts: tiny specs, server options, LoRA, checkpoints, metrics.

* the MoE tiny variants are upcycled from the dense builds (a small spec builds in seconds here):
  everything but the MLPs is the dense model's, noiseless experts compute the dense MLP exactly;
* a MoE model's server needs routes on GPUs only (the CPU build refuses the flag);
* LoRA reaches the linear layers (attention, a shared expert) and the merged push carries the fused
  expert tensors untouched under their names; experts themselves are not linear layers;
* a checkpoint (``write_servable``) stores the fused expert tensors under the trainer's names and
  transformers loads it back to the same weights;
* the step metrics: ``sampling/routing_mismatch`` from the parts of several micro-batches and ranks;
* ``ModelFlops`` counts active parameters and attention only in softmax-attention layers.

Run: ``.venv/bin/python -m pytest tests/test_moe_policy.py``.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from grpo_core.models.moe.policy import MoEPolicy, finalize_moe_metrics
from grpo_core.tiny import build_from_spec, default_spec
from grpo_core.tiny.spec import ModelSpec, MoESpec, TinySpec, TokenizerSpec, WarmupSpec
from grpo_core.training.loss import reduce_metric_parts
from grpo_core.training.perf import ModelFlops
from grpo_core.vllm_server.model_needs import is_mixture_of_experts, server_needs
from tests.test_moe_routing import tiny_moe

SMALL_MODEL = ModelSpec(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=2,
                        num_key_value_heads=1, head_dim=32)
SMALL_WARMUP = WarmupSpec(steps=3, batch_size=4, num_examples=32, warmup_steps=1)
SMALL_MOE = TinySpec(variant="arithmetic-moe", tokenizer=TokenizerSpec(corpus_size=400),
                     model=replace(SMALL_MODEL, moe=MoESpec(num_experts=4, experts_per_token=2)),
                     warmup=SMALL_WARMUP, moe_warmup=SMALL_WARMUP, eval_samples=0)


def test_moe_specs() -> None:
    moe, hybrid = default_spec("arithmetic-moe"), default_spec("arithmetic-hybrid-moe")
    assert moe.base() == default_spec("arithmetic") and hybrid.base() == default_spec("arithmetic-hybrid")
    assert len({default_spec(v).digest() for v in ("arithmetic", "arithmetic-hybrid", "arithmetic-moe",
                                                   "arithmetic-hybrid-moe")}) == 4
    with pytest.raises(ValueError, match="moe_warmup must be set"):
        replace(SMALL_MOE, moe_warmup=None)
    with pytest.raises(ValueError, match="model.moe for the MoE variants only"):
        replace(SMALL_MOE, variant="arithmetic", moe_warmup=None)
    with pytest.raises(ValueError, match="experts_per_token"):
        MoESpec(num_experts=4, experts_per_token=4)


def test_upcycled_build(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from grpo_core.tiny.warmup import upcycle

    path = build_from_spec(SMALL_MOE, tmp_path)
    dense_path = build_from_spec(SMALL_MOE.base(), tmp_path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    assert type(model).__name__ == "Qwen3MoeForCausalLM" and is_mixture_of_experts(model.config)
    dense = AutoModelForCausalLM.from_pretrained(dense_path, dtype=torch.float32)
    # Without noise every expert is the dense MLP and the top-k weights sum to 1: the dense model's output.
    spec = replace(SMALL_MOE.model, moe=MoESpec(num_experts=4, experts_per_token=2, expert_noise=0.0))
    same = upcycle(spec, AutoTokenizer.from_pretrained(dense_path), dense, 0)
    ids = torch.tensor([list(range(5, 40))])
    with torch.no_grad():
        assert torch.allclose(same(input_ids=ids).logits, dense(input_ids=ids).logits, atol=1e-5)
        assert not torch.allclose(model(input_ids=ids).logits, dense(input_ids=ids).logits, atol=1e-3)


def test_routes_flag_on_gpu_servers_only() -> None:
    config = tiny_moe("qwen3_moe").config
    assert is_mixture_of_experts(config)
    assert "return_routed_experts" in server_needs(config, cuda=True)
    assert "return_routed_experts" not in server_needs(config, cuda=False)


def test_lora_reaches_linear_layers_and_the_merged_push_keeps_fused_experts() -> None:
    from peft import LoraConfig

    from grpo_core.models.lora import LoraConfigError, apply_lora, merged_named_tensors

    model = tiny_moe("qwen3_5_moe")
    base = {n: p.detach().clone() for n, p in model.named_parameters()}
    wrapped = apply_lora(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "shared_expert.up_proj"]))
    with torch.no_grad():
        for name, p in wrapped.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    merged = dict(merged_named_tensors(wrapped))
    assert merged.keys() == base.keys()
    assert torch.equal(merged["model.layers.0.mlp.experts.gate_up_proj"], base["model.layers.0.mlp.experts.gate_up_proj"])
    assert not torch.equal(merged["model.layers.1.self_attn.q_proj.weight"], base["model.layers.1.self_attn.q_proj.weight"])
    assert not torch.equal(merged["model.layers.0.mlp.shared_expert.up_proj.weight"],
                           base["model.layers.0.mlp.shared_expert.up_proj.weight"])
    with pytest.raises((LoraConfigError, ValueError)):
        apply_lora(tiny_moe("qwen3_moe"), LoraConfig(r=4, target_modules=["gate"]))  # the router is not linear


def test_checkpoint_keeps_fused_expert_tensors(tmp_path: Path) -> None:
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from grpo_core.checkpoint.state import write_servable

    model = tiny_moe("qwen3_moe")
    model.config.architectures = ["Qwen3MoeForCausalLM"]
    state = {n: p.detach() for n, p in model.named_parameters()}
    write_servable(tmp_path, model, state, None, torch.float32)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        assert list(f.get_slice("model.layers.0.mlp.experts.gate_up_proj").get_shape()) == [6, 96, 64]
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    for name, p in loaded.named_parameters():
        assert torch.equal(p, state[name]), name


def test_routing_mismatch_metric_over_micro_batches() -> None:
    model = tiny_moe("qwen3_moe")
    policy = MoEPolicy.for_model(model, replay=False)
    assert MoEPolicy.for_model(torch.nn.Linear(2, 2), replay=True) is None
    ids = torch.randint(0, 96, (1, 12), generator=torch.Generator().manual_seed(0))
    parts = []
    for shift in (0, 1):
        with torch.no_grad():
            model(input_ids=ids)
        own = policy.routing.own_topk()
        sampler = ((own + shift) % 6).to(torch.int16)
        sampler[:2] = -1  # no routes at two positions
        _, part = policy.after_forward(sampler, torch.arange(12), route_conflicts=shift, row_positions=12, step_positions=24)
        parts.append(part)
        # per token, for the per-staleness mismatch metrics: positions 0-1 have no route; the shift moves all others
        differs, known = policy.token_routes
        assert known.tolist() == [False] * 2 + [True] * 10 and differs.tolist() == [False] * 2 + [bool(shift)] * 10
        policy.after_backward()
        assert policy.token_routes is None
    merged = {k: v.item() for k, v in reduce_metric_parts(parts).items()}
    metrics = finalize_moe_metrics(merged)
    assert metrics["sampling/routing_mismatch"] == pytest.approx(10 / 20)  # the shifted micro-batch's 10 of 20
    assert metrics["sampling/route_conflicts"] == 1
    assert finalize_moe_metrics({}) == {}


def test_flops_count_active_parameters() -> None:
    qwen3, hybrid = tiny_moe("qwen3_moe"), tiny_moe("qwen3_5_moe")
    f = ModelFlops.from_model(qwen3)
    attention = 2 * (64 * 64 + 2 * 64 * 32 + 64 * 64)  # q, k, v, o of two layers
    experts = 2 * (2 * 3 * 64 * 48 + 6 * 64)  # top-2 of the experts and the router, two layers
    assert (f.layer_params, f.num_layers) == (attention + experts, 2)
    assert ModelFlops.from_model(hybrid).num_layers == 1  # one of its two layers is Gated DeltaNet


def test_balancing_loss_term_reaches_the_routers() -> None:
    from grpo_core.models.moe.balance import load_balancing_loss

    model = tiny_moe("qwen3_moe")
    assert MoEPolicy.for_model(model, replay=False).after_forward(None, torch.arange(3), 0, 10, 40)[0] is None
    policy = MoEPolicy.for_model(model, replay=True, aux_loss_coef=0.5)
    ids = torch.randint(0, 96, (1, 10), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids)
    extra, parts = policy.after_forward(None, torch.arange(10), 0, row_positions=10, step_positions=40)
    aux = load_balancing_loss(policy.routing.probs(), policy.routing.dispatched(), 6)
    assert extra.item() == pytest.approx(0.5 * 0.25 * aux.item()) and parts["moe_aux_loss_sum"].item() == pytest.approx(0.25 * aux.item())
    extra.backward()
    assert all(m.router.weight.grad is not None and m.router.weight.grad.abs().sum() > 0 for m in policy.routing.layers)
    policy.after_backward()
    assert finalize_moe_metrics({"moe_aux_loss_sum": 0.3}) == {"moe/aux_loss": 0.3}

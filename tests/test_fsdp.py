"""FSDP2 sharding, rank roles and MFU accounting on the CPU (gloo, fp32); no server.

Two-rank checks run in one spawned pair of gloo processes (``_two_rank_checks``) and report back
through a file; each check there compares against the same computation done in one process:

* a step sharded over 2 ranks (each rank its planned row) gives the 1-process gradients and
  weights, with and without activation checkpointing;
* ``iter_full_layers`` gathers every full weight, one decoder layer at a time;
* ``StepFeed``: rank 1 rebuilds exactly the plan rank 0 collected, and both stop at end of data;
* ``gather_step_results`` gives the step's loss and token count on every rank.

Run: ``.venv/bin/python -m pytest tests/test_fsdp.py``.
"""

from __future__ import annotations

import json
import os
import re

import numpy as np
import pytest
import torch
import torch.distributed as dist

from grpo_core.config import AsyncGRPOConfig
from grpo_core.models.attention import tree as ta
from grpo_core.models.fsdp import FSDPSettings, decoder_layers, iter_full_layers, layer_groups, shard_policy
from grpo_core.models.head.reference import token_logprobs
from grpo_core.packing.collator import pack_row
from grpo_core.packing.planner import plan_step
from grpo_core.rollout.scheduler import END_OF_DATA
from grpo_core.rollout.types import GroupReport, RolloutSample
from grpo_core.training.collector import StepCollector, TrainingFrontier, WeightVersions
from grpo_core.training.loss import LossConfig, LossInputs, grpo_loss
from grpo_core.training.perf import ModelFlops, causal_pairs, peak_bf16_flops, perf_metrics
from grpo_core.vllm_server.process import free_port
from tests.child_processes import run_ranks
from tests.tolerances import (
    GradientMagnitudes,
    adam_direction,
    adamw_first_step,
    adamw_first_step_rounding,
    gamma,
    log_softmax_grad_magnitude,
    logprob_error_magnitude,
)

VOCAB = 96


def tiny_model(seed: int = 0):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, tie_word_embeddings=True,
                         max_position_embeddings=256)
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config).float()
    model.config.use_cache = False
    ta.register_tree_attention("varlen_emulated")
    model.set_attn_implementation(ta.TREE_ATTENTION)
    return model


def make_samples(n_groups: int = 4, group: int = 4, seed: int = 0) -> list[RolloutSample]:
    """Groups share a prompt, and completions share stems of random length: a trie with deep forks."""
    rng = np.random.default_rng(seed)
    out = []
    for g in range(n_groups):
        prompt = rng.integers(0, VOCAB, int(rng.integers(5, 20)))
        stem = rng.integers(0, VOCAB, 8)
        for r in range(group):
            comp = np.concatenate([stem[: int(rng.integers(0, 8))], rng.integers(0, VOCAB, int(rng.integers(3, 15)))])
            tokens = np.concatenate([prompt, comp]).astype(np.int32)
            mask = np.zeros(len(tokens), dtype=bool)
            mask[len(prompt):] = True
            n = int(mask.sum())
            out.append(RolloutSample(
                token_ids=tokens, completion_mask=mask,
                sampler_logprobs=np.where(mask, rng.uniform(-4.5, -4.0, len(tokens)), 0.0).astype(np.float32),
                advantage=float(rng.normal()), reward=0.0, group_id=g, row_index=g, epoch=0,
                rollout_id=f"s{g}-{r}", policy_version=0, position=g,
                sampler_top_ids=rng.integers(0, VOCAB, (n, 3)).astype(np.int32),
                sampler_top_logprobs=np.full((n, 3), -4.0, np.float32),
            ))
    return out


def row_loss(model, packed, num_tokens: int, inspect=None) -> torch.Tensor:
    """The trainer's loss for one packed row (same functions, same normaliser); ``inspect(logits,
    inputs)`` sees the loss's inputs before the loss is taken."""
    logits = model(**packed.model_inputs(), logits_to_keep=packed.logit_index).logits[0]
    if packed.num_trained == 0:
        return logits.sum() * 0.0
    logprobs, top = token_logprobs(logits, packed.target_ids, 1.0, top_ids=packed.sampler_top_ids.clamp(min=0))
    inputs = LossInputs(logprobs=logprobs, sampler_logprobs=packed.sampler_logprobs, advantages=packed.advantages,
                        top_logprobs=top, sampler_top_logprobs=packed.sampler_top_logprobs, top_valid=packed.top_valid)
    if inspect is not None:
        inspect(logits, inputs)
    return grpo_loss(inputs, LossConfig.from_config(AsyncGRPOConfig()), num_tokens)[0]


def train_step(model, rows, num_tokens: int) -> tuple[float, dict[str, torch.Tensor], dict[str, torch.Tensor], dict]:
    """Backward over ``rows``, then one AdamW step; returns loss, full gradients, full new weights and
    the optimizer's hyper-parameters."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loss = 0.0
    for row in rows:
        value = row_loss(model, pack_row(row), num_tokens)
        value.backward()
        loss += float(value.detach())
    grads = {n: full(p.grad).clone() for n, p in model.named_parameters()}
    optimizer.step()
    weights = {n: full(p.detach()).clone() for n, p in model.named_parameters()}
    adamw = {k: optimizer.defaults[k] for k in ("lr", "eps", "weight_decay", "betas")}
    return loss, grads, weights, adamw


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def max_rel(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).norm() / b[k].norm().clamp(min=1e-12)) for k in a)


# ------------------------------------------------------------------------------------------ one process
def test_causal_pairs_equal_the_tree_mask():
    # The attention term of the FLOP count must be exactly what the mask lets through.
    plan = plan_step(make_samples(), world_size=1, gradient_accumulation_steps=1, token_budget=10_000)
    row = plan.rows[0]
    assert any(seg.start > 0 for seg in row.segments()), "the test row must have forks"
    mask = pack_row(row).attention.dense_mask(torch.device("cpu"))
    assert causal_pairs(row) == int(mask.sum())
    flat = plan_step(make_samples(), world_size=1, gradient_accumulation_steps=1, token_budget=10_000, flat=True)
    n = [len(s.token_ids) - 1 for s in flat.rows[0].samples]  # a flat row: every sample alone, causal
    assert causal_pairs(flat.rows[0]) == sum(k * (k + 1) // 2 for k in n)


def test_model_flops_from_a_qwen3_config():
    model = tiny_model()
    flops = ModelFlops.from_model(model)
    d, ffn, heads, kv, hd, layers = 32, 64, 4, 2, 8, 3
    assert flops.layer_params == layers * (d * heads * hd * 2 + d * kv * hd * 2 + 3 * d * ffn)
    assert flops.head_params == d * VOCAB
    assert (flops.num_layers, flops.query_width) == (layers, heads * hd)
    plan = plan_step(make_samples(), world_size=1, gradient_accumulation_steps=1, token_budget=10_000)
    row = plan.rows[0]
    expected = (6 * flops.layer_params * row.num_unique_tokens + 6 * d * VOCAB * row.num_trained_tokens
                + 12 * layers * heads * hd * causal_pairs(row))
    assert flops.row_flops(row) == expected


@pytest.mark.parametrize("name, tflops", [
    ("NVIDIA H100 80GB HBM3", 989), ("NVIDIA H100 PCIe", 756), ("NVIDIA H100 NVL", 835), ("NVIDIA H200", 989),
    ("NVIDIA H200 NVL", 835), ("NVIDIA A100-SXM4-80GB", 312), ("NVIDIA A100 80GB PCIe", 312), ("NVIDIA B200", 2250),
    ("NVIDIA GH200 480GB", None), ("NVIDIA L40S", None), ("Tesla T4", None),
])
def test_peak_table(name, tflops):
    peak = peak_bf16_flops(name)
    assert peak == (tflops * 1e12 if tflops else None)


def test_mfu_is_omitted_without_a_known_peak():
    with_peak = perf_metrics(flops=4e15, tokens=1000, fwd_bwd_s=2.0, wall_s=4.0, world_size=2, peak_flops=1e15)
    assert with_peak == {"perf/tokens_per_s_fwd_bwd": 500.0, "perf/tokens_per_s_wall_clock": 250.0,
                         "perf/mfu_fwd_bwd": 1.0, "perf/mfu_wall_clock": 0.5}
    without = perf_metrics(flops=4e15, tokens=1000, fwd_bwd_s=2.0, wall_s=4.0, world_size=2, peak_flops=None)
    assert without == {"perf/tokens_per_s_fwd_bwd": 500.0, "perf/tokens_per_s_wall_clock": 250.0}


def test_layer_groups_follow_decoder_layers():
    names = ["model.embed_tokens.weight", "model.layers.0.a.weight", "model.layers.0.b.weight",
             "model.layers.1.a.weight", "model.layers.10.a.weight", "model.norm.weight", "lm_head.weight"]
    assert layer_groups(names) == [names[:1], names[1:3], names[3:4], names[4:5], names[5:]]


def test_settings_reject_unknown_compile_mode_and_cpu_bf16():
    with pytest.raises(ValueError, match="compile"):
        FSDPSettings(compile="everything")
    model = tiny_model()
    if dist.is_initialized():
        pytest.skip("a process group exists in this process")
    # One rank in fp32 needs no FSDP: the model comes back unwrapped.
    assert shard_policy(model, FSDPSettings(), torch.device("cpu")) is model
    assert not any(hasattr(p, "full_tensor") for p in model.parameters())
    with pytest.raises(ValueError, match="CUDA"):
        shard_policy(model, FSDPSettings(bf16=True), torch.device("cpu"))


@pytest.mark.parametrize("keep_weights", [False, True])
def test_one_rank_reduces_gradients_after_the_last_micro_batch_only(keep_weights: bool):
    """``before_micro_batch`` on one FSDP2 rank (gloo, fp32), over three optimizer steps of three micro-batches:

    * the micro-batches before the last leave the sharded gradients unset (no reduce ran), and after the last they
      equal the unsharded model's accumulated gradients;
    * with ``keep_weights`` a layer's gathered weights stay after the backward of every micro-batch but the last
      (its parameters stay plain tensors, not the sharded DTensors), and are freed after the last. The weights
      must track the optimizer's steps: a gathered copy kept across a step would train the next step on stale
      weights, and the losses and gradients would part from the unsharded model's."""
    import copy

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from grpo_core.models.fsdp import before_micro_batch
    from grpo_core.vllm_server.process import free_port

    if dist.is_initialized():
        pytest.skip("a process group exists in this process")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
        unsharded = copy.deepcopy(model)
        mesh = init_device_mesh("cpu", (1,))
        for layer in (model[0], model[2]):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.2)
        reference_optimizer = torch.optim.SGD(unsharded.parameters(), lr=0.2)
        for step in range(3):
            batches = [torch.randn(5, 8) for _ in range(3)]
            reduced, kept = [], []
            for i, x in enumerate(batches):
                before_micro_batch(model, last_micro_batch=i == len(batches) - 1, keep_weights=keep_weights)
                loss = model(x).pow(2).sum()
                reference_loss = unsharded(x).pow(2).sum()
                torch.testing.assert_close(loss, reference_loss, atol=1e-6, rtol=1e-6)
                loss.backward()
                reference_loss.backward()
                # the sharded parameters (DTensors) have gradients only once they were reduced
                reduced.append(all(isinstance(p, DTensor) and p.grad is not None for p in model.parameters()))
                kept.append(not isinstance(model[0].weight, DTensor))
            assert reduced == [False, False, True], step
            assert kept == ([True, True, False] if keep_weights else [False, False, False]), step
            for p, q in zip(model.parameters(), unsharded.parameters()):
                torch.testing.assert_close(p.grad.full_tensor(), q.grad, atol=1e-6, rtol=1e-6)
            optimizer.step()
            reference_optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            reference_optimizer.zero_grad(set_to_none=True)
    finally:
        dist.destroy_process_group()


def test_keeping_weights_between_micro_batches_resolves_per_rank_count_and_offload():
    """``fsdp_keep_weights_between_micro_batches``: ``auto`` is on for one rank without CPU offload only; ``True``
    on several ranks, or with offload, is refused naming the field."""
    from grpo_core.config import AsyncGRPOConfig, ConfigError
    from grpo_core.models.fsdp import resolve_keep_weights

    assert resolve_keep_weights("auto", 1, cpu_offload=False) is True
    assert resolve_keep_weights("auto", 2, cpu_offload=False) is False
    assert resolve_keep_weights("auto", 1, cpu_offload=True) is False
    assert resolve_keep_weights(False, 1, cpu_offload=False) is False
    assert resolve_keep_weights(True, 1, cpu_offload=False) is True
    with pytest.raises(ValueError, match="fsdp_keep_weights_between_micro_batches=True on 2 ranks"):
        resolve_keep_weights(True, 2, cpu_offload=False)
    with pytest.raises(ConfigError, match="fsdp_keep_weights_between_micro_batches"):
        AsyncGRPOConfig(fsdp_keep_weights_between_micro_batches=True, fsdp_cpu_offload=True)
    config = AsyncGRPOConfig()
    assert FSDPSettings.from_config(config, bf16=False, world_size=1).keep_weights_between_micro_batches
    assert not FSDPSettings.from_config(config, bf16=False, world_size=4).keep_weights_between_micro_batches


def test_row_plans_are_built_once_however_fsdp_copies_the_layers_inputs():
    """FSDP2's mixed precision rebuilds each sharded layer's dataclass and dict inputs (``cast_forward_inputs``), so
    every layer receives a copy of the row's metadata. The plans built from it (``TreeAttentionMetadata.cached``) must
    still be built once per row and shared by all layers: one rank (gloo), bf16 parameters, three sharded layers."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from grpo_core.models.attention.probe_rows import probe_meta
    from grpo_core.vllm_server.process import free_port

    builds, received = [], []

    class Layer(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = torch.nn.Linear(4, 4)

        def forward(self, x, tree_attention=None):
            received.append(tree_attention)
            plan = tree_attention.cached(("plan",), lambda: builds.append(1) or torch.arange(3))
            return self.linear(x) + plan.sum()

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = torch.nn.ModuleList(Layer() for _ in range(3))

        def forward(self, x, tree_attention=None):
            for layer in self.layers:
                x = layer(x, tree_attention=tree_attention)
            return x

    if dist.is_initialized():
        pytest.skip("a process group exists in this process")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        model, mesh = Model(), init_device_mesh("cpu", (1,))
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for layer in model.layers:
            fully_shard(layer, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        meta = probe_meta(torch.device("cpu"))
        model(torch.randn(2, 4), tree_attention=meta).float().sum().backward()
        assert any(r is not meta for r in received), "FSDP2 handed every layer the caller's own metadata: nothing to test"
        assert len(builds) == 1
        assert ("plan",) in meta.cache  # and the caller's record holds it for the row's next forward
    finally:
        dist.destroy_process_group()


# ------------------------------------------------------------------------------------------ two ranks
def _report(item) -> GroupReport:
    return GroupReport(position=item, row_index=item, epoch=0, rewards=np.ones(4), rewards_per_func={},
                       num_samples=4, dropped=False)


class _ListSource:
    def __init__(self, items):
        self.items = list(items)

    def get(self, timeout_s: float):
        return self.items.pop(0) if self.items else END_OF_DATA


def _two_rank_checks(rank: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank))
    from grpo_core.ranks import DistInfo, init_distributed
    from grpo_core.training.distributed import StepFeed, gather_step_results

    torch.set_num_threads(1)
    info = DistInfo.from_env()
    init_distributed(info, torch.device("cpu"), timeout_s=120)
    results: dict = {}
    samples = make_samples()

    # (1) a sharded step equals the one-process step on the same samples
    one = plan_step(samples, world_size=1, gradient_accumulation_steps=2, token_budget=200)
    two = plan_step(samples, world_size=2, gradient_accumulation_steps=2, token_budget=200)
    assert not one.leftover and not two.leftover, "the step must take every sample in both layouts"
    num_tokens = sum(r.num_trained_tokens for r in one.rows)
    ref_model = tiny_model()
    w0 = {n: p.detach().clone() for n, p in ref_model.named_parameters()}
    ref_loss, ref_grads, ref_weights, adamw = train_step(ref_model, one.rows, num_tokens)
    # Per-element tensors for the derived bounds (test_two_rank_step_equals_one_process).
    tensors = {"w0": w0, "adamw": adamw, "ref_grads": ref_grads, "ref_weights": ref_weights}
    for ac in (False, True):
        model = shard_policy(tiny_model(), FSDPSettings(activation_checkpointing=ac), torch.device("cpu"))
        sharded = all(hasattr(p, "full_tensor") for p in model.parameters())
        loss, grads, weights, _ = train_step(model, two.rows_for_rank(rank), num_tokens)
        _, loss_sum, _ = gather_step_results([], loss, 0.0)
        results[f"step_ac{int(ac)}"] = {"sharded": sharded, "loss": loss_sum, "ref_loss": ref_loss,
                                        "grad_rel": max_rel(grads, ref_grads), "weight_rel": max_rel(weights, ref_weights)}
        tensors[f"step_ac{int(ac)}"] = {"grads": grads, "weights": weights}
    torch.save(tensors, os.path.join(out_dir, f"rank{rank}-step.pt"))

    # (2) full weights a decoder layer at a time
    model = shard_policy(tiny_model(seed=3), FSDPSettings(), torch.device("cpu"))
    reference = dict(tiny_model(seed=3).named_parameters())
    groups = [[(n, t.clone()) for n, t in g] for g in iter_full_layers(model)]
    per_layer = [len({m.group(1) for n, _ in g if (m := re.search(r"layers\.(\d+)\.", n))}) for g in groups]
    results["gather"] = {
        "names": [n for g in groups for n, _ in g], "ref_names": list(reference),
        "max_diff": max(float((t - reference[n]).abs().max()) for g in groups for n, t in g),
        "layers_per_group": per_layer, "num_layers": len(decoder_layers(model)),
    }

    # (3) the step feed: rank 0 collects from a source, rank 1 rebuilds the same plan
    items = []
    for g in range(4):
        items.append(_report(g))
        items.extend(s for s in samples if s.group_id == g)
    collector = StepCollector(source=_ListSource(items) if rank == 0 else None, world_size=2,
                              gradient_accumulation_steps=2, token_budget=60, max_samples_per_step=6,
                              max_staleness=0, flat=False, frontier=TrainingFrontier(), timeout_s=1.0)
    feed = StepFeed(collector, rank, 2)
    steps = []
    while (batch := feed.collect(WeightVersions([0]))) is not None:
        packed = [[pack_row(r) for r in mb] for mb in batch.plan.microbatches]
        steps.append({
            "ids": [[[s.rollout_id for s in r.samples] for r in mb] for mb in batch.plan.microbatches],
            "inputs": [[p.input_ids.tolist() for p in mb] for mb in packed],
            "kv_index": [[None if p.attention.kv_index is None else p.attention.kv_index.tolist() for p in mb]
                         for mb in packed],
            "metrics": batch.plan.metrics(), "reports": [r.position for r in batch.reports],
        })
        feed.mark_trained(batch)
    results["feed"] = steps
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    # Both ranks done with every collective before either tears gloo down (a rank that leaves while the
    # other still talks has aborted with "terminate called without an active exception").
    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("two-ranks")
    run_ranks(_two_rank_checks, (free_port(), str(out)), nprocs=2)
    results = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    for r, result in enumerate(results):
        result["tensors"] = torch.load(out / f"rank{r}-step.pt", weights_only=True)
    return results


@pytest.fixture(scope="module")
def step_error_scale() -> dict:
    """What fp32 rounding differences between two layouts of the step's sums scale with.

    Two computations of the same step (1 process, or 2 ranks with other rows) differ only in the
    order of their sums. Each is within γ_k × magnitude of the exact value, k the longest reduction:
    the weight-gradient sum over every forwarded token of the step (longer than the attention sums
    over a row's keys, the loss's sum over trained tokens, the vocabulary, hidden and MLP sizes).
    Magnitudes (Σ|terms|) are taken with every sample forwarded alone (the flat layout): a trie
    shares a prefix token's term between samples, |x|·|δ_a + δ_b| <= |x|·|δ_a| + |x|·|δ_b|, so these
    bound both layouts' sums. The logits' gradient enters with its magnitude before the centering
    cancels it (``log_softmax_grad_magnitude``): rows of tokens that are neither sampled nor among the
    top ids have exact gradient 0 and computed ones of rounding size, near Adam's eps. Cancellations
    deeper in the backward (RMSNorm's projection, softmax's dP − D) are not seen by the hooks; they
    matter where a row's values agree (repeated tokens), which these random samples avoid.
    """
    samples = make_samples()
    one = plan_step(samples, world_size=1, gradient_accumulation_steps=2, token_budget=200)
    two = plan_step(samples, world_size=2, gradient_accumulation_steps=2, token_budget=200)
    flat = plan_step(samples, world_size=1, gradient_accumulation_steps=1, token_budget=10_000, flat=True)
    num_tokens = sum(r.num_trained_tokens for r in one.rows)
    model = tiny_model()
    seen, hidden = [], []
    model.lm_head.register_forward_hook(lambda m, inp, out: hidden.append(inp[0][0]))

    def inspect(logits, inputs):
        # Advantages as a leaf: the surrogate is positively homogeneous in A, so A·dloss/dA is each
        # token's term of the loss (also where a clip binds and dlogprob is 0).
        inputs.advantages = inputs.advantages.detach().clone().requires_grad_()
        seen.append((logits, inputs))

    loss_magnitude = 0.0
    with GradientMagnitudes(model, logits_module=model.lm_head) as mags:
        for row in flat.rows:
            packed = pack_row(row)
            loss = row_loss(model, packed, num_tokens, inspect)
            logits, inputs = seen.pop()
            top_ids = packed.sampler_top_ids.clamp(min=0).long()
            g_lp, g_top, g_adv = (g.detach().double().abs() for g in torch.autograd.grad(
                loss, (inputs.logprobs, inputs.top_logprobs, inputs.advantages), retain_graph=True))
            scattered = torch.zeros(logits.shape, dtype=torch.float64)
            scattered.scatter_add_(1, packed.target_ids.long()[:, None], g_lp[:, None]).scatter_add_(1, top_ids, g_top)
            mags.logits_magnitude(log_softmax_grad_magnitude(logits, scattered))
            loss.backward()
            # The loss moves by dloss/dlogprob times each log-prob's error (within γ_k·λ, see
            # logprob_error_magnitude), and its sum over tokens by γ_k·Σ|terms|.
            lp_magnitude = logprob_error_magnitude(hidden.pop(), model.lm_head.weight, logits, packed.target_ids)
            token_terms = inputs.advantages.detach().double().abs() * g_adv
            loss_magnitude += float(token_terms.sum() + (g_lp * lp_magnitude).sum())
    forwarded = max(sum(r.num_unique_tokens for r in plan.rows) for plan in (one, two))
    return {"k": forwarded, "grad": mags.result(), "loss": loss_magnitude}


@pytest.mark.parametrize("ac", [0, 1])
def test_two_rank_step_equals_one_process(two_ranks, step_error_scale, ac):
    # Bounds from the arithmetic (tests/tolerances.py): each of the two computations is within
    # γ_k × magnitude of the exact step, so they differ by at most twice that; k is the step's
    # forwarded tokens in the larger layout (219), the longest reduction (see step_error_scale).
    k, grad_magnitude = step_error_scale["k"], step_error_scale["grad"]
    for r in two_ranks:
        step, tensors = r[f"step_ac{ac}"], r["tensors"]
        assert step["sharded"], "FSDP2 did not shard the parameters"
        assert abs(step["loss"] - step["ref_loss"]) <= 2 * gamma(k) * step_error_scale["loss"], step
        hp, w0, ref_grads, ref_weights = tensors["adamw"], tensors["w0"], tensors["ref_grads"], tensors["ref_weights"]
        lr, eps = hp["lr"], hp["eps"]
        for name, grad in tensors[f"step_ac{ac}"]["grads"].items():
            g2, g1, weight = grad.double(), ref_grads[name].double(), tensors[f"step_ac{ac}"]["weights"][name].double()
            # Gradients: per element within 2·γ_k·Σ|terms| of the 1-process gradient.
            grad_bound = 2 * gamma(k) * grad_magnitude[name]
            assert ((g2 - g1).abs() <= grad_bound).all(), (name, float(((g2 - g1).abs() / grad_bound).max()))
            # The sharded AdamW step did what AdamW's arithmetic predicts from the 2-rank gradients ...
            rounding = adamw_first_step_rounding(w0[name], g2, lr, eps, hp["betas"])
            predicted = adamw_first_step(w0[name], g2, lr, eps, hp["weight_decay"])
            assert ((weight - predicted).abs() <= rounding).all(), (name, float(((weight - predicted).abs() / rounding).max()))
            # ... so its weights differ from the 1-process ones by what the gradient difference moves
            # through lr·g/(|g| + eps) (up to lr·|Δg|/eps where |g| is near eps), plus both roundings.
            moved = lr * (adam_direction(g2, eps) - adam_direction(g1, eps)).abs()
            weight_bound = moved + rounding + adamw_first_step_rounding(w0[name], g1, lr, eps, hp["betas"])
            gap = (weight - ref_weights[name].double()).abs()
            assert (gap <= weight_bound).all(), (name, float((gap / weight_bound).max()))


def test_gather_yields_every_full_weight_one_layer_at_a_time(two_ranks):
    for r in two_ranks:
        g = r["gather"]
        assert sorted(g["names"]) == sorted(g["ref_names"])
        assert g["max_diff"] == 0.0
        assert max(g["layers_per_group"]) == 1 and g["layers_per_group"].count(1) == g["num_layers"]


def test_step_feed_gives_every_rank_the_collected_plan(two_ranks):
    rank0, rank1 = two_ranks[0]["feed"], two_ranks[1]["feed"]
    assert len(rank0) >= 2, "the samples should fill more than one step at this budget"
    assert rank0 == rank1
    trained = sorted(i for step in rank0 for mb in step["ids"] for row in mb for i in row)
    assert trained == sorted(s.rollout_id for s in make_samples())


def test_config_fields_are_checked():
    from grpo_core.config import AsyncGRPOConfig, ConfigError

    with pytest.raises(ConfigError, match="compile_mode"):
        AsyncGRPOConfig(compile_mode="max-autotune")
    with pytest.raises(ConfigError, match="fsdp_cpu_offload"):
        AsyncGRPOConfig(fsdp_cpu_offload="yes")
    config = AsyncGRPOConfig(bf16=True, gradient_checkpointing=True, compile_mode="layers", fsdp_reshard_after_forward=False)
    settings = FSDPSettings.from_config(config, bf16=config.resolved_bf16(bf16_supported=False))
    assert settings == FSDPSettings(bf16=True, activation_checkpointing=True, reshard_after_forward=False,
                                    compile="layers", keep_weights_between_micro_batches=True)  # auto, one rank


def test_compile_mode_auto_compiles_layers_on_cuda_only():
    from grpo_core.config import AsyncGRPOConfig

    config = AsyncGRPOConfig()
    assert config.compile_mode == "auto"
    assert FSDPSettings.from_config(config, bf16=False, device_type="cpu").compile == "none"
    assert FSDPSettings.from_config(config, bf16=True, device_type="cuda").compile == "layers"
    for mode in ("none", "pointwise", "layers"):
        assert FSDPSettings.from_config(AsyncGRPOConfig(compile_mode=mode), bf16=True, device_type="cuda").compile == mode

"""The chunked log-prob head (``logprob_chunk_size``) gives the dense head's log-probs and gradients.

* ``head_token_logprobs`` against ``token_logprobs`` of the full logits (fp64, top ids, candidate
  sets, a bias): values and the gradients of hidden states, weight and bias;
* ``row_logprobs`` on a packed tree row of a tiny Qwen3 (fp64): the same log-probs and every weight's
  gradient as the dense head, and the head really sees no positions;
* the trainer: ``logprob_chunk_size`` reaches its micro-batch, the dense and chunked steps agree, and
  the chosen attention backend is logged as the run's ``resolved.attention_backend`` tag;
* under FSDP2 (two gloo ranks, with and without activation checkpointing): the chunked head's step
  gives the gradients of the dense one-process step;
* the config's rule for ``auto``.

Bounds come from the arithmetic (``tests/tolerances.py``): the two heads compute the same numbers,
row by row, except that the weight gradient's sum over tokens is split per chunk and the matmuls may
block differently. Each side is within γ_K·magnitude of the exact value (K: the longest chain of
reductions, first order), so they differ by at most twice that.

    .venv/bin/python -m pytest -q tests/test_logprob_head.py
"""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from grpo_core.config import AUTO_CHUNK_LOGITS, AUTO_DENSE_MAX_LOGITS, AsyncGRPOConfig, ConfigError
from grpo_core.models.attention import tree as ta
from grpo_core.models.head.lm_head import output_head
from grpo_core.models.head.reference import head_token_logprobs, token_logprobs
from grpo_core.packing.collator import pack_row
from grpo_core.packing.trie import TreeRow
from grpo_core.rollout.types import RolloutSample
from grpo_core.training.forward import row_logprobs
from grpo_core.training.loss import LossConfig, LossInputs, grpo_loss
from tests.test_checkpoint import model_path, train_rows  # noqa: F401 - fixtures
from tests.test_fsdp import step_error_scale  # noqa: F401 - fixture
from tests.tolerances import GradientMagnitudes, gamma, log_softmax_grad_magnitude, logprob_error_magnitude

F64 = torch.float64


# ---- the pure head -----------------------------------------------------------------------------------
def head_case(t: int = 11, d: int = 6, v: int = 13, n: int = 3, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(t, d, generator=gen, dtype=F64)
    weight = torch.randn(v, d, generator=gen, dtype=F64)
    bias = torch.randn(v, generator=gen, dtype=F64)
    masks = torch.rand(t, v, generator=gen) > 0.3
    targets = torch.tensor([int(torch.nonzero(row)[0]) for row in masks])  # the sampled token is in its set
    top_ids = torch.randint(0, v, (t, n), generator=gen)
    scores = torch.randn(t, generator=gen, dtype=F64), torch.randn(t, n, generator=gen, dtype=F64)
    return hidden, weight, bias, targets, top_ids, masks, scores


def weighted(lp: torch.Tensor, top: torch.Tensor, scores) -> torch.Tensor:
    """A loss of both outputs; top ids outside their set have -inf log-probs and stay out of it."""
    return (scores[0] * lp).sum() + torch.where(torch.isfinite(top), top * scores[1], 0.0).sum()


def head_bounds(hidden, weight, bias, targets, top_ids, masks, scores, temperature: float):
    """Twice γ_K times the magnitudes of: each log-prob, each top log-prob, and each entry of the
    gradients of hidden, weight and bias (first-order error analysis, both sides counted).

    The bias is a weight column against a hidden column of ones. Logits z = h·Wᵀ/T (a dot of d + 1
    terms) err by γ·(|h|·|W|ᵀ)/T; a log-prob by γ·λ (``logprob_error_magnitude``). The logits'
    gradient G = Σ scores·(e − p) has rounding magnitude ``log_softmax_grad_magnitude`` plus what
    the logits' errors do to p: |Δp_v| <= 2·p_v·max|Δz|, at most 2·p_v·λ per unit score. Then
    dh = G·W/T sums V terms, dW = Gᵀ·h/T sums T terms.
    """
    t, d = hidden.shape
    v = weight.shape[0]
    h1 = torch.cat([hidden, torch.ones(t, 1, dtype=F64)], 1) / temperature
    w1 = torch.cat([weight, bias[:, None]], 1)
    z = (h1 @ w1.T).masked_fill(~masks, float("-inf"))
    finite = torch.where(masks, z, torch.zeros_like(z))  # magnitudes ignore ids outside the set
    lam = logprob_error_magnitude(h1, w1, finite, targets)
    lam_top = torch.stack([logprob_error_magnitude(h1, w1, finite, top_ids[:, j]) for j in range(top_ids.shape[1])], 1)
    in_set = masks.gather(1, top_ids)
    upstream = torch.zeros(t, v, dtype=F64).scatter_add_(1, targets[:, None], scores[0].abs()[:, None])
    upstream.scatter_add_(1, top_ids, scores[1].abs() * in_set)
    p = torch.softmax(z, -1)
    g_mag = log_softmax_grad_magnitude(z, upstream) + 2 * upstream.sum(-1, keepdim=True) * p * lam.max()
    k = (d + 1) + 2 * v + t + 16
    bound = 2 * gamma(k, F64)
    grad_h = bound * (g_mag @ w1.abs())[:, :d] / temperature
    grad_w1 = bound * (g_mag.T @ h1.abs())
    return bound * lam, bound * lam_top, grad_h, grad_w1[:, :d], grad_w1[:, d]


@pytest.mark.parametrize("chunk", [1, 3, 11, 20])
def test_chunked_head_equals_the_dense_head(chunk):
    hidden, weight, bias, targets, top_ids, masks, scores = head_case()
    temperature = 0.7
    results = []
    for chunked in (False, True):
        h, w, b = (x.clone().requires_grad_() for x in (hidden, weight, bias))
        if chunked:
            lp, top = head_token_logprobs(h, w, targets, temperature, top_ids, masks, chunk_size=chunk, head_bias=b)
        else:
            lp, top = token_logprobs(F.linear(h, w, b), targets, temperature, top_ids, masks)
        weighted(lp, top, scores).backward()
        results.append((lp.detach(), top.detach(), h.grad, w.grad, b.grad))
    assert_heads_agree(results, (hidden, weight, bias, targets, top_ids, masks, scores), temperature)


def assert_heads_agree(results, case, temperature: float, num_grads: int = 3) -> None:
    """Two heads' ``(log-probs, top log-probs, grad hidden, grad weight, grad bias)`` on ``case`` (``head_case``)
    agree within ``head_bounds``; top ids outside their set are -inf on both; the first ``num_grads``
    gradients are compared."""
    hidden, weight, bias, targets, top_ids, masks, scores = case
    (lp0, top0, *g0), (lp1, top1, *g1) = results
    b_lp, b_top, *b_grads = head_bounds(hidden, weight, bias, targets, top_ids, masks, scores, temperature)
    assert ((lp0 - lp1).abs() <= b_lp).all()
    outside = ~masks.gather(1, top_ids)
    assert torch.equal(torch.isinf(top0), outside) and torch.equal(torch.isinf(top1), outside)
    assert ((top0 - top1).abs()[~outside] <= b_top[~outside]).all()
    for a, c, bound in list(zip(g0, g1, b_grads))[:num_grads]:
        assert torch.isfinite(c).all() and ((a - c).abs() <= bound).all(), float(((a - c).abs() / bound).max())


def test_chunked_head_without_tokens_or_gradients():
    hidden, weight, bias, targets, top_ids, masks, _ = head_case(t=4)
    lp, top = head_token_logprobs(hidden[:0], weight, targets[:0], 1.0, top_ids[:0], masks[:0], chunk_size=2)
    assert lp.shape == (0,) and top.shape == (0, 3)
    with torch.no_grad():  # evaluation: no recompute, the same values
        a, _ = head_token_logprobs(hidden, weight, targets, 1.0, chunk_size=3)
    b, _ = token_logprobs(hidden @ weight.T, targets, 1.0)
    assert a.shape == b.shape == (4,)
    with pytest.raises(ValueError, match="chunk_size"):
        head_token_logprobs(hidden, weight, targets, 1.0, chunk_size=0)


# ---- the head on a model ----------------------------------------------------------------------------
VOCAB = 24


def tiny_qwen3(dtype=F64):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=4, tie_word_embeddings=True,
                         max_position_embeddings=128)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config).to(dtype)
    with torch.no_grad():  # larger than the default init, so that log-probs are far from uniform
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.4)
    ta.enable_tree_attention(model, backend="reference")
    return model


def tree_samples(vocab: int, seed: int = 0, n_top: int = 3) -> list[RolloutSample]:
    """Two groups sharing prompts, completions forking from shared stems; top-N sampler ids."""
    rng = np.random.default_rng(seed)
    samples = []
    for g in range(2):
        prompt, stem = rng.integers(0, vocab, 6), rng.integers(0, vocab, 4)
        for r in range(3):
            comp = np.concatenate([stem[: int(rng.integers(0, 5))], rng.integers(0, vocab, int(rng.integers(2, 7)))])
            tokens = np.concatenate([prompt, comp]).astype(np.int32)
            mask = np.zeros(len(tokens), dtype=bool)
            mask[len(prompt):] = True
            n = int(mask.sum())
            samples.append(RolloutSample(
                token_ids=tokens, completion_mask=mask, advantage=float(rng.normal()), reward=0.0,
                sampler_logprobs=np.where(mask, rng.uniform(-3.2, -2.8, len(tokens)), 0.0).astype(np.float32),
                group_id=g, row_index=g, epoch=0, rollout_id=f"{g}-{r}", policy_version=0,
                sampler_top_ids=rng.integers(0, vocab, (n, n_top)).astype(np.int32),
                sampler_top_logprobs=np.full((n, n_top), -3.0, np.float32)))
    return samples


def packed_row(vocab: int):
    row = TreeRow()
    for s in tree_samples(vocab):
        row.add(s)
    return pack_row(row)


def error_scale(model, packed, loss_of) -> tuple[torch.Tensor, dict[str, torch.Tensor], int]:
    """The dense head's magnitudes for one row: per log-prob λ, per weight element Σ|terms| of its
    gradient (``GradientMagnitudes``, the logits' gradient taken before its cancellation), and K."""
    kept = []
    handle = model.lm_head.register_forward_hook(lambda m, inp, out: kept.append((inp[0][0], out[0])))
    top_ids = packed.sampler_top_ids.clamp(min=0)
    with GradientMagnitudes(model, logits_module=model.lm_head) as mags:
        head = row_logprobs(model, packed, 1.0, top_ids=top_ids)
        loss = loss_of(head)
        (hidden, logits), = kept
        g_lp, g_top = (g.detach().double().abs() for g in torch.autograd.grad(
            loss, (head.logprobs, head.top_logprobs), retain_graph=True))
        upstream = torch.zeros(logits.shape, dtype=F64)
        upstream.scatter_add_(1, packed.target_ids[:, None], g_lp[:, None]).scatter_add_(1, top_ids.long(), g_top)
        mags.logits_magnitude(log_softmax_grad_magnitude(logits, upstream))
        loss.backward()
    handle.remove()
    model.zero_grad(set_to_none=True)
    lam = logprob_error_magnitude(hidden, model.lm_head.weight, logits, packed.target_ids)
    config = model.config
    k = packed.num_tokens + config.vocab_size + config.hidden_size + config.intermediate_size + 64
    return lam, mags.result(), k


def plain_loss(head) -> torch.Tensor:
    weights = torch.linspace(-1.0, 1.0, head.top_logprobs.numel(), dtype=F64).reshape(head.top_logprobs.shape)
    return head.logprobs.sum() + (head.top_logprobs * weights).sum()


@pytest.mark.parametrize("fused", [False, True], ids=["reference", "fused"])
def test_row_logprobs_chunked_equal_dense_on_a_tree_row(fused):
    """Dense and chunked, each with the reference functions and with the fused ones (``models.head.fused``,
    which the CPU does not take by default), against the reference dense head's error scale."""
    model = tiny_qwen3()
    packed = packed_row(VOCAB)
    assert packed.num_trained > 5 and packed.attention.kv_index is not None  # a real tree, several chunks
    lam, magnitude, k = error_scale(model, packed, plain_loss)
    seen = []
    model.lm_head.register_forward_hook(lambda m, args, out: seen.append(out.shape[1]))  # positions projected
    runs = []
    for chunk in (None, 2):
        model.zero_grad(set_to_none=True)
        head = row_logprobs(model, packed, 1.0, top_ids=packed.sampler_top_ids.clamp(min=0), chunk_size=chunk,
                            fused=fused)
        assert head.anchor is None  # the row trains tokens
        plain_loss(head).backward()
        runs.append((head.logprobs.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    assert seen == [packed.num_trained, 0]  # the chunked run's head projected nothing itself
    model.zero_grad(set_to_none=True)
    reference = row_logprobs(model, packed, 1.0, top_ids=packed.sampler_top_ids.clamp(min=0), fused=False)
    plain_loss(reference).backward()
    g_ref = {n: p.grad.clone() for n, p in model.named_parameters()}
    for lp1, g1 in runs:
        assert ((reference.logprobs.detach() - lp1).abs() <= 2 * gamma(k, F64) * lam).all()
        for name, grad in g_ref.items():
            bound = 2 * gamma(k, F64) * magnitude[name]
            assert ((grad - g1[name]).abs() <= bound).all(), (name, float(((grad - g1[name]).abs() / bound).max()))


def test_chunked_head_refuses_models_that_rescale_logits():
    model = tiny_qwen3()
    assert output_head(model) is model.lm_head
    model.config.final_logit_softcapping = 30.0
    with pytest.raises(ValueError, match="logprob_chunk_size.*final_logit_softcapping"):
        output_head(model)


# ---- the config and the trainer ---------------------------------------------------------------------
def test_resolved_chunk_size():
    none, fixed, auto = (AsyncGRPOConfig(logprob_chunk_size=c) for c in (None, 4, "auto"))
    assert none.resolved_logprob_chunk_size(10**6, 151936) is None
    assert fixed.resolved_logprob_chunk_size(4, 100) is None  # one chunk is the dense head
    assert fixed.resolved_logprob_chunk_size(5, 100) == 4
    vocab = 151936
    dense_max = AUTO_DENSE_MAX_LOGITS // vocab
    assert auto.resolved_logprob_chunk_size(dense_max, vocab) is None
    assert auto.resolved_logprob_chunk_size(dense_max + 1, vocab) == AUTO_CHUNK_LOGITS // vocab == 3533
    for bad in (0, -3, "big", True, 2.0):
        with pytest.raises(ConfigError, match="logprob_chunk_size"):
            AsyncGRPOConfig(logprob_chunk_size=bad)


class TagsTracker:
    def __init__(self):
        self.tags: dict = {}

    def set_tags(self, tags):
        self.tags.update(tags)

    def close(self, status="FINISHED"):
        pass


def make_trainer(model_path, rows, tmp_path, **overrides):
    from grpo_core.rewards import accuracy_reward
    from grpo_core.training.trainer import AsyncGRPOTrainer

    args = AsyncGRPOConfig(output_dir=str(tmp_path), report_to="none", **overrides)
    trainer = AsyncGRPOTrainer(model=model_path, reward_funcs=accuracy_reward, train_dataset=rows, args=args,
                               tracker=TagsTracker())
    trainer.run.server = SimpleNamespace(candidate_sets=False)  # what _setup learns from the server (MicroBatch keeps False)
    trainer.model.double()  # fp64 for tight bounds; the optimizer never steps here
    return trainer


def test_trainer_logs_its_backend_and_trains_with_the_chunked_head(model_path, train_rows, tmp_path):  # noqa: F811
    dense = make_trainer(model_path, train_rows, tmp_path / "dense")
    chunked = make_trainer(model_path, train_rows, tmp_path / "chunked", logprob_chunk_size=2)
    assert dense.tracker.tags["resolved.attention_backend"] == "reference"  # the CPU's only backend
    assert dense.tracker.tags["resolved.compile_mode"] == "none"  # auto stays eager on the CPU
    assert dense.tracker.tags["resolved.bf16"] == "False"  # bf16=None trains in fp32 on the CPU
    vocab = dense.vocab_size
    packed = packed_row(vocab)
    num_tokens = packed.num_trained + 3

    def trainer_loss(head):  # the trainer's objective on the dense head, for its magnitudes
        inputs = LossInputs(logprobs=head.logprobs, sampler_logprobs=packed.sampler_logprobs.double(),
                            advantages=packed.advantages.double(), top_logprobs=head.top_logprobs,
                            sampler_top_logprobs=packed.sampler_top_logprobs.double(), top_valid=packed.top_valid)
        return grpo_loss(inputs, LossConfig.from_config(dense.args), num_tokens)[0]

    lam, magnitude, k = error_scale(dense.model, packed, trainer_loss)
    heads_seen = []
    chunked.model.lm_head.register_forward_hook(lambda m, args, out: heads_seen.append(out.shape[1]))
    grads = []
    for trainer in (dense, chunked):
        trainer.micro_batch.run(packed, num_tokens, packed.num_tokens)
        grads.append({n: p.grad.clone() for n, p in trainer.model.named_parameters()})
    assert heads_seen == [0]
    for name, grad in grads[0].items():
        bound = 2 * gamma(k, F64) * magnitude[name]
        assert ((grad - grads[1][name]).abs() <= bound).all(), name
    with pytest.raises(ValueError, match="attention_backend='flash_attn_cute'"):
        make_trainer(model_path, train_rows, tmp_path / "fa4", attention_backend="flash_attn_cute")


# ---- under FSDP2: two gloo ranks, the chunked head, against one process with the dense head -----------
def _two_rank_chunked_steps(rank: int, port: int, out_dir: str) -> None:
    import os

    import torch.distributed as dist

    from grpo_core.models.fsdp import FSDPSettings, shard_policy
    from grpo_core.packing.planner import plan_step
    from grpo_core.ranks import DistInfo, init_distributed
    from tests.test_fsdp import full, make_samples, tiny_model

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    init_distributed(DistInfo.from_env(), torch.device("cpu"), timeout_s=120)
    one = plan_step(make_samples(), world_size=1, gradient_accumulation_steps=2, token_budget=200)
    two = plan_step(make_samples(), world_size=2, gradient_accumulation_steps=2, token_budget=200)
    num_tokens = sum(r.num_trained_tokens for r in one.rows)
    config = LossConfig.from_config(AsyncGRPOConfig())

    def step(model, rows, chunk, fused=False):
        for row in rows:
            packed = pack_row(row)
            head = row_logprobs(model, packed, 1.0, top_ids=packed.sampler_top_ids.clamp(min=0), chunk_size=chunk,
                                fused=fused)
            inputs = LossInputs(logprobs=head.logprobs, sampler_logprobs=packed.sampler_logprobs,
                                advantages=packed.advantages, top_logprobs=head.top_logprobs,
                                sampler_top_logprobs=packed.sampler_top_logprobs, top_valid=packed.top_valid)
            loss = grpo_loss(inputs, config, num_tokens)[0]
            loss.backward()
        return {n: full(p.grad).clone() for n, p in model.named_parameters()}

    result = {"ref": step(tiny_model(), one.rows, None)}
    for ac, fused in itertools.product((False, True), (False, True)):
        model = shard_policy(tiny_model(), FSDPSettings(activation_checkpointing=ac), torch.device("cpu"))
        assert all(hasattr(p, "full_tensor") for p in model.parameters()), "FSDP2 did not shard"
        result[f"chunked_ac{int(ac)}_fused{int(fused)}"] = step(model, two.rows_for_rank(rank), 3, fused)
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


def test_two_fsdp_ranks_with_the_chunked_head_equal_one_process_with_the_dense_head(tmp_path, step_error_scale):  # noqa: F811
    """The chunked head projects inside the root unit's forward, with its gathered weight, and its
    backward finds the weight gathered again (the root reshards after forward here); the step's gradients are
    the dense 1-process step's, within the bounds of tests/test_fsdp.py (``step_error_scale``: the two differ
    only in the order of the step's sums). Both heads: the reference functions and ``models.head.fused``, whose
    backward uses the weight it saved in forward."""
    from tests.child_processes import run_ranks

    from grpo_core.vllm_server.process import free_port

    run_ranks(_two_rank_chunked_steps, (free_port(), str(tmp_path)), nprocs=2)
    k, magnitude = step_error_scale["k"], step_error_scale["grad"]
    for rank in range(2):
        result = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        assert len(result) == 5
        for variant in (v for v in result if v != "ref"):
            for name, grad in result[variant].items():
                bound = 2 * gamma(k) * magnitude[name]
                gap = (grad.double() - result["ref"][name].double()).abs()
                assert (gap <= bound).all(), (variant, name, float((gap / bound).max()))

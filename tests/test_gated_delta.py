"""Gated DeltaNet hybrids in packed rows are exact: tiny random Qwen3.5 and Qwen3-Next (and Qwen3.5-MoE,
OLMo hybrid), CPU.

* the kernels: the chunked delta rule equals the token-by-token recurrence, and the tree rule /
  tree convolution equal the recurrence / convolution run along every segment's path (fp64);
* the models, fp64: trained-token log-probs of a tree row (shared prompt, completions forking three
  levels deep, a segment longer than one 64-token chunk) and of a flat row equal each sample
  forwarded alone, and so do the gradients of every parameter. "Alone" is transformers' own layer
  code with the delta rule run token by token in fp64 (transformers' function computes in fp32
  whatever the model's dtype, which would cap the comparison at fp32 rounding);
* fp32 against transformers' unmodified path: equal up to fp32 rounding (~2e-5 in log-prob);
* changing one sibling's tokens leaves the other sibling's log-probs where they were; the stock
  transformers functions fail the comparison (so it can fail);
* the architecture check accepts these hybrids and names what it refuses.

Run: ``.venv/bin/python -m pytest tests/test_gated_delta.py -s`` (``-s`` prints the measured errors).
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import os
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from transformers import Lfm2Config, Lfm2ForCausalLM, Qwen3_5ForCausalLM, Qwen3_5TextConfig, Qwen3NextConfig, Qwen3NextForCausalLM

from grpo_core.models.attention import gated_delta as gd
from grpo_core.models.attention import hybrid
from grpo_core.models.attention import short_conv as sc
from grpo_core.models.attention import tree as ta
from grpo_core.models.attention.metadata import TreeAttentionMetadata
from grpo_core.models.attention.probe_rows import probe_meta
from grpo_core.models.attention.tree_conv_plan import conv_context, conv_indices
from grpo_core.packing.collator import pack_row
from grpo_core.packing.planner import plan_step
from grpo_core.packing.trie import TreeRow
from tests.test_packing_trie import make_sample, sample_sets

VOCAB = 64


pytestmark = pytest.mark.usefixtures("one_torch_thread")


# ------------------------------------------------------------------------------------------ kernels
def recurrence(q, k, v, g, beta, state):
    """The gated delta rule one token at a time: ``[T, H, D]`` inputs (q scaled, q/k normalised)."""
    outs = []
    for t in range(q.shape[0]):
        state = state * g[t].exp()[:, None, None]
        correction = beta[t][:, None] * (v[t] - torch.einsum("hkv,hk->hv", state, k[t]))
        state = state + k[t][:, :, None] * correction[:, None, :]
        outs.append(torch.einsum("hkv,hk->hv", state, q[t]))
    return torch.stack(outs), state


def random_gdn_inputs(u: int, heads: int = 2, dim: int = 8, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(u, heads, dim, generator=gen, dtype=torch.float64) for _ in range(3))
    g = -F.softplus(torch.randn(u, heads, generator=gen, dtype=torch.float64))
    beta = torch.rand(u, heads, generator=gen, dtype=torch.float64)
    return q, k, v, g, beta


@pytest.mark.parametrize("length, chunk", [(1, 64), (37, 8), (150, 64)])
def test_chunked_rule_equals_recurrence(length, chunk):
    q, k, v, g, beta = random_gdn_inputs(length)
    q, k = gd.l2_normalize(q) * 8**-0.5, gd.l2_normalize(k)
    state = torch.randn(2, 8, 8, dtype=torch.float64)
    expected, expected_state = recurrence(q, k, v, g, beta, state)
    batch = lambda x: x.transpose(0, 1).unsqueeze(0)  # noqa: E731  [T, H, ...] -> [1, H, T, ...]
    out, final = gd.chunked_delta_rule(batch(q), batch(k), batch(v), g.T[None], beta.T[None], state[None], chunk=chunk)
    torch.testing.assert_close(out[0].transpose(0, 1), expected, atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(final[0], expected_state, atol=1e-12, rtol=1e-10)


def paths_of(meta):
    cu_q, cu_k = meta.cu_seq_q.tolist(), meta.cu_seq_k.tolist()
    for s in range(len(cu_q) - 1):
        own = torch.arange(cu_q[s], cu_q[s + 1])
        path = own if meta.kv_index is None else meta.kv_index[cu_k[s] : cu_k[s + 1]]
        yield own, path


@given(samples=sample_sets(vocab_max=4))
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_tree_kernels_follow_each_path(samples):
    """Every segment's outputs are those of its root-to-segment path run alone from a zero state."""
    row = TreeRow()
    for s in samples:
        row.add(s)
    meta = pack_row(row).attention
    u = int(meta.cu_seq_q[-1])
    q, k, v, g, beta = random_gdn_inputs(u)
    out = gd.tree_gated_delta_rule(q, k, v, g, beta, meta, l2norm=True)
    x = torch.randn(1, 6, u, dtype=torch.float64)
    weight, bias = torch.randn(6, 4, dtype=torch.float64), torch.randn(6, dtype=torch.float64)
    conv = sc.tree_causal_conv1d(x, weight, bias, meta)
    for own, path in paths_of(meta):
        n = len(own)
        alone, _ = recurrence(gd.l2_normalize(q[path]) * 8**-0.5, gd.l2_normalize(k[path]), v[path], g[path], beta[path],
                              torch.zeros(2, 8, 8, dtype=torch.float64))
        torch.testing.assert_close(out[own], alone[-n:], atol=1e-10, rtol=1e-8)
        plain = F.conv1d(x[:, :, path], weight[:, None], bias, padding=3, groups=6)[:, :, : len(path)]
        torch.testing.assert_close(conv[:, :, own], plain[:, :, -n:], atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(conv, sc.tree_causal_conv1d_grouped(x, weight, bias, meta), atol=1e-12, rtol=1e-10)


def test_conv_gradients_match_the_grouped_convolution():
    row = TreeRow()
    for tail in ([5, 6, 7], [9, 9, 2, 4], [9, 9, 3]):
        row.add(make_sample([1, 2, 3, 4] + tail, len(tail)))
    meta = pack_row(row).attention
    u = int(meta.cu_seq_q[-1])
    gen = torch.Generator().manual_seed(3)
    inputs = [torch.randn(1, 5, u, generator=gen, dtype=torch.float64), torch.randn(5, 4, generator=gen, dtype=torch.float64),
              torch.randn(5, generator=gen, dtype=torch.float64)]
    grads = []
    for fn in (sc.tree_causal_conv1d, sc.tree_causal_conv1d_grouped):
        xs = [t.clone().requires_grad_() for t in inputs]
        (fn(xs[0], xs[1], xs[2], meta) ** 2).sum().backward()
        grads.append([t.grad for t in xs])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-8)


def test_conv_window_crosses_into_the_parent_never_the_sibling():
    row = TreeRow()
    row.add(make_sample([1, 2, 3, 4, 5, 6, 7], 2))
    row.add(make_sample([1, 2, 3, 4, 9, 9, 2], 2))
    row.add(make_sample([1, 2, 3, 4, 9, 9, 3, 4], 2))
    meta = pack_row(row).attention
    assert gd.segment_parents(meta).tolist() == [-1, 0, 0, 2, 2]
    source, keep = conv_indices(meta, 4)
    # Segment 2 ([4 9] at row 6-7) reads the root's last three tokens, not segment 1 (rows 3-5).
    assert source.tolist()[12:17] == [0, 1, 2, 6, 7]
    # Segment 3 (row 8) reads its parent's two tokens and the root's last one.
    assert source.tolist()[17:21] == [2, 6, 7, 8]
    assert len(keep) == meta.cu_seq_q[-1]


def test_conv_context_reads_the_path_before_each_segment():
    """A root of 5 tokens (rows 0-4), a child of one token (5), its child (6-8), a second child (9-10): the context of
    the grandchild reaches past its one-token parent into the root."""
    meta = probe_meta(torch.device("cpu"), [5, 1, 3, 2])
    assert conv_context(meta, 4).tolist() == [[-1, -1, -1], [2, 3, 4], [3, 4, 5], [2, 3, 4]]
    assert conv_context(meta, 1).shape == (4, 0)
    source, _ = conv_indices(meta, 4)
    assert source.tolist()[:8] == [-1, -1, -1, 0, 1, 2, 3, 4] and source.tolist()[12:18] == [3, 4, 5, 6, 7, 8]


def test_a_rows_segment_tree_is_built_once_and_the_first_call_decides_its_chunk_plans(monkeypatch):
    """``segment_tree``: every layer reads the tree the first call built; ``plan_chunks=False`` (the benchmark's
    unplanned form) leaves ``plan_varlen_chunks`` uncalled."""
    cpu = torch.device("cpu")
    planned = []
    monkeypatch.setattr(gd, "plan_varlen_chunks", lambda cu, cu_cpu: planned.append(1) or cu)
    meta = probe_meta(cpu, [5, 1, 3, 2])
    tree = gd.segment_tree(meta, cpu, plan_chunks=False)
    assert planned == [] and gd.segment_tree(meta, cpu) is tree  # the later default call reads the first's
    gd.segment_tree(probe_meta(cpu, [5, 1, 3, 2]), cpu)
    assert len(planned) == 3  # one plan per depth


def test_a_row_of_roots_is_taken_as_it_is_and_a_tree_is_permuted_once():
    """A row of three unrelated samples is one depth in row order: no permutation in, none out, the one slice the row
    itself. A tree's row is put in depth order by one permutation, whose backward is the inverse gather, and cut into
    one slice per depth."""
    cpu = torch.device("cpu")
    cu = torch.tensor([0, 4, 9, 12], dtype=torch.int32)
    flat = gd.build_segment_tree(TreeAttentionMetadata(cu, cu, 5, 5, None), cpu)
    assert len(flat.depths) == 1 and flat.order is None and flat.unsort is None and flat.sizes == [12]
    x = torch.randn(12, 2)
    (whole,) = gd.depth_slices(x, flat)
    assert whole.data_ptr() == x.data_ptr() and whole.shape == x.shape
    tree = gd.build_segment_tree(probe_meta(cpu, [5, 1, 3, 2]), cpu)
    assert tree.sizes == [int(d.cu_seqlens_cpu[-1]) for d in tree.depths] and sum(tree.sizes) == 11
    assert tree.order is not None and tree.unsort is not None
    assert tree.order[tree.unsort].tolist() == list(range(11))
    slices = gd.depth_slices(torch.arange(11), tree)
    assert [s.tolist() for s in slices] == [p.tolist() for p in torch.split(tree.order, tree.sizes)]
    assert slices[1].tolist() == [5, 9, 10]
    # the gradient of a weighted sum of the slices lands on each row position, without accumulation
    y = torch.randn(11, 3, requires_grad=True)
    weights = torch.randn(11, 3)
    sum((s * w).sum() for s, w in zip(gd.depth_slices(y, tree), torch.split(weights, tree.sizes))).backward()
    torch.testing.assert_close(y.grad, weights[tree.unsort], atol=0, rtol=0)


def test_a_compiled_layer_keeps_the_input_preparation_in_its_graph():
    """Under ``torch.compile`` the delta rule's kernels break the graph (fla's are ``torch.compiler.disable``d, as the
    stand-in backend's are here). The break must come at ``run_segment_tree``, outside the loop over depths: a break
    inside that loop makes the compiler run the whole calling frame eagerly ("graph break in a for/while loop"), the
    l2 norms and casts before it included. Checked on a tree of three depths, the result equal to the eager call."""
    import torch._dynamo

    opaque = gd.GDNBackend("opaque", torch.compiler.disable(gd._reference_depth), needs_cuda=False)
    meta = probe_meta(torch.device("cpu"), [5, 1, 3, 2])
    xs = random_gdn_inputs(int(meta.cu_seq_q[-1]))
    rule = lambda *xs: gd.tree_gated_delta_rule(*xs, meta, l2norm=True, backend=opaque)  # noqa: E731
    torch._dynamo.reset()
    explained = torch._dynamo.explain(rule)(*xs)
    reasons = [str(b.reason) for b in explained.break_reasons]
    assert reasons and all("run_segment_tree" in r and "loop" not in r for r in reasons), reasons
    assert any("rsqrt" in str(graph.code) for graph in explained.graphs)  # the l2 norms were compiled
    torch.testing.assert_close(torch.compile(rule, backend="eager")(*xs), rule(*xs), atol=0, rtol=0)
    torch._dynamo.reset()


def test_plans_read_the_collators_host_copy_not_the_device():
    """Moved rows keep their host copy, and the per-row plans read it: no copy back from the device (a sync on a GPU).
    ``meta`` tensors stand in for the device here: reading them back would raise."""
    host = probe_meta(torch.device("cpu"), [5, 1, 3, 2])
    moved = host.to(torch.device("meta"))
    assert moved.on_host() is host and host.on_host() is host
    assert conv_context(moved, 4).tolist() == conv_context(host, 4).tolist()
    assert [d.cu_seqlens_cpu.tolist() for d in gd.build_segment_tree(moved, torch.device("cpu")).depths] == \
        [[0, 5], [0, 1, 3], [0, 3]]
    orphan = TreeAttentionMetadata(*(t.to("meta") for t in (host.cu_seq_q, host.cu_seq_k)), 5, 8, None)
    assert orphan.on_host() is None


def test_the_convolution_backend_follows_the_delta_rule_and_its_own_probe(monkeypatch, caplog):
    cpu = torch.device("cpu")
    asked = []
    monkeypatch.setattr(sc, "probe_conv", lambda *a, **k: asked.append(a) or 1e-3)
    assert sc.select_conv_backend("reference", cpu, 64, 4).name == "torch" and not asked
    assert sc.select_conv_backend("fla", cpu, 96, 3).name == "triton"  # the project's kernels first
    # the layers' width, both trees, and only the first kernel's probe where it passes
    assert [(a[0].name, *a[2:]) for a in asked] == [("triton", 96, 3, tree) for tree in sc.PROBE_TREES]
    # the Triton kernels failing their probe: fla's, with the reason in the log
    monkeypatch.setattr(sc, "probe_conv", lambda backend, *a, **k: 0.2 if backend.name == "triton" else 1e-3)
    with caplog.at_level("WARNING", logger=sc.__name__):
        assert sc.select_conv_backend("fla", cpu, 64, 4).name == "fla"
    assert "short convolutions run fla: triton's kernels are not usable here (probe error 2.00e-01)" in caplog.text
    caplog.clear()

    def missing(backend, *args, **kwargs):
        if backend.name == "fla":
            raise ModuleNotFoundError("No module named 'fla'")
        return 0.2

    monkeypatch.setattr(sc, "probe_conv", missing)
    with caplog.at_level("WARNING", logger=sc.__name__):
        assert sc.select_conv_backend("fla", cpu, 64, 4).name == "torch"
    assert "triton's kernels are not usable here (probe error 2.00e-01)" in caplog.text
    assert "fla's kernels are not usable here (ModuleNotFoundError: No module named 'fla')" in caplog.text
    assert "the short convolutions run the PyTorch form" in caplog.text
    gd.register_gdn_backend("reference", "cpu")
    assert sc.active_conv_backend().name == "torch"


def fla_conv_device() -> str | None:
    """Where flash-linear-attention's convolution can run here: CUDA, or the CPU under Triton's interpreter."""
    if importlib.util.find_spec("fla") is None:
        return None
    if torch.cuda.is_available():
        return "cuda"
    return "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else None


@pytest.mark.skipif(fla_conv_device() is None, reason="needs flash-linear-attention and CUDA, or fla with Triton's "
                                                      "interpreter (TRITON_INTERPRET=1) on the CPU")
def test_fla_convolution_equals_the_pytorch_form_on_trees(monkeypatch):
    """fla's varlen convolution started from each segment's path context: output and gradients of input, weight and
    bias equal the PyTorch form in fp32, on forked trees (a context reaching past a short parent included)."""
    device = torch.device(fla_conv_device())
    if device.type == "cpu":  # the interpreter has no timer: the autotuner takes its first config
        import triton.runtime.autotuner as autotuner

        monkeypatch.setattr(autotuner.Autotuner, "do_bench", lambda self, fn, quantiles=None: [0.0, 0.0, 0.0],
                            raising=False)
    for seed in range(3):
        plan = plan_step(forked_samples(seed), world_size=1, gradient_accumulation_steps=1, token_budget=10_000)
        meta = pack_row(plan.rows[0]).attention.to(device)
        u = int(meta.cu_seq_q[-1])
        gen = torch.Generator().manual_seed(seed)
        inputs = [torch.randn(1, u, 24, generator=gen).transpose(1, 2), torch.randn(24, 4, generator=gen),
                  torch.randn(24, generator=gen)]
        grad = torch.randn(1, 24, u, generator=gen).to(device)
        for activation in ("silu", None, "gelu"):
            results = []
            for backend in (sc.CONV_BACKENDS["fla"], sc.CONV_BACKENDS["torch"]):
                xs = [t.to(device).requires_grad_() for t in inputs]
                out = sc.tree_conv(*xs, activation, meta, backend=backend)
                out.backward(grad)
                results.append([out.detach()] + [t.grad for t in xs])
            for a, b in zip(*results):
                torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


# ------------------------------------------------------------------------------------------ models
LAYERS = ["linear_attention"] * 3 + ["full_attention"]
COMMON = dict(vocab_size=VOCAB, hidden_size=128, intermediate_size=128, num_hidden_layers=4, num_attention_heads=2,
              num_key_value_heads=1, head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4,
              linear_key_head_dim=32, linear_value_head_dim=32, linear_conv_kernel_dim=4, layer_types=LAYERS,
              max_position_embeddings=512)


def tiny_hybrid(kind: str, dtype: torch.dtype = torch.float64) -> tuple[torch.nn.Module, torch.nn.Module]:
    """``(packed, alone)``: the same random weights, tree packing enabled on the first."""
    torch.manual_seed(0)
    if kind == "qwen3_5":
        model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**COMMON))
    else:  # experts as a loop: the grouped-matmul kernel has no fp64
        model = Qwen3NextForCausalLM(Qwen3NextConfig(**COMMON, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                                                     shared_expert_intermediate_size=64, experts_implementation="eager"))
    with torch.no_grad():  # wider than the default init, so that log-probs are far from uniform
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.12)
    model = model.to(dtype).eval()
    alone = copy.deepcopy(model)
    alone.set_attn_implementation("sdpa")
    ta.enable_tree_attention(model, backend="reference", linear_backend="reference")
    return model, alone


MODELS = {kind: tiny_hybrid(kind) for kind in ("qwen3_5", "qwen3_next")}


def oracle_delta_rule(query, key, value, g, beta, chunk_size=64, initial_state=None, output_final_state=False,
                      use_qk_l2norm_in_kernel=False, **kwargs):
    """The delta rule token by token in the inputs' dtype: transformers' own function computes in fp32
    whatever the model's dtype, which would cap an fp64 comparison at fp32 accuracy."""
    assert initial_state is None and not output_final_state and query.shape[0] == 1
    q, k = query[0], key[0]
    if use_qk_l2norm_in_kernel:
        q, k = (x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6) for x in (q, k))
    state = q.new_zeros(q.shape[1], q.shape[2], value.shape[-1])
    # The layer computes g from ``A_log.float()``: widen it, or exp(g) would round at fp32.
    out, _ = recurrence(q * q.shape[-1] ** -0.5, k, value[0], g[0].to(value.dtype), beta[0], state)
    return out.unsqueeze(0), None


@contextlib.contextmanager
def fp64_oracle(model):
    """Unpacked forwards of ``model`` run transformers' layers with ``oracle_delta_rule`` inside."""
    module = sys.modules[type(model.model.layers[0].linear_attn).__module__]
    patched = getattr(module, hybrid.CHUNK_FN)
    setattr(module, hybrid.CHUNK_FN, oracle_delta_rule)
    try:
        yield
    finally:
        setattr(module, hybrid.CHUNK_FN, patched)


def forked_samples(seed: int = 0):
    """Two groups. Group 0 forks three levels deep: prompt -> stems -> completions, with a tool-result
    hole in the trained mask; one completion is longer than a 64-token chunk. Group 1 is a plain pair."""
    rng = np.random.default_rng(seed)
    tok = lambda n: list(rng.integers(0, VOCAB, n))  # noqa: E731
    prompt, stem_a, stem_b = tok(11), tok(6), tok(4)
    tails = [stem_a + tok(5), stem_a + tok(9), stem_a + tok(70), stem_b + tok(7), stem_b + tok(3)]
    samples = []
    for i, completion in enumerate(tails):
        mask = [False] * len(prompt) + [True] * len(completion)
        if i == 1:
            mask[len(prompt) + 7 : len(prompt) + 9] = [False, False]  # a tool result inside the completion
        samples.append(make_sample(prompt + completion, mask, group_id=0, advantage=float(rng.normal())))
    other = tok(8)
    for n in (6, 12):
        samples.append(make_sample(other + tok(n), n, group_id=1, advantage=float(rng.normal())))
    return samples


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits, -1).gather(-1, targets[:, None])[:, 0]


def packed_logprobs(model, samples, flat: bool):
    plan = plan_step(samples, world_size=1, gradient_accumulation_steps=1, token_budget=10_000, flat=flat)
    assert not plan.leftover and len(plan.rows) == 1
    row = pack_row(plan.rows[0])
    out = model(**row.model_inputs(), logits_to_keep=row.logit_index)
    return token_logprobs(out.logits[0], row.target_ids), row


def alone_logprobs(model, samples) -> torch.Tensor:
    result = []
    for s in samples:
        trained = np.flatnonzero(s.completion_mask)
        ids = torch.as_tensor(s.token_ids, dtype=torch.long)
        logits = model(input_ids=ids[None], use_cache=False).logits[0]
        result.append(token_logprobs(logits[trained - 1], ids[trained]))
    return torch.cat(result)


def compare(model, alone, samples, flat: bool, oracle: bool) -> tuple[float, float, str]:
    """Max |log-prob diff| and the largest per-parameter relative gradient difference (and where).

    ``oracle``: the unpacked forwards run ``oracle_delta_rule`` (only they: the patched module
    functions are shared by both models)."""
    model.zero_grad()
    alone.zero_grad()
    packed, row = packed_logprobs(model, samples, flat)
    if not flat:
        depths = gd.build_segment_tree(row.attention, torch.device("cpu")).depths
        assert len(depths) >= 3, "the tree row must fork three levels deep"
    with fp64_oracle(alone) if oracle else contextlib.nullcontext():
        expected = alone_logprobs(alone, samples)
    assert packed.shape == expected.shape
    assert expected.std() > 0.5, "log-probs too close to uniform to test anything"
    adv = torch.tensor([s.advantage for s in samples], dtype=packed.dtype)
    weight = adv[row.sample_index] + 0.01 * torch.arange(row.num_trained)  # a GRPO-like loss
    (packed * weight).sum().backward()
    (expected * weight).sum().backward()
    g_packed = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    g_alone = {n: p.grad for n, p in alone.named_parameters() if p.grad is not None}
    assert g_packed.keys() == g_alone.keys()  # MoE experts no token was routed to have no gradient in either
    rel = {n: ((g_packed[n] - g_alone[n]).norm() / g_alone[n].norm().clamp(min=1e-30)).item() for n in g_alone}
    worst = max(rel, key=rel.get)
    return (packed - expected).abs().max().item(), rel[worst], worst


@pytest.mark.parametrize("flat", [False, True], ids=["tree", "flat"])
@pytest.mark.parametrize("kind", list(MODELS))
def test_packed_row_equals_each_sample_alone(kind, flat):
    model, alone = MODELS[kind]
    logprob_diff, grad_rel, where = compare(model, alone, forked_samples(), flat, oracle=True)
    print(f"\nfp64 {kind} {'flat' if flat else 'tree'}: max |logprob diff| {logprob_diff:.1e}, "
          f"max relative grad diff {grad_rel:.1e} ({where})")
    assert logprob_diff <= 1e-5
    assert grad_rel <= 1e-4


@pytest.mark.parametrize("kind", list(MODELS))
def test_fp32_against_stock_transformers(kind):
    """fp32 against transformers' unmodified path: equal up to fp32 rounding. Measured: the stock fp32
    and fp64 forwards of the same model already differ by ~2e-5 in log-prob, so 1e-4 here."""
    model, alone = (m.float() for m in copy.deepcopy(MODELS[kind]))
    for flat in (False, True):
        logprob_diff, grad_rel, where = compare(model, alone, forked_samples(), flat, oracle=False)
        print(f"\nfp32 {kind} {'flat' if flat else 'tree'}: max |logprob diff| {logprob_diff:.1e}, "
              f"max relative grad diff {grad_rel:.1e} ({where})")
        assert logprob_diff <= 1e-4
        assert grad_rel <= 1e-3


def other_family(kind: str) -> torch.nn.Module:
    from transformers import OlmoHybridConfig, OlmoHybridForCausalLM, Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    torch.manual_seed(1)
    if kind == "qwen3_5_moe":
        return Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(
            **COMMON, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, shared_expert_intermediate_size=64,
            experts_implementation="eager"))
    return OlmoHybridForCausalLM(OlmoHybridConfig(**COMMON, pad_token_id=0, bos_token_id=1, eos_token_id=1))


@pytest.mark.parametrize("kind", ["qwen3_5_moe", "olmo_hybrid"])
def test_other_gdn_families(kind):
    """The same patches reach Qwen3.5-MoE's and OLMo hybrid's GDN layers. fp64: in fp32 a near-tie in
    MoE routing flips with rounding (the stock fp32 Qwen3.5-MoE alone is 8e-5 off its fp64 self)."""
    model = other_family(kind)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.12)
    model = model.double().eval()
    alone = copy.deepcopy(model)
    alone.set_attn_implementation("sdpa")
    ta.enable_tree_attention(model, backend="reference", linear_backend="reference")
    assert len(hybrid.gated_delta_layers(model)) == 3
    logprob_diff, grad_rel, where = compare(model, alone, forked_samples(), flat=False, oracle=True)
    print(f"\nfp64 {kind} tree: max |logprob diff| {logprob_diff:.1e}, max relative grad diff {grad_rel:.1e} ({where})")
    assert logprob_diff <= 1e-5
    assert grad_rel <= 1e-4


@pytest.mark.parametrize("kind", list(MODELS))
def test_changing_a_sibling_leaves_the_other_unchanged(kind):
    model, _ = MODELS[kind]
    samples = forked_samples()
    changed = copy.deepcopy(samples)
    ids = changed[0].token_ids.copy()
    ids[-4:] = (ids[-4:] + 1) % VOCAB  # sample 0's last tokens; its siblings share the prompt and stem
    changed[0] = make_sample(ids, changed[0].completion_mask, group_id=0, advantage=changed[0].advantage)
    with torch.no_grad():
        before, row = packed_logprobs(model, samples, flat=False)
        after, row2 = packed_logprobs(model, changed, flat=False)
    assert torch.equal(row.sample_index, row2.sample_index)
    mine = row.sample_index == 0
    assert (before[mine] - after[mine]).abs().max() > 1e-3, "the changed sample itself must move"
    torch.testing.assert_close(before[~mine], after[~mine], atol=1e-12, rtol=0)


def test_stock_functions_get_packed_rows_wrong():
    """Without the patches a flat row of a GDN model leaks state across samples (so the tests can fail)."""
    model, alone = MODELS["qwen3_5"]
    samples = forked_samples()[-2:]
    module = sys.modules[type(model.model.layers[0].linear_attn).__module__]
    hybrid.unpatch_module(module)
    try:
        with torch.no_grad():
            packed, _ = packed_logprobs(model, samples, flat=True)
    finally:
        hybrid.patch_module(module)
    with torch.no_grad(), fp64_oracle(alone):
        assert (packed - alone_logprobs(alone, samples)).abs().max() > 1e-2


# ------------------------------------------------------------------------------------------ checks
def test_architecture_check_accepts_hybrids_and_names_what_it_refuses():
    for model, _ in MODELS.values():
        ta.check_supported_architecture(model)
        assert len(hybrid.gated_delta_layers(model)) == 3
    lfm2 = Lfm2ForCausalLM(Lfm2Config(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1, layer_types=["conv", "full_attention"]))
    with pytest.raises(ta.UnsupportedArchitectureError, match="'conv'"):
        ta.check_supported_architecture(lfm2)
    # A linear-attention layer that is not a transformers Gated DeltaNet is refused by its class name.
    odd = copy.deepcopy(MODELS["qwen3_5"][0])
    odd.model.layers[1].linear_attn = torch.nn.Conv1d(4, 4, 3)
    with pytest.raises(ta.UnsupportedArchitectureError, match="linear_attn.*Conv1d"):
        ta.check_supported_architecture(odd)


def test_a_packed_row_cannot_use_a_cache():
    model, _ = MODELS["qwen3_5"]
    row = TreeRow()
    row.add(make_sample([1, 2, 3, 4], 2))
    inputs = pack_row(row).model_inputs()
    inputs["use_cache"] = True
    with pytest.raises(ValueError, match="cache"):
        model(**inputs)

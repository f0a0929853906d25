"""Tree attention is exact: one packed forward gives every trained token the log-prob (and gradient)
it gets when its sample is forwarded alone. Tiny random Qwen3 and Llama, fp32, CPU."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch.utils.checkpoint
from hypothesis import HealthCheck, given, settings
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from grpo_core.models.attention import tree as ta
from grpo_core.models.attention import gather as tg
from grpo_core.packing.collator import pack_row
from grpo_core.packing.trie import TreeRow
from tests.test_packing_trie import make_sample, sample_sets
from tests.tolerances import GradientMagnitudes, gamma, log_softmax_grad_magnitude, logprob_error_magnitude

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
    p = pack_row(row)
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


def alone_error_scale(model, samples, weights: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per trained token the log-prob's magnitude λ (``logprob_error_magnitude``), and per weight
    element Σ|terms| of the gradient of Σ_t weight_t·logprob_t (``GradientMagnitudes``), every
    sample forwarded alone: a packed row shares a prefix's terms, |x|·|δ_a + δ_b| <= |x|·|δ_a| +
    |x|·|δ_b|, so these bound the packed computation's sums too. Runs on a copy of ``model``."""
    model = copy.deepcopy(model)
    model.zero_grad()
    hidden, lp_mags = [], []
    handle = model.lm_head.register_forward_hook(lambda m, inp, out: hidden.append(inp[0][0]))
    with GradientMagnitudes(model, logits_module=model.lm_head) as mags:
        for s, weight in zip(samples, weights):
            trained = np.flatnonzero(s.completion_mask)
            if not len(trained):
                continue
            ids = torch.as_tensor(s.token_ids, dtype=torch.long)
            logits = model(input_ids=ids[None]).logits[0]
            targets = ids[trained]
            lp_mags.append(logprob_error_magnitude(hidden.pop()[trained - 1], model.lm_head.weight,
                                                   logits[trained - 1], targets))
            grad = torch.zeros(logits.shape, dtype=torch.float64)
            grad[trained - 1, targets] = weight.double().abs()
            mags.logits_magnitude(log_softmax_grad_magnitude(logits, grad))
            (token_logprobs(logits[trained - 1], targets) * weight).sum().backward()
    handle.remove()
    result = mags.result()
    return torch.cat(lp_mags), torch.cat([result[n].flatten() for n, p in model.named_parameters() if p.grad is not None])


def forward_k(samples, config) -> int:
    """The longest sum of a packed forward: a row's keys (masked ones add exact zeros), or the MLP."""
    row = TreeRow()
    for s in samples:
        row.add(s)
    return max(pack_row(row).num_tokens, config.intermediate_size, config.hidden_size, config.vocab_size)


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
    # gradients of a GRPO-like loss: each token weighted by its sample's advantage (+ a token term)
    adv = torch.tensor([s.advantage for s in samples], dtype=torch.float32)
    weight = adv[owner] + 0.01 * torch.arange(len(owner))
    sizes = [len(x) for x in singles]
    lp_magnitude, grad_magnitude = alone_error_scale(alone, samples, list(torch.split(weight, sizes)))
    # fp32, two kernels: each log-prob within γ_k·λ of exact, k the longest forward sum (row keys)
    lp_bound = 2 * gamma(forward_k(samples, alone.config)) * lp_magnitude
    assert ((packed - expected).abs().double() <= lp_bound).all()
    (packed * weight).sum().backward()
    (expected * weight).sum().backward()
    g1, g2 = flat_grad(model), flat_grad(alone)
    # Each weight gradient's last sum is within γ_k·Σ|terms| of exact, k the longest backward sum (a
    # weight gradient over every token forwarded alone, more than the row's, or a key's gradient over
    # a row's queries of its head group). Cancellations before that sum, which the hooks do not see
    # (RMSNorm's projection; softmax's dP − D where a row's values agree, as with repeated tokens),
    # leave single elements with noise of the cancelled terms' size, so the check is on the norm:
    # ||g1 − g2|| <= ||2·γ_k·Σ|terms|||, and then sin(angle) <= that over ||g2||.
    heads_per_kv = alone.config.num_attention_heads // alone.config.num_key_value_heads
    k = max(sum(len(s.token_ids) for s in samples), heads_per_kv * forward_k(samples, alone.config))
    bound = (2 * gamma(k) * grad_magnitude).norm().item()
    if g2.norm() > 0:  # (all weights 0: both gradients exactly 0, checked below)
        # The cosine in fp64 and without cosine_similarity's floor on the norms; its own rounding
        # (γ of its 3 sums over n entries) is then negligible.
        a, b = g1.double(), g2.double()
        cos = (a @ b / (a.norm() * b.norm())).item()
        sin = bound / b.norm().item()
        assert cos >= (1 - sin**2 if sin < 1 else -1.0) - gamma(3 * len(g1), torch.float64)
    assert (g1 - g2).norm() <= bound


@pytest.mark.parametrize("plan", ["varlen_emulated", "split_emulated", "split_gathered_emulated"])
@given(samples=sample_sets(vocab_max=VOCAB))
@settings(max_examples=15, deadline=None)
def test_fused_kernel_plans_equal_reference(plan, samples):
    """The fused-kernel plans with the kernel emulated: gather (K/V gathered along paths, one varlen call)
    and split (a call per ancestor depth, merged by log-sum-exp), its level calls reading the row in place
    (windows) or gathered."""
    model, alone = MODELS["qwen3"]
    with torch.no_grad():
        ref, _ = packed_logprobs(model, samples, "reference")
        emu, _ = packed_logprobs(model, samples, plan)
    ta.register_tree_attention("reference")
    if len(ref):
        # fp32, two kernels: each log-prob within γ_k·λ of exact (the same values as each sample alone)
        lp_magnitude, _ = alone_error_scale(alone, samples, [torch.zeros(int(s.completion_mask.sum())) for s in samples])
        assert ((ref - emu).abs().double() <= 2 * gamma(forward_k(samples, alone.config)) * lp_magnitude).all()


def test_diagram_attention_rows():
    """Query rows of the diagram's segment S2 see p1 p2 and their own causal past only."""
    row = TreeRow()
    row.add(make_sample([1, 2, 3, 4, 5], 2))
    row.add(make_sample([1, 2, 3, 6, 7], 2))
    mask = pack_row(row).attention.dense_mask(torch.device("cpu")).int().tolist()
    assert mask == [
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0],
        [1, 1, 1, 1, 0, 0],
        [1, 1, 0, 0, 1, 0],
        [1, 1, 0, 0, 1, 1],
    ]


def test_probe_accepts_a_correct_kernel():
    # 2e-2 is select_backend's acceptance threshold (grpo_core/models/attention/tree.py), a policy and
    # not an error bound: the probe runs the kernel in bf16 against fp32 references, and rounding the
    # inputs alone moves each by up to u_bf16 = 2^-8 = 3.9e-3, so a correct kernel lands at about one or
    # two u_bf16 in norm and a wrong one (mask, head mapping) at O(1). This checks it would be accepted.
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


def attention_error_scale(q, k, v, grad, mask, scale) -> list[torch.Tensor]:
    """Magnitudes of attention's output and q/k/v gradients (shaped like them), fp64, such that each
    computed value is within γ_k times its magnitude of exact (first order, k the longest sum).

    Scores s = scale·q·k are within γ of s_m = scale·|q|·|k|; a probability p = softmax(s) is then
    off by p·(|Δs| + Σ p|Δs|) plus its exp's and normaliser's roundings: magnitude p·(1 + s_m + Σ p·s_m).
    Each later product or sum (o = p·v; dv = pᵀ·do; dp = do·vᵀ; D = Σ do∘o; ds = p∘(dp − D);
    dq = scale·ds·k; dk = scale·dsᵀ·q) takes its factors' magnitudes in place of their values.
    """
    heads, kv_heads = q.shape[1], k.shape[1]
    rep = heads // kv_heads  # query head h reads K/V head h // rep (repeat_interleave)
    q, k, v, grad = (t.detach().double().transpose(0, 1) for t in
                     (q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), grad))  # [H, T, D]
    p = torch.softmax((scale * q @ k.transpose(1, 2)).masked_fill(~mask, float("-inf")), -1)
    s_mag = scale * q.abs() @ k.abs().transpose(1, 2)
    p_mag = p * (1 + s_mag + (p * s_mag).sum(-1, keepdim=True))
    out_mag = p_mag @ v.abs()
    dp_mag = grad.abs() @ v.abs().transpose(1, 2)
    ds_mag = 2 * p_mag * (dp_mag + (grad.abs() * out_mag).sum(-1, keepdim=True))
    dq_mag = scale * ds_mag @ k.abs()
    dk_mag = scale * ds_mag.transpose(1, 2) @ q.abs()
    dv_mag = p_mag.transpose(1, 2) @ grad.abs()

    def per_kv_head(t):  # the query heads of a group add into their K/V head's gradient
        return t.reshape(kv_heads, rep, *t.shape[1:]).sum(1)

    return [t.transpose(0, 1) for t in (out_mag, dq_mag, per_kv_head(dk_mag), per_kv_head(dv_mag))]


@pytest.mark.parametrize("plan", ["varlen_emulated", "split_emulated", "split_gathered_emulated"])
@given(samples=sample_sets(vocab_max=VOCAB))
@settings(max_examples=15, deadline=None)
def test_fused_kernel_plans_gradients_equal_reference(plan, samples):
    """Output and q/k/v gradients of the gather plan (fp32 accumulation of shared K/V) and of the split
    plan (fp32 sum of the level calls' gradients) vs reference."""
    row = TreeRow()
    for s in samples:
        row.add(s)
    p = pack_row(row)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(p.num_tokens, h, 8, generator=gen) for h in (4, 2, 2))
    grad = torch.randn(p.num_tokens, 4, 8, generator=gen)
    results = []
    for name in ("reference", plan):
        xs = [t.clone().requires_grad_() for t in (q, k, v)]
        out = ta.BACKENDS[name].run(*xs, p.attention, 8**-0.5)
        out.backward(grad)
        results.append([out.detach()] + [x.grad for x in xs])
    # fp32, two kernels: within 2·γ_k of the magnitudes, k the longest sum (a K/V row's gradient
    # over the queries of its head group; a query's keys are fewer)
    magnitudes = attention_error_scale(q, k, v, grad, p.attention.dense_mask(torch.device("cpu")), 8**-0.5)
    k_longest = (4 // 2) * p.num_tokens + 8
    for a, b, magnitude in zip(*results, magnitudes):
        assert ((a - b).abs().double() <= 2 * gamma(k_longest) * magnitude).all()


# ---- re-gathering K/V in backward ---------------------------------------------------------------------


def shared_prompt_row():
    """A row whose paths repeat a 24-token prompt and a fork: the gathered K/V is longer than the row."""
    prompt = list(range(1, 25))
    row = TreeRow()
    for tail in ([30, 31, 32], [30, 31, 40, 41, 42], [50, 51], [60] * 7):
        row.add(make_sample(prompt + tail, len(tail)))
    p = pack_row(row)
    assert p.attention.kv_index.numel() > 2 * p.num_tokens
    return p


def gather_backend(repeat_kv: bool) -> ta.Backend:
    # The fused kernels' path on the CPU; repeat_kv is the variant for kernels without grouped heads.
    return ta._gather_backend("emulated", ta._emulated_kernel, repeat_kv=repeat_kv, needs_cuda=False)


def run_backend(backend: ta.Backend, p, regather: bool, wrap=None):
    """Output and q/k/v gradients of one attention call; ``wrap(fn)`` runs the call inside something."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(p.num_tokens, h, 8, generator=gen).requires_grad_() for h in (4, 2, 2))
    grad = torch.randn(p.num_tokens, 4, 8, generator=gen)
    previous = ta.set_kv_regather(regather)
    try:
        fn = lambda: backend.run(q, k, v, p.attention, 8**-0.5)  # noqa: E731
        out = wrap(fn) if wrap is not None else fn()
        out.backward(grad)
    finally:
        ta.set_kv_regather(previous)
    return [out.detach(), q.grad, k.grad, v.grad]


@pytest.mark.parametrize("repeat_kv", [False, True])
def test_regather_is_bitwise_the_saving_path(repeat_kv):
    """Re-gathering K/V in backward copies the same rows again: outputs and gradients are identical."""
    p, backend = shared_prompt_row(), gather_backend(repeat_kv)
    saved = run_backend(backend, p, regather=False)
    regathered = run_backend(backend, p, regather=True)
    for a, b in zip(saved, regathered):
        assert torch.equal(a, b)


class SavedBytes:
    """Outer saved-tensor hooks that record the shape of every tensor the graph keeps for backward."""

    def __init__(self):
        self.shapes: list[tuple[int, ...]] = []

    def pack(self, t):
        self.shapes.append(tuple(t.shape))
        return t.detach()

    def unpack(self, t):
        return t

    def run(self, fn):
        with torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack):
            return fn()


@pytest.mark.parametrize("repeat_kv", [False, True])
def test_regather_keeps_gathered_kv_out_of_saved_tensors(repeat_kv):
    """Saving path: the kernel keeps K/V of the gathered length (K rows). Re-gather: no tensor of that
    length is kept, the saved tensors pass through the caller's hooks, and the results do not change."""
    p, backend = shared_prompt_row(), gather_backend(repeat_kv)
    gathered_rows = p.attention.kv_index.numel()
    expected = run_backend(backend, p, regather=False)
    kept = {}
    for regather in (False, True):
        counter = SavedBytes()
        result = run_backend(backend, p, regather=regather, wrap=counter.run)
        for a, b in zip(expected, result):
            assert torch.equal(a, b)
        kept[regather] = counter.shapes
    def gathered_kv(shapes):  # [K, heads, D]; the paths themselves are [K] in both modes
        return [s for s in shapes if len(s) == 3 and s[0] == gathered_rows]

    assert len(gathered_kv(kept[False])) >= 2  # the gathered K and V
    assert not gathered_kv(kept[True])
    # instead: the row's own K and V (U rows) and the paths, each time a gathered tensor was saved
    assert (p.num_tokens, 2, 8) in kept[True] and (gathered_rows,) in kept[True]


def test_regather_under_activation_checkpointing():
    """Non-reentrant checkpointing recomputes what the re-gather keeps; gradients stay identical."""
    p, backend = shared_prompt_row(), gather_backend(False)
    expected = run_backend(backend, p, regather=False)

    def checkpointed(fn):
        return torch.utils.checkpoint.checkpoint(fn, use_reentrant=False)

    for regather in (False, True):
        for a, b in zip(expected, run_backend(backend, p, regather=regather, wrap=checkpointed)):
            assert torch.equal(a, b)


def test_flat_rows_and_no_grad_skip_the_hooks(monkeypatch):
    """Flat rows gather nothing and inference saves nothing: neither pushes hooks."""
    pushed = []
    real = torch.autograd.graph.saved_tensors_hooks

    def spy(pack, unpack):
        pushed.append(pack)
        return real(pack, unpack)

    monkeypatch.setattr(torch.autograd.graph, "saved_tensors_hooks", spy)
    p, backend = shared_prompt_row(), gather_backend(False)
    with torch.no_grad():
        run = backend.run(*(torch.randn(p.num_tokens, h, 8) for h in (4, 2, 2)), p.attention, 8**-0.5)
    assert run.shape == (p.num_tokens, 4, 8) and not pushed
    flat = ta.TreeAttentionMetadata(p.attention.cu_seq_q, p.attention.cu_seq_q, p.attention.max_q,
                                    p.attention.max_q, None)
    xs = [torch.randn(p.num_tokens, h, 8).requires_grad_() for h in (4, 2, 2)]
    backend.run(*xs, flat, 8**-0.5).sum().backward()
    assert not pushed
    backend.run(*xs, p.attention, 8**-0.5).sum().backward()
    assert len(pushed) == 1


# A stand-in for a fused kernel as compiled code meets one (torch_varlen is such a custom op): opaque to
# the compiler, saving its q/k/v for a backward op of its own. The backward is written out because an
# op's body runs below autograd.
@torch.library.custom_op("grpo_test::varlen_attn", mutates_args=())
def _op_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor,
               scale: float) -> torch.Tensor:
    return tg._emulated_attention(q, k, v, cu_q, cu_k, scale)


@torch.library.custom_op("grpo_test::varlen_attn_bwd", mutates_args=())
def _op_varlen_bwd(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor,
                   cu_k: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    rep = q.shape[1] // k.shape[1]
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    cq, ck = cu_q.tolist(), cu_k.tolist()
    for g in range(len(cq) - 1):
        (qa, qb), (ka, kb) = (cq[g], cq[g + 1]), (ck[g], ck[g + 1])
        qq, gg = q[qa:qb].transpose(0, 1), grad[qa:qb].transpose(0, 1)
        kk, vv = (x[ka:kb].repeat_interleave(rep, 1).transpose(0, 1) for x in (k, v))
        mask = torch.ones(qb - qa, kb - ka, dtype=torch.bool).tril((kb - ka) - (qb - qa))
        p = torch.softmax((scale * qq @ kk.transpose(1, 2)).masked_fill(~mask, float("-inf")), -1)
        ds = p * (gg @ vv.transpose(1, 2) - (gg * (p @ vv)).sum(-1, keepdim=True))
        dq[qa:qb] = (scale * ds @ kk).transpose(0, 1)
        per_kv_head = lambda t: t.transpose(0, 1).reshape(kb - ka, k.shape[1], rep, -1).sum(2)  # noqa: E731
        dk[ka:kb] = per_kv_head(scale * ds.transpose(1, 2) @ qq)
        dv[ka:kb] = per_kv_head(p.transpose(1, 2) @ gg)
    return dq, dk, dv


_op_varlen.register_fake(lambda q, k, v, cu_q, cu_k, scale: torch.empty_like(q))
_op_varlen_bwd.register_fake(
    lambda grad, q, k, v, cu_q, cu_k, scale: (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)))


def _op_setup(ctx, inputs, output):
    q, k, v, cu_q, cu_k, scale = inputs
    ctx.save_for_backward(q, k, v, cu_q, cu_k)
    ctx.scale = scale


def _op_backward(ctx, grad):
    q, k, v, cu_q, cu_k = ctx.saved_tensors
    return (*_op_varlen_bwd(grad, q, k, v, cu_q, cu_k, ctx.scale), None, None, None)


_op_varlen.register_autograd(_op_backward, setup_context=_op_setup)


def test_regather_in_compiled_layers():
    """A compiled caller (compile_mode="layers") keeps the gathered K/V: hooks are not traced, and the
    partitioner saves it. ``set_kv_regather_compiled`` breaks the graph around the attention of a tree
    row, which then runs under the hooks and keeps none of it; results are identical."""
    p = shared_prompt_row()
    gathered_rows = p.attention.kv_index.numel()
    op_kernel = lambda q, k, v, cu_q, cu_k, max_q, max_k, scale: _op_varlen(q, k, v, cu_q, cu_k, scale)  # noqa: E731
    inner = ta._gather_backend("op", op_kernel, repeat_kv=False, needs_cuda=False)

    def layer(q, k, v, meta, scale):  # K/V reach attention as intermediates, as after RoPE
        return inner.run(q, k * 1.5 + 0.25, v, meta, scale) * 2

    # aot_eager_decomp_partition: inductor's decompositions and min-cut partitioner, no C++ compile
    compiled = ta.Backend("compiled", torch.compile(layer, backend="aot_eager_decomp_partition", dynamic=True),
                          needs_cuda=False)
    expected = run_backend(ta.Backend("eager", layer, needs_cuda=False), p, regather=True)
    kept = {}
    for regather, in_compiled in ((False, False), (True, False), (True, True)):
        counter = SavedBytes()
        previous = ta.set_kv_regather_compiled(in_compiled)
        try:
            result = run_backend(compiled, p, regather=regather, wrap=counter.run)
        finally:
            ta.set_kv_regather_compiled(previous)
        for a, b in zip(expected, result):
            assert torch.equal(a, b)
        kept[regather, in_compiled] = [s for s in counter.shapes if len(s) == 3 and s[0] == gathered_rows]
    assert len(kept[False, False]) >= 2 and len(kept[True, False]) >= 2  # the gathered K and V
    assert not kept[True, True]


@pytest.mark.parametrize("mode,eager,compiled", [("eager", True, False), ("always", True, True), ("never", False, False)])
def test_the_config_setting_reaches_both_switches(mode, eager, compiled):
    from grpo_core.tiny import build_tiny_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(build_tiny_model()))
    before = ta.set_kv_regather(True), ta.set_kv_regather_compiled(False)
    try:
        ta.enable_tree_attention(model, backend="reference", kv_regather=mode)
        assert (tg.kv_regather_enabled(), tg._kv_regather_compiled) == (eager, compiled)
        with pytest.raises(ValueError, match="kv_regather='sometimes'"):
            ta.enable_tree_attention(model, backend="reference", kv_regather="sometimes")
    finally:
        ta.set_kv_regather(before[0])
        ta.set_kv_regather_compiled(before[1])

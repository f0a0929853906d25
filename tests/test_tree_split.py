"""The split plan of tree attention (``grpo_core.models.attention.split``): its level plan, the emulated LSE
kernel against autograd, and what it saves for backward. Its agreement with the dense reference over
random tries is in ``tests/test_tree_attention.py`` (``test_fused_kernel_plans_*``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from grpo_core.models.attention import tree as ta
from grpo_core.models.attention.split import EmulatedLSEKernel, levels_from_paths, plan_levels, split_tree_attention
from grpo_core.packing.collator import pack_row
from grpo_core.packing.trie import TreeRow
from tests.test_packing_trie import make_sample


def forked_row():
    """A 24-token prompt, a shared stem below it with two tails, and two more completions."""
    prompt = list(range(1, 25))
    row = TreeRow()
    for tail in ([30, 31, 32], [30, 31, 40, 41, 42], [50, 51], [60] * 7):
        row.add(make_sample(prompt + tail, len(tail)))
    return pack_row(row)


def test_levels_cover_exactly_the_ancestor_pairs_of_the_mask():
    p = forked_row()
    meta = p.attention
    levels = meta.levels
    assert levels is not None and len(levels) == 2  # the prompt's level and the stem's
    seg_lens = np.diff(meta.cu_seq_q.numpy())
    own_pairs = int((seg_lens * (seg_lens + 1) // 2).sum())  # the self call, causal
    mask = meta.dense_mask(torch.device("cpu"))
    assert own_pairs + sum(lv.num_pairs for lv in levels) == int(mask.sum())
    # Every level pair is allowed by the mask and no pair is listed twice.
    seen = set()
    for lv in levels:
        cq, ck = lv.cu_q.tolist(), lv.cu_k.tolist()
        for a in range(len(cq) - 1):
            for i in lv.q_index[cq[a] : cq[a + 1]].tolist():
                for j in lv.k_index[ck[a] : ck[a + 1]].tolist():
                    assert mask[i, j] and (i, j) not in seen
                    seen.add((i, j))


def test_level_windows_are_the_levels_rows():
    """Each level's windows (a start and a length per sequence, as FlashAttention's seqused takes them) hold
    exactly the row positions of its gathered queries and keys, in the same order, and never overlap."""
    p = forked_row()
    for lv in p.attention.levels:
        assert lv.has_windows
        for starts, lengths, index, cu in ((lv.q_starts, lv.q_lengths, lv.q_index, lv.cu_q),
                                           (lv.k_starts, lv.k_lengths, lv.k_index, lv.cu_k)):
            assert starts.dtype == lengths.dtype == torch.int32 and int(starts[-1]) == p.num_tokens
            assert torch.equal(lengths.long(), torch.diff(cu.long()))
            runs = [torch.arange(int(s), int(s) + int(n)) for s, n in zip(starts[:-1], lengths)]
            assert torch.equal(torch.cat(runs), index)
            assert all(int(s) + int(n) <= int(t) for s, n, t in zip(starts[:-1], lengths, starts[1:]))


def test_a_layout_without_runs_has_no_windows():
    """A subtree that is not one run of the row (another root between a root's children): that level runs
    gathered; subtrees that are runs, whatever their children's order, keep their windows."""
    (split,) = plan_levels([4, 2, 3, 2], [None, 0, None, 0])  # root 2 sits between root 0's two children
    assert not split.has_windows and split.q_index.tolist() == [4, 5, 9, 10]
    assert all(lv.has_windows for lv in plan_levels([4, 2, 3, 2], [None, 0, 0, 1]))


@pytest.mark.parametrize("in_place", [True, False])
def test_split_levels_in_place_and_gathered_agree(in_place):
    """The two ways of running a level call give the same output and gradients (fp32: to rounding), and the
    in-place one never reads a row outside its windows (the emulated kernel leaves NaN there)."""
    p = forked_row()
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(p.num_tokens, h, 8, generator=gen) for h in (4, 2, 2))
    grad = torch.randn(p.num_tokens, 4, 8, generator=gen)
    results = []
    for name in ("varlen_emulated", "split_emulated" if in_place else "split_gathered_emulated"):
        xs = [t.clone().requires_grad_() for t in (q, k, v)]
        out = ta.BACKENDS[name].run(*xs, p.attention, 8**-0.5)
        out.backward(grad)
        results.append([out.detach()] + [x.grad for x in xs])
    for got, want in zip(results[1], results[0]):
        assert torch.isfinite(got).all() and torch.allclose(got, want, atol=1e-5)


def test_a_kernel_without_windows_refuses_them():
    cu = torch.tensor([0, 3], dtype=torch.int32)
    q = torch.randn(3, 2, 8)
    with pytest.raises(TypeError, match="no windows"):
        EmulatedLSEKernel(in_place=False).forward(q, q, q, cu, cu, 3, 3, 0.3, False, used_q=cu[1:], used_k=cu[1:])


def test_the_collators_levels_equal_those_derived_from_the_paths():
    meta = forked_row().attention
    derived = levels_from_paths(meta.cu_seq_q, meta.cu_seq_k, meta.kv_index)
    assert len(derived) == len(meta.levels)
    for a, b in zip(derived, meta.levels):
        for name in ("q_index", "k_index", "cu_q", "cu_k", "q_starts", "q_lengths", "k_starts", "k_lengths"):
            assert torch.equal(getattr(a, name), getattr(b, name)), name
        assert (a.max_q, a.max_k) == (b.max_q, b.max_k)


def test_flat_rows_have_no_levels():
    row = TreeRow()
    row.add(make_sample([1, 2, 3, 4], 2))
    row.add(make_sample([5, 6, 7], 1))
    p = pack_row(row)
    assert p.attention.kv_index is None and p.attention.levels == ()
    assert plan_levels([3, 4], [None, None]) == ()


@pytest.mark.parametrize("causal", [True, False])
def test_emulated_lse_kernel_matches_autograd(causal):
    """Forward output and LSE, and the backward from (output, LSE), against autograd through dense math (fp32)."""
    gen = torch.Generator().manual_seed(1)
    cu_q = torch.tensor([0, 5, 12], dtype=torch.int32)
    cu_k = cu_q.clone() if causal else torch.tensor([0, 9, 13], dtype=torch.int32)
    q = torch.randn(12, 4, 8, generator=gen, dtype=torch.float32)
    k, v = (torch.randn(int(cu_k[-1]), 2, 8, generator=gen, dtype=torch.float32) for _ in range(2))
    dout = torch.randn(12, 4, 8, generator=gen, dtype=torch.float32)
    kern = EmulatedLSEKernel()
    out, lse = kern.forward(q, k, v, cu_q, cu_k, 7, 9, 0.3, causal)
    dq, dk, dv = kern.backward(dout, q, k, v, out, lse, cu_q, cu_k, 7, 9, 0.3, causal)

    xs = [t.clone().requires_grad_() for t in (q, k, v)]
    outs, lses = [], []
    for a in range(2):
        qs, qe, ks, ke = int(cu_q[a]), int(cu_q[a + 1]), int(cu_k[a]), int(cu_k[a + 1])
        s = torch.einsum("qhd,khd->hqk", xs[0][qs:qe], xs[1][ks:ke].repeat_interleave(2, 1)) * 0.3
        if causal:
            s = s.masked_fill(~torch.ones(qe - qs, ke - ks, dtype=torch.bool).tril(ke - ks - (qe - qs)), float("-inf"))
        outs.append(torch.einsum("hqk,khd->qhd", F.softmax(s, -1), xs[2][ks:ke].repeat_interleave(2, 1)))
        lses.append(torch.logsumexp(s, -1))
    ref = torch.cat(outs)
    ref.backward(dout)
    # fp32 both ways, sums of at most 9 terms of magnitude ~1: a few ulps
    assert torch.allclose(out, ref.detach(), atol=1e-5) and torch.allclose(lse, torch.cat(lses, 1), atol=1e-5)
    for got, want in zip((dq, dk, dv), xs):
        assert torch.allclose(got, want.grad, atol=1e-5)


def test_split_saves_nothing_of_the_paths_length():
    """The gather plan saves K/V of the paths' length (unless re-gathered); the split plan saves the
    row's q, k, v, its output and the LSE only."""
    p = forked_row()
    u, paths = p.num_tokens, p.attention.kv_index.numel()
    assert paths > 2 * u
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(u, h, 8, generator=gen).requires_grad_() for h in (4, 2, 2))
    saved_rows = []

    def pack(t):
        saved_rows.append(t.shape[0] if t.dim() else 0)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = ta.BACKENDS["split_emulated"].run(q, k, v, p.attention, 8**-0.5)
    assert max(saved_rows) <= max(u, 4)  # q/k/v/out [U, ...], lse [H, U], cu_seq [G + 1]
    out.sum().backward()
    assert all(x.grad is not None and torch.isfinite(x.grad).all() for x in (q, k, v))


def test_bf16_split_is_as_close_to_fp32_as_the_gather_plan():
    """In bf16 the merge adds one rounding of the output; its error against fp32 stays at the gather
    plan's size (both well under the start-up probe's 2e-2 acceptance)."""
    p = forked_row()
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(p.num_tokens, h, 64, generator=gen) for h in (4, 2, 2))
    ref = ta.BACKENDS["reference"].run(q, k, v, p.attention, 64**-0.5)
    errors = {}
    for name in ("varlen_emulated", "split_emulated"):
        out = ta.BACKENDS[name].run(*(t.bfloat16() for t in (q, k, v)), p.attention, 64**-0.5).float()
        errors[name] = float((out - ref).norm() / ref.norm())
    assert errors["split_emulated"] <= 2 * errors["varlen_emulated"] + 1e-3, errors
    assert ta._probe(ta.BACKENDS["split_emulated"], torch.device("cpu")) < 2e-2


def test_split_function_with_no_levels_is_the_self_call():
    gen = torch.Generator().manual_seed(0)
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    q, k, v = (torch.randn(8, 2, 8, generator=gen) for _ in range(3))
    out = split_tree_attention(q, k, v, EmulatedLSEKernel(), cu, 5, (), 0.25)
    want, _ = EmulatedLSEKernel().forward(q, k, v, cu, cu, 5, 5, 0.25, True)
    assert torch.equal(out, want)


def test_an_unknown_plan_is_refused():
    with pytest.raises(ValueError, match="tree attention plan 'paths'"):
        ta.select_backend("auto", "cpu", plan="paths")


def test_the_auto_plan_splits_rows_whose_paths_are_long(monkeypatch):
    """``auto`` runs a row split where its paths hold SPLIT_MIN_PATHS_PER_TOKEN keys per token, else gathered."""
    p = forked_row()
    per_token = p.attention.kv_index.numel() / p.num_tokens
    calls = []
    for name in ("split_emulated", "varlen_emulated"):
        backend = ta.BACKENDS[name]
        monkeypatch.setattr(backend, "run", lambda *a, _n=name, _r=backend.run: calls.append(_n) or _r(*a))
    q, k, v = (torch.randn(p.num_tokens, h, 8) for h in (4, 2, 2))
    auto = ta.BACKENDS["split_or_gather_emulated"]
    for threshold, expected in ((per_token, "split_emulated"), (per_token + 0.01, "varlen_emulated")):
        monkeypatch.setattr(ta, "SPLIT_MIN_PATHS_PER_TOKEN", threshold)
        calls.clear()
        auto.run(q, k, v, p.attention, 8**-0.5)
        assert calls == [expected]

"""The sampler's routes of a mixture-of-experts policy from a reply to the routers, and tree rows = flat rows, CPU.

* routes from a reply (base64 ``.npy``) and through a multi-turn sequence, then through a packed
  row: every forwarded position carries the routes of its sample at that token, in tree and flat
  rows, and a shared position whose samples disagree is counted;
* tiny random Qwen3-MoE and Qwen3.5-MoE (grouped-GEMM experts, fp32): a tree row and a flat row give
  the same log-probs and gradients as each sample forwarded alone, within the fp32 noise of forwarding
  the samples alone or as one padded batch (measured here, printed with ``-s``), with free routing and
  with the samples' own routes replayed.

Run: ``.venv/bin/python -m pytest tests/test_moe_routes.py -s``.
"""

from __future__ import annotations

import base64
import copy
import io

import numpy as np
import pytest
import torch

from grpo_core.models.attention import tree as ta
from grpo_core.models.moe.experts import use_grouped_experts
from grpo_core.models.moe.routing import NO_ROUTE, RoutingReplay, moe_layers
from grpo_core.packing.collator import pack_row
from grpo_core.packing.planner import plan_step
from grpo_core.rollout.reconcile import reconcile_turns
from grpo_core.rollout.routes import sequence_routes
from grpo_core.rollout.types import TurnRecord
from tests.test_moe_routing import KINDS, TOP_K, VOCAB, tiny_moe
from grpo_core.vllm_server.replies import RoutesFormatError, decode_routed_experts
from tests.test_packing_trie import make_sample


pytestmark = pytest.mark.usefixtures("one_torch_thread")


# ---- routes from replies, through sequences and rows ---------------------------------------------------------------
def npy_b64(array: np.ndarray) -> str:
    buf = io.BytesIO()
    np.save(buf, array)
    return base64.b64encode(buf.getvalue()).decode()


def test_decode_routed_experts():
    routes = np.arange(5 * 3 * 2, dtype=np.uint8).reshape(5, 3, 2)
    assert np.array_equal(decode_routed_experts(npy_b64(routes), num_tokens=6), routes)
    assert decode_routed_experts(None, 6) is None
    with pytest.raises(RoutesFormatError, match=r"expected \[6, layers"):
        decode_routed_experts(npy_b64(routes), num_tokens=7)
    with pytest.raises(RoutesFormatError, match="base64"):
        decode_routed_experts("not base64!", 6)


def routes_of(tokens: list[int] | np.ndarray, salt: int = 0, layers: int = 3) -> np.ndarray:
    """Routes that name their token and position: [len - 1, layers, 2] uint8."""
    n = len(tokens) - 1
    base = (np.asarray(tokens[:n], dtype=np.int64) * 7 + np.arange(n) + salt) % 250
    return np.stack([np.stack([base, base + 1 + layer], -1) for layer in range(layers)], 1).astype(np.uint8)


def test_sequence_routes_take_each_trained_tokens_own_turn():
    prompt, out0 = [1, 2, 3], [10, 11]
    prompt1, out1 = prompt + out0 + [4, 5], [12, 13, 14]
    turns = [TurnRecord(prompt, out0, [-0.5] * 2, routed_experts=routes_of(prompt + out0, salt=100)),
             TurnRecord(prompt1, out1, [-0.5] * 3, routed_experts=routes_of(prompt1 + out1))]
    (seq,) = reconcile_turns(turns, fork_threshold_tokens=4).sequences
    routes = sequence_routes(seq, turns)
    want = routes_of(prompt1 + out1)
    want[2:4] = routes_of(prompt + out0, salt=100)[2:4]  # positions 2, 3 predict turn 0's tokens 10, 11
    assert np.array_equal(routes, want)
    turns[0].routed_experts = None  # an earlier turn without routes: the last turn's stand
    assert np.array_equal(sequence_routes(seq, turns), routes_of(prompt1 + out1))
    turns[1].routed_experts = None
    assert sequence_routes(seq, turns) is None


@pytest.mark.parametrize("flat", [False, True], ids=["tree", "flat"])
def test_packed_rows_carry_each_positions_routes(flat):
    prompt = [5, 6, 7, 8]
    tails = [[20, 21, 22], [20, 21, 30, 31], [40, 41]]
    samples = []
    for i, tail in enumerate(tails):
        tokens = prompt + tail
        samples.append(make_sample(tokens, len(tail), routed_experts=routes_of(tokens)))
    samples.append(make_sample(prompt + [50, 51], 2))  # no routes: its own positions route themselves
    plan = plan_step(samples, world_size=1, gradient_accumulation_steps=1, token_budget=1000, flat=flat)
    (row,) = plan.rows
    packed = pack_row(row)
    assert packed.routes.shape == (packed.num_tokens, 3, 2) and packed.route_conflicts == 0
    for i, sample in enumerate(row.samples):
        for seg, used in row.sample_segments(i):
            got = packed.routes[seg.offset : seg.offset + used].numpy()
            if sample.routed_experts is None:
                if flat:
                    assert (got == NO_ROUTE).all()
                continue
            assert np.array_equal(got, sample.routed_experts[seg.start : seg.start + used])
    # A later sample that disagrees on a shared position: the first one's stays, the position is counted.
    other = samples[1].routed_experts.copy()
    other[1, 0] = [200, 201]
    samples[1] = make_sample(prompt + tails[1], len(tails[1]), routed_experts=other)
    packed = pack_row(plan_step(samples, world_size=1, gradient_accumulation_steps=1, token_budget=1000, flat=flat).rows[0])
    assert packed.route_conflicts == (0 if flat else 1)


# ---- tree rows = flat rows = alone, with MoE layers --------------------------------------------------------------------
def forked_samples(seed: int = 0):
    rng = np.random.default_rng(seed)
    tok = lambda n: list(rng.integers(0, VOCAB, n))  # noqa: E731
    prompt, stem = tok(12), tok(5)
    tails = [stem + tok(6), stem + tok(9), tok(7), stem[:2] + tok(11)]
    samples = [make_sample(prompt + t, len(t), advantage=float(rng.normal())) for t in tails]
    other = tok(9)
    samples += [make_sample(other + tok(n), n, group_id=1, advantage=float(rng.normal())) for n in (5, 8)]
    return samples


def alone(model, samples, replay: RoutingReplay | None):
    """Trained-token log-probs of each sample forwarded by itself (and its own routes, when ``replay``)."""
    out, routes = [], []
    for s in samples:
        ids = torch.as_tensor(s.token_ids, dtype=torch.long)
        t = torch.as_tensor(np.flatnonzero(s.completion_mask))
        logits = model(input_ids=ids[None], use_cache=False).logits[0]
        out.append(torch.log_softmax(logits[t - 1], -1).gather(-1, ids[t][:, None])[:, 0])
        if replay is not None:
            routes.append(replay.own_topk()[:-1].to(torch.uint8).numpy())
    return torch.cat(out), routes


def packed(model, samples, flat: bool, replay: RoutingReplay | None):
    plan = plan_step(samples, world_size=1, gradient_accumulation_steps=1, token_budget=10_000, flat=flat)
    (row,) = plan.rows
    p = pack_row(row)
    if replay is not None:
        replay.set_row(p.routes)
    logits = model(**p.model_inputs(), logits_to_keep=p.logit_index).logits[0]
    return torch.log_softmax(logits, -1).gather(-1, p.target_ids[:, None])[:, 0], p


def loss_and_grads(model, logprobs, advantages):
    model.zero_grad()
    loss = -(logprobs * advantages).sum() / len(logprobs)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def rel(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(((a[n] - b[n]).norm() / b[n].norm().clamp(min=1e-30)).item() for n in a)


@pytest.mark.parametrize("replayed", [False, True], ids=["free", "replayed"])
@pytest.mark.parametrize("kind", KINDS)
def test_tree_row_equals_flat_row_equals_alone(kind, replayed):
    model = tiny_moe(kind)
    use_grouped_experts(model)
    alone_model = copy.deepcopy(model)
    alone_model.set_attn_implementation("sdpa")
    ta.enable_tree_attention(model, backend="reference", linear_backend="reference")
    replay = RoutingReplay.install(model, 2) if replayed else None
    alone_replay = RoutingReplay.install(alone_model, 2) if replayed else None
    samples = forked_samples()
    ref, routes = alone(alone_model, samples, alone_replay)
    if replayed:
        samples = [make_sample(s.token_ids, s.completion_mask, group_id=s.group_id, advantage=s.advantage,
                               routed_experts=r) for s, r in zip(samples, routes, strict=True)]
    adv = torch.tensor([s.advantage for s in samples])
    trained = [torch.as_tensor(np.flatnonzero(s.completion_mask)) for s in samples]
    ref_adv = torch.cat([adv[i].expand(len(t)) for i, t in enumerate(trained)])
    ref_loss, ref_grads = loss_and_grads(alone_model, ref, ref_adv)
    # The noise scale: the same samples as one padded batch against one at a time.
    width = max(len(s.token_ids) for s in samples)
    ids = torch.zeros(len(samples), width, dtype=torch.long)
    mask = torch.zeros(len(samples), width, dtype=torch.long)
    for i, s in enumerate(samples):
        ids[i, : len(s.token_ids)] = torch.as_tensor(s.token_ids)
        mask[i, : len(s.token_ids)] = 1
    with torch.no_grad():
        if alone_replay is not None:
            batch_routes = torch.full((ids.numel(), 2, TOP_K), NO_ROUTE, dtype=torch.int16)
            for i, r in enumerate(routes):
                batch_routes[i * width : i * width + len(r)] = torch.as_tensor(r.astype(np.int16))
            alone_replay.set_row(batch_routes)
        logits = alone_model(input_ids=ids, attention_mask=mask).logits
        if alone_replay is not None:
            alone_replay.clear()
    batched = torch.cat([torch.log_softmax(logits[i, t - 1], -1).gather(-1, ids[i, t][:, None])[:, 0]
                         for i, t in enumerate(trained)])
    noise = (batched - ref).abs().max().item()
    report = {"batched_vs_alone": noise}
    for mode in ("tree", "flat"):
        lp, row = packed(model, samples, mode == "flat", replay)
        order = torch.cat([torch.as_tensor(np.flatnonzero(np.asarray(row.sample_index) == i)) for i in range(len(samples))])
        lp_alone_order = torch.empty_like(lp)
        lp_alone_order[order] = ref  # the row lists the samples in its own order
        loss, grads = loss_and_grads(model, lp, adv[row.sample_index])
        if replay is not None:
            replay.clear()
        diff = (lp - lp_alone_order).abs().max().item()
        report[mode] = {"logprob_max": diff, "loss": abs(loss - ref_loss).item(), "grad_rel": rel(grads, ref_grads)}
        assert diff <= 8 * noise + 1e-5, f"{mode}: {report}"
        assert report[mode]["loss"] <= 1e-5 and report[mode]["grad_rel"] <= 1e-4, f"{mode}: {report}"
    print(f"\nfp32 {kind} {'replayed' if replayed else 'free'} routing: {report}")
    assert moe_layers(model)

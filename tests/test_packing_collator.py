"""The collator: depth-first layout, positions, logit indices and each segment's K/V path."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings

from grpo_core.packing.collator import pack_row
from grpo_core.packing.trie import TreeRow
from tests.test_packing_trie import make_sample, sample_sets


def visible_keys(packed, position: int) -> list[int]:
    """Row positions that query ``position`` attends to, read off the segment metadata."""
    meta = packed.attention
    cu_q, cu_k = meta.cu_seq_q.tolist(), meta.cu_seq_k.tolist()
    g = int(np.searchsorted(cu_q, position, side="right")) - 1
    q_len, k_len = cu_q[g + 1] - cu_q[g], cu_k[g + 1] - cu_k[g]
    r = position - cu_q[g]
    keys = (list(range(cu_q[g], cu_q[g + 1])) if meta.kv_index is None
            else meta.kv_index[cu_k[g] : cu_k[g + 1]].tolist())
    return keys[: k_len - q_len + r + 1]  # bottom-right causal


def test_diagram_layout():
    row = TreeRow()
    row.add(make_sample([1, 2, 3, 4, 5], 2))
    row.add(make_sample([1, 2, 3, 6, 7], 2))
    p = pack_row(row)
    assert p.input_ids.tolist() == [1, 2, 3, 4, 3, 6]
    assert p.position_ids.tolist() == [0, 1, 2, 3, 2, 3]
    assert p.attention.cu_seq_q.tolist() == [0, 2, 4, 6]
    assert p.attention.cu_seq_k.tolist() == [0, 2, 6, 10]
    assert p.attention.kv_index.tolist() == [0, 1, 0, 1, 2, 3, 0, 1, 4, 5]
    assert (p.attention.max_q, p.attention.max_k) == (2, 4)
    assert p.logit_index.tolist() == [2, 3, 4, 5]
    assert p.target_ids.tolist() == [4, 5, 6, 7]
    assert p.sample_index.tolist() == [0, 0, 1, 1]
    assert p.input_ids.dtype == p.position_ids.dtype == p.logit_index.dtype == torch.int64
    assert p.attention.cu_seq_q.dtype == torch.int32


@given(sample_sets())
@settings(max_examples=120, deadline=None)
def test_every_trained_token_sees_exactly_its_prefix(samples):
    row = TreeRow()
    for s in samples:
        row.add(s)
    p = pack_row(row)
    if row.num_unique_tokens == 0:
        assert p.is_dummy and p.num_trained == 0
        return
    assert p.num_tokens == row.num_unique_tokens
    ids, pos = p.input_ids.tolist(), p.position_ids.tolist()
    logit_index, targets, owner = p.logit_index.tolist(), p.target_ids.tolist(), p.sample_index.tolist()
    t_all = 0
    for i, s in enumerate(samples):
        for t in np.flatnonzero(s.completion_mask):
            j = logit_index[t_all]
            assert targets[t_all] == s.token_ids[t] and owner[t_all] == i
            assert p.advantages[t_all] == np.float32(s.advantage)
            assert p.sampler_logprobs[t_all] == s.sampler_logprobs[t]
            assert ids[j] == s.token_ids[t - 1] and pos[j] == t - 1
            keys = visible_keys(p, j)
            assert [ids[k] for k in keys] == s.token_ids[:t].tolist()  # the sample's own history
            assert [pos[k] for k in keys] == list(range(t))
            t_all += 1
    assert t_all == p.num_trained == p.sample_num_trained.sum()
    # segments tile the row in order and each path ends with the segment itself
    meta = p.attention
    assert meta.cu_seq_q[-1] == p.num_tokens
    if meta.kv_index is not None:
        cu_q, cu_k = meta.cu_seq_q.tolist(), meta.cu_seq_k.tolist()
        for g in range(meta.num_segments):
            own = meta.kv_index[cu_k[g + 1] - (cu_q[g + 1] - cu_q[g]) : cu_k[g + 1]].tolist()
            assert own == list(range(cu_q[g], cu_q[g + 1]))


def test_flat_row_is_plain_varlen():
    row = TreeRow(flat=True)
    row.add(make_sample([1, 2, 3, 4], 2))
    row.add(make_sample([1, 2, 3, 5, 6], 2))
    p = pack_row(row)
    assert p.attention.kv_index is None
    assert p.attention.cu_seq_q.tolist() == p.attention.cu_seq_k.tolist() == [0, 3, 7]
    assert p.position_ids.tolist() == [0, 1, 2, 0, 1, 2, 3]
    assert p.logit_index.tolist() == [1, 2, 5, 6]


def test_disjoint_tree_rows_skip_the_gather():
    row = TreeRow()
    row.add(make_sample([1, 2, 3], 1))
    row.add(make_sample([4, 5, 6], 1))
    assert pack_row(row).attention.kv_index is None


def test_top_n_and_sampling_masks_follow_trained_tokens():
    a = make_sample([1, 2, 3, 4], 2, sampler_top_ids=np.array([[3, 9], [4, 8]], np.int32),
                    sampler_top_logprobs=np.array([[-0.1, -2.0], [-0.2, -3.0]], np.float32),
                    sampling_masks=[np.array([3, 9]), np.array([4])])
    b = make_sample([1, 2, 5], 1)  # no top-N, no masks
    c = make_sample([1, 2, 6, 7], 1, sampler_top_ids=np.array([[7]], np.int32),
                    sampler_top_logprobs=np.array([[-0.5]], np.float32))
    row = TreeRow()
    for s in (a, b, c):
        row.add(s)
    p = pack_row(row)
    assert p.sampler_top_ids.tolist() == [[3, 9], [4, 8], [0, 0], [7, 0]]
    assert p.top_valid.tolist() == [[True, True], [True, True], [False, False], [True, False]]
    assert p.sampler_top_logprobs[3, 0].item() == np.float32(-0.5)
    assert p.sampling_mask_valid.tolist() == [True, True, False, False]
    offs = p.sampling_mask_offsets.tolist()
    assert p.sampling_mask_ids[offs[0] : offs[1]].tolist() == [3, 9]
    assert p.sampling_mask_ids[offs[1] : offs[2]].tolist() == [4]
    assert offs[2] == offs[3] == offs[4]


def test_empty_row_packs_to_a_dummy():
    p = pack_row(TreeRow())
    assert p.is_dummy and p.num_tokens == 1 and p.num_trained == 0
    assert p.attention.cu_seq_q.tolist() == [0, 1]


def test_to_and_model_inputs():
    row = TreeRow()
    row.add(make_sample([1, 2, 3, 4, 5], 2))
    row.add(make_sample([1, 2, 3, 6, 7], 2))
    p = pack_row(row).to("cpu")
    inputs = p.model_inputs()
    assert inputs["input_ids"].shape == inputs["position_ids"].shape == (1, 6)
    assert inputs["tree_attention"].kv_index.tolist() == [0, 1, 0, 1, 2, 3, 0, 1, 4, 5]
    assert inputs["use_cache"] is False

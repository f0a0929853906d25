"""TreeRow: trie keyed on (token, next token), novel-token pricing, segments and attention cost."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from grpo_core.packing.trie import TreeRow, forwarded_positions
from grpo_core.rollout.types import RolloutSample


def make_sample(tokens, trained, group_id: int = 0, advantage: float = 1.0, **extra) -> RolloutSample:
    """``trained``: a bool list, or an int k meaning "the last k tokens are trained"."""
    tokens = np.asarray(tokens, dtype=np.int32)
    if isinstance(trained, (int, np.integer)):
        mask = np.zeros(len(tokens), dtype=bool)
        if trained:
            mask[-trained:] = True
    else:
        mask = np.asarray(trained, dtype=bool)
    logprobs = np.where(mask, -0.1 * (np.arange(len(tokens)) + 1), 0.0).astype(np.float32)
    return RolloutSample(
        token_ids=tokens, completion_mask=mask, sampler_logprobs=logprobs, advantage=advantage, reward=0.0,
        group_id=group_id, row_index=group_id, epoch=0, rollout_id=f"g{group_id}-{tokens.tobytes().hex()[:12]}",
        policy_version=0, **extra,
    )


@st.composite
def sample_sets(draw, max_groups: int = 3, max_rollouts: int = 4, vocab_max: int = 6):
    """Groups sharing prompts; a tiny vocabulary makes completions fork at every depth; some samples
    have no trained token, some are long chains; groups come interleaved."""
    vocab = draw(st.integers(2, vocab_max))
    tok = st.integers(0, vocab - 1)
    samples = []
    for g in range(draw(st.integers(1, max_groups))):
        prompt = draw(st.lists(tok, min_size=1, max_size=8))
        for _ in range(draw(st.integers(1, max_rollouts))):
            completion = draw(st.lists(tok, min_size=0, max_size=10))
            if draw(st.integers(0, 9)) == 0:  # a long chain
                completion += draw(st.lists(tok, min_size=30, max_size=60))
            tokens = prompt + completion
            if draw(st.integers(0, 7)) == 0:
                mask = [False] * len(tokens)  # nothing trained
            else:
                # completion tokens mostly trained, with holes (tool results); the first token never
                mask = [False] * len(prompt) + draw(st.lists(st.booleans(), min_size=len(completion),
                                                              max_size=len(completion)))
                mask[0] = False
            samples.append(make_sample(tokens, mask, group_id=g, advantage=draw(st.floats(-2, 2))))
    return draw(st.permutations(samples))


def brute_force(samples) -> tuple[int, int]:
    """Unique nodes and attention cost computed from the set of all node prefixes."""
    nodes = set()
    for s in samples:
        n = forwarded_positions(s)
        t = tuple(int(x) for x in s.token_ids)
        nodes.update(t[: i + 2] for i in range(n))  # node at depth i = tokens 0..i+1
    children: dict[tuple, list[tuple]] = {}
    for node in nodes:
        children.setdefault(node[:-1] if len(node) > 2 else None, []).append(node)
    cost = 0
    for node in nodes:
        parent = node[:-1] if len(node) > 2 else None
        if parent is not None and len(children[parent]) == 1:
            continue  # not the start of a segment
        start, q, cur = len(node) - 2, 1, node
        while len(children.get(cur, [])) == 1:
            cur, q = children[cur][0], q + 1
        cost += q * (start + q)
    return len(nodes), cost


def test_diagram_row():
    # r0: p1 p2 p3 a1 a2, r1: p1 p2 p3 b1 b2 with the completions trained (tokens 1..7)
    r0 = make_sample([1, 2, 3, 4, 5], 2)
    r1 = make_sample([1, 2, 3, 6, 7], 2)
    row = TreeRow()
    assert row.add(r0) == 4  # the last token predicts nothing: 4 positions
    assert row.add(r1) == 2  # (p3, b1) and (b1, b2): the fork happens one token early
    assert row.num_unique_tokens == 6 and row.num_raw_tokens == 8
    segs = row.segments()
    assert [s.ids[:-1].tolist() for s in segs] == [[1, 2], [3, 4], [3, 6]]
    assert [s.start for s in segs] == [0, 2, 2]
    assert row.attention_cost == 2 * 2 + 2 * 4 + 2 * 4 == row.recompute_attention_cost()


def test_prefix_and_duplicate_samples_are_free():
    row = TreeRow()
    row.add(make_sample([1, 2, 3, 4, 5, 6], 3))
    assert row.novel_tokens(make_sample([1, 2, 3, 4, 5, 6], 3)) == 0
    assert row.novel_tokens(make_sample([1, 2, 3, 4], 1)) == 0  # nodes (1,2) (2,3) (3,4) exist
    assert row.novel_tokens(make_sample([1, 2, 3, 9], 1)) == 1  # (3,9) is new


def test_leaf_extension_keeps_one_segment():
    row = TreeRow()
    row.add(make_sample([1, 2, 3], 1))
    row.add(make_sample([1, 2, 3, 4, 5], 1))
    assert len(row.segments()) == 1 and row.num_unique_tokens == 4
    assert row.attention_cost == 4 * 4 == row.recompute_attention_cost()


def test_split_inside_a_segment():
    row = TreeRow()
    row.add(make_sample([1, 2, 3, 4, 5, 6, 7], 3))
    novel, cost = row.preview(make_sample([1, 2, 3, 9, 9], 2))
    row.add(make_sample([1, 2, 3, 9, 9], 2))
    assert novel == 2 and cost == row.attention_cost == row.recompute_attention_cost()
    assert [s.ids[:-1].tolist() for s in row.segments()] == [[1, 2], [3, 4, 5, 6], [3, 9]]


def test_untrained_tail_and_no_trained_token():
    s = make_sample([1, 2, 3, 4, 5], [False, False, True, False, False])
    assert forwarded_positions(s) == 2  # positions 0 and 1; 1 predicts token 2
    row = TreeRow()
    assert row.add(make_sample([1, 2, 3], 0)) == 0
    assert row.num_samples == 1 and row.num_unique_tokens == 0


def test_fits_counts_unique_tokens():
    row = TreeRow()
    prompt = list(range(10))
    row.add(make_sample(prompt + [20, 21], 2))  # 11 positions
    other = make_sample(prompt + [30, 31], 2)  # shares 9 positions, 2 novel
    assert row.fits(other, token_budget=13) and not row.fits(other, token_budget=12)


def test_flat_row_shares_nothing():
    row = TreeRow(flat=True)
    for _ in range(3):
        row.add(make_sample([1, 2, 3, 4], 2))
    assert row.num_unique_tokens == row.num_raw_tokens == 9
    assert row.attention_cost == 3 * 9 == row.recompute_attention_cost()


@given(sample_sets())
@settings(max_examples=150, deadline=None)
def test_trie_matches_brute_force(samples):
    row = TreeRow()
    for s in samples:
        expected_novel, expected_cost = row.preview(s)
        assert row.add(s) == expected_novel
        assert row.attention_cost == expected_cost
    unique, cost = brute_force(samples)
    assert row.num_unique_tokens == unique
    assert row.attention_cost == cost == row.recompute_attention_cost()
    assert row.num_raw_tokens == sum(forwarded_positions(s) for s in samples)
    # every segment but the roots hangs off a fork (or it would have been merged into its parent)
    for seg in row.segments():
        if seg.start:
            assert len(seg.parent.children) >= 2
        keys = list(seg.children)
        assert len({k[0] for k in keys}) <= 1 and len(set(keys)) == len(keys)


@pytest.mark.parametrize("flat", [False, True])
def test_order_does_not_change_size(flat):
    rng = np.random.default_rng(0)
    samples = [make_sample([7, 7, 7] + rng.integers(0, 3, 6).tolist(), 4) for _ in range(12)]
    sizes = set()
    for perm in range(4):
        row = TreeRow(flat=flat)
        for i in rng.permutation(len(samples)) if perm else range(len(samples)):
            row.add(samples[i])
        sizes.add((row.num_unique_tokens, row.attention_cost))
    assert len(sizes) == 1

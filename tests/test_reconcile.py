"""Multi-turn reconcile on hand-built token chains: CLEAN, REALIGN, FORK, drops and the threshold edge."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from grpo_core.rollout.reconcile import (
    TurnKind,
    align_turn,
    gather_sampling_masks,
    gather_top_logprobs,
    reconcile_turns,
)
from grpo_core.rollout.types import RolloutSample, TurnRecord

# A toy ChatML vocabulary: specials below 100, text tokens from 100 on.
IM_START, IM_END, NL, SYSTEM, USER, ASSISTANT, TOOL, THINK, END_THINK = range(1, 10)


def msg(role: int, *content: int) -> list[int]:
    return [IM_START, role, NL, *content, IM_END, NL]


GEN = [IM_START, ASSISTANT, NL]  # generation prompt
P0 = msg(SYSTEM, 100) + msg(USER, 101, 102) + GEN


def turn(prompt: list[int], output: list[int], version: int = 0, top_n: int = 0) -> TurnRecord:
    """A turn whose log-probs encode (turn-free) positions so alignment errors show up as wrong values."""
    logprobs = [-0.01 * (t % 97) - 0.001 * i for i, t in enumerate(output)]
    rec = TurnRecord(prompt_ids=list(prompt), output_ids=list(output), output_logprobs=logprobs, policy_version=version)
    if top_n:
        rec.top_ids = np.array([[t + k for k in range(top_n)] for t in output], dtype=np.int32).reshape(-1, top_n)
        rec.top_logprobs = np.array([[lp - k for k in range(top_n)] for lp in logprobs], dtype=np.float32).reshape(
            -1, top_n
        )
        rec.sampling_masks = [np.array([t, t + 1], dtype=np.int32) for t in output]
    return rec


def check_trained_tokens_are_sampled(turns: list[TurnRecord], result) -> None:
    """The core guarantee: each trained token is exactly a sampled token with its sampler log-prob."""
    for seq in result.sequences:
        trained = np.flatnonzero(seq.completion_mask)
        assert len(trained) == len(seq.output_turn) == len(seq.output_pos)
        for p, t, k in zip(trained, seq.output_turn, seq.output_pos, strict=True):
            assert seq.token_ids[p] == turns[t].output_ids[k]
            assert seq.sampler_logprobs[p] == np.float32(turns[t].output_logprobs[k])
        assert np.all(seq.sampler_logprobs[~seq.completion_mask] == 0)
        assert seq.token_ids.dtype == np.int32 and seq.completion_mask.dtype == bool
        assert seq.sampler_logprobs.dtype == np.float32
        # A sequence always ends as its last turn's prompt + output.
        last = turns[seq.last_turn]
        assert seq.token_ids.tolist() == last.prompt_ids + last.output_ids


def trained_ids(seq) -> list[int]:
    return seq.token_ids[seq.completion_mask].tolist()


# --------------------------------------------------------------------------------------------------
# CLEAN
# --------------------------------------------------------------------------------------------------


def test_single_turn() -> None:
    turns = [turn(P0, [200, 201, IM_END])]
    r = reconcile_turns(turns, fork_threshold_tokens=8)
    assert len(r.sequences) == 1 and r.turn_kinds == [None]
    seq = r.sequences[0]
    assert seq.completion_mask.tolist() == [False] * len(P0) + [True] * 3
    assert seq.output_turn.tolist() == [0, 0, 0] and seq.output_pos.tolist() == [0, 1, 2]
    assert r.stats.fork_frac == 0.0
    check_trained_tokens_are_sampled(turns, r)


def test_clean_chain_stays_one_sequence() -> None:
    out0 = [200, 201, IM_END]
    p1 = P0 + out0 + [NL] + msg(TOOL, 300, 301) + GEN
    out1 = [210, IM_END]
    p2 = p1 + out1 + [NL] + msg(TOOL, 302) + GEN
    out2 = [220, 221, 222, IM_END]
    turns = [turn(P0, out0), turn(p1, out1), turn(p2, out2)]
    r = reconcile_turns(turns, fork_threshold_tokens=8)
    assert r.turn_kinds == [None, TurnKind.CLEAN, TurnKind.CLEAN]
    assert (r.stats.clean, r.stats.realign, r.stats.fork) == (2, 0, 0)
    (seq,) = r.sequences
    assert trained_ids(seq) == out0 + out1 + out2
    # Tool results and templates are context.
    assert not seq.completion_mask[len(P0) + len(out0) : len(p1)].any()
    assert seq.output_turn.tolist() == [0] * 3 + [1] * 2 + [2] * 4
    check_trained_tokens_are_sampled(turns, r)


# --------------------------------------------------------------------------------------------------
# REALIGN
# --------------------------------------------------------------------------------------------------


def test_realign_bpe_merge_at_answer_end() -> None:
    # Generation stopped on length after "201 202"; the template closes the message and the tokenizer
    # merges the two into 250: the answer's last token never re-appears, so no tail re-synchronises.
    out0 = [200, 201, 202]
    p1 = P0 + [200, 250, IM_END, NL] + msg(USER, 103) + GEN
    out1 = [210, IM_END]
    turns = [turn(P0, out0), turn(p1, out1)]
    r = reconcile_turns(turns, fork_threshold_tokens=8)
    assert r.turn_kinds == [None, TurnKind.REALIGN]
    assert r.stats.realign == 1 and r.stats.realigned_tokens == 2
    (seq,) = r.sequences
    assert seq.token_ids.tolist() == p1 + out1
    assert trained_ids(seq) == [200] + out1  # 250 (the re-tokenised drift) is context
    assert not seq.completion_mask[len(P0) + 1]
    check_trained_tokens_are_sampled(turns, r)


def test_realign_resyncs_tail_inside_answer() -> None:
    # Mid-answer, the model sampled 201 202 where the tokenizer writes 260; the rest matches again, and
    # later IM_END tokens in the tool message must not be mistaken for the answer's end.
    out0 = [200, 201, 202, 203, 204, IM_END]
    p1 = P0 + [200, 260, 203, 204, IM_END, NL] + msg(TOOL, 300, IM_END) + GEN
    out1 = [210, IM_END]
    turns = [turn(P0, out0), turn(p1, out1)]
    a = align_turn(P0 + out0, len(P0), p1, fork_threshold_tokens=8)
    assert a.kind is TurnKind.REALIGN
    assert (a.prefix_len, a.held_resume, a.new_resume, a.drift_tokens) == (len(P0) + 1, len(P0) + 3, len(P0) + 2, 2)
    r = reconcile_turns(turns, fork_threshold_tokens=8)
    (seq,) = r.sequences
    assert trained_ids(seq) == [200, 203, 204, IM_END] + out1
    assert seq.output_pos.tolist()[:4] == [0, 3, 4, 5]  # the tail keeps its sampled positions
    assert r.stats.realigned_tokens == 2
    check_trained_tokens_are_sampled(turns, r)


def test_realign_when_template_inserts_inside_answer() -> None:
    # Pure insertion (e.g. an empty think block rendered before the answer): nothing sampled is lost.
    out0 = [200, 201, IM_END]
    p1 = P0 + [THINK, NL, END_THINK, 200, 201, IM_END, NL] + msg(USER, 103) + GEN
    turns = [turn(P0, out0), turn(p1, [210])]
    r = reconcile_turns(turns, fork_threshold_tokens=8)
    assert r.turn_kinds[1] is TurnKind.REALIGN
    assert r.stats.realigned_tokens == 0
    assert trained_ids(r.sequences[0]) == out0 + [210]
    check_trained_tokens_are_sampled(turns, r)


def test_think_dropped_from_last_answer_realigns_when_small() -> None:
    out0 = [THINK, 400, 401, END_THINK, 200, IM_END]
    p1 = P0 + [200, IM_END, NL] + msg(USER, 103) + GEN
    turns = [turn(P0, out0), turn(p1, [210, IM_END])]
    r = reconcile_turns(turns, fork_threshold_tokens=5)
    assert r.turn_kinds[1] is TurnKind.REALIGN
    assert r.stats.realigned_tokens == 4
    assert trained_ids(r.sequences[0]) == [200, IM_END, 210, IM_END]
    check_trained_tokens_are_sampled(turns, r)
    # The same drift at a threshold of 4 forks.
    assert reconcile_turns(turns, fork_threshold_tokens=4).turn_kinds[1] is TurnKind.FORK


# --------------------------------------------------------------------------------------------------
# FORK
# --------------------------------------------------------------------------------------------------


def test_fork_on_large_drift() -> None:
    # The model's tool call was re-rendered by the template: a long span differs.
    out0 = [200, 500, 501, 502, 503, 504, 505, IM_END]
    p1 = P0 + [200, 600, 601, 602, 603, 604, 605, 606, IM_END, NL] + msg(TOOL, 300) + GEN
    out1 = [210, IM_END]
    turns = [turn(P0, out0, version=3), turn(p1, out1, version=4)]
    r = reconcile_turns(turns, fork_threshold_tokens=4)
    assert r.turn_kinds == [None, TurnKind.FORK]
    assert r.stats.fork == 1 and r.stats.fork_frac == 1.0
    first, second = r.sequences
    assert first.token_ids.tolist() == P0 + out0 and trained_ids(first) == out0
    assert second.token_ids.tolist() == p1 + out1 and trained_ids(second) == out1
    assert (first.first_turn, first.last_turn, second.first_turn, second.last_turn) == (0, 0, 1, 1)
    assert (first.policy_version, second.policy_version) == (3, 4)
    check_trained_tokens_are_sampled(turns, r)


def test_fork_when_template_drops_earlier_think() -> None:
    # Tool loop: reasoning is kept while the assistant keeps the floor (CLEAN); after a new user
    # message the template strips <think> from all past assistant turns, so the drift starts inside
    # turn 0's answer, before the last answer: always a fork, whatever the threshold.
    out0 = [THINK, 400, 401, END_THINK, 200, IM_END]
    p1 = P0 + out0 + [NL] + msg(TOOL, 300) + GEN
    out1 = [THINK, 410, END_THINK, 210, IM_END]
    p2 = P0 + [200, IM_END, NL] + msg(TOOL, 300) + [IM_START, ASSISTANT, NL, 210, IM_END, NL] + msg(USER, 104) + GEN
    out2 = [THINK, 420, END_THINK, 220, IM_END]
    turns = [turn(P0, out0), turn(p1, out1), turn(p2, out2)]
    r = reconcile_turns(turns, fork_threshold_tokens=10_000)
    assert r.turn_kinds == [None, TurnKind.CLEAN, TurnKind.FORK]
    assert r.stats.fork_frac == 0.5
    first, second = r.sequences
    assert trained_ids(first) == out0 + out1  # the reasoning keeps its exact sampled tokens
    assert second.token_ids.tolist() == p2 + out2 and trained_ids(second) == out2
    check_trained_tokens_are_sampled(turns, r)


def test_fork_on_drift_in_context() -> None:
    # The system prompt changed (e.g. a date in the template): drift before any answer.
    out0 = [200, IM_END]
    p1 = msg(SYSTEM, 199) + msg(USER, 101, 102) + msg(ASSISTANT, 200) + msg(USER, 103) + GEN
    turns = [turn(P0, out0), turn(p1, [210])]
    r = reconcile_turns(turns, fork_threshold_tokens=10_000)
    assert r.turn_kinds[1] is TurnKind.FORK and len(r.sequences) == 2
    check_trained_tokens_are_sampled(turns, r)


# --------------------------------------------------------------------------------------------------
# Threshold boundary
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("threshold", "kind"), [(2, TurnKind.FORK), (3, TurnKind.FORK), (4, TurnKind.REALIGN)])
def test_threshold_boundary(threshold: int, kind: TurnKind) -> None:
    # Held span 201 202 203 (3 tokens) re-tokenised as 260 270 (2 tokens): drift = max(3, 2) = 3.
    out0 = [200, 201, 202, 203, 204, IM_END]
    p1 = P0 + [200, 260, 270, 204, IM_END, NL] + msg(USER, 103) + GEN
    turns = [turn(P0, out0), turn(p1, [210])]
    assert align_turn(P0 + out0, len(P0), p1, threshold).drift_tokens == 3
    r = reconcile_turns(turns, fork_threshold_tokens=threshold)
    assert r.turn_kinds[1] is kind
    assert len(r.sequences) == (1 if kind is TurnKind.REALIGN else 2)
    check_trained_tokens_are_sampled(turns, r)


@pytest.mark.parametrize(("threshold", "kind"), [(2, TurnKind.FORK), (3, TurnKind.REALIGN)])
def test_threshold_boundary_insertion_side(threshold: int, kind: TurnKind) -> None:
    # Held 201 (1 token) re-tokenised as 261 262 (2 tokens): the larger side counts, drift = 2.
    out0 = [200, 201, 204, IM_END]
    p1 = P0 + [200, 261, 262, 204, IM_END, NL] + msg(USER, 103) + GEN
    turns = [turn(P0, out0), turn(p1, [210])]
    assert reconcile_turns(turns, fork_threshold_tokens=threshold).turn_kinds[1] is kind


# --------------------------------------------------------------------------------------------------
# Drops, alignment of per-token data, validation
# --------------------------------------------------------------------------------------------------


def test_sequence_without_trained_token_is_dropped() -> None:
    # Turn 0 was aborted with no tokens; the next prompt differs in context, so the empty sequence
    # is closed by a fork and dropped.
    p1 = msg(SYSTEM, 199) + msg(USER, 101) + GEN
    turns = [turn(P0, []), turn(p1, [210, IM_END])]
    r = reconcile_turns(turns, fork_threshold_tokens=8)
    assert r.turn_kinds[1] is TurnKind.FORK
    assert r.stats.dropped_sequences == 1
    (seq,) = r.sequences
    assert seq.first_turn == 1
    # A single turn with nothing generated yields nothing.
    r = reconcile_turns([turn(P0, [])], fork_threshold_tokens=8)
    assert r.sequences == [] and r.stats.dropped_sequences == 1


def test_sequence_whose_tokens_all_realigned_away_is_dropped() -> None:
    out0 = [201, 202]  # length stop; re-tokenised as one token, and the next turn generated nothing
    p1 = P0 + [250, IM_END, NL] + msg(USER, 103) + GEN
    turns = [turn(P0, out0), turn(p1, [])]
    r = reconcile_turns(turns, fork_threshold_tokens=8)
    assert r.turn_kinds[1] is TurnKind.REALIGN
    assert r.sequences == [] and r.stats.dropped_sequences == 1


def test_top_n_and_sampling_masks_follow_trained_positions() -> None:
    out0 = [200, 201, 202, 203, 204, IM_END]
    p1 = P0 + [200, 260, 203, 204, IM_END, NL] + msg(TOOL, 300) + GEN
    out1 = [210, 211, IM_END]
    turns = [turn(P0, out0, version=7, top_n=3), turn(p1, out1, version=8, top_n=3)]
    r = reconcile_turns(turns, fork_threshold_tokens=8)
    (seq,) = r.sequences
    top = gather_top_logprobs(seq, turns)
    assert top is not None
    top_ids, top_lp = top
    assert top_ids.shape == (seq.num_trained, 3) and top_ids.dtype == np.int32
    # The toy top-N puts the sampled token first: column 0 must equal the trained tokens.
    assert top_ids[:, 0].tolist() == trained_ids(seq)
    assert np.array_equal(top_lp[:, 0], seq.sampler_logprobs[seq.completion_mask])
    masks = gather_sampling_masks(seq, turns)
    assert masks is not None and [int(m[0]) for m in masks] == trained_ids(seq)
    sample = RolloutSample(
        token_ids=seq.token_ids,
        completion_mask=seq.completion_mask,
        sampler_logprobs=seq.sampler_logprobs,
        advantage=0.5,
        reward=1.0,
        group_id=0,
        row_index=0,
        epoch=0,
        rollout_id="r0",
        policy_version=seq.policy_version,
        sampler_top_ids=top_ids,
        sampler_top_logprobs=top_lp,
        sampling_masks=masks,
    )
    assert sample.num_trained == len(top_ids) and sample.policy_version == 7
    # Without top-N in a contributing turn there is nothing to gather.
    turns[1].top_ids = None
    turns[1].sampling_masks = None
    assert gather_top_logprobs(seq, turns) is None and gather_sampling_masks(seq, turns) is None


def test_policy_version_is_that_of_first_trained_token() -> None:
    out0 = [201, 202]
    p1 = P0 + [250, IM_END, NL] + msg(USER, 103) + GEN
    turns = [turn(P0, out0, version=1), turn(p1, [210], version=2)]
    (seq,) = reconcile_turns(turns, fork_threshold_tokens=8).sequences
    assert seq.policy_version == 2  # turn 0's tokens were all realigned to context


def test_empty_first_prompt_never_trains_position_zero() -> None:
    turns = [turn([], [200, 201])]
    (seq,) = reconcile_turns(turns, fork_threshold_tokens=8).sequences
    assert seq.completion_mask.tolist() == [False, True]
    assert seq.output_pos.tolist() == [1]


def test_validation() -> None:
    bad = TurnRecord(prompt_ids=[1], output_ids=[2, 3], output_logprobs=[-0.1])
    with pytest.raises(ValueError, match="output_logprobs"):
        reconcile_turns([bad], fork_threshold_tokens=8)
    with pytest.raises(ValueError, match="fork_threshold_tokens"):
        reconcile_turns([turn(P0, [200])], fork_threshold_tokens=0)
    assert reconcile_turns([], fork_threshold_tokens=8).sequences == []


# --------------------------------------------------------------------------------------------------
# Properties on random chains
# --------------------------------------------------------------------------------------------------


@st.composite
def chains(draw: st.DrawFn) -> list[TurnRecord]:
    """Random chains over a tiny alphabet (so stray tail matches are common) with random drift."""
    tok = st.integers(min_value=100, max_value=104)
    prompt = draw(st.lists(tok, min_size=0, max_size=6))
    turns = []
    for k in range(draw(st.integers(min_value=1, max_value=5))):
        output = draw(st.lists(tok, min_size=0, max_size=6))
        turns.append(turn(prompt, output, version=k))
        held = prompt + output
        if draw(st.booleans()) and held:
            # Re-tokenisation drift: replace a random span with random tokens.
            a = draw(st.integers(min_value=0, max_value=len(held) - 1))
            b = draw(st.integers(min_value=a, max_value=len(held)))
            held = held[:a] + draw(st.lists(tok, max_size=3)) + held[b:]
        prompt = held + draw(st.lists(tok, min_size=0, max_size=4))
    return turns


@settings(max_examples=300, deadline=None)
@given(chains(), st.integers(min_value=1, max_value=6))
def test_random_chains_keep_invariants(turns: list[TurnRecord], threshold: int) -> None:
    r = reconcile_turns(turns, fork_threshold_tokens=threshold)
    check_trained_tokens_are_sampled(turns, r)
    s = r.stats
    assert s.clean + s.realign + s.fork == len(turns) - 1
    assert len(r.sequences) + s.dropped_sequences == s.fork + 1
    assert all(seq.num_trained > 0 and not seq.completion_mask[0] for seq in r.sequences)
    # Every turn's output is trained whole in the sequence that ends with it (bar position 0).
    for seq in r.sequences:
        last = seq.last_turn
        n_last = int((seq.output_turn == last).sum())
        assert n_last == len(turns[last].output_ids) - (1 if len(seq) == len(turns[last].output_ids) else 0)


def brute_force_drift(held: list[int], answer_start: int, new: list[int]) -> int | None:
    """Smallest drift over every (i, j) re-synchronisation, None for CLEAN or drift before the answer."""
    p = 0
    while p < min(len(held), len(new)) and held[p] == new[p]:
        p += 1
    if p == len(held) or p < answer_start:
        return None
    best = len(held) - p  # no tail
    for i in range(p, len(held)):
        tail = held[i:]
        for j in range(p, len(new) - len(tail) + 1):
            if new[j : j + len(tail)] == tail:
                best = min(best, max(i - p, j - p))
    return best


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.integers(100, 102), max_size=6),
    st.lists(st.integers(100, 102), min_size=1, max_size=6),
    st.lists(st.integers(100, 102), max_size=12),
)
def test_drift_search_matches_brute_force(prefix: list[int], answer: list[int], new: list[int]) -> None:
    held = prefix + answer
    expected = brute_force_drift(held, len(prefix), new)
    a = align_turn(held, len(prefix), new, fork_threshold_tokens=1_000)
    if expected is None:
        assert a.kind is not TurnKind.REALIGN
    else:
        assert a.kind is TurnKind.REALIGN and a.drift_tokens == expected
        # The chosen split really re-synchronises.
        tail = held[a.held_resume :]
        assert new[a.new_resume : a.new_resume + len(tail)] == tail

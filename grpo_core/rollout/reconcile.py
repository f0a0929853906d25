"""Multi-turn re-tokenisation reconcile: a chain of ``TurnRecord`` in, training sequences out (pure).

Each turn of a multi-turn rollout re-renders the whole message list with the chat template, so the
prompt of turn k is a fresh tokenisation of everything said so far. It usually starts with exactly the
tokens held from turns < k, but not always: a sampled answer need not be the canonical tokenisation of
its own text (BPE merges differ, whitespace is stripped, tool calls are re-rendered), and some templates
rewrite earlier turns (Qwen3 drops ``<think>...</think>`` from past assistant turns). Each turn after the
first is classified against the held tokens:

- CLEAN: the new prompt starts with the held tokens; append the new context and the new output.
- REALIGN: the prompt differs only inside the previous turn's answer, by fewer than
  ``fork_threshold_tokens``; keep one sequence, take the re-tokenised tokens, and make the drifted
  span context, since those tokens are not what was sampled.
- FORK: anything else; close the sequence and open a new one on the new prompt, so every trained token
  keeps its exact sampled id and log-prob.

How REALIGN finds the drift span, with H the held tokens and N the new prompt: p = the length of their
common prefix. If p lies before the start of the previous answer, it is a FORK. Otherwise the end of
the answer must re-appear in N: for each place q in N where H's last token occurs, the common suffix of
H and N[:q] (kept at or after p) is the re-synchronised tail H[i:] == N[j:q]; the drift is the pair of
spans H[p:i] (held, dropped) and N[p:j] (re-tokenised, context), measured as max(i - p, j - p). The q
with the smallest drift wins, so a stray match of a common token (e.g. a later ``<|im_end|>``) loses to
the true one. When no tail re-synchronises (the answer's last token changed), where the old answer ends
inside N is unknown without a tokenizer, so the drift is measured on the held side alone: len(H) - p.
The tail keeps its trained status: those are the sampled tokens, only their left context was
re-tokenised. Tests: tests/test_reconcile.py.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from grpo_core.rollout.types import TurnRecord


class TurnKind(str, enum.Enum):
    CLEAN = "clean"
    REALIGN = "realign"
    FORK = "fork"


@dataclass(frozen=True)
class Alignment:
    """How a turn's new prompt lines up with the held tokens (see the module docstring for H, N, p, i, j).

    For CLEAN, ``held_resume == new_resume == prefix_len == len(H)``. For REALIGN the held span
    ``[prefix_len, held_resume)`` is replaced by the new span ``[prefix_len, new_resume)``, and
    ``held_resume == len(H)`` when no tail re-synchronised. For FORK the resume fields are meaningless.
    """

    kind: TurnKind
    prefix_len: int
    held_resume: int
    new_resume: int
    drift_tokens: int


@dataclass
class RolloutSequence:
    """One training sequence of a rollout: a run of turns that share one token history.

    ``token_ids``, ``completion_mask`` and ``sampler_logprobs`` are aligned ([L]); ``sampler_logprobs`` is
    0 where the token is not trained. ``output_turn`` / ``output_pos`` ([T], T = number of trained
    tokens, in position order) say which turn's ``output_ids[pos]`` each trained token is, so per-token
    turn data (top-N arrays, sampling masks) can be gathered with ``gather_top_logprobs`` /
    ``gather_sampling_masks``.
    """

    token_ids: np.ndarray  # int32 [L]
    completion_mask: np.ndarray  # bool [L]
    sampler_logprobs: np.ndarray  # float32 [L]
    output_turn: np.ndarray  # int32 [T]
    output_pos: np.ndarray  # int32 [T]
    first_turn: int
    last_turn: int
    # Weight version that generated the first trained token (RolloutSample.policy_version).
    policy_version: int

    @property
    def num_trained(self) -> int:
        return int(self.completion_mask.sum())

    def __len__(self) -> int:
        return len(self.token_ids)


@dataclass
class ReconcileStats:
    """Per-rollout classification counts; sum them over rollouts before dividing."""

    turns: int = 0
    clean: int = 0
    realign: int = 0
    fork: int = 0
    # Held trained tokens a REALIGN turned into context (generated, not trained).
    realigned_tokens: int = 0
    dropped_sequences: int = 0

    @property
    def fork_frac(self) -> float:
        """``rollout/fork_frac``: forks / turns after the first; 0.0 for a single-turn rollout."""
        later = self.turns - 1
        return self.fork / later if later > 0 else 0.0


@dataclass
class ReconcileResult:
    sequences: list[RolloutSequence]
    stats: ReconcileStats
    # One entry per turn; None for the first turn, which has nothing to reconcile against.
    turn_kinds: list[TurnKind | None] = field(default_factory=list)


# ---------------------------------------------------------------------------------------------------
# Alignment of one turn
# ---------------------------------------------------------------------------------------------------


def _common_prefix_len(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if len(diff) else n


def align_turn(held: Sequence[int], answer_start: int, new_prompt: Sequence[int], fork_threshold_tokens: int) -> Alignment:
    """Classify a new prompt against the held tokens, whose last answer starts at ``answer_start``."""
    h = np.asarray(held, dtype=np.int64)
    n = np.asarray(new_prompt, dtype=np.int64)
    p = _common_prefix_len(h, n)
    if p == len(h):
        return Alignment(TurnKind.CLEAN, p, p, p, 0)
    if p < answer_start:
        # Drift in context or an earlier answer: a realign would silently retrain earlier turns.
        return Alignment(TurnKind.FORK, p, p, p, len(h) - p)

    # No tail: everything from p on is dropped; only the held side of the drift is measurable.
    best = (len(h) - p, len(h), len(n))
    # The tail H[i:] == N[j:q] must start at or after p on both sides, and a drift >= threshold forks
    # anyway, so q < len(H) + threshold bounds the search.
    q_max = min(len(n), len(h) + fork_threshold_tokens)
    rev_h = h[p:][::-1]
    for q in np.flatnonzero(n[p:q_max] == h[-1]) + p + 1:
        limit = min(len(rev_h), int(q) - p)
        rev_n = n[q - limit : q][::-1]
        mismatch = np.flatnonzero(rev_h[:limit] != rev_n)
        tail = int(mismatch[0]) if len(mismatch) else limit
        i, j = len(h) - tail, int(q) - tail
        drift = max(i - p, j - p)
        # Ties prefer the longer tail: fewer sampled tokens lose their trained status.
        if (drift, i) < (best[0], best[1]):
            best = (drift, i, j)
    drift, i, j = best
    kind = TurnKind.REALIGN if drift < fork_threshold_tokens else TurnKind.FORK
    return Alignment(kind, p, i, j, drift)


# ---------------------------------------------------------------------------------------------------
# Chain → sequences
# ---------------------------------------------------------------------------------------------------


class _Builder:
    """Mutable token history of the sequence being built; ``turn == -1`` marks context tokens."""

    def __init__(self, first_turn: int) -> None:
        self.first_turn = first_turn
        self.last_turn = first_turn
        self.tokens: list[int] = []
        self.logprobs: list[float] = []
        self.turn: list[int] = []
        self.pos: list[int] = []
        self.answer_start = 0

    def add_context(self, ids: Sequence[int]) -> None:
        self.tokens.extend(int(t) for t in ids)
        self.logprobs.extend([0.0] * len(ids))
        self.turn.extend([-1] * len(ids))
        self.pos.extend([-1] * len(ids))

    def add_output(self, turn_index: int, record: TurnRecord) -> None:
        self.answer_start = len(self.tokens)
        self.last_turn = turn_index
        self.tokens.extend(int(t) for t in record.output_ids)
        self.logprobs.extend(float(x) for x in record.output_logprobs)
        self.turn.extend([turn_index] * len(record.output_ids))
        self.pos.extend(range(len(record.output_ids)))

    def realign(self, a: Alignment, new_prompt: Sequence[int]) -> int:
        """Rebuild as N with the tail's metadata kept; return how many trained tokens became context."""
        p, i, j = a.prefix_len, a.held_resume, a.new_resume
        lost = sum(1 for t in self.turn[p:i] if t >= 0)
        tail = (self.tokens[i:], self.logprobs[i:], self.turn[i:], self.pos[i:])
        del self.tokens[p:], self.logprobs[p:], self.turn[p:], self.pos[p:]
        self.add_context(new_prompt[p:j])
        self.tokens.extend(tail[0])
        self.logprobs.extend(tail[1])
        self.turn.extend(tail[2])
        self.pos.extend(tail[3])
        self.add_context(new_prompt[j + len(tail[0]) :])
        return lost

    def build(self, turns: Sequence[TurnRecord]) -> RolloutSequence:
        turn = np.asarray(self.turn, dtype=np.int32)
        mask = turn >= 0
        # Nothing predicts the first token, so it can never be trained (only reachable with an empty
        # first prompt); RolloutSample rejects a trained position 0.
        if len(mask):
            mask[0] = False
        logprobs = np.where(mask, np.asarray(self.logprobs, dtype=np.float32), np.float32(0.0))
        trained = np.flatnonzero(mask)
        out_turn = turn[trained]
        first = int(out_turn[0]) if len(out_turn) else self.first_turn
        return RolloutSequence(
            token_ids=np.asarray(self.tokens, dtype=np.int32),
            completion_mask=mask,
            sampler_logprobs=logprobs.astype(np.float32),
            output_turn=out_turn,
            output_pos=np.asarray(self.pos, dtype=np.int32)[trained],
            first_turn=self.first_turn,
            last_turn=self.last_turn,
            policy_version=turns[first].policy_version if len(turns) else 0,
        )


def _check(index: int, record: TurnRecord) -> None:
    if len(record.output_ids) != len(record.output_logprobs):
        raise ValueError(
            f"turn {index}: {len(record.output_ids)} output_ids but {len(record.output_logprobs)} output_logprobs"
        )


def reconcile_turns(turns: Sequence[TurnRecord], fork_threshold_tokens: int) -> ReconcileResult:
    """Turn a rollout's chain of turns into training sequences (at least one unless nothing is trained)."""
    if fork_threshold_tokens < 1:
        raise ValueError(f"fork_threshold_tokens must be >= 1, got {fork_threshold_tokens}")
    stats = ReconcileStats(turns=len(turns))
    kinds: list[TurnKind | None] = []
    closed: list[_Builder] = []
    current: _Builder | None = None
    for k, record in enumerate(turns):
        _check(k, record)
        if current is None:
            kinds.append(None)
            current = _Builder(k)
            current.add_context(record.prompt_ids)
        else:
            a = align_turn(current.tokens, current.answer_start, record.prompt_ids, fork_threshold_tokens)
            kinds.append(a.kind)
            if a.kind is TurnKind.CLEAN:
                stats.clean += 1
                current.add_context(record.prompt_ids[a.prefix_len :])
            elif a.kind is TurnKind.REALIGN:
                stats.realign += 1
                stats.realigned_tokens += current.realign(a, record.prompt_ids)
            else:
                stats.fork += 1
                closed.append(current)
                current = _Builder(k)
                current.add_context(record.prompt_ids)
        current.add_output(k, record)
    if current is not None:
        closed.append(current)

    sequences = []
    for builder in closed:
        seq = builder.build(turns)
        if seq.num_trained:
            sequences.append(seq)
        else:
            stats.dropped_sequences += 1
    return ReconcileResult(sequences=sequences, stats=stats, turn_kinds=kinds)


# ---------------------------------------------------------------------------------------------------
# Per-trained-token turn data
# ---------------------------------------------------------------------------------------------------


def gather_top_logprobs(seq: RolloutSequence, turns: Sequence[TurnRecord]) -> tuple[np.ndarray, np.ndarray] | None:
    """Sampler top-N (ids int32 [T, N], log-probs float32 [T, N]) of the trained tokens, in order.

    None when a turn that contributes a trained token has no top-N arrays.
    """
    ids_rows: list[np.ndarray] = []
    lp_rows: list[np.ndarray] = []
    for t in np.unique(seq.output_turn):
        if turns[t].top_ids is None or turns[t].top_logprobs is None:
            return None
    for t, pos in zip(seq.output_turn.tolist(), seq.output_pos.tolist(), strict=True):
        ids_rows.append(turns[t].top_ids[pos])  # type: ignore[index]
        lp_rows.append(turns[t].top_logprobs[pos])  # type: ignore[index]
    if not ids_rows:
        return None
    return np.stack(ids_rows).astype(np.int32), np.stack(lp_rows).astype(np.float32)


def gather_sampling_masks(seq: RolloutSequence, turns: Sequence[TurnRecord]) -> list[np.ndarray] | None:
    """Per trained token, the candidate ids that survived top-k/top-p; None when a turn lacks them."""
    if any(turns[t].sampling_masks is None for t in np.unique(seq.output_turn)):
        return None
    return [
        np.asarray(turns[t].sampling_masks[pos], dtype=np.int32)  # type: ignore[index]
        for t, pos in zip(seq.output_turn.tolist(), seq.output_pos.tolist(), strict=True)
    ]

"""The prefix trie of one packed row (``TreeRow``): a token shared by several samples is stored once.

A node is one forwarded position, keyed on ``(token, next token)``: its output predicts exactly one
token, so two samples that share ``p1 p2 p3`` and then go ``a1`` / ``b1`` split one token early, at
``(p3, a1)`` / ``(p3, b1)``. Chains of nodes without a fork are stored as one ``Segment`` (a radix
trie), which is also the unit of attention: a segment's queries see the keys of its root-to-segment
path.

A sample only needs the positions up to the one that predicts its last trained token: the last
token of a sample predicts nothing, and untrained tokens after the last trained one cannot change
any trained log-prob (attention is causal). So a sample of ``L`` tokens whose last trained token is
at index ``n`` costs ``n`` positions (``forwarded_positions``), and a sample with no trained token
costs none. This is exact and is applied in flat mode too, so the two modes stay comparable.

Run its tests: ``.venv/bin/python -m pytest tests/test_packing_trie.py``.
"""

from __future__ import annotations

import numpy as np

from grpo_core.rollout.types import RolloutSample


def forwarded_positions(sample: RolloutSample) -> int:
    """Positions a sample needs forwarded alone: the index of its last trained token (0 if none)."""
    trained = np.flatnonzero(sample.completion_mask)
    return int(trained[-1]) if len(trained) else 0


def path_ids(sample: RolloutSample) -> np.ndarray:
    """int64 ``token_ids[: n + 1]``: the ``n`` forwarded tokens plus the last token they predict."""
    n = forwarded_positions(sample)
    return np.asarray(sample.token_ids[: n + 1] if n else sample.token_ids[:0], dtype=np.int64)


class Segment:
    """A chain of trie nodes without a fork.

    ``ids`` holds ``q + 1`` tokens for ``q`` nodes: node ``i`` forwards ``ids[i]`` at depth
    ``start + i`` and predicts ``ids[i + 1]``.
    """

    __slots__ = ("ids", "start", "parent", "children", "offset")

    def __init__(self, ids: np.ndarray, start: int, parent: Segment | None) -> None:
        self.ids = ids
        self.start = start
        self.parent = parent
        self.children: dict[tuple, Segment] = {}
        self.offset = -1  # first index in the packed row; set by the collator

    @property
    def num_nodes(self) -> int:
        return len(self.ids) - 1

    @property
    def cost(self) -> int:
        """Queries x keys: the segment's nodes attend to their whole root-to-node path."""
        return self.num_nodes * (self.start + self.num_nodes)


def _key(ids: np.ndarray, i: int) -> tuple[int, int]:
    return int(ids[i]), int(ids[i + 1])


class TreeRow:
    """One row: the samples one data-parallel rank forwards in one micro-batch, as a prefix trie.

    With ``flat=True`` nothing is shared: every sample is a root segment of its own, which is plain
    padding-free packing (kept for comparison).
    """

    def __init__(self, flat: bool = False) -> None:
        self.flat = flat
        self.samples: list[RolloutSample] = []
        self.group_ids: set[int] = set()
        self._root = Segment(np.zeros(0, dtype=np.int64), 0, None)
        self._flat_segments: list[Segment | None] = []  # flat mode: each sample's own segment
        self._unique = 0
        self._raw = 0
        self._trained = 0
        self._cost = 0

    # ---- size and cost -------------------------------------------------------------------------
    @property
    def num_unique_tokens(self) -> int:
        """Positions this row forwards: every trie node once."""
        return self._unique

    @property
    def num_raw_tokens(self) -> int:
        """Positions its samples would forward one by one (the flat-packing size)."""
        return self._raw

    @property
    def num_trained_tokens(self) -> int:
        return self._trained

    @property
    def num_samples(self) -> int:
        return len(self.samples)

    @property
    def attention_cost(self) -> int:
        """Sum over segments of queries x keys: what the attention kernel is asked to do."""
        return self._cost

    @property
    def roots(self) -> list[Segment]:
        return list(self._root.children.values())

    def __len__(self) -> int:
        return self.num_samples

    # ---- placing samples -----------------------------------------------------------------------
    def preview(self, sample: RolloutSample) -> tuple[int, int]:
        """``(novel tokens, attention cost after adding)`` without changing the row."""
        ids = path_ids(sample)
        novel, delta, _ = self._plan_insert(ids)
        return novel, self._cost + delta

    def novel_tokens(self, sample: RolloutSample) -> int:
        """Tokens the sample would add: its positions that are not already in the trie."""
        return self.preview(sample)[0]

    def fits(self, sample: RolloutSample, token_budget: int) -> bool:
        """Whether the row stays within ``token_budget`` unique tokens with the sample in it."""
        return self._unique + self.novel_tokens(sample) <= token_budget

    def add(self, sample: RolloutSample) -> int:
        """Insert the sample; returns the number of novel tokens it added."""
        ids = path_ids(sample)
        n = max(len(ids) - 1, 0)
        novel, delta, where = self._plan_insert(ids)
        self.samples.append(sample)
        self.group_ids.add(sample.group_id)
        self._raw += n
        self._trained += sample.num_trained
        self._unique += novel
        self._cost += delta
        if self.flat:
            self._flat_segments.append(self._new_child(self._root, ids, 0, ("flat", len(self.samples))) if n else None)
        elif novel:
            self._insert(ids, *where)
        return novel

    def _plan_insert(self, ids: np.ndarray) -> tuple[int, int, tuple]:
        """Novel tokens, attention-cost delta and where the insertion happens (see ``_insert``)."""
        n = max(len(ids) - 1, 0)
        if self.flat:
            return n, n * n, ()
        parent, child, depth, matched = self._walk(ids)
        novel = n - depth - matched
        if novel == 0:
            return 0, 0, ()
        if child is None:
            if parent is not self._root and not parent.children:  # extend a leaf chain
                q = parent.num_nodes
                delta = (q + novel) * (depth + novel) - q * depth
            else:  # new branch under a fork (or a new root)
                delta = novel * (depth + novel)
        else:  # split ``child`` after ``matched`` nodes, then branch
            s, q, m = child.start, child.num_nodes, matched
            delta = m * (s + m) + (q - m) * (s + q) + novel * (s + m + novel) - q * (s + q)
        return novel, delta, (parent, child, depth, matched)

    def _walk(self, ids: np.ndarray) -> tuple[Segment, Segment | None, int, int]:
        """Follow ``ids`` down the trie.

        Returns ``(parent, child, depth, matched)``: the walk matched every node down to ``parent``
        (``depth`` nodes) and then ``matched`` more nodes of ``child`` (``child`` is None when no
        child of ``parent`` starts with the next node).
        """
        n = max(len(ids) - 1, 0)
        cur, depth = self._root, 0
        while depth < n:
            child = cur.children.get(_key(ids, depth))
            if child is None:
                return cur, None, depth, 0
            q = child.num_nodes
            span = min(q + 1, n - depth + 1)
            diff = np.flatnonzero(child.ids[:span] != ids[depth : depth + span])
            # node i matches when tokens i and i + 1 match; the key already matched node 0
            matched = int(diff[0]) - 1 if len(diff) else span - 1
            if matched < q:
                return cur, child, depth, matched
            cur, depth = child, depth + q
        return cur, None, depth, 0

    def _new_child(self, parent: Segment, ids: np.ndarray, start: int, key: tuple) -> Segment:
        seg = Segment(np.array(ids, dtype=np.int64), start, parent)
        parent.children[key] = seg
        return seg

    def _insert(self, ids: np.ndarray, parent: Segment, child: Segment | None, depth: int, matched: int) -> None:
        n = len(ids) - 1
        if child is None:
            if parent is not self._root and not parent.children:
                parent.ids = np.concatenate([parent.ids, ids[depth + 1 : n + 1]])
            else:
                self._new_child(parent, ids[depth : n + 1], depth, _key(ids, depth))
            return
        # Split ``child`` into its first ``matched`` nodes and a tail that keeps its children.
        tail = Segment(child.ids[matched:].copy(), child.start + matched, child)
        tail.children = child.children
        for grandchild in tail.children.values():
            grandchild.parent = tail
        child.ids = child.ids[: matched + 1].copy()
        child.children = {_key(tail.ids, 0): tail}
        at = depth + matched
        self._new_child(child, ids[at : n + 1], at, _key(ids, at))

    # ---- reading the trie back -----------------------------------------------------------------
    def segments(self) -> list[Segment]:
        """All segments in depth-first order (children in insertion order): the packed layout."""
        order: list[Segment] = []
        stack = list(reversed(self._root.children.values()))
        while stack:
            seg = stack.pop()
            order.append(seg)
            stack.extend(reversed(seg.children.values()))
        return order

    def sample_segments(self, index: int) -> list[tuple[Segment, int]]:
        """The ``(segment, nodes used)`` pairs sample ``index`` runs through, root first."""
        if self.flat:
            seg = self._flat_segments[index]
            return [] if seg is None else [(seg, seg.num_nodes)]
        ids = path_ids(self.samples[index])
        n = max(len(ids) - 1, 0)
        path, cur, depth = [], self._root, 0
        while depth < n:
            cur = cur.children[_key(ids, depth)]
            used = min(cur.num_nodes, n - depth)
            path.append((cur, used))
            depth += used
        return path

    def recompute_attention_cost(self) -> int:
        """The attention cost summed from scratch (the incremental count is checked against it)."""
        return sum(seg.cost for seg in self.segments())

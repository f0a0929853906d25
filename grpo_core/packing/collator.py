"""The collator: lays a ``TreeRow`` out depth-first as the CPU tensors of one packed forward.

For the row of the diagram in the tree-packing docs (``p1 p2 p3 a1 a2`` and ``p1 p2 p3 b1 b2``, both
completions trained) the layout is::

    index          0  1 | 2  3 | 4  5        segments S0 [p1 p2], S1 [p3 a1], S2 [p3 b1]
    input_ids     p1 p2 | p3 a1 | p3 b1      (the last tokens a2 / b2 predict nothing: not forwarded)
    position_ids   0  1 |  2  3 |  2  3
    kv_index      0 1 | 0 1 2 3 | 0 1 4 5    each segment's root-to-segment path
    logit_index   r0: 2 3     r1: 4 5        the position that predicts each trained token (a1 a2, b1 b2)

Every trained token keeps its own target, advantage and sampler log-prob, so the loss sees exactly
the terms it would see without packing. Run its tests: ``.venv/bin/python -m pytest
tests/test_packing_collator.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from grpo_core.models.attention.metadata import TreeAttentionMetadata
from grpo_core.models.attention.split import plan_levels

if TYPE_CHECKING:
    from grpo_core.packing.trie import TreeRow


@dataclass
class PackedRow:
    """One row as tensors; ``U`` unique positions, ``T`` trained tokens, ``S`` samples, ``N`` top-N."""

    input_ids: torch.Tensor  # int64 [U]
    position_ids: torch.Tensor  # int64 [U]: depth in the trie = position in the sample
    logit_index: torch.Tensor  # int64 [T]: the position whose output predicts the trained token
    target_ids: torch.Tensor  # int64 [T]
    advantages: torch.Tensor  # float32 [T]
    sampler_logprobs: torch.Tensor  # float32 [T]: the old (sampler) log-prob of the target
    sample_index: torch.Tensor  # int64 [T]: which of the row's samples the token belongs to
    attention: TreeAttentionMetadata  # segments: query ranges and root-to-segment K/V indices
    sample_num_trained: torch.Tensor  # int64 [S]
    sample_policy_version: torch.Tensor  # int64 [S]
    sample_staleness: torch.Tensor  # int64 [S]: weight updates behind the trainer when it took the sample
    sampler_top_ids: torch.Tensor | None = None  # int64 [T, N]; None when no sample has top-N
    sampler_top_logprobs: torch.Tensor | None = None  # float32 [T, N]
    top_valid: torch.Tensor | None = None  # bool [T, N]: False where a sample had fewer (or none)
    # Sampling masks of every trained token as one CSR list: token t's candidate ids are
    # sampling_mask_ids[sampling_mask_offsets[t]:sampling_mask_offsets[t + 1]], valid where
    # sampling_mask_valid[t]. None when no sample in the row has masks.
    sampling_mask_ids: torch.Tensor | None = None  # int64 [M]
    sampling_mask_offsets: torch.Tensor | None = None  # int64 [T + 1]
    sampling_mask_valid: torch.Tensor | None = None  # bool [T]
    # The sampler's expert routes of a mixture-of-experts policy, per forwarded position: int16 [U, layers, k],
    # NO_ROUTE (-1) where the position's samples have none; None when no sample in the row has routes. A
    # position shared by samples takes the first one's (in row order); route_conflicts counts the shared
    # positions where a later sample's expert set differs from it.
    routes: torch.Tensor | None = None
    route_conflicts: int = 0
    is_dummy: bool = False  # an empty row: one pad position and no trained token (keeps ranks in step)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())

    @property
    def num_trained(self) -> int:
        return int(self.target_ids.numel())

    @property
    def num_samples(self) -> int:
        return int(self.sample_num_trained.numel())

    def to(self, device: torch.device | str, non_blocking: bool = True) -> PackedRow:
        moved: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, (torch.Tensor, TreeAttentionMetadata)):
                moved[f.name] = value.to(device, non_blocking=non_blocking)
        return replace(self, **moved)

    def model_inputs(self) -> dict[str, Any]:
        """Keyword arguments for a Hugging Face causal LM whose attention is ``grpo_tree``.

        ``model(**row.model_inputs(), logits_to_keep=row.logit_index)`` returns logits
        ``[1, T, V]`` for the trained tokens only.
        """
        return {
            "input_ids": self.input_ids.unsqueeze(0),
            "position_ids": self.position_ids.unsqueeze(0),
            "tree_attention": self.attention,
            "use_cache": False,
        }


def _long(a: Any) -> torch.Tensor:
    return torch.as_tensor(np.asarray(a, dtype=np.int64))


def _empty_row() -> PackedRow:
    one = torch.zeros(1, dtype=torch.int64)
    none = torch.zeros(0, dtype=torch.int64)
    cu = torch.tensor([0, 1], dtype=torch.int32)
    return PackedRow(
        input_ids=one, position_ids=one.clone(), logit_index=none, target_ids=none.clone(),
        advantages=torch.zeros(0), sampler_logprobs=torch.zeros(0), sample_index=none.clone(),
        attention=TreeAttentionMetadata(cu_seq_q=cu, cu_seq_k=cu.clone(), max_q=1, max_k=1, kv_index=None),
        sample_num_trained=none.clone(), sample_policy_version=none.clone(), sample_staleness=none.clone(),
        is_dummy=True,
    )


def _layout(row: TreeRow) -> tuple[np.ndarray, np.ndarray, TreeAttentionMetadata]:
    """Depth-first layout: input ids, positions and the attention metadata of every segment."""
    order = row.segments()
    offset = 0
    for seg in order:
        seg.offset = offset
        offset += seg.num_nodes
    input_ids = np.concatenate([seg.ids[:-1] for seg in order])
    position_ids = np.concatenate([np.arange(seg.start, seg.start + seg.num_nodes) for seg in order])
    q_lens = np.array([seg.num_nodes for seg in order], dtype=np.int64)
    k_lens = np.array([seg.start + seg.num_nodes for seg in order], dtype=np.int64)
    cu_q = np.concatenate([[0], np.cumsum(q_lens)])
    cu_k = np.concatenate([[0], np.cumsum(k_lens)])
    levels: tuple = ()
    if all(seg.start == 0 for seg in order):
        kv_index = None  # every segment is a root: its keys are its own queries, no gather needed
    else:
        index_of = {id(seg): g for g, seg in enumerate(order)}
        levels = plan_levels(q_lens.tolist(), [index_of.get(id(seg.parent)) for seg in order])
        paths: dict[int, np.ndarray] = {}
        parts = []
        for seg in order:  # parents come before their children in depth-first order
            own = np.arange(seg.offset, seg.offset + seg.num_nodes, dtype=np.int64)
            parent_path = paths.get(id(seg.parent))
            path = own if parent_path is None else np.concatenate([parent_path, own])
            paths[id(seg)] = path
            parts.append(path)
        kv_index = _long(np.concatenate(parts))
    meta = TreeAttentionMetadata(
        cu_seq_q=torch.as_tensor(cu_q, dtype=torch.int32),
        cu_seq_k=torch.as_tensor(cu_k, dtype=torch.int32),
        max_q=int(q_lens.max()),
        max_k=int(k_lens.max()),
        kv_index=kv_index,
        levels=levels,
    )
    return input_ids, position_ids, meta


def pack_row(row: TreeRow) -> PackedRow:
    """Collate one row (``TreeRow.pack`` calls this). An empty row gives a dummy one-token row."""
    if row.num_unique_tokens == 0:
        dummy = _empty_row()
        s = row.num_samples
        dummy.sample_num_trained = torch.zeros(s, dtype=torch.int64)
        dummy.sample_policy_version = _long([x.policy_version for x in row.samples])
        dummy.sample_staleness = _long([x.staleness for x in row.samples])
        return dummy
    input_ids, position_ids, meta = _layout(row)

    logit_index, targets, advantages, old_logprobs, sample_index = [], [], [], [], []
    for i, sample in enumerate(row.samples):
        steps = [seg.offset + np.arange(used) for seg, used in row.sample_segments(i)]
        positions = np.concatenate(steps) if steps else np.zeros(0, dtype=np.int64)
        trained = np.flatnonzero(sample.completion_mask)  # all >= 1 and <= len(positions)
        logit_index.append(positions[trained - 1])
        targets.append(np.asarray(sample.token_ids)[trained])
        advantages.append(np.full(len(trained), sample.advantage, dtype=np.float32))
        old_logprobs.append(np.asarray(sample.sampler_logprobs, dtype=np.float32)[trained])
        sample_index.append(np.full(len(trained), i, dtype=np.int64))

    packed = PackedRow(
        input_ids=_long(input_ids),
        position_ids=_long(position_ids),
        logit_index=_long(np.concatenate(logit_index)),
        target_ids=_long(np.concatenate(targets)),
        advantages=torch.as_tensor(np.concatenate(advantages)),
        sampler_logprobs=torch.as_tensor(np.concatenate(old_logprobs)),
        sample_index=_long(np.concatenate(sample_index)),
        attention=meta,
        sample_num_trained=_long([s.num_trained for s in row.samples]),
        sample_policy_version=_long([s.policy_version for s in row.samples]),
        sample_staleness=_long([s.staleness for s in row.samples]),
    )
    _add_top_n(packed, row)
    _add_sampling_masks(packed, row)
    _add_routes(packed, row)
    return packed


def _add_top_n(packed: PackedRow, row: TreeRow) -> None:
    widths = [s.sampler_top_ids.shape[1] for s in row.samples if s.sampler_top_ids is not None]
    if not widths:
        return
    t, n = packed.num_trained, max(widths)
    ids = np.zeros((t, n), dtype=np.int64)
    logprobs = np.zeros((t, n), dtype=np.float32)
    valid = np.zeros((t, n), dtype=bool)
    start = 0
    for s in row.samples:
        k = s.num_trained
        if s.sampler_top_ids is not None and k:
            w = s.sampler_top_ids.shape[1]
            ids[start : start + k, :w] = s.sampler_top_ids
            logprobs[start : start + k, :w] = s.sampler_top_logprobs
            valid[start : start + k, :w] = True
        start += k
    packed.sampler_top_ids = torch.as_tensor(ids)
    packed.sampler_top_logprobs = torch.as_tensor(logprobs)
    packed.top_valid = torch.as_tensor(valid)


NO_ROUTE = -1
"""A route entry of a position whose samples carry no routes: the model routes it itself."""


def _add_routes(packed: PackedRow, row: TreeRow) -> None:
    shapes = {s.routed_experts.shape[1:] for s in row.samples if s.routed_experts is not None}
    if not shapes:
        return
    if len(shapes) > 1:
        raise ValueError(f"samples of one row carry routes of different shapes {sorted(shapes)}")
    ((layers, k),) = shapes
    routes = np.full((packed.num_tokens, layers, k), NO_ROUTE, dtype=np.int16)
    written = np.zeros(packed.num_tokens, dtype=bool)
    conflicts = 0
    for i, sample in enumerate(row.samples):
        if sample.routed_experts is None:
            continue
        for seg, used in row.sample_segments(i):
            at = slice(seg.offset, seg.offset + used)
            given = sample.routed_experts[seg.start : seg.start + used]
            seen = written[at]
            if seen.any():  # a shared position: the first sample's routes stay
                differ = np.sort(routes[at][seen], -1) != np.sort(given[seen].astype(np.int16), -1)
                conflicts += int(differ.any(axis=(1, 2)).sum())
            routes[at][~seen] = given[~seen]
            written[at] = True
    packed.routes = torch.as_tensor(routes)
    packed.route_conflicts = conflicts


def _add_sampling_masks(packed: PackedRow, row: TreeRow) -> None:
    if all(s.sampling_masks is None for s in row.samples):
        return
    chunks, lengths, valid = [], [], []
    for s in row.samples:
        k = s.num_trained
        masks = s.sampling_masks if s.sampling_masks is not None else [None] * k
        for m in masks:
            chunks.append(np.zeros(0, dtype=np.int64) if m is None else np.asarray(m, dtype=np.int64))
            lengths.append(len(chunks[-1]))
            valid.append(m is not None)
    packed.sampling_mask_ids = _long(np.concatenate(chunks) if chunks else np.zeros(0))
    packed.sampling_mask_offsets = _long(np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)]))
    packed.sampling_mask_valid = torch.as_tensor(np.array(valid, dtype=bool))

"""What every layer's attention needs to know about a packed row: its segments and their paths.

The collator (``grpo_core.packing.collator``) builds one ``TreeAttentionMetadata`` per row on the host;
the model's forward hands it to every layer (``tree_attention=<metadata>``): softmax tree attention
(``tree.py``, its plans ``gather.py`` and ``split.py``) and Gated DeltaNet (``gated_delta.py``) read it.
Kept on its own so that the row's producers and its readers depend on this record, not on each other.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from grpo_core.models.attention.split import AncestorLevel, levels_from_paths


class RowPlans:
    """The plans derived from one row's segments (gated delta's segment depths, the convolutions' gathers, the split
    plan's levels on a device, the dense mask), built by the first layer that needs one and read by the rest.

    A class of its own, not a dict: FSDP2 casts every sharded layer's inputs by rebuilding each dataclass, dict and
    list among them (its mixed-precision ``cast_forward_inputs``). A dict of plans would reach every layer as a fresh
    copy, and every layer would build the row's plans again, each with its host work and device copies (measured: the
    host waited for the GPU about eight times per Gated DeltaNet layer and row). An object of another type passes
    through as it is, so every copy of the metadata shares this one."""

    __slots__ = ("_plans",)

    def __init__(self) -> None:
        self._plans: dict[tuple, object] = {}

    def get(self, key: tuple, build: Callable[[], object]) -> object:
        if key not in self._plans:
            self._plans[key] = build()
        return self._plans[key]

    def __contains__(self, key: tuple) -> bool:
        return key in self._plans


@dataclass
class TreeAttentionMetadata:
    """Segments of one packed row (``G`` segments, ``K`` gathered keys)."""

    cu_seq_q: torch.Tensor  # int32 [G + 1]: query range of each segment in the row
    cu_seq_k: torch.Tensor  # int32 [G + 1]: range of each segment's keys in the gathered K/V
    max_q: int  # longest segment
    max_k: int  # longest root-to-segment path
    kv_index: torch.Tensor | None  # int64 [K]: row positions of every path; None = no gather (flat)
    # The split plan's calls per ancestor depth (``split.plan_levels``; the collator builds them on
    # the host); None: derived from ``kv_index`` when first needed.
    levels: tuple[AncestorLevel, ...] | None = None
    # Per-row plans derived from the segments, built by the first layer that needs them and read by the rest of the
    # forward, whatever copies of this record the layers receive (``RowPlans``).
    cache: RowPlans = field(default_factory=RowPlans, repr=False, compare=False)
    # The host copy this metadata was moved from (``to``): plans built on the host read it without a device sync.
    host: TreeAttentionMetadata | None = field(default=None, repr=False, compare=False)

    @property
    def num_segments(self) -> int:
        return int(self.cu_seq_q.numel()) - 1

    def to(self, device: torch.device | str, non_blocking: bool = True) -> TreeAttentionMetadata:
        move = lambda t: None if t is None else t.to(device, non_blocking=non_blocking)  # noqa: E731
        levels = None if self.levels is None else tuple(lv.to(device, non_blocking) for lv in self.levels)
        return TreeAttentionMetadata(
            move(self.cu_seq_q), move(self.cu_seq_k), self.max_q, self.max_k, move(self.kv_index), levels,
            host=self.on_host(),
        )

    def on_host(self) -> TreeAttentionMetadata | None:
        """This row's segments on the host without a copy from the device: this metadata where it is there, else the
        copy it was moved from (None if it was built on a device)."""
        return self if self.cu_seq_q.device.type == "cpu" else self.host

    def host_arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """int64 ``cu_seq_q``, ``cu_seq_k`` and ``kv_index`` (None for a flat row) as host arrays: from the collator's
        host copy where the row has one, else copied from the device (one sync)."""
        src = self.on_host() or self
        as_np = lambda t: t.cpu().numpy().astype(np.int64)  # noqa: E731
        return as_np(src.cu_seq_q), as_np(src.cu_seq_k), None if src.kv_index is None else as_np(src.kv_index)

    def cached(self, key: tuple, build: Callable[[], object]) -> object:
        """``build()`` once per row (``cache``): every layer of a forward reads the same plan."""
        return self.cache.get(key, build)

    def ancestor_levels(self, device: torch.device) -> tuple[AncestorLevel, ...]:
        """The split plan's level calls, on ``device`` (derived from the paths once if not given)."""
        levels = self.levels if self.levels is not None else self.cached(
            ("split_levels",), lambda: levels_from_paths(self.cu_seq_q, self.cu_seq_k, self.kv_index))
        if levels and levels[0].q_index.device != device:
            levels = self.cached(("split_levels", device), lambda: tuple(lv.to(device) for lv in levels))
        return levels

    def dense_mask(self, device: torch.device) -> torch.Tensor:
        """bool ``[U, U]``: ``mask[i, j]`` iff query ``i`` may see key ``j``. Built once per row."""
        return self.cached(("dense_mask", device), lambda: self._build_dense_mask(device))

    def _build_dense_mask(self, device: torch.device) -> torch.Tensor:
        cu_q, cu_k = self.cu_seq_q.tolist(), self.cu_seq_k.tolist()
        kv = None if self.kv_index is None else self.kv_index.cpu()
        u = cu_q[-1]
        mask = torch.zeros(u, u, dtype=torch.bool)
        for g in range(len(cu_q) - 1):
            qs, qe, ks, ke = cu_q[g], cu_q[g + 1], cu_k[g], cu_k[g + 1]
            cols = torch.arange(qs, qe) if kv is None else kv[ks:ke]
            ql, kl = qe - qs, ke - ks
            mask[qs:qe, cols] = torch.ones(ql, kl, dtype=torch.bool).tril(kl - ql)
        return mask.to(device)

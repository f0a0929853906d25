"""Small packed rows shaped as trees, for the start-up probes of the recurrent token mixers: the delta rule
(``gated_delta.probe_gdn``) and the short convolution (``short_conv.probe_conv``) check a kernel against their
PyTorch forms on these before a run uses it."""

from __future__ import annotations

import numpy as np
import torch

from grpo_core.models.attention.metadata import TreeAttentionMetadata

PROBE_TREES = {
    # a root of 70 tokens (two chunks), children of 9 and 40, a grandchild of 3 under the first
    "short": [70, 9, 3, 40],
    # the same tree under a root of 4,000 tokens: long enough for a kernel to split one sequence over the
    # GPU (FlashQLA's intra-card context parallelism), a path the short tree never takes
    "long": [4000, 9, 3, 400],
}


def probe_meta(device: torch.device, q_lens: list[int] = PROBE_TREES["short"],
               parents: tuple[int | None, ...] = (None, 0, 1, 0)) -> TreeAttentionMetadata:
    """Segments of ``q_lens`` tokens laid out in that order, segment ``i`` under ``parents[i]`` (None: a root; a
    parent comes before its children). The default: a root, two children, a grandchild under the first child."""
    if len(parents) != len(q_lens) or any(p is not None and not 0 <= p < i for i, p in enumerate(parents)):
        raise ValueError(f"parents {parents}: one per segment of {q_lens}, each None or an earlier segment")
    offsets = np.concatenate([[0], np.cumsum(q_lens)])
    paths: list[np.ndarray] = []
    for i, p in enumerate(parents):
        own = np.arange(offsets[i], offsets[i + 1])
        paths.append(own if p is None else np.concatenate([paths[p], own]))
    cu = lambda xs: torch.tensor(np.concatenate([[0], np.cumsum(xs)]), dtype=torch.int32)  # noqa: E731
    return TreeAttentionMetadata(cu(q_lens), cu([len(p) for p in paths]), max(q_lens), max(len(p) for p in paths),
                                 torch.as_tensor(np.concatenate(paths), dtype=torch.int64)).to(device)

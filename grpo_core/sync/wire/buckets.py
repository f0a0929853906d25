"""The bucket layout of one weight sync: which tensors travel together in one flat broadcast.

A sync sends the model as a few large flat buffers instead of one message per parameter: each
bucket is the byte concatenation of consecutive tensors (in ``metadata()`` order, cast to their wire
dtype, no padding), and the receiver splits it back by the names, dtypes and shapes it was told.

The cut is the one vLLM's packed NCCL receiver makes from the same metadata: tensors are added in
order and a bucket closes right after the tensor that takes it *past* ``bucket_bytes``. Sender and
receiver must cut identically or they disagree on every later broadcast's size, so this module is
the only place the rule is written on the trainer side. A bucket therefore holds at most
``bucket_bytes`` plus its last tensor (the 0.6 GB embedding of a 1.7B model is a bucket of its own).

Pure metadata: no tensors, no devices, no vLLM; ``tests/test_sync_buckets.py`` checks the cut
against vLLM's own packer.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

DEFAULT_BUCKET_BYTES = 256 * 2**20
"""Bucket threshold (both backends); ``benchmarks/sync/nccl_sync.py`` compares sizes side by side."""


class TensorMeta(Protocol):
    """What the plan reads of a parameter (vLLM's ``ParamMeta`` has these fields)."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]


@dataclass(frozen=True)
class Slot:
    """One tensor's place in its bucket's flat buffer."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    """Byte offset in the bucket."""
    nbytes: int


@dataclass(frozen=True)
class Bucket:
    """Consecutive tensors sent as one flat byte buffer."""

    slots: tuple[Slot, ...]
    nbytes: int
    first: int
    """Index in ``metadata()`` of the bucket's first tensor."""

    @property
    def names(self) -> list[str]:
        return [s.name for s in self.slots]


def tensor_nbytes(dtype: torch.dtype, shape: Sequence[int]) -> int:
    return math.prod(int(d) for d in shape) * dtype.itemsize


def plan_buckets(meta: Sequence[TensorMeta], bucket_bytes: int) -> list[Bucket]:
    """Split ``meta`` (in order) into buckets, closing each after the tensor that exceeds ``bucket_bytes``."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes={bucket_bytes}: must be at least 1")
    buckets: list[Bucket] = []
    slots: list[Slot] = []
    size = first = 0
    for index, m in enumerate(meta):
        nbytes = tensor_nbytes(m.dtype, m.shape)
        slots.append(Slot(m.name, m.dtype, tuple(int(d) for d in m.shape), size, nbytes))
        size += nbytes
        if size > bucket_bytes:
            buckets.append(Bucket(tuple(slots), size, first))
            slots, size, first = [], 0, index + 1
    if slots:
        buckets.append(Bucket(tuple(slots), size, first))
    return buckets


def largest_bucket_bytes(plan: Sequence[Bucket]) -> int:
    return max((b.nbytes for b in plan), default=0)


def update_info(meta: Sequence[TensorMeta]) -> dict[str, list]:
    """The per-sync metadata vLLM's receivers parse: names, dtype names and shapes, in send order."""
    return {
        "names": [m.name for m in meta],
        "dtype_names": [str(m.dtype).removeprefix("torch.") for m in meta],
        "shapes": [[int(d) for d in m.shape] for m in meta],
    }


def plan_from_sizes(meta: Sequence[TensorMeta], group_sizes: Sequence[int]) -> list[Bucket]:
    """The plan whose buckets hold ``group_sizes`` consecutive tensors of ``meta`` (as a sender announced it)."""
    if sum(group_sizes) != len(meta) or any(size < 1 for size in group_sizes):
        raise ValueError(f"bucket sizes {list(group_sizes)} do not cover {len(meta)} tensors")
    plan: list[Bucket] = []
    first = 0
    for size in group_sizes:
        slots: list[Slot] = []
        offset = 0
        for m in meta[first : first + size]:
            nbytes = tensor_nbytes(m.dtype, m.shape)
            slots.append(Slot(m.name, m.dtype, tuple(int(d) for d in m.shape), offset, nbytes))
            offset += nbytes
        plan.append(Bucket(tuple(slots), offset, first))
        first += size
    return plan

"""Delta encoding of one bucket: only the elements that changed since the last push, where that is smaller.

A bucket (``buckets.Bucket``) is sent as two buffers instead of its flat bytes:

* the header, one int64 per tensor of the bucket: the number of changed elements k when the tensor
  travels sparse, or ``DENSE`` (-1) when it travels whole;
* the payload, per tensor in bucket order: sparse → k int32 flat indices, then the k new values in the
  wire dtype; dense → the whole tensor's bytes. Each section starts on an 8-byte boundary, so every
  typed view of the payload is aligned.

"Changed" compares bit patterns in the wire dtype (bf16 for bf16 training): a value the optimizer
moved by less than half a bf16 step rounds back to the same bits and is not sent. A tensor travels
sparse only when that is smaller: 8-aligned 4·k + s·k bytes against s·n (s the element size), so in
bf16 below a third of the elements and in fp32 below half (``sparse_pays``). The rule is per tensor,
so one push mixes both, and a step that changed everything sends the dense bytes plus a header of
8 bytes per tensor.

The receiver applies a header and payload to its copy of the previous weights (``apply_bucket``) and
gets the new full tensors, which it loads as a dense push would. Pure tensors: no transport, no vLLM.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from grpo_core.sync.wire.buckets import Bucket, Slot

DENSE = -1
"""Header value of a tensor sent whole."""
_ALIGN = 8
_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_INDEX_BYTES = 4  # int32 flat indices: a checkpoint tensor has fewer than 2^31 elements
_MAX_NUMEL = 2**31 - 1


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def sparse_nbytes(count: int, itemsize: int) -> int:
    """Payload bytes of a tensor sent as ``count`` indices and values."""
    return _aligned(_INDEX_BYTES * count) + _aligned(itemsize * count)


def dense_nbytes(slot: Slot) -> int:
    return _aligned(slot.nbytes)


def sparse_pays(count: int, numel: int, itemsize: int) -> bool:
    """Whether ``count`` changed elements of a ``numel``-element tensor travel in fewer bytes sparse."""
    return sparse_nbytes(count, itemsize) < _aligned(numel * itemsize)


def _numel(slot: Slot) -> int:
    return slot.nbytes // slot.dtype.itemsize


def _region(buffer: torch.Tensor, slot: Slot) -> torch.Tensor:
    """A slot's bytes in a bucket buffer as integers of the element's width (bit patterns)."""
    region = buffer[slot.offset : slot.offset + slot.nbytes]
    width = _INT_VIEW[slot.dtype.itemsize]
    if slot.offset % slot.dtype.itemsize:
        region = region.clone()  # a misaligned slot (after an odd-sized narrower tensor): copy to view
    return region.view(width)


@dataclass
class EncodedBucket:
    """One bucket's header and payload, and what it carried."""

    header: torch.Tensor
    """int64, one entry per slot: changed count (sparse) or ``DENSE``."""
    payload: torch.Tensor
    """uint8, the sections in slot order."""
    changed: int
    """Elements that differ from the previous push (all of a tensor with no previous)."""
    numel: int
    """Elements of the bucket."""

    @property
    def nbytes(self) -> int:
        return self.header.numel() * 8 + self.payload.numel()


def encode_bucket(bucket: Bucket, new: torch.Tensor, old: torch.Tensor | None) -> EncodedBucket:
    """Header and payload of ``new`` (the bucket's flat uint8 wire buffer) against ``old`` (the same
    bucket at the previous push, or None: every tensor dense)."""
    header = torch.empty(len(bucket.slots), dtype=torch.int64)
    sections: list[tuple[str, torch.Tensor, torch.Tensor | None]] = []  # kind, indices or region, values
    changed = numel = 0
    for i, slot in enumerate(bucket.slots):
        n = _numel(slot)
        if n > _MAX_NUMEL:
            raise ValueError(f"{slot.name}: {n} elements, more than int32 delta indices can address")
        numel += n
        current = _region(new, slot)
        if old is None:
            header[i] = DENSE
            changed += n
            sections.append(("dense", current, None))
            continue
        positions = torch.nonzero(current != _region(old, slot)).reshape(-1)
        count = positions.numel()
        changed += count
        if sparse_pays(count, n, slot.dtype.itemsize):
            header[i] = count
            sections.append(("sparse", positions.to(torch.int32), current[positions]))
        else:
            header[i] = DENSE
            sections.append(("dense", current, None))
    payload = torch.zeros(payload_nbytes(bucket, header), dtype=torch.uint8, device=new.device)
    offset = 0
    for (kind, first, values), slot in zip(sections, bucket.slots):
        if kind == "dense":
            payload[offset : offset + slot.nbytes].copy_(first.reshape(-1).view(torch.uint8))
            offset += dense_nbytes(slot)
            continue
        count = first.numel()
        payload[offset : offset + 4 * count].copy_(first.view(torch.uint8))
        offset += _aligned(4 * count)
        payload[offset : offset + slot.dtype.itemsize * count].copy_(values.view(torch.uint8))
        offset += _aligned(slot.dtype.itemsize * count)
    return EncodedBucket(header=header, payload=payload, changed=changed, numel=numel)


def payload_nbytes(bucket: Bucket, header: torch.Tensor | Sequence[int]) -> int:
    """The payload size a header announces (the receiver sizes its receive buffer from it)."""
    counts = header.tolist() if isinstance(header, torch.Tensor) else list(header)
    if len(counts) != len(bucket.slots):
        raise ValueError(f"a header of {len(counts)} entries for a bucket of {len(bucket.slots)} tensors")
    total = 0
    for count, slot in zip(counts, bucket.slots):
        if count == DENSE:
            total += dense_nbytes(slot)
        elif 0 <= count <= _numel(slot):
            total += sparse_nbytes(count, slot.dtype.itemsize)
        else:
            raise ValueError(f"{slot.name}: header says {count} changed elements of {_numel(slot)}")
    return total


def apply_bucket(bucket: Bucket, header: torch.Tensor, payload: torch.Tensor,
                 base: dict[str, torch.Tensor]) -> None:
    """Bring ``base`` (flat tensors by name, the previous weights) to the new weights of ``bucket``.

    A dense section replaces the tensor (creating it when ``base`` has none); a sparse one writes its
    values at its indices and needs the tensor in ``base``.
    """
    if payload.numel() != payload_nbytes(bucket, header):
        raise ValueError(f"payload of {payload.numel()} bytes; the header announces {payload_nbytes(bucket, header)}")
    offset = 0
    for count, slot in zip(header.tolist(), bucket.slots):
        n = _numel(slot)
        if count == DENSE:
            values = payload[offset : offset + slot.nbytes].view(slot.dtype)
            offset += dense_nbytes(slot)
            held = base.get(slot.name)
            if held is None or held.numel() != n or held.dtype != slot.dtype:
                base[slot.name] = values.clone()
            else:
                held.copy_(values)
            continue
        held = base.get(slot.name)
        if held is None:
            raise KeyError(f"{slot.name}: a sparse update for a tensor this receiver holds no previous value of")
        if held.numel() != n or held.dtype != slot.dtype:
            raise ValueError(f"{slot.name}: held as {held.dtype} x {held.numel()}, the update is {slot.dtype} x {n}")
        indices = payload[offset : offset + 4 * count].view(torch.int32).to(torch.int64)
        offset += _aligned(4 * count)
        values = payload[offset : offset + slot.dtype.itemsize * count].view(slot.dtype)
        offset += _aligned(slot.dtype.itemsize * count)
        if count:
            if int(indices.min()) < 0 or int(indices.max()) >= n:
                raise ValueError(f"{slot.name}: sparse indices outside its {n} elements")
            held.index_copy_(0, indices, values)

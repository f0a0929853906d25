"""Fill one bucket's flat wire buffer from the trainer's tensors: one collective per bucket.

The tensors of a bucket arrive as the trainer holds them:

* FSDP2 shards (a ``DTensor`` sharded on dim 0 over a 1-D mesh of W ranks): every rank packs its
  local rows of all the bucket's shards, cast to the wire dtype, into one flat buffer, padded to
  ``ceil(rows / W)`` rows per tensor (FSDP2 cuts dim 0 like ``torch.chunk``, so the last ranks may
  hold fewer rows or none); one ``all_gather_into_tensor`` brings every rank's buffer; the sender
  then copies each tensor's W row blocks to its place in the wire buffer, dropping the padding;
* plain tensors (one rank, LoRA-merged weights, a 1-rank mesh): cast-copied to their place;
* any other ``DTensor`` layout: ``full_tensor()`` (a collective of its own), then copied.

The cast happens on the device the tensors live on, before anything moves, so the gather and the
send move wire bytes (bf16 for bf16 training), and nothing is staged through host memory. Every rank
calls ``fill`` for every bucket in the same order (the gathers are collectives); ranks that do not
send pass ``out=None`` and skip the copies.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist

from grpo_core.sync.wire.buckets import Bucket, Slot

_ALIGN = 16  # shard regions in the gather buffer start aligned, so typed views of them are legal


def _align(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def _dim0_mesh(tensor: torch.Tensor):
    """The 1-D mesh ``tensor`` is sharded over on dim 0, or None (plain tensor or another layout)."""
    placements = getattr(tensor, "placements", None)
    if placements is None or tensor.dim() == 0:
        return None
    mesh = tensor.device_mesh
    if mesh.ndim == 1 and len(placements) == 1 and placements[0].is_shard(dim=0):
        return mesh
    return None


def local_shard(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (a plain tensor as is), without a grad-tracked ``to_local()`` call.

    ``_local_tensor`` is read directly: ``to_local()`` goes through autograd and DTensor dispatch
    for each of the ~300 tensors of a model, host time that the sync's pipeline waits on.
    """
    local = getattr(tensor, "_local_tensor", None)
    return local if local is not None else tensor


def copy_into(out: torch.Tensor, slot: Slot, tensor: torch.Tensor) -> None:
    """Write ``tensor`` (any dtype, any device) into its slot of the flat uint8 buffer ``out``, cast."""
    if tuple(tensor.shape) != slot.shape:
        raise ValueError(f"{slot.name}: tensor of shape {tuple(tensor.shape)}, metadata says {slot.shape}")
    region = out[slot.offset : slot.offset + slot.nbytes]
    if slot.offset % slot.dtype.itemsize == 0:
        region.view(slot.dtype).view(slot.shape).copy_(tensor)
    else:  # a slot after an odd-sized tensor of a narrower dtype: copy bytes instead
        region.copy_(tensor.to(slot.dtype).contiguous().view(-1).view(torch.uint8))


class BucketGather:
    """Gathers buckets into wire buffers; one per sync (its gather scratch lives as long as it does)."""

    def __init__(self) -> None:
        self.collectives = 0
        # Reused by every bucket: a fresh pair per bucket would pile up, since the host runs ahead
        # of the device and the allocator cannot recycle memory an enqueued collective still owns.
        # Reuse is safe in stream order: a bucket's packing waits behind the last one's unpacking.
        self._local: torch.Tensor | None = None
        self._gathered: torch.Tensor | None = None

    @property
    def scratch_bytes(self) -> int:
        return sum(t.numel() for t in (self._local, self._gathered) if t is not None)

    def _scratch(self, size: int, world: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if (self._local is None or self._local.numel() < size or self._gathered.numel() < world * size
                or self._local.device != device):
            self._local = self._gathered = None  # free the smaller pair before taking the larger
            self._local = torch.empty(size, dtype=torch.uint8, device=device)
            self._gathered = torch.empty(world * size, dtype=torch.uint8, device=device)
        return self._local[:size], self._gathered[: world * size]

    def fill(self, bucket: Bucket, tensors: Sequence[torch.Tensor], out: torch.Tensor | None) -> None:
        """Write every tensor of ``bucket`` into ``out`` (uint8, ``bucket.nbytes``), or only take part."""
        if len(tensors) != len(bucket.slots):
            raise ValueError(f"bucket of {len(bucket.slots)} tensors got {len(tensors)}")
        by_mesh: dict[object, list[int]] = {}
        for i, (slot, tensor) in enumerate(zip(bucket.slots, tensors)):
            mesh = _dim0_mesh(tensor)
            if mesh is not None and mesh.size() > 1:
                by_mesh.setdefault(mesh, []).append(i)
                continue
            if mesh is not None:  # a 1-rank mesh: the local shard is the whole tensor
                tensor = local_shard(tensor)
            elif hasattr(tensor, "full_tensor"):
                tensor = tensor.full_tensor()
                self.collectives += 1
            if out is not None:
                copy_into(out, slot, tensor)
        for mesh, indices in by_mesh.items():
            self._gather_shards(mesh, bucket, [(i, tensors[i]) for i in indices], out)

    def _gather_shards(self, mesh, bucket: Bucket, items: list[tuple[int, torch.Tensor]], out: torch.Tensor | None) -> None:
        world, rank = mesh.size(), mesh.get_local_rank()
        layout: list[tuple[Slot, int, int, int]] = []  # slot, row numel, rows per rank, local offset
        size = 0
        for i, _ in items:
            slot = bucket.slots[i]
            row_numel = math.prod(slot.shape[1:])
            chunk_rows = -(-slot.shape[0] // world)
            size = _align(size)
            layout.append((slot, row_numel, chunk_rows, size))
            size += chunk_rows * row_numel * slot.dtype.itemsize
        size = _align(size)
        local, gathered = self._scratch(size, world, items[0][1].device)
        for (slot, row_numel, chunk_rows, offset), (_, tensor) in zip(layout, items):
            shard = local_shard(tensor)
            held = _rows_held(slot.shape[0], chunk_rows, rank)
            if shard.shape[0] != held:
                raise RuntimeError(
                    f"{slot.name}: rank {rank} holds {shard.shape[0]} rows, expected {held} of {slot.shape[0]} "
                    f"(dim-0 chunks of {chunk_rows} over {world} ranks)"
                )
            if held:
                n = held * row_numel
                local[offset : offset + n * slot.dtype.itemsize].view(slot.dtype).copy_(shard.reshape(-1))
        dist.all_gather_into_tensor(gathered, local, group=mesh.get_group())
        self.collectives += 1
        if out is None:
            return
        per_rank = gathered.view(world, size)
        for slot, row_numel, chunk_rows, offset in layout:
            _unpack(out, slot, per_rank, offset, chunk_rows * row_numel, row_numel, world)


def _rows_held(rows: int, chunk_rows: int, rank: int) -> int:
    return max(0, min(chunk_rows, rows - rank * chunk_rows))


def _unpack(out: torch.Tensor, slot: Slot, per_rank: torch.Tensor, offset: int, chunk_numel: int, row_numel: int, world: int) -> None:
    """Copy one tensor's row blocks from the gathered ``[world, size]`` buffer into its wire slot."""
    dtype, rows = slot.dtype, slot.shape[0]
    dst = out[slot.offset : slot.offset + slot.nbytes]
    src = per_rank[:, offset : offset + chunk_numel * dtype.itemsize]
    if slot.offset % dtype.itemsize == 0:  # element copies; byte copies only where the slot is misaligned
        dst, src, unit = dst.view(dtype), src.view(dtype), 1
    else:
        unit = dtype.itemsize
    chunk = chunk_numel * unit
    if rows % world == 0:  # every rank holds a full chunk: one strided copy
        dst.view(world, chunk).copy_(src)
        return
    chunk_rows = chunk_numel // row_numel
    for rank in range(world):
        n = _rows_held(rows, chunk_rows, rank) * row_numel * unit
        if n:
            dst[rank * chunk : rank * chunk + n].copy_(src[rank, :n])

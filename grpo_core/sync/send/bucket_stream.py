"""Send a model bucket by bucket, gathering bucket k+1 while bucket k is on the wire.

``send_buckets`` walks a bucket plan (``buckets.plan_buckets``) over the trainer's tensors: for each
bucket it fills a flat wire buffer (``flat_gather.BucketGather``: cast, FSDP2 all-gather, unpack) and
hands it to ``send``. On CUDA the two halves run on two streams: gathering on the caller's current
stream, sending on a side stream, so bucket k+1's gather overlaps bucket k's broadcast.

Double buffering in one arena: even buckets fill it from the front, odd buckets from the back, and
it is as large as the largest sum of two consecutive buckets, so two buckets in flight never
overlap, and a bucket's space is refilled only after the event recorded behind the send two buckets
earlier has passed. The sync's extra device memory is that arena plus the gather scratch, at most
twice the largest bucket whatever the model's size (a lone large tensor, such as a 0.6 GB
embedding, does not double the arena as two equal buffers would). The host never waits inside the
loop: every dependency is a device-side event, so the CPU enqueues all buckets while the GPUs work.

On the CPU (gloo) the same loop runs serially. ``send`` is called on the sending rank only (the rank
that passes it); every other rank runs the same loop with ``send=None`` to take part in the gathers.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from grpo_core.sync.send.flat_gather import BucketGather
from grpo_core.sync.wire.buckets import Bucket, largest_bucket_bytes

Send = Callable[[torch.Tensor], None]
"""Puts one flat uint8 buffer on the wire; on CUDA it must enqueue on the current stream."""


@dataclass(frozen=True)
class TransferStats:
    """What one sync moved, and the device memory it set aside for that."""

    buckets: int
    bytes: int
    largest_bucket_bytes: int
    buffer_bytes: int
    """Wire buffer arena (≤ 2 × the largest bucket; 0 off the sending rank)."""
    scratch_bytes: int
    """Largest FSDP2 gather scratch (packed local shards + gathered copy; 0 with one rank)."""
    collectives: int
    """Gather collectives issued (one per bucket with sharded tensors; 0 with one rank)."""
    host_s: float
    """Host time to walk the plan and enqueue every gather and send (the device may still be busy)."""

    @property
    def extra_bytes(self) -> int:
        """The sync's planned extra memory on the device its tensors live on."""
        return self.buffer_bytes + self.scratch_bytes


def local_tensors(source: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """A weight source's tensors as this rank holds them (FSDP2 shards unmaterialised) where it can
    say (``ModelWeightSource.iter_local``), else its materialised iteration (any vLLM ``WeightSource``)."""
    iter_local = getattr(source, "iter_local", None)
    return iter_local() if callable(iter_local) else iter(source)


def source_device(source: Any) -> torch.device:
    """Where a weight source's tensors live: its module's first parameter, else the current GPU."""
    module = getattr(source, "module", None) or getattr(source, "_module", None)
    param = next(module.parameters(), None) if module is not None else None
    if param is not None:
        return param.device  # a DTensor reports its local shard's device
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def take_bucket(tensors: Iterator[tuple[str, torch.Tensor]], bucket: Bucket) -> list[torch.Tensor]:
    """The next ``len(bucket.slots)`` tensors of ``tensors``, checked against the plan's names."""
    out = []
    for slot in bucket.slots:
        try:
            name, tensor = next(tensors)
        except StopIteration:
            raise RuntimeError(f"the weight source ended before {slot.name!r}; metadata() promised more") from None
        if name != slot.name:
            raise RuntimeError(f"the weight source yielded {name!r} where metadata() put {slot.name!r}")
        out.append(tensor)
    return out


def send_buckets(
    plan: Sequence[Bucket],
    tensors: Iterator[tuple[str, torch.Tensor]],
    send: Send | None,
    device: torch.device,
) -> TransferStats:
    """Gather every bucket of ``plan`` from ``tensors`` and ``send`` it (or only gather, ``send=None``).

    Returns once everything is enqueued; on CUDA the caller's stream then waits for the last send,
    so anything the caller runs next (an optimizer step, freeing memory) is ordered after the sync.
    """
    gather = BucketGather()
    start = time.perf_counter()
    with torch.no_grad():  # the source hands out parameters as they are, grad-tracked
        if device.type == "cuda":
            buffer_bytes = _send_overlapped(plan, tensors, gather, send, device)
        else:
            buffer_bytes = _send_serial(plan, tensors, gather, send, device)
    if next(tensors, None) is not None:
        raise RuntimeError("the weight source yielded more tensors than metadata() declared")
    return TransferStats(
        buckets=len(plan),
        bytes=sum(b.nbytes for b in plan),
        largest_bucket_bytes=largest_bucket_bytes(plan),
        buffer_bytes=buffer_bytes,
        scratch_bytes=gather.scratch_bytes,
        collectives=gather.collectives,
        host_s=time.perf_counter() - start,
    )


def arena_bytes(plan: Sequence[Bucket]) -> int:
    """The double-buffer arena for ``plan``: the largest sum of two consecutive buckets."""
    sizes = [b.nbytes for b in plan]
    return max((a + b for a, b in zip(sizes, sizes[1:])), default=sum(sizes))


def _send_serial(plan, tensors, gather: BucketGather, send: Send | None, device: torch.device) -> int:
    largest = largest_bucket_bytes(plan)
    buffer = torch.empty(largest, dtype=torch.uint8, device=device) if send is not None else None
    for bucket in plan:
        out = buffer[: bucket.nbytes] if buffer is not None else None
        gather.fill(bucket, take_bucket(tensors, bucket), out)
        if send is not None:
            send(out)
    return largest if send is not None else 0


_SEND_STREAMS: dict[int, torch.cuda.Stream] = {}


def _send_stream(device: torch.device) -> torch.cuda.Stream:
    # One stream per device for the process's lifetime: the caching allocator files freed blocks
    # under the stream that used them, so a fresh stream per sync would strand memory.
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SEND_STREAMS:
        _SEND_STREAMS[index] = torch.cuda.Stream(device=index)
    return _SEND_STREAMS[index]


def _send_overlapped(plan, tensors, gather: BucketGather, send: Send | None, device: torch.device) -> int:
    gather_stream = torch.cuda.current_stream(device)
    if send is None:
        for bucket in plan:
            gather.fill(bucket, take_bucket(tensors, bucket), None)
        return 0
    send_stream = _send_stream(device)
    size = arena_bytes(plan)
    arena = torch.empty(size, dtype=torch.uint8, device=device)
    sent: list[torch.cuda.Event | None] = [None, None]  # behind the last send from the front / back
    for k, bucket in enumerate(plan):
        end = k % 2
        if sent[end] is not None:
            gather_stream.wait_event(sent[end])  # bucket k-2 has left this end of the arena
        out = arena[: bucket.nbytes] if end == 0 else arena[size - bucket.nbytes :]
        gather.fill(bucket, take_bucket(tensors, bucket), out)
        filled = torch.cuda.Event()
        filled.record(gather_stream)
        send_stream.wait_event(filled)
        with torch.cuda.stream(send_stream):
            send(out)
        done = torch.cuda.Event()
        done.record(send_stream)
        sent[end] = done
    # The arena is freed when this returns: the gather stream (where the allocator reuses it) must
    # not run ahead of the sends still reading it.
    gather_stream.wait_stream(send_stream)
    return size

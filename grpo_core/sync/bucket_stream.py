"""Send a model bucket by bucket, gathering bucket k+1 while bucket k is on the wire.

``send_buckets`` walks a bucket plan (``buckets.plan_buckets``) over the trainer's tensors: for each
bucket it fills a flat wire buffer (``flat_gather.BucketGather``: cast, FSDP2 all-gather, unpack) and
hands it to ``send``. On CUDA the two halves run on two streams: gathering on the caller's current
stream, sending on a side stream, so bucket k+1's gather overlaps bucket k's broadcast. ``num_buffers``
wire buffers (2: double buffering) rotate; a buffer is refilled only after the event recorded behind
its last send has passed, so the extra device memory of a sync is ``num_buffers`` × the largest
bucket plus the gather scratch, whatever the model's size. The host never waits inside the loop:
every dependency is a device-side event, so the CPU enqueues all buckets while the GPUs work.

On the CPU (gloo) the same loop runs serially. ``send`` is called on the sending rank only (the rank
that passes it); every other rank runs the same loop with ``send=None`` to take part in the gathers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from grpo_core.sync.buckets import Bucket, largest_bucket_bytes
from grpo_core.sync.flat_gather import BucketGather

Send = Callable[[torch.Tensor], None]
"""Puts one flat uint8 buffer on the wire; on CUDA it must enqueue on the current stream."""


@dataclass(frozen=True)
class TransferStats:
    """What one sync moved, and the device memory it set aside for that."""

    buckets: int
    bytes: int
    largest_bucket_bytes: int
    buffer_bytes: int
    """Wire buffers held at once (``num_buffers`` × the largest bucket; 0 off the sending rank)."""
    scratch_bytes: int
    """Largest FSDP2 gather scratch (packed local shards + gathered copy; 0 with one rank)."""
    collectives: int
    """Gather collectives issued (one per bucket with sharded tensors; 0 with one rank)."""

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
    num_buffers: int = 2,
) -> TransferStats:
    """Gather every bucket of ``plan`` from ``tensors`` and ``send`` it (or only gather, ``send=None``).

    Returns once everything is enqueued; on CUDA the caller's stream then waits for the last send,
    so anything the caller runs next (an optimizer step, freeing memory) is ordered after the sync.
    """
    if num_buffers < 1:
        raise ValueError(f"num_buffers={num_buffers}: must be at least 1")
    gather = BucketGather()
    largest = largest_bucket_bytes(plan)
    if device.type == "cuda":
        buffer_count = _send_overlapped(plan, tensors, gather, send, device, num_buffers, largest)
    else:
        buffer_count = _send_serial(plan, tensors, gather, send, device, largest)
    if next(tensors, None) is not None:
        raise RuntimeError("the weight source yielded more tensors than metadata() declared")
    return TransferStats(
        buckets=len(plan),
        bytes=sum(b.nbytes for b in plan),
        largest_bucket_bytes=largest,
        buffer_bytes=buffer_count * largest if send is not None else 0,
        scratch_bytes=gather.scratch_bytes,
        collectives=gather.collectives,
    )


def _send_serial(plan, tensors, gather: BucketGather, send: Send | None, device: torch.device, largest: int) -> int:
    buffer = torch.empty(largest, dtype=torch.uint8, device=device) if send is not None else None
    for bucket in plan:
        out = buffer[: bucket.nbytes] if buffer is not None else None
        gather.fill(bucket, take_bucket(tensors, bucket), out)
        if send is not None:
            send(out)
    return 1


_SEND_STREAMS: dict[int, torch.cuda.Stream] = {}


def _send_stream(device: torch.device) -> torch.cuda.Stream:
    # One stream per device for the process's lifetime: the caching allocator files freed blocks
    # under the stream that used them, so a fresh stream per sync would strand memory.
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SEND_STREAMS:
        _SEND_STREAMS[index] = torch.cuda.Stream(device=index)
    return _SEND_STREAMS[index]


def _send_overlapped(plan, tensors, gather: BucketGather, send: Send | None, device: torch.device,
                     num_buffers: int, largest: int) -> int:
    gather_stream = torch.cuda.current_stream(device)
    if send is None:
        for bucket in plan:
            gather.fill(bucket, take_bucket(tensors, bucket), None)
        return 0
    send_stream = _send_stream(device)
    count = min(num_buffers, len(plan))
    buffers = [torch.empty(largest, dtype=torch.uint8, device=device) for _ in range(count)]
    sent: list[torch.cuda.Event | None] = [None] * count
    for k, bucket in enumerate(plan):
        slot = k % count
        if sent[slot] is not None:
            gather_stream.wait_event(sent[slot])  # the buffer's previous bucket has left
        out = buffers[slot][: bucket.nbytes]
        gather.fill(bucket, take_bucket(tensors, bucket), out)
        filled = torch.cuda.Event()
        filled.record(gather_stream)
        send_stream.wait_event(filled)
        with torch.cuda.stream(send_stream):
            send(out)
        done = torch.cuda.Event()
        done.record(send_stream)
        sent[slot] = done
    # The buffers are freed when this returns: the gather stream (where the allocator reuses them)
    # must not run ahead of the sends still reading them.
    gather_stream.wait_stream(send_stream)
    return count

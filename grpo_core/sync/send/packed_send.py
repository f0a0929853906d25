"""One sync in vLLM's packed NCCL format, over any communicator: start → update ∥ buckets → finish.

``send_packed`` is the body of ``nccl_trainer.BucketedNCCLTrainerEngine.send_weights``, kept free of
vLLM imports so the same code also drives a receiver over a plain ``torch.distributed`` NCCL group
(``benchmarks/sync/nccl_sync.py`` where vLLM cannot be imported). ``comm`` is anything with
``broadcast(tensor, src, stream)`` that enqueues on ``stream``: vLLM's ``PyNcclCommunicator`` is one.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol

import torch

from grpo_core.sync.send.bucket_stream import TransferStats, local_tensors, send_buckets, source_device
from grpo_core.sync.wire.buckets import plan_buckets, update_info


class Broadcaster(Protocol):
    def broadcast(self, tensor: torch.Tensor, src: int, stream: Any = None) -> None: ...


def send_packed(
    client: Any,
    source: Any,
    comm: Broadcaster | None,
    bucket_bytes: int,
    weight_version: str | None = None,
) -> TransferStats:
    """Push every tensor of ``source`` (a ``WeightSource``) to the server behind ``client``.

    Call on every trainer rank; ``comm`` is None off the sending rank (rank 0), which then only takes
    part in the gathers and never touches ``client``. Returns after the server has received and
    applied the last bucket and the update is finished.
    """
    meta = source.metadata()
    plan = plan_buckets(meta, bucket_bytes)
    device = source_device(source)
    if comm is None:
        stats = send_buckets(plan, local_tensors(source), None, device)
        _wait(device)
        return stats
    client.start_weight_update()
    pool = ThreadPoolExecutor(max_workers=1)
    try:
        # /update_weights returns once the server has received every bucket: it runs beside the
        # broadcasts, which meet the server's receives inside NCCL.
        pending = pool.submit(client.update_weights, update_info(meta))
        # send_buckets calls this inside its send stream: enqueue there (a CPU group has no stream).
        cuda = device.type == "cuda"
        stats = send_buckets(
            plan,
            local_tensors(source),
            lambda buffer: comm.broadcast(buffer, src=0, stream=torch.cuda.current_stream(device) if cuda else None),
            device,
        )
        _wait_for_sends(device, pending)
        pending.result()
    finally:
        # Never join the request thread on failure: the server would still sit in a broadcast
        # this rank will not make, and joining would turn the error into a hang.
        pool.shutdown(wait=False)
    client.finish_weight_update(weight_version)
    return stats


def _wait(device: torch.device) -> None:
    # The sync is done when the last send has left: the caller may then change the weights.
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def _wait_for_sends(device: torch.device, pending: Future) -> None:
    """Wait for the last send while watching the server's answer to ``/update_weights``.

    A server whose receive fails answers with an error and never joins the remaining broadcasts;
    waiting on the stream alone would then hang this rank for good (seen on the two-GPU harness).
    """
    if device.type != "cuda":
        return  # host sends have completed when they return
    sent = torch.cuda.Event()
    sent.record(torch.cuda.current_stream(device))
    while not sent.query():
        if pending.done():
            pending.result()  # raises the server's error; an answer means every bucket arrived
            break
        time.sleep(50e-6)
    sent.synchronize()

"""The receiving end of ``benchmarks/sync/sparse_push_gpu.py``: a second process that holds its own copy of the weights.

It stands in for a server's receiving worker on a GPU: two copies of the model in the wire dtype on its
device, one per lane (``dense`` and ``delta``, so that each lane's pushes apply to what that lane sent
before), filled by the lane's first push (sent whole). It joins the trainer's gloo group through the
product's gated rendezvous (``gated_store``: the secret comes in the environment), reads the bucket plan
the trainer announced in the store (``buckets.plan_from_sizes``), and then obeys one command broadcast
at a time:

* ``PUSH_DENSE`` / ``PUSH_DELTA``: per bucket, receive its flat bytes (or ``delta``'s header and
  payload) into pinned host memory, copy them to the device and apply them there (slot copies, or
  ``delta.apply_bucket`` on the held tensors); then send back its wait and apply seconds, which is
  also the trainer's sign that the push is applied;
* ``DIGEST``: send back ``digest.tensor_digest`` of every held tensor of a lane, in plan order;
* ``COMPARE``: send every held tensor of a lane back, bucket by bucket, for a full comparison;
* ``STOP``.

gloo moves host tensors only, and both processes share one GPU, so the wire is TCP over loopback.
"""

from __future__ import annotations

import json
import os
import sys
import time
from datetime import timedelta

import torch


from grpo_core.sync.wire.buckets import Bucket, plan_from_sizes  # noqa: E402
from grpo_core.sync.wire.delta import apply_bucket, payload_nbytes  # noqa: E402
from grpo_core.sync.wire.digest import tensor_digest  # noqa: E402
from grpo_core.sync.wire.gated_store import StoreDialer, gloo_group, member_store  # noqa: E402

PUSH_DENSE, PUSH_DELTA, DIGEST, COMPARE, STOP = range(5)
LANES = ("dense", "delta")
SECRET_ENV = "SPARSE_PUSH_SECRET"
"""Environment variable that carries the rendezvous secret to the receiver (never on its command line)."""
TIMEOUT = timedelta(seconds=300)
DIGEST_CHARS = 32


class WireMeta:
    """One tensor as the plan reads it (name, wire dtype, shape)."""

    def __init__(self, name: str, dtype: torch.dtype, shape: tuple[int, ...]):
        self.name, self.dtype, self.shape = name, dtype, shape


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def host_buffer(nbytes: int, device: torch.device) -> torch.Tensor:
    """Host staging memory for the wire, pinned when a GPU is on the other side of it."""
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")


def max_payload_bytes(plan: list[Bucket]) -> int:
    """The largest buffer one bucket needs on the wire, whichever way it travels (delta's dense sections
    are 8-aligned, so an all-dense delta payload can exceed the bucket's flat bytes)."""
    return max(max(payload_nbytes(b, [-1] * len(b.slots)), b.nbytes) for b in plan)


class Receiver:
    def __init__(self, group: object, plan: list[Bucket], device: torch.device):
        self.group, self.plan, self.device = group, plan, device
        self.held: list[dict[str, torch.Tensor]] = [{}, {}]  # per lane: name -> flat tensor on the device
        self.host = host_buffer(max_payload_bytes(plan), device)
        self.staged = torch.empty(self.host.numel(), dtype=torch.uint8, device=device)

    def receive(self, tensor: torch.Tensor) -> torch.Tensor:
        self.group.broadcast(tensor, 0).wait()
        return tensor

    def send(self, tensor: torch.Tensor) -> None:
        self.group.broadcast(tensor, 1).wait()

    def to_device(self, nbytes: int) -> torch.Tensor:
        staged = self.staged[:nbytes]
        staged.copy_(self.host[:nbytes], non_blocking=True)
        return staged

    def push(self, lane: int, delta: bool) -> None:
        held = self.held[lane]
        wait_s = apply_s = 0.0
        for bucket in self.plan:
            start = time.perf_counter()
            if delta:
                header = self.receive(torch.empty(len(bucket.slots), dtype=torch.int64))
                nbytes = payload_nbytes(bucket, header)
            else:
                nbytes = bucket.nbytes
            if nbytes:  # an all-unchanged delta bucket has an empty payload, and nothing is broadcast
                self.receive(self.host[:nbytes])
            arrived = time.perf_counter()
            wait_s += arrived - start
            payload = self.to_device(nbytes)
            if delta:
                apply_bucket(bucket, header, payload, held)
            else:
                for slot in bucket.slots:
                    values = payload[slot.offset : slot.offset + slot.nbytes].view(slot.dtype)
                    if slot.name in held:
                        held[slot.name].copy_(values)
                    else:
                        held[slot.name] = values.clone()
            sync(self.device)
            apply_s += time.perf_counter() - arrived
        self.send(torch.tensor([wait_s, apply_s], dtype=torch.float64))  # the trainer's "applied"

    def digest(self, lane: int) -> None:
        text = "".join(tensor_digest(self.held[lane][s.name]) for b in self.plan for s in b.slots)
        self.send(torch.frombuffer(bytearray(text.encode()), dtype=torch.uint8))

    def compare(self, lane: int) -> None:
        for bucket in self.plan:
            flat = torch.cat([self.held[lane][s.name].view(torch.uint8) for s in bucket.slots])
            self.host[: bucket.nbytes].copy_(flat)
            self.send(self.host[: bucket.nbytes])

    def serve(self) -> None:
        command = torch.empty(2, dtype=torch.int64)
        while True:
            op, lane = self.receive(command).tolist()
            if op == STOP:
                return
            if op in (PUSH_DENSE, PUSH_DELTA):
                self.push(lane, delta=op == PUSH_DELTA)
            elif op == DIGEST:
                self.digest(lane)
            elif op == COMPARE:
                self.compare(lane)
            else:
                raise ValueError(f"unknown command {op}")


def plan_from_store(store: object) -> list[Bucket]:
    """The plan the trainer announced: every tensor's name, dtype and shape, and the tensors per bucket."""
    info = json.loads(store.get("plan").decode())
    meta = [WireMeta(n, getattr(torch, d), tuple(s)) for n, d, s in zip(info["names"], info["dtype_names"], info["shapes"])]
    return plan_from_sizes(meta, info["group_sizes"])


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--port", type=int, required=True, help="the trainer's rendezvous gate on 127.0.0.1")
    ap.add_argument("--device", default="cuda", help="where the held weights live: cuda or cpu")
    args = ap.parse_args()
    secret = os.environ.get(SECRET_ENV)
    if not secret:
        raise SystemExit(f"{SECRET_ENV} is not set: the trainer passes the rendezvous secret in it")
    device = torch.device(args.device)
    torch.set_num_threads(2)
    dialer = StoreDialer("127.0.0.1", args.port, secret)
    store = member_store(dialer, 2, TIMEOUT)
    group = gloo_group(store, 1, 2, TIMEOUT, bind_address="127.0.0.1")
    try:
        Receiver(group, plan_from_store(store), device).serve()
    finally:
        group.shutdown()
        dialer.close()


if __name__ == "__main__":
    main()

"""Weight pushes after real AdamW steps on one GPU, side by side: every tensor (dense) against the changes (delta).

The trainer process holds a Qwen3-1.7B-shaped model (random weights built from a config in code, seed 0;
fp32 master weights on the GPU, bf16 compute, AdamW with betas 0.9/0.999, eps 1e-8, no weight decay,
gradients clipped to norm 1; the gradients are real, of the next-token loss on random tokens, a fresh
seeded batch per step, the same batches for every learning rate). The receiver is a second process
(``sparse_push_gpu_receiver.py``) holding its own copies of the weights on the same GPU, one per lane.

For each learning rate the model starts from the same weights with a fresh optimizer; each lane is first
sent whole (its keyframe, the base its deltas need), then the trainer takes ``--steps`` optimizer steps
and after each pushes the new bf16 weights twice, once per lane, alternating which goes first:

* ``dense``: every bucket's flat bf16 bytes;
* ``delta``: per bucket ``delta.encode_bucket`` against the bytes the delta lane pushed last (kept on the
  GPU), i.e. changed elements as int32 indices + bf16 values where that is smaller than the tensor, else
  the whole tensor; the receiver applies it with ``delta.apply_bucket``.

What runs is the product's: the bucket plan (``buckets.plan_buckets``, 256 MiB), the bucket fill
(``bucket_stream.send_buckets``: cast on the GPU into a double-buffered arena), the delta encoder and
applier, the digest (``digest.tensor_digest``) and the gated gloo rendezvous (``gated_store``). The
product's gloo sender (``gloo_trainer``) talks to a vLLM server over HTTP and encodes on the host, and
the device has no vLLM, so this script drives the encoder with a minimal send/receive loop of its own:
a command broadcast, then per bucket the (header and) payload, then the receiver's "applied".

Transport: only one GPU is lent, and NCCL between two ranks on one GPU is not allowed, so the bytes
travel over gloo on TCP loopback between the two processes of one host, through pinned host memory
(device → host, broadcast, host → device). Absolute times are therefore not NCCL's; the bytes are, and
the ratios show what the encoding saves on a link of this kind.

Per push and lane: bytes on the wire, seconds (fill = cast into the bucket buffer; encode = the delta
encoder and keeping the pushed copy; copy to host; transfer = the sender's broadcasts; apply = host →
device and applying, at the receiver; total = from the command to the receiver's "applied"), changed
share. After every push the receiver's digest of each held tensor is compared with the trainer's digest
of its own bf16 cast; on the last push of each learning rate every tensor of both lanes is sent back and
compared whole.

    python3 -m benchmarks.sync.sparse_push_gpu --out $OUT/sparse_push_gpu.json       # one H200, about 80 s
    .venv/bin/python -m benchmarks.sync.sparse_push_gpu --smoke                        # CPU, tiny model (< 1 min)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import secrets
import statistics
import subprocess
import sys
import time
from typing import Any

import torch


from benchmarks.bench_io import ROOT, write_report  # noqa: E402
from benchmarks.sync.nccl_sync_receiver import build_model  # noqa: E402
from benchmarks.sync.sparse_push_gpu_receiver import (  # noqa: E402
    COMPARE, DIGEST, DIGEST_CHARS, LANES, PUSH_DELTA, PUSH_DENSE, SECRET_ENV, STOP, TIMEOUT, WireMeta,
    host_buffer, max_payload_bytes, sync,
)

from grpo_core.sync.send.bucket_stream import send_buckets  # noqa: E402
from grpo_core.sync.wire.buckets import DEFAULT_BUCKET_BYTES, Bucket, plan_buckets, update_info  # noqa: E402
from grpo_core.sync.wire.delta import encode_bucket  # noqa: E402
from grpo_core.sync.wire.digest import tensor_digest  # noqa: E402
from grpo_core.sync.wire.gated_store import StoreGate, gloo_group, trainer_store  # noqa: E402

LEARNING_RATES = (1e-6, 3e-6, 1e-5)
DENSE_LANE, DELTA_LANE = 0, 1
PHASES = ("fill_s", "encode_s", "d2h_s", "transfer_s", "apply_s", "total_s")


class Pusher:
    """The trainer's end: pushes the model's bf16 weights to one lane of the receiver, and checks them."""

    def __init__(self, model: torch.nn.Module, plan: list[Bucket], group: Any, device: torch.device):
        self.model, self.plan, self.group, self.device = model, plan, group, device
        self.offsets = [sum(b.nbytes for b in plan[:k]) for k in range(len(plan))]
        # The bytes the delta lane pushed last, bucket by bucket, on the GPU (the encoder's "old").
        self.pushed = torch.empty(sum(b.nbytes for b in plan), dtype=torch.uint8, device=device)
        self.host = host_buffer(max_payload_bytes(plan), device)

    def command(self, op: int, lane: int) -> None:
        self.group.broadcast(torch.tensor([op, lane], dtype=torch.int64), 0).wait()

    def push(self, lane: int, delta: bool) -> dict[str, Any]:
        times = dict.fromkeys(PHASES, 0.0)
        counts = {"wire_bytes": 0, "changed": 0, "numel": 0}
        start = time.perf_counter()
        self.command(PUSH_DELTA if delta else PUSH_DENSE, lane)
        state = {"k": 0, "last": time.perf_counter()}

        def send(buffer: torch.Tensor) -> None:
            k, bucket = state["k"], self.plan[state["k"]]
            state["k"] += 1
            sync(self.device)
            filled = time.perf_counter()
            times["fill_s"] += filled - state["last"]
            kept = self.pushed[self.offsets[k] : self.offsets[k] + bucket.nbytes]
            header = None
            if delta:
                encoded = encode_bucket(bucket, buffer, kept)
                header, payload = encoded.header, encoded.payload
                counts["changed"] += encoded.changed
            else:
                payload = buffer
            if lane == DELTA_LANE:
                kept.copy_(buffer)
            counts["numel"] += sum(s.nbytes // s.dtype.itemsize for s in bucket.slots)
            sync(self.device)
            encoded_at = time.perf_counter()
            host = self.host[: payload.numel()]
            host.copy_(payload)
            copied = time.perf_counter()
            if header is not None:
                self.group.broadcast(header, 0).wait()
                counts["wire_bytes"] += header.numel() * header.element_size()
            if payload.numel():
                self.group.broadcast(host, 0).wait()
            counts["wire_bytes"] += payload.numel()
            sent = state["last"] = time.perf_counter()
            times["encode_s"] += encoded_at - filled
            times["d2h_s"] += copied - encoded_at
            times["transfer_s"] += sent - copied

        send_buckets(self.plan, iter(self.model.named_parameters()), send, self.device)
        applied = torch.empty(2, dtype=torch.float64)
        self.group.broadcast(applied, 1).wait()
        times["total_s"] = time.perf_counter() - start
        times["recv_wait_s"], times["apply_s"] = applied.tolist()
        changed = counts["changed"] if delta else None
        return {"lane": LANES[lane], "encoding": "delta" if delta else "dense", **counts, "changed": changed,
                "changed_share": None if changed is None else changed / counts["numel"],
                "dense_bytes": sum(b.nbytes for b in self.plan), **times}

    def bf16(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().to(torch.bfloat16).reshape(-1) for n, p in self.model.named_parameters()}

    def digests_equal(self, lane: int) -> bool:
        """The receiver's digest of every held tensor of ``lane`` against the trainer's of its own bf16 cast."""
        self.command(DIGEST, lane)
        names = [s.name for b in self.plan for s in b.slots]
        theirs = torch.empty(len(names) * DIGEST_CHARS, dtype=torch.uint8)
        self.group.broadcast(theirs, 1).wait()
        ours = "".join(tensor_digest(t) for t in self.bf16().values())
        return bytes(theirs.tolist()).decode() == ours

    def compare(self, lane: int) -> list[str]:
        """Every tensor of ``lane`` sent back and compared whole; returns the names that differ."""
        self.command(COMPARE, lane)
        ours, differ = self.bf16(), []
        for bucket in self.plan:
            host = self.host[: bucket.nbytes]
            self.group.broadcast(host, 1).wait()
            theirs = host.to(self.device)
            for s in bucket.slots:
                if not torch.equal(theirs[s.offset : s.offset + s.nbytes].view(s.dtype), ours[s.name]):
                    differ.append(s.name)
        return differ


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int, batch: int, seq: int,
               device: torch.device) -> dict[str, float]:
    """One AdamW step on next-token loss over a seeded batch of random tokens (real gradients)."""
    start = time.perf_counter()
    generator = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(model.config.vocab_size, (batch, seq), generator=generator).to(device)
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    sync(device)
    return {"loss": float(loss.detach()), "grad_norm": float(norm), "step_s": time.perf_counter() - start}


def median(rows: list[dict[str, Any]], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over the steps (keyframes left out) per lane, and delta / dense for bytes and seconds."""
    steps = [r for r in rows if r["step"] > 0]
    out: dict[str, Any] = {}
    for lane in LANES:
        mine = [r for r in steps if r["lane"] == lane]
        out[lane] = {k: median(mine, k) for k in ("wire_bytes", *PHASES)}
    out["changed_share"] = [r["changed_share"] for r in steps if r["lane"] == "delta"]
    out["bytes_ratio"] = out["delta"]["wire_bytes"] / out["dense"]["wire_bytes"]
    out["seconds_ratio"] = out["delta"]["total_s"] / out["dense"]["total_s"]
    out["digests_equal_every_push"] = all(r["digests_equal"] for r in rows)
    return out


def run_lr(pusher: Pusher, initial: dict[str, torch.Tensor], lr: float, args: argparse.Namespace,
           device: torch.device) -> dict[str, Any]:
    model = pusher.model
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(initial[name])
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                                  fused=device.type == "cuda")
    rows: list[dict[str, Any]] = []

    def push(step: int, lane: int, delta: bool) -> dict[str, Any]:
        row = {"lr": lr, "step": step, **pusher.push(lane, delta)}
        row["digests_equal"] = pusher.digests_equal(lane)
        rows.append(row)
        return row

    push(0, DENSE_LANE, delta=False)  # keyframes: each lane's receiver copy starts whole
    push(0, DELTA_LANE, delta=False)
    unchanged = push(0, DELTA_LANE, delta=True)  # nothing moved: only headers travel (and warms the path)
    steps = []
    for step in range(1, args.steps + 1):
        steps.append({"step": step, **train_step(model, optimizer, step, args.batch, args.seq, device)})
        for lane in ((DENSE_LANE, DELTA_LANE) if step % 2 else (DELTA_LANE, DENSE_LANE)):
            row = push(step, lane, delta=lane == DELTA_LANE)
            print(f"  lr {lr:g} step {step} {row['lane']}: {row['wire_bytes'] / 1e6:.1f} MB, total "
                  f"{row['total_s']:.3f} s, digests equal {row['digests_equal']}", flush=True)
    differ = {LANES[lane]: pusher.compare(lane) for lane in (DENSE_LANE, DELTA_LANE)}
    summary = summarize(rows)
    summary["unchanged_push_bytes"] = unchanged["wire_bytes"]
    summary["last_push_tensors_differing"] = {lane: len(names) for lane, names in differ.items()}
    return {"learning_rate": lr, "train_steps": steps, "pushes": rows, "differing_tensors": differ, "summary": summary}


def start_receiver(device: torch.device) -> tuple[StoreGate, Any, subprocess.Popen]:
    secret = secrets.token_hex(32)
    gate = StoreGate("127.0.0.1", 0, secret)
    child = subprocess.Popen([sys.executable, "-m", "benchmarks.sync.sparse_push_gpu_receiver", "--port", str(gate.port),
                              "--device", device.type], env=os.environ | {SECRET_ENV: secret}, cwd=ROOT)
    try:
        store = trainer_store(gate, 2, TIMEOUT)
    except BaseException:
        child.kill()
        gate.close()
        raise
    return gate, store, child


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=5, help="optimizer steps (pushes per lane) per learning rate")
    ap.add_argument("--lrs", default=",".join(f"{lr:g}" for lr in LEARNING_RATES))
    ap.add_argument("--batch", type=int, default=4, help="sequences per step")
    ap.add_argument("--seq", type=int, default=1024, help="tokens per sequence")
    ap.add_argument("--bucket-bytes", type=int, default=DEFAULT_BUCKET_BYTES)
    ap.add_argument("--out", default="benchmarks/results/sparse_push_gpu.json")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny model, 2 steps, small buckets: checks the script")
    args = ap.parse_args()
    if args.smoke:
        args.steps, args.batch, args.seq, args.bucket_bytes = 2, 2, 32, 16 << 10
        args.out = args.out if args.out != ap.get_default("out") else "/tmp/sparse_push_gpu_smoke.json"
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    shape = "tiny" if args.smoke else "qwen3-1.7b"
    model = build_model(shape, device, torch.float32, seed=0)
    model.train()
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    meta = [WireMeta(n, torch.bfloat16, tuple(p.shape)) for n, p in model.named_parameters()]
    plan = plan_buckets(meta, args.bucket_bytes)

    gate, store, child = start_receiver(device)
    group = gloo_group(store, 0, 2, TIMEOUT, bind_address="127.0.0.1")
    store.set("plan", json.dumps(update_info(meta) | {"group_sizes": [len(b.slots) for b in plan]}))
    pusher = Pusher(model, plan, group, device)
    report: dict[str, Any] = {
        "env": {"torch": torch.__version__, "python": platform.python_version(),
                "device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu"},
        "command": " ".join(sys.argv), "shape": shape, "steps": args.steps, "batch": args.batch, "seq": args.seq,
        "transport": "gloo over TCP loopback between two processes on one host, pinned host staging",
        "plan": {"tensors": len(meta), "buckets": len(plan), "bucket_bytes": args.bucket_bytes,
                 "dense_bytes": sum(b.nbytes for b in plan)},
        "runs": [],
    }
    try:
        for lr_text in args.lrs.split(","):
            run = run_lr(pusher, initial, float(lr_text), args, device)
            report["runs"].append(run)
            write_report(args.out, report, announce=False)  # what is done survives a later failure
            s = run["summary"]
            print(f"lr {lr_text}: changed share {' '.join(f'{x:.4f}' for x in s['changed_share'])}; median bytes "
                  f"dense {s['dense']['wire_bytes'] / 1e6:.1f} MB, delta {s['delta']['wire_bytes'] / 1e6:.1f} MB "
                  f"(delta/dense {s['bytes_ratio']:.3f}); median total s dense {s['dense']['total_s']:.3f}, delta "
                  f"{s['delta']['total_s']:.3f} (delta/dense {s['seconds_ratio']:.3f}); digests equal at every push "
                  f"{s['digests_equal_every_push']}; tensors differing on the last push "
                  f"{s['last_push_tensors_differing']}", flush=True)
        pusher.command(STOP, 0)
    finally:
        group.shutdown()
        gate.close()
        child.wait(timeout=60)
    write_report(args.out, report)


if __name__ == "__main__":
    main()

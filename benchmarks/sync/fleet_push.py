"""A push to a fleet over gloo: one transfer group per server against one group spanning every server.

The trainer (this process, rank 0) sends ``--mb`` MiB to two receiver processes (stand-ins for two servers' weight
workers), over loopback, in alternating rounds of

    per_server_seq   a group of two (trainer + one server) per server, the servers one after the other: what a
                     run does (``grpo_core.fleet.servers``: one session per server, pushed in turn)
    per_server_par   the same groups, both broadcasts in flight at once
    spanning         one group of three (trainer + both servers), one broadcast

each ending when every receiver has the bytes (a one-element all-reduce on each group after its broadcast). Prints
the median seconds and MB/s of each and the ratios to ``spanning``; the report goes to
``benchmarks/results/fleet_push.json``. Gloo on loopback on a shared CPU measures the sender's cost, not a
network's: with NCCL across nodes a spanning broadcast pipelines through the receivers, so its time stays near one
transfer's while per-server pushes grow with the number of servers (docs/fleet.md).

    .venv/bin/python -m benchmarks.sync.fleet_push
    .venv/bin/python -m benchmarks.sync.fleet_push --mb 64 --rounds 3
    .venv/bin/python -m benchmarks.sync.fleet_push --smoke --out /tmp/fleet_push.json
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import time
from datetime import timedelta
from pathlib import Path

import torch

from benchmarks.bench_io import write_report  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT = timedelta(seconds=600)
MODES = ("per_server_seq", "per_server_par", "spanning")


def group(port: int, rank: int, world: int) -> torch.distributed.ProcessGroup:
    from torch.distributed import PrefixStore, ProcessGroupGloo, TCPStore

    store = TCPStore("127.0.0.1", port, world, is_master=rank == 0, timeout=TIMEOUT)
    return ProcessGroupGloo(PrefixStore(f"fleet-push-{port}", store), rank, world, TIMEOUT)


def delivered(pg: torch.distributed.ProcessGroup, tensor: torch.Tensor) -> torch.distributed.Work:
    """Broadcast ``tensor`` from rank 0, then a one-element all-reduce: done once every member has the bytes."""
    pg.broadcast(tensor, 0).wait()
    return pg.allreduce([torch.zeros(1)])


def receiver(index: int, ports: dict[str, int], numel: int, rounds: int) -> None:
    spanning = group(ports["spanning"], index + 1, 3)
    own = group(ports[f"server{index}"], 1, 2)
    buffer = torch.empty(numel, dtype=torch.uint8)
    for _ in range(rounds):
        for mode in MODES:
            pg = spanning if mode == "spanning" else own
            delivered(pg, buffer).wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=int, default=256, help="MiB per push")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "fleet_push.json"))
    parser.add_argument("--smoke", action="store_true", help="1 MiB, one round: checks the script")
    args = parser.parse_args()
    if args.smoke:
        args.mb, args.rounds = 1, 1

    from grpo_core.vllm_server.process import free_port

    numel = args.mb << 20
    ports = {"spanning": free_port(), "server0": free_port(), "server1": free_port()}
    ctx = mp.get_context("spawn")
    children = [ctx.Process(target=receiver, args=(i, ports, numel, args.rounds)) for i in range(2)]
    for child in children:
        child.start()
    spanning = group(ports["spanning"], 0, 3)
    own = [group(ports[f"server{i}"], 0, 2) for i in range(2)]
    payload = torch.randint(0, 255, (numel,), dtype=torch.uint8)
    seconds: dict[str, list[float]] = {m: [] for m in MODES}
    for r in range(args.rounds):
        for mode in MODES:
            start = time.perf_counter()
            if mode == "spanning":
                delivered(spanning, payload).wait()
            elif mode == "per_server_seq":
                for pg in own:
                    delivered(pg, payload).wait()
            else:
                works = [pg.broadcast(payload, 0) for pg in own]
                for w in works:
                    w.wait()
                for w in [pg.allreduce([torch.zeros(1)]) for pg in own]:
                    w.wait()
            seconds[mode].append(time.perf_counter() - start)
        print(f"round {r + 1}: " + ", ".join(f"{m} {seconds[m][-1]:.3f} s" for m in MODES), flush=True)
    for child in children:
        child.join(timeout=60)
    median = {m: statistics.median(v) for m, v in seconds.items()}
    print(f"\n{args.mb} MiB to two receivers over gloo (loopback), median of {args.rounds}:")
    for m in MODES:
        print(f"  {m:15s} {median[m]:.3f} s  {2 * args.mb / median[m]:7.0f} MiB/s delivered  "
              f"x{median[m] / median['spanning']:.2f} of spanning")
    write_report(args.out, {"config": vars(args), "median_s": median, "seconds": seconds,
                            "ratio_to_spanning": {m: median[m] / median["spanning"] for m in MODES}})


if __name__ == "__main__":
    main()

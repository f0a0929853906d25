"""Where the CPU goes while this project trains beside a local CPU vLLM server (issue 18).

Starts one CPU vLLM server for the tiny model (as ``peer_trl.py`` does), runs ``peer_trl.py``'s ``ours_async`` and
``ours_sync`` contenders against it under each placement asked for, and samples ``/proc`` every 0.25 s: each
thread's CPU time (utime + stime), the core it last ran on and its involuntary context switches, grouped by role
(trainer, rollout worker, API server, engine core, engine worker). Over the steady steps (the first
``--skip`` steps left out) it reports, per step: wall, ``perf/fwd_bwd_s``, and each role's CPU seconds, split by
core. A trainer whose forward/backward takes longer than alone while its own CPU time per step stays the same is
waiting for a core; one whose CPU time grows is doing more work (or spinning).

Placements (``--placements``): ``none`` (as the flow ran before: nothing pinned) and the names in
``grpo_core.vllm_server.cpu_placement`` (``embedded``: the trainer alone on its core(s), the server and the rollout worker on
the rest).

    .venv/bin/python -m benchmarks.trainer.cpu_share --steps 30 --out benchmarks/results/cpu_share.json
    .venv/bin/python -m benchmarks.trainer.cpu_share --smoke --server-url URL --out /tmp/cpu_share.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any
from benchmarks.bench_io import write_report
from benchmarks.rollout.rollout_throughput import listening_pid

ROOT = Path(__file__).resolve().parents[2]

CLK = os.sysconf("SC_CLK_TCK")


def _children(pid: int) -> list[int]:
    out: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tasks:
        try:
            out += [int(c) for c in Path(f"/proc/{pid}/task/{tid}/children").read_text().split()]
        except OSError:
            pass
    return out


def _tree(pid: int) -> list[int]:
    seen, todo = [], [pid]
    while todo:
        p = todo.pop()
        seen.append(p)
        todo += _children(p)
    return seen


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return "?"


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def thread_stats(pid: int) -> dict[int, tuple[float, int, int, float]]:
    """tid -> (CPU seconds, last core, involuntary switches, seconds runnable but waiting for a core) for every
    thread of ``pid``."""
    out = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
            fields = stat[stat.rindex(")") + 2:].split()
            cpu = (int(fields[11]) + int(fields[12])) / CLK  # utime, stime (fields 14, 15 of stat)
            core = int(fields[36])  # processor (field 39)
            status = Path(f"/proc/{pid}/task/{tid}/status").read_text()
            nvcs = int(status.split("nonvoluntary_ctxt_switches:")[1].split()[0])
            waited = int(Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[1]) / 1e9
            out[int(tid)] = (cpu, core, nvcs, waited)
        except (OSError, IndexError, ValueError):
            pass
    return out


class Sampler:
    """Per-role CPU time split by the core each thread was last seen on, sampled every ``period_s``."""

    def __init__(self, server_pid: int, period_s: float = 0.25):
        self.server_pid, self.period_s = server_pid, period_s
        self.trainer_pid: int | None = None
        self.samples: list[tuple[float, dict[str, dict[int, float]], dict[str, float]]] = []
        self.last: dict[tuple[int, int], float] = {}
        self.acc: dict[str, dict[int, float]] = {}
        self.nvcs: dict[str, float] = {}
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def roles(self) -> dict[int, str]:
        out = {}
        for p in _tree(self.server_pid):
            name = _comm(p)
            out[p] = "api_server" if p == self.server_pid else ("engine_worker" if "Worker" in name else
                                                                 "engine_core" if "EngineCor" in name else "server_other")
        if self.trainer_pid is not None:
            for p in _tree(self.trainer_pid):
                cmd = _cmdline(p)
                out[p] = "trainer" if p == self.trainer_pid else ("rollout_worker" if "spawn_main" in cmd and "tracker_fd" in cmd
                                                                  and "resource_tracker" not in cmd else "trainer_other")
        return out

    def _run(self) -> None:
        while not self.stop.is_set():
            now = time.perf_counter()
            nv: dict[str, float] = {}
            for pid, role in self.roles().items():
                for tid, (cpu, core, n, waited) in thread_stats(pid).items():
                    prev = self.last.get((pid, tid), 0.0)
                    self.last[(pid, tid)] = cpu
                    per_core = self.acc.setdefault(role, {})
                    per_core[core] = per_core.get(core, 0.0) + (cpu - prev)
                    nv[role] = nv.get(role, 0) + n
                    nv[role + "/runq"] = nv.get(role + "/runq", 0.0) + waited
            for role, n in nv.items():
                self.nvcs[role] = max(self.nvcs.get(role, 0), n)
            self.samples.append((now, {r: dict(c) for r, c in self.acc.items()}, dict(self.nvcs)))
            self.stop.wait(self.period_s)

    def at(self, t: float) -> tuple[dict[str, dict[int, float]], dict[str, int]]:
        """The cumulative figures of the last sample at or before ``t``."""
        best = self.samples[0]
        for s in self.samples:
            if s[0] <= t:
                best = s
        return best[1], best[2]


def run_contender(name: str, spec: dict[str, Any], work: Path, sampler: Sampler, env_extra: dict[str, str],
                  trainer_cores: set[int] | None, timeout_s: float) -> dict[str, Any]:
    from benchmarks.peers import peer_trl

    spec_path = work / f"spec-{name}.json"
    spec_path.write_text(json.dumps(spec))
    out = work / f"{name}.json"
    cmd = [peer_trl._python_for(name), "-m", "benchmarks.peers.peer_trl", "--contender", name, "--spec",
           str(spec_path), "--out", str(out)]
    env = {**peer_trl._contender_env(name), **env_extra}
    from grpo_core.vllm_server.cpu_placement import forked_on

    with open(work / f"{name}.log", "wb") as log, forked_on(trainer_cores):
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=str(ROOT),
                                start_new_session=True)
        sampler.trainer_pid = proc.pid
        try:
            rc = proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            import signal

            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = "timeout"
    result = json.loads(out.read_text()) if out.exists() else {"error": f"exit {rc}"}
    if "steps" in result:
        # train()'s start on this clock: the output file is written right after the last step ends.
        end_perf = time.perf_counter() - (time.time() - out.stat().st_mtime)
        result["t_train0"] = end_perf - result["steps"][-1]["t_end"]
    return result


def steady(result: dict[str, Any], sampler: Sampler, skip: int) -> dict[str, Any]:
    steps = result["steps"][skip:]
    t_train0 = result["t_train0"]  # step ends are measured from train()
    a = t_train0 + steps[0]["t_end"] - steps[0]["wall_s"]
    b = t_train0 + steps[-1]["t_end"]
    (c0, n0), (c1, n1) = sampler.at(a), sampler.at(b)
    n = len(steps)
    cpu = {}
    for role in c1:
        cores = {core: (c1[role].get(core, 0.0) - c0.get(role, {}).get(core, 0.0)) / n for core in c1[role]}
        cpu[role] = {"per_step_s": sum(cores.values()), "by_core": {str(k): round(v, 3) for k, v in sorted(cores.items())},
                     "involuntary_switches_per_step": (n1.get(role, 0) - n0.get(role, 0)) / n,
                     "runqueue_wait_per_step_s": (n1.get(role + "/runq", 0.0) - n0.get(role + "/runq", 0.0)) / n}
    return {
        "steps": n, "window_s": b - a,
        "step_s_median": statistics.median(s["wall_s"] for s in steps),
        "fwd_bwd_s_median": statistics.median(s.get("perf/fwd_bwd_s", 0.0) for s in steps),
        "rollout_wait_s_median": statistics.median(s.get("perf/rollout_wait_s", 0.0) for s in steps),
        "generated_tok_s_median": statistics.median(s.get("rollout/generated_tok_s", 0.0) for s in steps),
        "cpu": cpu,
        "cpu_total_per_step_s": sum(v["per_step_s"] for v in cpu.values()),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--skip", type=int, default=5, help="first steps left out (start-up, queue filling)")
    parser.add_argument("--contenders", default="ours_async,ours_sync")
    parser.add_argument("--placements", default="none,embedded")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "cpu_share.json"))
    parser.add_argument("--server-url", default=None, help="sample this running server of the tiny model (placement "
                        "none only: a placement is set when a server starts) instead of starting one per placement")
    parser.add_argument("--smoke", action="store_true", help="ours_async for 3 steps beside the server at "
                        "--server-url: checks the script")
    args = parser.parse_args(argv)
    if args.smoke:
        if not args.server_url:
            parser.error("--smoke needs --server-url (a running server of the tiny model)")
        args.steps, args.skip, args.contenders, args.placements = 3, 1, "ours_async", "none"
    if args.server_url and args.placements != "none":
        parser.error("--server-url: only --placements none (the server was started without one)")

    from grpo_core.tiny import build_tiny_model
    from grpo_core.vllm_server.cpu_placement import embedded_placement
    from grpo_core.vllm_server.process import VLLMServer, VLLMServerSpec

    model_path = str(build_tiny_model())
    spec = {"model_path": model_path, "steps": args.steps, "snapshot_steps": [], "num_train": 2000, "num_eval": 16,
            "seed": 0, "server_url": None}
    report: dict[str, Any] = {"cpus": os.cpu_count(), "load_avg_before": os.getloadavg(), "runs": []}
    for placement_name in [p for p in args.placements.split(",") if p]:
        placement = None if placement_name == "none" else embedded_placement(sorted(os.sched_getaffinity(0)))
        work = Path(tempfile.mkdtemp(prefix=f"cpu_share-{placement_name}-"))
        server = None
        if args.server_url is None:
            server_spec = VLLMServerSpec(model=model_path, max_model_len=512, max_logprobs=20)
            server = VLLMServer(server_spec, work, placement=placement).start(timeout_s=900)
        spec["server_url"] = args.server_url or server.base_url
        sampler = Sampler(listening_pid(args.server_url) if server is None else server.process.pid)
        sampler.thread.start()
        try:
            for name in [c for c in args.contenders.split(",") if c]:
                env_extra = placement.trainer_environment() if placement else {}
                print(f"[cpu_share] {placement_name}: {name} ...", flush=True)
                result = run_contender(name, spec, work, sampler, env_extra,
                                       set(placement.trainer) if placement else None, 1800)
                if "steps" not in result:
                    print(f"[cpu_share] {name} failed: {result.get('error')}", flush=True)
                    report["runs"].append({"placement": placement_name, "contender": name, "error": result.get("error")})
                    continue
                row = {"placement": placement_name, "contender": name,
                       "placement_cores": placement.describe() if placement else None,
                       **steady(result, sampler, args.skip)}
                report["runs"].append(row)
                _print_row(row)
        finally:
            sampler.stop.set()
            sampler.thread.join()
            if server is not None:
                server.stop()
    report["load_avg_after"] = os.getloadavg()
    write_report(args.out, report)
    return 0


def _print_row(row: dict[str, Any]) -> None:
    print(f"  step {row['step_s_median']:.3f} s  fwd_bwd {row['fwd_bwd_s_median']:.3f} s  wait {row['rollout_wait_s_median']:.3f} s  "
          f"gen {row['generated_tok_s_median']:.0f} tok/s  CPU/step {row['cpu_total_per_step_s']:.2f} s", flush=True)
    for role, v in sorted(row["cpu"].items(), key=lambda kv: -kv[1]["per_step_s"]):
        print(f"    {role:15s} CPU {v['per_step_s']:.3f} s/step  by core {v['by_core']}  waiting for a core "
              f"{v['runqueue_wait_per_step_s']:.3f} s/step  invol. switches/step {v['involuntary_switches_per_step']:.0f}", flush=True)


if __name__ == "__main__":
    sys.exit(main())

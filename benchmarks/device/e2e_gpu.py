"""The whole run on one GPU, as a user runs it: ``grpo train`` with a flow-started CUDA vLLM server beside the trainer.

The flow places both on the machine's one GPU (``vllm_server.gpu_placement``: the server takes its memory share,
pushes go through CUDA IPC), trains, and the trainer is killed once mid-run (SIGKILL, after its first checkpoint):
the flow must resume it by itself. Afterwards this reads the run back (``summary.json``, the MLflow run, the
ledger) and writes one JSON record:

* held-out accuracy before and after with 95% intervals, and the gain's interval;
* per step (medians over the steps of the run): step time, time waiting for rollouts, generated and trained
  tokens/s, the push's time into the engine, the probe's check of every push;
* the GPU's busy share while training (``nvidia-smi`` sampled every 0.5 s);
* the resume: attempts, prompts trained twice among the steps the final model holds, and whether the MLflow
  run has every step from 1 to ``max_steps`` (no gap).

    python3 -m benchmarks.device.e2e_gpu --job benchmarks/device/e2e_gpu.yaml --out OUT/e2e_gpu.json \\
        --kill-at-step 100

On the GPU machine after the packed set-up (benchmarks/device/pack_vllm_cuda.sh), with ``BENCH_COMMIT`` naming the
commit; ``--backend gloo`` runs the same job with the other transport, for the push-time comparison. ``--smoke``
(CI, on the CPU build): four steps of a small job against a running server (``--server-url``), the trainer killed
at step 3 and resumed from its step-2 checkpoint.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import yaml

from benchmarks.bench_io import write_report

STEP_LINE = re.compile(r"\bstep\s+(\d+)\b")
SMOKE_JOB: dict[str, Any] = {
    "model": "tiny:arithmetic", "dataset": "tiny:arithmetic",
    "trainer": {"bf16": False, "max_steps": 4, "per_device_train_batch_size": 16, "num_generations": 4,
                "max_completion_length": 16, "save_steps": 2, "logging_steps": 1, "do_eval": False},
}
SMOKE_KILL_AT = 3


class GpuSampler:
    """``nvidia-smi``'s utilisation of GPU 0, every half second, in a thread."""

    def __init__(self) -> None:
        self.samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                out = subprocess.run(["nvidia-smi", "--query-gpu=utilization.gpu,memory.used", "--format=csv,noheader,nounits"],
                                     capture_output=True, text=True, timeout=5).stdout.split("\n")[0]
                util, _ = (float(x) for x in out.split(","))
                self.samples.append((time.time(), util))
            except (OSError, ValueError, subprocess.TimeoutExpired):
                pass
            self._stop.wait(0.5)

    def __enter__(self) -> "GpuSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def busy_share(self, start: float, end: float) -> float | None:
        inside = [u for t, u in self.samples if start <= t <= end]
        return round(statistics.fmean(inside) / 100.0, 4) if inside else None


def run_job(job: Path, out_dir: Path, kill_at_step: int | None, log_path: Path) -> dict[str, Any]:
    """``grpo train`` in a child process; SIGKILL the trainer once at ``kill_at_step``. Returns timings."""
    cmd = [sys.executable, "-m", "flows.cli", "train", str(job), "--output-dir", str(out_dir)]
    started = time.time()
    killed: dict[str, Any] = {}
    with open(log_path, "w") as log, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                                       text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"},
                                                       start_new_session=True) as proc:
        assert proc.stdout is not None
        try:
            code = _follow(proc, log, out_dir, kill_at_step, started, killed)
        except TimeoutError:  # SIGTERM from a time limit: stop the whole job, keep what it recorded
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            code = None
    return {"exit_code": code, "wall_s": time.time() - started, "killed": killed, "timed_out": code is None}


def _follow(proc: subprocess.Popen, log: Any, out_dir: Path, kill_at_step: int | None, started: float,
            killed: dict[str, Any]) -> int:
    seen_step = 0
    for line in proc.stdout:
        log.write(line)
        log.flush()
        match = STEP_LINE.search(line)
        if match:
            seen_step = max(seen_step, int(match[1]))
        if kill_at_step and not killed and seen_step >= kill_at_step:
            pid = int((out_dir / "trainer.pid").read_text().split()[0])
            os.killpg(pid, signal.SIGKILL)
            killed.update({"at_step": seen_step, "pid": pid, "t": time.time() - started})
            print(f"e2e_gpu: killed the trainer (pid {pid}) at step {seen_step}", flush=True)
    killed["last_step_seen"] = seen_step
    return proc.wait()


def environment() -> dict[str, Any]:
    """What the run ran on: the GPU, Python, the versions that matter, and how this machine's packages differ from
    requirements-cuda.lock (benchmarks/device/cuda_carry.py's check, written by the set-up)."""
    import platform

    from benchmarks.device.cuda_carry import installed_version

    try:
        gpu = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True).stdout.strip()
    except OSError:
        gpu = None
    check = Path("/tmp/site/.vcuda-check.json")
    differs = json.loads(check.read_text())["differs_from_lock"] if check.is_file() else None
    return {"gpu": gpu, "python": platform.python_version(),
            **{name: installed_version(name) for name in ("vllm", "torch", "transformers", "triton", "prefect", "mlflow")},
            "differs_from_lock": differs}


def median(values: list[float]) -> float | None:
    return round(statistics.median(values), 6) if values else None


def read_run(out_dir: Path, max_steps: int) -> dict[str, Any]:
    """The run as it was recorded: summary, MLflow metrics (medians and continuity), the ledger."""
    import mlflow

    from grpo_core.checkpoint.ledger import attempts_per_position, read_ledger, surviving_steps

    if (out_dir / "summary.json").is_file():
        summary = json.loads((out_dir / "summary.json").read_text())
        client = mlflow.MlflowClient(summary["mlflow_tracking_uri"])
        run = client.get_run(summary["mlflow_run_id"])
    else:  # a run stopped before its end: its store in the run folder, its one run
        summary = {}
        client = mlflow.MlflowClient(f"sqlite:///{out_dir / 'mlflow.db'}")
        run = client.search_runs([e.experiment_id for e in client.search_experiments()])[0]
    keys = sorted(k for k in run.data.metrics if k.split("/")[0] in ("perf", "sync", "rollout", "sample", "waste"))
    medians, steps_logged = {}, set()
    for key in keys:
        history = client.get_metric_history(run.info.run_id, key)
        medians[key] = median([m.value for m in history])
        if key == "perf/step_s":
            steps_logged = {m.step for m in history}
    attempts, step_records = read_ledger(str(out_dir))
    kept = surviving_steps(attempts, step_records)
    # Trained twice: a position whose samples the final model learned from in two attempts. (A group dropped as stale
    # or foreign in one attempt and trained in the next is trained once: only ``trained`` positions count.)
    twice = sum(1 for a in attempts_per_position([{**r, "dropped_groups": []} for r in kept]).values() if len(a) > 1)
    return {
        "summary": {k: summary.get(k) for k in summary if k.startswith("eval_") or k in ("final_step", "mlflow_run_id")},
        "heldout": summary.get("heldout") or {k: v for k, v in summary.items() if "accuracy" in k or "gain" in k},
        "metric_medians": medians,
        "steps_logged": len(steps_logged),
        "missing_steps": sorted(set(range(1, max_steps + 1)) - steps_logged)[:20],
        "ledger": {"attempts": len(attempts), "steps_recorded": len(step_records), "steps_kept": len(kept),
                   "prompts_trained_twice_in_final_model": twice},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--job", type=Path, default=Path(__file__).with_name("e2e_gpu.yaml"))
    parser.add_argument("--out", type=Path, required=True, help="the JSON record to write")
    parser.add_argument("--run-dir", type=Path, default=Path("/tmp/e2e_gpu"))
    parser.add_argument("--kill-at-step", type=int, default=0, help="SIGKILL the trainer once at this step (0: never)")
    parser.add_argument("--backend", choices=["ipc", "gloo"], help="override the job's weight_transfer_backend")
    parser.add_argument("--max-steps", type=int, help="override the job's max_steps")
    parser.add_argument("--save-steps", type=int, help="override the job's save_steps")
    parser.add_argument("--server-url", help="a running server (the job's server is then not managed)")
    parser.add_argument("--smoke", action="store_true", help="a few CPU steps: the driver's own check (CI)")
    args = parser.parse_args(argv)

    def stop(signum: int, frame: Any) -> None:
        raise TimeoutError(f"signal {signum}")

    signal.signal(signal.SIGTERM, stop)
    job = SMOKE_JOB if args.smoke else yaml.safe_load(args.job.read_text())
    kill_at = SMOKE_KILL_AT if args.smoke else args.kill_at_step
    if args.server_url:
        job["server"] = {"managed": False, "base_url": args.server_url}
    if args.backend:
        job.setdefault("trainer", {})["weight_transfer_backend"] = args.backend
    if args.max_steps:
        job.setdefault("trainer", {})["max_steps"] = args.max_steps
    if args.save_steps:
        job.setdefault("trainer", {})["save_steps"] = args.save_steps
    run_dir = args.run_dir / (args.backend or "default")
    run_dir.mkdir(parents=True, exist_ok=True)
    job_file = run_dir / "job.yaml"
    job_file.write_text(yaml.safe_dump(job))
    with GpuSampler() as gpu:
        timing = run_job(job_file, run_dir / "out", kill_at or None, args.out.with_suffix(".log"))
        end = time.time()
    record: dict[str, Any] = {"run_environment": environment(), "job": job, "run": timing,
                              "gpu_busy_share": gpu.busy_share(end - timing["wall_s"], end)}
    try:
        record.update(read_run(run_dir / "out", int(job["trainer"]["max_steps"])))
    except Exception as err:  # the record keeps what did run, with why the rest could not be read
        record["read_error"] = f"{type(err).__name__}: {err}"
    write_report(args.out, record, default=str)
    print(json.dumps({k: record.get(k) for k in ("run", "gpu_busy_share", "heldout", "ledger", "steps_logged",
                                                  "missing_steps", "read_error")}, indent=1, default=str))
    return 0 if timing["exit_code"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())

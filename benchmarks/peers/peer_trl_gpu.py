"""Our trainer against TRL 1.16.0's ``AsyncGRPOTrainer`` on one GPU, fed the same fixed rollout stream.

The stream (``peer_gpu_stream.py``): groups of 8 samples sharing a prompt (every prompt its own at ratio ~1)
with advantages, sampler log-probs and staleness 0-2, at packing ratios ~1, ~3.4 and ~6, one
``token_budget=16384`` row per optimizer step, five steps per workload; both trainers' planners close the same
rows (checked before anything runs). Qwen3-1.7B shape, random weights (seed 0), fp32 master weights with bf16
compute on both sides. Each trainer runs its own ``train()`` loop in a process of its own, with its rollout
source replaced by the stream and its weight sync turned off (``peer_gpu_runs.py`` says exactly how).

Per step: wall time between step ends, trained tokens/s, peak allocated memory, loss. Per workload, its
first step is the warm-up and the other four are timed. The learning rate is 1e-12, so every step is taken at
the initial weights and its loss can be compared between the trainers and with an fp32 reference that
forwards each sample alone (``--lr`` is not offered: the comparison depends on it).

Commands::

    python3 -m benchmarks.peers.peer_trl_gpu --out $OUT/peer_trl_gpu.json       # one GPU, TRL importable
    python3 -m benchmarks.peers.peer_trl_gpu probes --out $OUT/peer_trl_gpu_probes.json   # what TRL does offline as shipped
    .venv-trl/bin/python -m benchmarks.peers.peer_trl_gpu --smoke              # CPU, tiny model: checks the harness
    python -m benchmarks.peers.peer_trl_gpu report benchmarks/results/peer_trl_gpu.json   # table + PNG
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import pickle
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch


from benchmarks.bench_io import ROOT, write_report  # noqa: E402
from benchmarks.peers.peer_gpu_stream import SMOKE_BUDGET, SMOKE_WORKLOADS, WORKLOADS, Stream, make_stream, reference_losses, write_model_folder  # noqa: E402

ROWS_PER_WORKLOAD = 5


def _role_main(args: argparse.Namespace) -> None:
    """A subprocess role: one trainer (or the probes) on the saved stream; writes its JSON to ``--out``."""
    from benchmarks.peers.peer_gpu_runs import error_record, run_ours, run_trl

    with open(args.stream, "rb") as f:
        stream: Stream = pickle.load(f)
    try:
        if args.role == "ours":
            result = run_ours(args.model_dir, stream, args.smoke)
        else:
            result = run_trl(args.model_dir, stream, args.smoke, args.kernel, args.gc == "on", args.attn_override)
    except Exception as exc:  # noqa: BLE001 - a run that cannot go on is a result too
        result = {"trainer": args.role, **error_record(exc)}
    Path(args.out).write_text(json.dumps(result, indent=1, default=str))


def _subprocess(role: str, paths: dict[str, str], smoke: bool, timeout: float, *extra: str) -> dict[str, Any]:
    out = tempfile.NamedTemporaryFile(suffix=".json", delete=False).name
    cmd = [sys.executable, "-m", "benchmarks.peers.peer_trl_gpu", role, "--out", out, *(["--smoke"] if smoke else []), *extra]
    if paths:
        cmd += ["--model-dir", paths["model"], "--stream", paths["stream"]]
    env = {**os.environ, "HF_HUB_DISABLE_TELEMETRY": "1", "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}
    start = time.perf_counter()
    try:
        subprocess.run(cmd, check=True, timeout=timeout, env=env, cwd=ROOT)
        result = json.loads(Path(out).read_text())
    except (subprocess.SubprocessError, OSError, ValueError) as exc:
        result = {"trainer": role, "error": f"{type(exc).__name__}: {exc}"}
    result["process_wall_s"] = time.perf_counter() - start
    return result


def _trl_kernel(requested: str, device: torch.device) -> str:
    if device.type != "cuda":
        return "emulated"
    if requested != "auto":
        return requested
    has_fa4 = importlib.util.find_spec("flash_attn") is not None and importlib.util.find_spec("cutlass") is not None
    return "fa4" if has_fa4 else "fa2"


def launch(args: argparse.Namespace) -> None:
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    shape, budget = ("tiny", SMOKE_BUDGET) if args.smoke else ("qwen3-1.7b", 16384)
    rows = 3 if args.smoke else ROWS_PER_WORKLOAD
    work = Path(tempfile.mkdtemp(prefix="peer_trl_gpu_"))
    t0 = time.perf_counter()
    from benchmarks.peers.peer_gpu_stream import SHAPES

    # The rows of the default seed were checked against TRL's planner on a CPU (``--check-rows``, about 90 s
    # of pure Python there); on the GPU both trainers' logged trained tokens per step check them again.
    check = args.check_rows or args.smoke
    stream = make_stream(SMOKE_WORKLOADS if args.smoke else WORKLOADS, rows, budget, SHAPES[shape]["vocab_size"],
                         seed=args.seed, check_trl=check)
    if args.check_rows_only:
        print(json.dumps({"seed": stream.seed, "trl_planner_same_rows": stream.trl_rows_checked,
                          "rows": [len(r) for r in stream.rows], "command": " ".join(sys.argv)}))
        return
    model_dir = write_model_folder(shape, work / "model", device)
    with open(work / "stream.pkl", "wb") as f:
        pickle.dump(stream, f)
    paths = {"model": str(model_dir), "stream": str(work / "stream.pkl")}
    kernel = _trl_kernel(args.trl_kernel, device)
    import transformers

    report: dict[str, Any] = {
        "env": {"torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version(),
                "device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
                "trl": _version("trl"), "datasets": _version("datasets")},
        "command": " ".join(sys.argv), "shape": shape, "token_budget": budget, "rows_per_workload": rows,
        "stream": _describe(stream), "setup_s": time.perf_counter() - t0, "runs": {},
    }
    print(json.dumps({k: v for k, v in report["stream"].items() if k != "rows"}), flush=True)
    if args.smoke:
        report["probes"] = _subprocess("probes", {}, True, 300)
    # Each phase's result is written as soon as it is in: a run cut off by the machine's limit keeps the rest.
    report["runs"]["ours"] = _subprocess("ours", paths, args.smoke, args.timeout)
    _write(args.out, report)
    gcs = args.trl_gc.split(",")
    first = _subprocess("trl", paths, args.smoke, args.timeout, "--kernel", kernel, "--gc", gcs[0])
    if "error" in first and kernel == "fa4":  # FlashAttention-4 refused TRL's call: its error kept, FA2 instead
        report["runs"][f"trl_gc_{gcs[0]}_fa4"] = first
        kernel = "fa2"
        first = _subprocess("trl", paths, args.smoke, args.timeout, "--kernel", kernel, "--gc", gcs[0])
    report["runs"][f"trl_gc_{gcs[0]}"] = first
    _write(args.out, report)
    t1 = time.perf_counter()
    report["reference"] = reference_losses(model_dir, stream, device)
    report["reference_s"] = time.perf_counter() - t1
    _write(args.out, report)
    for gc in gcs[1:]:
        report["runs"][f"trl_gc_{gc}"] = _subprocess("trl", paths, args.smoke, args.timeout, "--kernel", kernel,
                                                     "--gc", gc)
        _write(args.out, report)
    if args.smoke:  # the CPU check of the sdpa attempt (see peer_gpu_probes.py)
        report["runs"]["trl_sdpa_swapped"] = _subprocess("trl", paths, True, args.timeout, "--kernel", kernel,
                                                         "--gc", "on", "--attn-override", "sdpa")
    _write(args.out, report)
    print(json.dumps(report["summary"], indent=1), flush=True)
    print(f"wrote {args.out}")


def _write(path: str, report: dict[str, Any]) -> None:
    from benchmarks.peers.peer_gpu_report import summarize

    report["summary"] = summarize(report)
    write_report(path, report, default=str)


def probes(args: argparse.Namespace) -> None:
    """The attempts of ``peer_gpu_probes.py`` on a tiny stream; writes ``--out``."""
    from benchmarks.peers.peer_gpu_probes import probe_attempts

    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    stream = make_stream(SMOKE_WORKLOADS, 3, SMOKE_BUDGET, 512, seed=3, check_trl=False)
    result = {"env": {"device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
                      "trl": _version("trl"), "datasets": _version("datasets"), "torch": torch.__version__},
              "attempts": probe_attempts(stream, args.smoke, _trl_kernel(args.trl_kernel, device))}
    write_report(args.out, result, default=str)
    print(json.dumps(result, indent=1, default=str), flush=True)


def _describe(stream: Stream) -> dict[str, Any]:
    rows = []
    for r, (row, name) in enumerate(zip(stream.rows, stream.workload_of_row)):
        samples = [stream.samples[i] for i in row]
        staleness = [r - s.policy_version for s in samples]
        rows.append({"step": r + 1, "workload": name, "samples": len(samples),
                     "groups": len({s.group_id for s in samples}),
                     "raw_tokens": int(sum(len(s.token_ids) for s in samples)),
                     "trained_tokens": int(sum(s.num_trained for s in samples)),
                     "staleness_counts": {str(k): staleness.count(k) for k in sorted(set(staleness))}})
    return {"seed": stream.seed, "samples": len(stream.samples), "trl_planner_same_rows": stream.trl_rows_checked,
            "rows": rows}


def _version(name: str) -> str | None:
    try:
        from importlib.metadata import version

        return version(name)
    except Exception:  # noqa: BLE001 - not installed
        return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("role", nargs="?", default="launch", choices=("launch", "ours", "trl", "probes", "report"))
    ap.add_argument("json", nargs="?", help="report: the results JSON")
    ap.add_argument("--out", default="benchmarks/results/peer_trl_gpu.json")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny model, token_budget 1024: checks the harness")
    ap.add_argument("--trl-gc", default="off,on", help="TRL runs: gradient_checkpointing off and/or on (its default)")
    ap.add_argument("--trl-kernel", default="auto", help="the kernel behind TRL's tree attention: auto (fa4 where "
                    "FlashAttention-4 imports, else fa2), fa4 or fa2")
    ap.add_argument("--timeout", type=float, default=420, help="seconds per trainer process")
    ap.add_argument("--seed", type=int, default=1, help="the stream's seed (1: its rows were checked against TRL's "
                    "planner with --check-rows)")
    ap.add_argument("--check-rows", action="store_true", help="check the rows against TRL's planner first "
                    "(pure Python; on by default with --smoke)")
    ap.add_argument("--check-rows-only", action="store_true", help="build and check the stream, then stop")
    ap.add_argument("--plot", default=None, help="report: the PNG to write (default: the JSON's name with .png)")
    ap.add_argument("--merge-attempts", default=None, help="report: a smoke JSON whose CPU attempts join the JSON")
    ap.add_argument("--merge-probes", default=None, help="report: the probes role's JSON from the GPU machine")
    ap.add_argument("--rows-check", default=None, help="report: the JSON --check-rows-only printed on the CPU")
    # subprocess roles
    ap.add_argument("--model-dir")
    ap.add_argument("--stream")
    ap.add_argument("--kernel", default="fa2")
    ap.add_argument("--gc", default="off")
    ap.add_argument("--attn-override", default=None)
    args = ap.parse_args()
    if args.role == "launch":
        launch(args)
    elif args.role == "probes":
        probes(args)
    elif args.role == "report":
        from benchmarks.peers.peer_gpu_report import report_main

        report_main(args)
    else:
        _role_main(args)


if __name__ == "__main__":
    main()

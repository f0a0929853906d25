"""This project against TRL 1.16.0 on the same GRPO work, side by side in one run (issue 18).

Contenders, all on the tiny offline model (``grpo_core.tiny``), the arithmetic task, the same prompts,
batch (64 completions: 8 prompts x 8), group size, learning rate, completion length and step count:

    trl_sync    TRL ``GRPOTrainer``, ``use_vllm=True, vllm_mode="colocate"`` (vLLM's CPU build in-process)
    trl_async   TRL ``AsyncGRPOTrainer`` against a vLLM server (the same server as ours)
    ours_async  this project's ``AsyncGRPOTrainer`` with the demo's settings (``flows/cli.py``)
    ours_sync   the same with ``max_staleness=0`` and one batch in flight (``max_concurrent_rollouts=64``)

TRL runs in its own environment, ``benchmarks/.venv-trl`` (``benchmarks/peers/peer_trl_env.sh`` makes it; it never
enters the project's lock). Each contender trains in a subprocess; every ``--eval-every`` steps it copies
its weights (in memory, outside nothing else); after all runs each copy is scored on held-out problems
with one sampler for all (``grpo_core.tiny.evaluate.sampled_eval``: temperature 1, no top-k/top-p,
``max_completion_length`` new tokens, the same seed), so accuracy is plotted against each run's own wall
clock (from ``train()`` to the end of the step). A contender that cannot run on this CPU build is
reported with the exact error that stopped it. The server and our contenders share the cores as the flow's
local provisioner places them (``grpo_core.vllm_server.cpu_placement``; on two cores our trainer alone on core 1, the server
and the rollout worker on core 0); ``--cpu-placement off`` leaves them to the scheduler.

    bash benchmarks/peers/peer_trl_env.sh
    .venv/bin/python -m benchmarks.peers.peer_trl                 # full run: JSON + PNG under benchmarks/results/
    .venv/bin/python -m benchmarks.peers.peer_trl --smoke         # two steps each, to check the script
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.peers.peer_trl_contenders import SHARED, contender_main
from benchmarks.bench_io import write_report

ROOT = Path(__file__).resolve().parents[2]
TRL_ENV = ROOT / "benchmarks" / ".venv-trl"
RESULTS = ROOT / "benchmarks" / "results"

CONTENDERS = ("trl_sync", "trl_async", "ours_async", "ours_sync")
ON_TRL_ENV = {"trl_sync", "trl_async"}
NEEDS_SERVER = {"trl_async", "ours_async", "ours_sync"}


# ============================================================================ orchestrator (project environment)
def _python_for(name: str) -> str:
    return str((TRL_ENV if name in ON_TRL_ENV else ROOT / ".venv") / "bin" / "python")


def _contender_env(name: str, placement: Any = None) -> dict[str, str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}
    if name.startswith("ours"):
        # As the flow starts a trainer beside a local CPU server (flows/provision.py, LocalProvisioner.training_env).
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 2) // 2)))
        if placement is not None:
            env.update(placement.trainer_environment())
    if name == "trl_sync":
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # as the server gets (grpo_core.vllm_server.process.ServerOptions.kv_cache_gib)
    return env


def run_one(name: str, spec: dict[str, Any], work: Path, round_index: int, timeout_s: float,
            placement: Any = None) -> dict[str, Any]:
    """One contender in a subprocess; ours start on the placement's trainer cores, as the flow starts a trainer
    beside a CPU server it placed (TRL's are never placed: its synchronous trainer uses no server)."""
    from grpo_core.vllm_server.cpu_placement import forked_on

    placement = placement if name.startswith("ours") else None
    spec_path = work / "spec.json"
    spec_path.write_text(json.dumps(spec))
    tag = f"{name}{'-hf' if name == 'trl_sync' and spec.get('trl_generation') else ''}-r{round_index}"
    out = work / f"{tag}.json"
    log_path = work / f"{tag}.log"
    cmd = [_python_for(name), "-m", "benchmarks.peers.peer_trl", "--contender", name, "--spec", str(spec_path), "--out", str(out)]
    print(f"[peer_trl] round {round_index}: {name} ...", flush=True)
    start = time.perf_counter()
    with open(log_path, "wb") as log, forked_on(placement.trainer if placement is not None else None):
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=_contender_env(name, placement),
                                cwd=str(ROOT), start_new_session=True)
        try:
            rc = proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            import signal

            os.killpg(proc.pid, signal.SIGKILL)  # the group this call started, nothing else
            proc.wait()
            rc = "timeout"
    elapsed = time.perf_counter() - start
    result = json.loads(out.read_text()) if out.exists() else {}
    if rc != 0 and "error" not in result:
        tail = log_path.read_text(errors="replace").splitlines()[-25:]
        result["error"] = f"exit {rc}: " + "\n".join(tail)
    result.update({"name": name, "round": round_index, "process_s": elapsed, "log": str(log_path),
                   "cpu_placement": placement.describe() if placement is not None else None,
                   **({"trl_generation": spec.get("trl_generation") or "vllm colocate"} if name == "trl_sync" else {})})
    print(f"[peer_trl] {name}: {'ok' if 'steps' in result else 'FAILED'} in {elapsed:.0f} s", flush=True)
    return result


def evaluate_snapshots(runs: list[dict[str, Any]], model_path: str, spec: dict[str, Any]) -> None:
    """Held-out accuracy of every weight copy, with one sampler and seed for all."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from grpo_core.tiny import arithmetic_dataset
    from grpo_core.tiny.evaluate import sampled_eval

    torch.set_num_threads(os.cpu_count() or 2)
    held = arithmetic_dataset(num_train=spec["num_train"], num_eval=spec["num_eval"], seed=spec["seed"])["eval"]
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path).eval()
    initial = {k: v.clone() for k, v in model.state_dict().items()}

    def accuracy(state: dict[str, Any]) -> float:
        missing, unexpected = model.load_state_dict(state, strict=False)
        if unexpected or any(not k.startswith("lm_head") for k in missing):
            raise RuntimeError(f"snapshot does not fit the model: missing {missing}, unexpected {unexpected}")
        res = sampled_eval(model, tokenizer, held["prompt"], held["solution"], seed=spec["seed"],
                           max_new_tokens=SHARED["max_completion_length"], batch_size=200)
        return res.accuracy

    start_acc = accuracy(initial)
    for run in runs:
        if "snapshots" not in run:
            continue
        curve = [{"step": 0, "t": 0.0, "accuracy": start_acc}]
        for snap in run["snapshots"]:
            curve.append({"step": snap["step"], "t": snap["t"],
                          "accuracy": accuracy(torch.load(snap["path"], weights_only=True))})
        run["accuracy_curve"] = curve
        print(f"[peer_trl] {run['name']} r{run['round']}: accuracy {[round(c['accuracy'], 3) for c in curve]}", flush=True)


def _median(values: list[float]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def summarize(run: dict[str, Any]) -> dict[str, Any]:
    """Per-step figures of one run (the first step, which includes start-up, left out of medians)."""
    steps = run.get("steps") or []
    body = steps[1:] if len(steps) > 1 else steps
    name = run["name"]
    out: dict[str, Any] = {"steps": len(steps), "total_s": steps[-1]["t_end"] if steps else None,
                           "first_step_s": steps[0]["wall_s"] if steps else None,
                           "step_s_median": _median([r["wall_s"] for r in body])}
    wall = sum(r["wall_s"] for r in body) or float("nan")
    if name.startswith("ours"):
        gen = [r.get("rollout/generated_tok_s", 0.0) * r.get("perf/step_s", 0.0) for r in body]
        trained = [r.get("batch/trained_tokens_per_step", 0.0) for r in body]
        waits = [r.get("perf/rollout_wait_s", 0.0) for r in body]
        out.update({
            "rollout_wait_s_median": _median(waits),
            "rollout_wait_s_mean": statistics.fmean(waits) if waits else None,
            "train_s_median": _median([r["wall_s"] - r.get("perf/rollout_wait_s", 0.0) for r in body]),
            "fwd_bwd_s_median": _median([r.get("perf/fwd_bwd_s") for r in body]),
            "sync_s_median": _median([r.get("sync/seconds") for r in body]),
            "stale_dropped": sum(r.get("sample/stale_dropped", 0.0) for r in steps),
            "staleness_mean": statistics.fmean([r.get("sample/staleness_mean", 0.0) for r in body]) if body else None,
            "queue_size_median": _median([r.get("rollout/queue_size") for r in body]),
        })
    elif name == "trl_sync":
        gen = [r.get("gen_tokens", 0.0) for r in body]
        trained = gen  # every completion of the step is in its loss (zero-advantage groups included)
        out.update({"gen_s_median": _median([r.get("gen_s") for r in body]),
                    "train_s_median": _median([r["wall_s"] - r.get("gen_s", 0.0) for r in body])})
    else:
        gen = [r.get("completions/mean_length", 0.0) * SHARED["batch_completions"] for r in body]
        trained = gen
    out["generated_tok_s"] = sum(gen) / wall
    out["trained_tok_s"] = sum(trained) / wall
    out["reward_last5"] = statistics.fmean([r.get("reward", float("nan")) for r in steps[-5:]]) if steps else None
    return out


def time_to_accuracy(curve: list[dict[str, float]], target: float) -> float | None:
    """Wall time of the first evaluation at or above ``target`` (linear between evaluations)."""
    prev = None
    for point in curve:
        if point["accuracy"] >= target - 1e-12:
            if prev is None or point["accuracy"] == prev["accuracy"]:
                return point["t"]
            frac = (target - prev["accuracy"]) / (point["accuracy"] - prev["accuracy"])
            return prev["t"] + max(0.0, min(1.0, frac)) * (point["t"] - prev["t"])
        prev = point
    return None


def aggregate(runs: list[dict[str, Any]]) -> dict[str, Any]:
    by_name: dict[str, list[dict[str, Any]]] = {}
    for run in runs:
        by_name.setdefault(run["name"], []).append(run)
    table: dict[str, Any] = {}
    for name, group in by_name.items():
        ok = [r for r in group if "steps" in r]
        entry: dict[str, Any] = {"runs": len(group), "ok": len(ok)}
        if ok:
            per = [summarize(r) for r in ok]
            entry.update({k: _median([p[k] for p in per]) for k in per[0] if isinstance(per[0][k], (int, float))})
            entry["best_accuracy"] = _median([max(c["accuracy"] for c in r["accuracy_curve"]) for r in ok if "accuracy_curve" in r])
            entry["final_accuracy"] = _median([r["accuracy_curve"][-1]["accuracy"] for r in ok if "accuracy_curve" in r])
        errors = [a for r in group for a in (r.get("attempts") or [])]
        errors += [{"error": r["error"]} for r in group if "error" in r and not r.get("attempts")]
        if errors:
            entry["errors"] = errors
        table[name] = entry
    # The accuracy the slowest contender reaches: the lowest of the contenders' best held-out accuracies.
    reached = {n: e["best_accuracy"] for n, e in table.items() if e.get("best_accuracy") is not None}
    common = min(reached.values()) if reached else None
    for name, entry in table.items():
        curves = [r["accuracy_curve"] for r in by_name[name] if "accuracy_curve" in r]
        times = [time_to_accuracy(c, common) for c in curves] if common is not None else []
        entry["time_to_common_accuracy_s"] = _median([t for t in times if t is not None])
    ratios = {}
    t = {n: e.get("time_to_common_accuracy_s") for n, e in table.items()}
    if t.get("ours_async") and t.get("trl_sync"):
        ratios["trl_sync_over_ours_async_time_to_accuracy"] = t["trl_sync"] / t["ours_async"]
    if t.get("ours_async") and t.get("trl_async"):
        ratios["trl_async_over_ours_async_time_to_accuracy"] = t["trl_async"] / t["ours_async"]
    sync, async_ = table.get("ours_sync", {}), table.get("ours_async", {})
    if sync.get("rollout_wait_s_median") is not None and async_.get("step_s_median") is not None:
        gen, train = sync["rollout_wait_s_median"], sync["train_s_median"]
        ratios["ours_sync_generation_s"] = gen
        ratios["ours_sync_training_s"] = train
        ratios["ours_async_step_over_max_gen_train"] = async_["step_s_median"] / max(gen, train)
        ratios["ours_sync_step_over_async_step"] = sync["step_s_median"] / async_["step_s_median"]
    return {"common_accuracy": common, "contenders": table, "targets": ratios}


def plot(runs: list[dict[str, Any]], summary: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_acc, ax_step) = plt.subplots(1, 2, figsize=(12, 4.5))
    colors = {"trl_sync": "tab:red", "trl_async": "tab:orange", "ours_async": "tab:blue", "ours_sync": "tab:green"}
    seen = set()
    for run in runs:
        if "accuracy_curve" not in run:
            continue
        name = run["name"]
        curve = run["accuracy_curve"]
        ax_acc.plot([c["t"] for c in curve], [c["accuracy"] for c in curve], marker="o", color=colors.get(name),
                    label=name if name not in seen else None, alpha=0.85)
        ax_step.plot([r["step"] for r in run["steps"]], [r["wall_s"] for r in run["steps"]], color=colors.get(name),
                     label=name if name not in seen else None, alpha=0.85)
        seen.add(name)
    if summary.get("common_accuracy") is not None:
        ax_acc.axhline(summary["common_accuracy"], color="grey", ls="--", lw=1, label="common accuracy")
    ax_acc.set_xlabel("wall time since train() (s)")
    ax_acc.set_ylabel("held-out accuracy (sampled, T=1)")
    ax_acc.legend()
    ax_step.set_xlabel("optimizer step")
    ax_step.set_ylabel("wall time of the step (s)")
    ax_step.set_yscale("log")
    ax_step.legend()
    fig.suptitle("Tiny model, arithmetic, 2 CPU cores: this project vs TRL 1.16.0")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _drop_bulky(run: dict[str, Any]) -> dict[str, Any]:
    keep = ("step", "t_end", "wall_s", "reward", "perf/rollout_wait_s", "perf/step_s", "perf/fwd_bwd_s", "sync/seconds",
            "rollout/generated_tok_s", "batch/trained_tokens_per_step", "sample/stale_dropped", "sample/staleness_mean",
            "rollout/queue_size", "rollout/concurrency", "gen_s", "gen_tokens", "completions/mean_length",
            "perf/weight_sync_s", "loss", "rollout/completions_per_request")
    run = dict(run)
    run["steps"] = [{k: r[k] for k in keep if k in r} for r in run.get("steps", [])]
    run.pop("snapshots", None)
    return run


def markdown_table(result: dict[str, Any]) -> str:
    """The README's table from a result file (``--table PATH``)."""
    def f(v: Any, digits: int = 2) -> str:
        return "—" if v is None else (f"{v:.{digits}f}" if isinstance(v, float) else str(v))

    rows = ["| contender | ran | step s (median) | first step s | generated tok/s | trained tok/s | rollout_wait_s (median) "
            "| stale dropped | held-out acc. start → best | time to common acc. s |", "|---|---|---|---|---|---|---|---|---|---|"]
    start = None
    for run in result["runs"]:
        if run.get("accuracy_curve"):
            start = run["accuracy_curve"][0]["accuracy"]
            break
    for name, e in result["contenders"].items():
        ran = "yes" if e.get("ok") else "no"
        if name == "trl_sync" and e.get("ok"):
            ran = next((r.get("trl_generation") for r in result["runs"] if r["name"] == name), ran)
        rows.append(f"| {name} | {ran} | {f(e.get('step_s_median'))} | {f(e.get('first_step_s'), 1)} | "
                    f"{f(e.get('generated_tok_s'), 0)} | {f(e.get('trained_tok_s'), 0)} | {f(e.get('rollout_wait_s_median'))} | "
                    f"{f(e.get('stale_dropped'), 0) if e.get('stale_dropped') is not None else '—'} | "
                    f"{f(start, 3) if e.get('ok') else '—'} → {f(e.get('best_accuracy'), 3)} | {f(e.get('time_to_common_accuracy_s'), 1)} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="two steps per contender, a few held-out prompts")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=1, help="alternating rounds over the contenders")
    parser.add_argument("--num-eval", type=int, default=400, help="held-out problems scored per evaluation")
    parser.add_argument("--contenders", default=",".join(CONTENDERS))
    parser.add_argument("--server-url", default=None, help="use this running server (started with the same spec) instead of starting one")
    parser.add_argument("--timeout-s", type=float, default=1800.0, help="per contender run")
    parser.add_argument("--cpu-placement", choices=("auto", "off"), default="auto",
                        help="split the cores between our trainer and the server it starts, as the flow does "
                             "(grpo_core.vllm_server.cpu_placement; never with --server-url)")
    parser.add_argument("--out", default=str(RESULTS / "peer_trl.json"))
    parser.add_argument("--plot", default=str(RESULTS / "peer_trl.png"))
    parser.add_argument("--table", help="print the README table of this result file and exit")
    # Inside a contender's process:
    parser.add_argument("--contender", help=argparse.SUPPRESS)
    parser.add_argument("--spec", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.contender:
        return contender_main(args.contender, args.spec, args.out)
    if args.table:
        print(markdown_table(json.loads(Path(args.table).read_text())))
        return 0

    if args.smoke:
        args.steps, args.eval_every, args.num_eval, args.rounds = 2, 1, 16, 1
        if args.out == str(RESULTS / "peer_trl.json"):
            args.out, args.plot = "/tmp/peer_trl_smoke.json", "/tmp/peer_trl_smoke.png"
        elif args.plot == str(RESULTS / "peer_trl.png"):
            args.plot = str(Path(args.out).with_suffix(".png"))
    names = [n.strip() for n in args.contenders.split(",") if n.strip()]
    if any(n in ON_TRL_ENV for n in names):
        subprocess.run(["bash", str(ROOT / "benchmarks" / "peers" / "peer_trl_env.sh")], check=True)

    from grpo_core.tiny import build_tiny_model
    from grpo_core.vllm_server.process import VLLMServer, VLLMServerSpec

    model_path = str(build_tiny_model())
    snapshot_steps = sorted({*range(args.eval_every, args.steps + 1, args.eval_every), args.steps})
    spec = {"model_path": model_path, "steps": args.steps, "snapshot_steps": snapshot_steps, "num_train": 2000,
            "num_eval": args.num_eval, "seed": SHARED["seed"], "server_url": None}
    work = Path(tempfile.mkdtemp(prefix="peer_trl-"))
    print(f"[peer_trl] work folder {work}", flush=True)
    runs: list[dict[str, Any]] = []
    server = None
    placement = None
    try:
        if args.server_url:
            spec["server_url"] = args.server_url
        elif any(n in NEEDS_SERVER for n in names):
            import torch

            from grpo_core.vllm_server.cpu_placement import resolve_placement

            placement = resolve_placement(args.cpu_placement, cuda=torch.cuda.is_available(), server_started_here=True)
            print(f"[peer_trl] cpu placement: {placement.describe() if placement else 'none'}", flush=True)
            server = VLLMServer(VLLMServerSpec(model=model_path, max_model_len=SHARED["max_model_len"], max_logprobs=20),
                                work / "server", placement=placement).start(timeout_s=900)
            spec["server_url"] = server.base_url
        for r in range(args.rounds):
            order = names if r % 2 == 0 else list(reversed(names))  # alternate, so drift in load hits all alike
            for name in order:
                run = run_one(name, spec, work, r, args.timeout_s, placement)
                if name == "trl_sync" and "steps" not in run and spec.get("trl_generation") is None:
                    # vLLM colocated cannot run here: say why, and from then on use transformers generation.
                    spec["trl_generation"] = "transformers generate"
                    retry = run_one(name, spec, work, r, args.timeout_s, placement)
                    retry["attempts"] = run.get("attempts", []) + retry.get("attempts", [])
                    run = retry
                runs.append(run)
    finally:
        if server is not None:
            server.stop()
    evaluate_snapshots(runs, model_path, spec)
    summary = aggregate(runs)
    import platform

    import torch

    result = {
        "settings": {**SHARED, "steps": args.steps, "eval_every": args.eval_every, "num_eval": args.num_eval,
                     "rounds": args.rounds, "cpu_placement": placement.describe() if placement is not None else "none"},
        "machine": {"cpus": os.cpu_count(), "torch": torch.__version__, "python": platform.python_version(),
                    "load_avg_after": os.getloadavg()},
        **summary,
        "runs": [_drop_bulky(r) for r in runs],
    }
    write_report(args.out, result)
    plot(runs, summary, Path(args.plot))
    print(json.dumps({"common_accuracy": summary["common_accuracy"], "targets": summary["targets"],
                      "contenders": {n: {k: v for k, v in e.items() if k != "errors"} for n, e in summary["contenders"].items()}},
                     indent=1))
    print(f"[peer_trl] wrote {args.out} and {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""How long a CPU vLLM server takes to start, and how fast it generates, with its model worker in a process of its
own (vLLM's default on CPU) or inside the engine process (``ServerOptions.cpu_worker_in_engine``, the default here).

Side by side in one run, on the tiny model (``grpo_core.tiny``), rounds alternating the order of the two launches:
the seconds from ``Popen`` to the first answer on ``/v1/models``, the server's processes once ready, then the
rollout worker's request shape (``rollout_throughput.py``'s ``ours``: one request per completion, top-8 log-probs,
128 in flight) for ``--completions`` completions. Prints the medians and the ratios in-engine / own process.

    .venv/bin/python -m benchmarks.rollout.server_start --rounds 2                 # JSON to benchmarks/results/
    .venv/bin/python -m benchmarks.rollout.server_start --model MODEL_DIR --modes in_engine,in_engine_eager \
        --rounds 2 --completions 256 --out benchmarks/results/server_start_hybrid.json
    .venv/bin/python -m benchmarks.rollout.server_start --smoke --server-url URL --out /tmp/server_start.json   # starts nothing

Measured on two cores shared with other work (so absolute times are high; ratios are what to quote):
``results/server_start.json`` (tiny Qwen3): in-engine / worker process: start 0.53x, tok/s 1.26x, server CPU per
token 0.47x; eager / worker process: start 0.50x, tok/s 1.02x. ``results/server_start_hybrid.json`` (the tiny
Gated DeltaNet hybrid, bf16): eager started in 59 s against 125 s compiled cold (74 s with vLLM's compile cache
warm) and generated 0.64x the tokens per second.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.bench_io import write_report  # noqa: E402
from benchmarks.rollout.rollout_throughput import SHAPES, listening_pid, prompt_ids, roles, run_shape, server_cpu  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
MODES = {
    "worker_process": {"cpu_worker_in_engine": False, "enforce_eager": False},
    "in_engine": {"cpu_worker_in_engine": True, "enforce_eager": False},
    "in_engine_eager": {"cpu_worker_in_engine": True, "enforce_eager": True},
}
"""Each launch measured, and the ``ServerOptions`` it sets."""
BASE = "worker_process"


def measure(mode: str, model_path: str, prompts: list[list[int]], completions: int, work: Path) -> dict[str, Any]:
    from grpo_core.vllm_server.process import ServerOptions, VLLMServer, VLLMServerSpec

    from grpo_core.config import AsyncGRPOConfig
    from grpo_core.vllm_server.model_needs import model_server_options

    # The options the flow would give this model (bf16 for a Gated DeltaNet model on CPU), then the mode's.
    options = dataclasses.replace(model_server_options(model_path, ServerOptions(), cuda=False), **MODES[mode])
    spec = VLLMServerSpec.for_run(model_path, AsyncGRPOConfig(output_dir=str(work / "unused")), options)
    server = VLLMServer(spec, work / f"{mode}-{time.monotonic_ns()}")
    began = time.monotonic()
    server.start(timeout_s=900)
    start_s = time.monotonic() - began
    try:
        assert server.process is not None
        result = generate_on(server.base_url, server.process.pid, prompts, completions, warm_up=64)
    finally:
        server.stop()
    result = {"mode": mode, "start_s": start_s, **result}
    print(f"  {mode:15s} start {start_s:6.1f} s   {result['tok_s']:7.0f} tok/s   processes {result['processes']}", flush=True)
    return result


def generate_on(url: str, pid: int, prompts: list[list[int]], completions: int, warm_up: int) -> dict[str, Any]:
    """What a started server does: its processes by role, tokens/s of the rollout worker's request shape, and the
    CPU its process group spent on them."""
    processes = {role: len(pids) for role, pids in roles(pid).items()}
    asyncio.run(run_shape(url, prompts, SHAPES["ours"], warm_up))
    before = server_cpu(pid)
    run = asyncio.run(run_shape(url, prompts, SHAPES["ours"], completions))
    after = server_cpu(pid)
    return {"processes": processes, "tok_s": run["tok_s"], "tokens": run["tokens"],
            "server_cpu_s": sum(after.values()) - sum(before.values())}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--completions", type=int, default=512)
    parser.add_argument("--variant", default="arithmetic", help="the tiny model variant served (grpo_core.tiny)")
    parser.add_argument("--model", default=None, help="a model folder to serve instead of a tiny variant")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "server_start.json"))
    parser.add_argument("--smoke", action="store_true", help="start nothing: the generation and CPU part on the server "
                        "at --server-url, 16 completions (the start itself takes minutes on two cores)")
    parser.add_argument("--server-url", default=None, help="--smoke: the running server of the same tiny model")
    args = parser.parse_args(argv)
    if args.smoke:
        if not args.server_url:
            parser.error("--smoke needs --server-url (a running server of the tiny model)")
        from grpo_core.tiny import build_tiny_model

        prompts = prompt_ids(str(build_tiny_model(variant=args.variant)), 32)
        run = generate_on(args.server_url, listening_pid(args.server_url), prompts, 16, warm_up=4)
        write_report(args.out, {"smoke": True, "cpus": len(os.sched_getaffinity(0)), "runs": [{"mode": "running", **run}]})
        return 0

    from grpo_core.tiny import build_tiny_model

    model_path = args.model or str(build_tiny_model(variant=args.variant))
    modes = [m for m in args.modes.split(",") if m]
    prompts = prompt_ids(model_path, 512)
    work = Path(tempfile.mkdtemp(prefix="server_start-"))
    report: dict[str, Any] = {"cpus": len(os.sched_getaffinity(0)), "load_avg_before": os.getloadavg(), "runs": []}
    for r in range(args.rounds):
        order = modes if r % 2 == 0 else list(reversed(modes))
        print(f"round {r}", flush=True)
        for mode in order:
            report["runs"].append(measure(mode, model_path, prompts, args.completions, work))
    report["load_avg_after"] = os.getloadavg()
    summary: dict[str, Any] = {}
    for mode in modes:
        runs = [r for r in report["runs"] if r["mode"] == mode]
        summary[mode] = {"start_s_median": statistics.median(r["start_s"] for r in runs),
                         "tok_s_median": statistics.median(r["tok_s"] for r in runs),
                         "server_cpu_ms_per_1k_tok": 1e6 * sum(r["server_cpu_s"] for r in runs) / sum(r["tokens"] for r in runs)}
    for mode in modes:
        if mode != BASE and BASE in summary:
            summary[mode]["over_" + BASE] = {key: summary[mode][key] / summary[BASE][key]
                                             for key in ("start_s_median", "tok_s_median", "server_cpu_ms_per_1k_tok")}
    report["summary"] = summary
    print("\nlaunch           start s (median)   tok/s (median)   server CPU ms / 1k tok")
    for mode in modes:
        s = summary[mode]
        print(f"{mode:16s} {s['start_s_median']:17.1f} {s['tok_s_median']:16.0f} {s['server_cpu_ms_per_1k_tok']:24.0f}")
    for mode in modes:
        if mode != BASE and BASE in summary:
            ratio = summary[mode]["over_" + BASE]
            print(f"{mode} / {BASE}: start {ratio['start_s_median']:.2f}x, tok/s {ratio['tok_s_median']:.2f}x, "
                  f"server CPU per token {ratio['server_cpu_ms_per_1k_tok']:.2f}x")
    write_report(args.out, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())

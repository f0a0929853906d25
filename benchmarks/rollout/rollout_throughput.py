"""Where rollout generation time goes on one CPU vLLM server, and what sharing the cores costs the trainer.

Side by side in one run, on the tiny model (``grpo_core.tiny``), arithmetic prompts, 24 completion tokens,
temperature 1, against one server started as ``benchmarks/peers/peer_trl.py`` starts it:

Part 1, request shapes (completions generated at a fixed number in flight, rounds alternating; tok/s, the
client's CPU seconds, and the CPU seconds each server process spent, per 1,000 generated tokens):

    ours          what the rollout worker sends: /inference/v1/generate, one request per completion (n=1),
                  top-8 sampler log-probs (logprobs=9), non-streaming, 128 in flight (the async ceiling),
                  parsed with the worker's own parser
    ours_c64      the same with 64 in flight (the synchronous setting's ceiling)
    ours_c256     the same with 256 in flight
    lp0           ours without top log-probs (logprobs=0: the sampled token's log-prob only)
    n8            ours with the 8 completions of a group in one request (n=8)
    n8_lp0        n=8 and logprobs=0
    batch_lp0     /v1/completions, all prompts of the batch in one request, n=8, logprobs=0: the engine's
                  throughput with the least HTTP and serialisation (the reference point)
    stream        ours, streamed (one chunk per token)

Part 2, core sharing (2 cores): a trainer stand-in (forward + backward of the same model in transformers on
64 sequences of prompt + 24 tokens, ``OMP_NUM_THREADS=1``, as the trainer runs beside a local server) timed
with the server idle and with a loader process (the rollout worker stand-in, the ``ours`` shape) keeping it
busy (the ``ours_coalesced`` shape), under different core placements (``os.sched_setaffinity``) of the trainer, the loader and the server's
API-server / engine-core processes (the engine's worker binds its OpenMP thread to core 0 by itself:
``VLLM_CPU_OMP_THREADS_BIND=auto`` reserves the last core for the other server processes).

    .venv/bin/python -m benchmarks.rollout.rollout_throughput            # both parts, JSON to benchmarks/results/
    .venv/bin/python -m benchmarks.rollout.rollout_throughput --quick    # fewer completions and rounds
    .venv/bin/python -m benchmarks.rollout.rollout_throughput --smoke --server-url URL --out /tmp/rollout_throughput.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from urllib.parse import urlsplit
from typing import Any

from benchmarks.bench_io import write_report  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
MAX_TOKENS = 24


# ------------------------------------------------------------------------------------------------ prompts
def prompt_ids(model_path: str, count: int) -> list[list[int]]:
    from transformers import AutoTokenizer

    from grpo_core.tiny import arithmetic_dataset

    tok = AutoTokenizer.from_pretrained(model_path)
    rows = arithmetic_dataset(num_train=count, num_eval=8, seed=0)["train"]
    out = []
    for row in rows:
        text = tok.apply_chat_template(row["prompt"], tokenize=False, add_generation_prompt=True)
        out.append(list(tok(text, add_special_tokens=False)["input_ids"]))
    return out


# ------------------------------------------------------------------------------------------------ server CPU
def server_cpu(pid: int) -> dict[str, float]:
    """CPU seconds (user + system) of each process of the server's group, by role."""
    import psutil

    out: dict[str, float] = {}
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return out
    for p in procs:
        try:
            cmd = " ".join(p.cmdline())
            t = p.cpu_times()
            name = p.name()
        except psutil.NoSuchProcess:
            continue
        role = "api_server" if p.pid == pid else ("engine_worker" if "Worker" in name or "VllmWorker" in name else
                                                  "engine_core" if "EngineCore" in name else name or cmd[:20])
        out[role] = out.get(role, 0.0) + t.user + t.system
    return out


def listening_pid(url: str) -> int:
    """The process that listens on ``url``'s port: a running server's API process, the root of its group."""
    import psutil

    port = urlsplit(url).port
    pids = {c.pid for c in psutil.net_connections(kind="tcp") if c.status == psutil.CONN_LISTEN and c.laddr.port == port}
    if len(pids) != 1 or None in pids:
        raise SystemExit(f"--server-url: found {len(pids)} processes listening on port {port}, not one")
    return pids.pop()


def roles(pid: int) -> dict[str, list[int]]:
    import psutil

    out: dict[str, list[int]] = {}
    root = psutil.Process(pid)
    for p in [root, *root.children(recursive=True)]:
        name = p.name()
        role = "api_server" if p.pid == pid else ("engine_worker" if "Worker" in name else
                                                  "engine_core" if "EngineCore" in name else name)
        out.setdefault(role, []).append(p.pid)
    return out


# ------------------------------------------------------------------------------------------------ shapes
SHAPES: dict[str, dict[str, Any]] = {
    "ours": {"route": "generate", "n": 1, "num_top": 8, "in_flight": 128, "coalesce": False},
    "ours_coalesced": {"route": "generate", "n": 1, "num_top": 8, "in_flight": 128, "coalesce": True},
    "ours_c64": {"route": "generate", "n": 1, "num_top": 8, "in_flight": 64, "coalesce": False},
    "ours_c256": {"route": "generate", "n": 1, "num_top": 8, "in_flight": 256, "coalesce": False},
    "lp0": {"route": "generate", "n": 1, "num_top": 0, "in_flight": 128, "coalesce": False},
    "n8": {"route": "generate", "n": 8, "num_top": 8, "in_flight": 128},
    "n8_lp0": {"route": "generate", "n": 8, "num_top": 0, "in_flight": 128},
    "batch_lp0": {"route": "completions_batch", "n": 8, "num_top": 0, "in_flight": 128},
    "stream": {"route": "generate_stream", "n": 1, "num_top": 8, "in_flight": 128},
}


async def run_shape(base_url: str, prompts: list[list[int]], shape: dict[str, Any], completions: int) -> dict[str, Any]:
    """Generate ``completions`` completions keeping ``in_flight`` in flight; tokens, wall and client CPU."""
    import httpx

    from grpo_core.rollout.generation import VLLMGenerateClient
    from grpo_core.vllm_server.replies import parse_generate_choice

    client = VLLMGenerateClient(base_url, max_connections=1024, coalesce=shape.get("coalesce", False))
    raw = httpx.AsyncClient(base_url=base_url, timeout=600, limits=httpx.Limits(max_connections=1024, max_keepalive_connections=1024))
    n, num_top, in_flight = shape["n"], shape["num_top"], shape["in_flight"]
    params = {"max_tokens": MAX_TOKENS, "temperature": 1.0, "ignore_eos": False}
    tokens = 0
    requests = completions // n
    next_prompt = 0

    async def one(i: int) -> int:
        # As the worker sends them: one prompt per group of 8 completions (n=1: 8 calls, n=8: one).
        ids = prompts[(i // (8 // n)) % len(prompts)]
        if shape["route"] == "generate":
            choices = await client.generate(ids, {**params, "n": n}, num_top=num_top)
            return sum(len(c.token_ids) for c in choices)
        if shape["route"] == "generate_stream":
            body = {"token_ids": ids, "sampling_params": {**params, "n": n, "logprobs": num_top + 1 if num_top else 0},
                    "stream": True}
            count = 0
            async with raw.stream("POST", "/inference/v1/generate", json=body) as resp:
                async for line in resp.aiter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        chunk = json.loads(line[6:])
                        for c in chunk.get("choices", []):
                            parse_generate_choice(c, num_top)
                            count += len(c.get("token_ids") or [])
            return count
        raise ValueError(shape["route"])

    async def batch(start: int, count: int) -> int:
        group = [prompts[(start + k) % len(prompts)] for k in range(count)]
        body = {"prompt": group, "n": n, "max_tokens": MAX_TOKENS, "temperature": 1.0, "return_token_ids": True}
        resp = await raw.post("/v1/completions", json=body)
        resp.raise_for_status()
        return sum(len(c.get("token_ids") or []) for c in resp.json()["choices"])

    cpu0, t0 = time.process_time(), time.perf_counter()
    if shape["route"] == "completions_batch":
        per = in_flight // n
        for start in range(0, requests, per):
            tokens += await batch(start, min(per, requests - start))
    else:
        sem = asyncio.Semaphore(max(1, in_flight // n))

        async def guarded(i: int) -> int:
            async with sem:
                return await one(i)

        counts = await asyncio.gather(*(guarded(next_prompt + i) for i in range(requests)))
        tokens = sum(counts)
    wall = time.perf_counter() - t0
    cpu = time.process_time() - cpu0
    await client.aclose()
    await raw.aclose()
    return {"tokens": tokens, "wall_s": wall, "client_cpu_s": cpu, "tok_s": tokens / wall,
            "completions_per_request": (client.completions_received / client.requests_sent) if client.requests_sent else None}


def part1(base_url: str, pid: int, prompts: list[list[int]], names: list[str], completions: int, rounds: int) -> dict[str, Any]:
    asyncio.run(run_shape(base_url, prompts, SHAPES["ours"], 64))  # warm-up (compiled shapes, connections)
    runs: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    for r in range(rounds):
        order = names if r % 2 == 0 else list(reversed(names))
        for name in order:
            before = server_cpu(pid)
            res = asyncio.run(run_shape(base_url, prompts, SHAPES[name], completions))
            after = server_cpu(pid)
            res["server_cpu_s"] = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
            runs[name].append(res)
            print(f"  [{name} r{r}] {res['tok_s']:.0f} tok/s, wall {res['wall_s']:.2f} s, client cpu {res['client_cpu_s']:.2f} s, "
                  f"server cpu { {k: round(v, 2) for k, v in res['server_cpu_s'].items()} }", flush=True)
    summary = {}
    for name, rs in runs.items():
        tok = sum(x["tokens"] for x in rs)
        roles_ = sorted({k for x in rs for k in x["server_cpu_s"]})
        summary[name] = {
            **SHAPES[name],
            "tok_s_median": statistics.median(x["tok_s"] for x in rs),
            "client_cpu_ms_per_1k_tok": 1e6 * sum(x["client_cpu_s"] for x in rs) / tok,
            "server_cpu_ms_per_1k_tok": {k: 1e6 * sum(x["server_cpu_s"].get(k, 0.0) for x in rs) / tok for k in roles_},
            "runs": rs,
        }
    base = summary["ours"]["tok_s_median"] if "ours" in summary else None
    if base:
        for s in summary.values():
            s["tok_s_over_ours"] = s["tok_s_median"] / base
    return summary


# ------------------------------------------------------------------------------------------------ part 2
def _pin(cores: list[int] | None) -> None:
    if cores is not None:
        os.sched_setaffinity(0, set(cores))


def trainer_standin(model_path: str, prompts: list[list[int]], cores: list[int] | None, reps: int, q: Any) -> None:
    """Forward + backward of the model on 64 sequences of prompt + 24 tokens, OMP_NUM_THREADS=1; one time per rep."""
    _pin(cores)
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(model_path, torch_dtype=torch.float32)
    model.train()
    gen = torch.Generator().manual_seed(0)
    seqs = [p + torch.randint(0, model.config.vocab_size, (MAX_TOKENS,), generator=gen).tolist() for p in prompts[:64]]
    width = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros(len(seqs), width, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s)
        mask[i, : len(s)] = 1
    times = []
    for _ in range(reps + 1):
        t0 = time.perf_counter()
        out = model(input_ids=ids, attention_mask=mask)
        out.logits.float().log_softmax(-1).mean().backward()
        model.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    q.put(times[1:])


def loader(base_url: str, prompts: list[list[int]], cores: list[int] | None, stop: Any, q: Any) -> None:
    """The rollout-worker stand-in: the ``ours_coalesced`` shape, batch after batch, until ``stop`` is set."""
    _pin(cores)
    total, t0 = 0, time.perf_counter()

    async def go() -> None:
        nonlocal total
        while not stop.is_set():
            total += (await run_shape(base_url, prompts, SHAPES["ours_coalesced"], 128))["tokens"]

    asyncio.run(go())
    q.put({"tokens": total, "wall_s": time.perf_counter() - t0})


PLACEMENTS: dict[str, dict[str, list[int] | None]] = {
    # name: trainer cores, loader cores, API-server + engine-core cores (None: left as the OS schedules)
    "unpinned": {"trainer": None, "loader": None, "server_front": None},
    "trainer_c1": {"trainer": [1], "loader": None, "server_front": None},
    "trainer_c1_rest_c0": {"trainer": [1], "loader": [0], "server_front": [0]},
}
# Left out: the trainer pinned to core 0 beside the engine worker's bound thread got under 1 s of CPU in
# 90 s (a first run of this script); it never finished its steps.


def part2(base_url: str, pid: int, model_path: str, prompts: list[list[int]], reps: int, names: list[str]) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    procs = roles(pid)
    # Affinity is per thread on Linux: every thread of the API server and the engine core.
    front = [int(t) for p in procs.get("api_server", []) + procs.get("engine_core", []) for t in os.listdir(f"/proc/{p}/task")]
    original = {p: os.sched_getaffinity(p) for p in front}
    results: dict[str, Any] = {}

    def timed(cores: list[int] | None) -> list[float]:
        q = ctx.Queue()
        p = ctx.Process(target=trainer_standin, args=(model_path, prompts, cores, reps, q))
        p.start()
        times = q.get(timeout=900)
        p.join()
        return times

    try:
        before, t0 = server_cpu(pid), time.perf_counter()
        idle = timed(None)
        after, wall = server_cpu(pid), time.perf_counter() - t0
        results["idle"] = {"fwd_bwd_s_median": statistics.median(idle), "times": idle,
                           "server_cpu_share_while_idle": {k: (after[k] - before.get(k, 0.0)) / wall for k in after}}
        print(f"  [idle] trainer fwd+bwd {statistics.median(idle):.3f} s; idle server's CPU share "
              f"{ {k: round(v, 2) for k, v in results['idle']['server_cpu_share_while_idle'].items()} }", flush=True)
        for name in names:
            place = PLACEMENTS[name]
            for p in front:
                try:
                    os.sched_setaffinity(p, set(place["server_front"]) if place["server_front"] else original[p])
                except OSError:  # a thread that has ended
                    pass
            q, stop = ctx.Queue(), ctx.Event()
            load = ctx.Process(target=loader, args=(base_url, prompts, place["loader"], stop, q))
            load.start()
            time.sleep(3.0)
            times = timed(place["trainer"])
            stop.set()
            gen = q.get(timeout=300)
            load.join()
            results[name] = {**place, "fwd_bwd_s_median": statistics.median(times), "times": times,
                             "loader_tok_s": gen["tokens"] / gen["wall_s"],
                             "fwd_bwd_over_idle": statistics.median(times) / results["idle"]["fwd_bwd_s_median"]}
            print(f"  [{name}] trainer fwd+bwd {statistics.median(times):.3f} s "
                  f"({results[name]['fwd_bwd_over_idle']:.2f}x idle), generation {results[name]['loader_tok_s']:.0f} tok/s",
                  flush=True)
    finally:
        for p, cores in original.items():
            try:
                os.sched_setaffinity(p, cores)
            except OSError:
                pass
    return results


# ------------------------------------------------------------------------------------------------ main
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--completions", type=int, default=512, help="completions per shape and round")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--placements", default=",".join(PLACEMENTS))
    parser.add_argument("--reps", type=int, default=8, help="trainer stand-in steps per placement")
    parser.add_argument("--skip-part2", action="store_true")
    parser.add_argument("--server-env", default="", help="extra server environment, K=V,K=V (e.g. VLLM_CPU_OMP_THREADS_BIND=nobind)")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "rollout_throughput.json"))
    parser.add_argument("--server-url", default=None, help="measure this running server of the tiny model (started "
                        "with max_logprobs >= 20) instead of starting one; part 2 then moves its threads' cores and "
                        "restores them")
    parser.add_argument("--smoke", action="store_true", help="16 completions per shape, one round, part 2 unpinned "
                        "with one step: checks the script")
    args = parser.parse_args(argv)
    if args.quick:
        args.completions, args.rounds, args.reps = 256, 1, 4
    if args.smoke:
        args.completions, args.rounds, args.reps, args.placements = 16, 1, 1, "unpinned"

    from grpo_core.tiny import build_tiny_model
    from grpo_core.vllm_server.process import VLLMServer, VLLMServerSpec

    model_path = str(build_tiny_model())
    prompts = prompt_ids(model_path, 512)
    env = dict(kv.split("=", 1) for kv in args.server_env.split(",") if kv)
    work = Path(tempfile.mkdtemp(prefix="rollout_tp-"))
    server = None
    if args.server_url is None:
        spec = VLLMServerSpec(model=model_path, max_model_len=512, max_logprobs=20, env=env)
        server = VLLMServer(spec, work).start(timeout_s=900)
        assert server.process is not None
    url = args.server_url or server.base_url
    pid = listening_pid(url) if server is None else server.process.pid
    report: dict[str, Any] = {"server_env": env, "cpus": os.cpu_count(), "load_avg_before": os.getloadavg(),
                              "prompt_tokens_mean": statistics.fmean(len(p) for p in prompts), "max_tokens": MAX_TOKENS}
    try:
        report["server_affinity"] = {role: [sorted(os.sched_getaffinity(p)) for p in pids] for role, pids in roles(pid).items()}
        print(f"server processes and their cores: {report['server_affinity']}", flush=True)
        shapes = [s for s in args.shapes.split(",") if s]
        print("part 1: request shapes", flush=True)
        report["shapes"] = part1(url, pid, prompts, shapes, args.completions, args.rounds)
        if not args.skip_part2:
            print("part 2: core sharing", flush=True)
            report["core_sharing"] = part2(url, pid, model_path, prompts, args.reps,
                                           [p for p in args.placements.split(",") if p])
    finally:
        if server is not None:
            server.stop()
    report["load_avg_after"] = os.getloadavg()
    print("\nshape           in flight  n  top-N  compl/req   tok/s   x ours   client ms/1k tok   server ms/1k tok (api / core / worker)")
    for name, s in report["shapes"].items():
        sc = s["server_cpu_ms_per_1k_tok"]
        cpr = s["runs"][0].get("completions_per_request") or s["n"]
        print(f"{name:15s} {s['in_flight']:9d} {s['n']:2d} {s['num_top']:6d} {cpr:10.2f} {s['tok_s_median']:7.0f} {s.get('tok_s_over_ours', float('nan')):7.2f}x"
              f" {s['client_cpu_ms_per_1k_tok']:18.0f}   {sc.get('api_server', 0):.0f} / {sc.get('engine_core', 0):.0f} / {sc.get('engine_worker', 0):.0f}")
    if "core_sharing" in report:
        print("\nplacement            trainer fwd+bwd s   x idle   generation tok/s")
        for name, r in report["core_sharing"].items():
            print(f"{name:20s} {r['fwd_bwd_s_median']:17.3f} {r.get('fwd_bwd_over_idle', 1.0):7.2f}x {r.get('loader_tok_s', 0):10.0f}")
    write_report(args.out, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())

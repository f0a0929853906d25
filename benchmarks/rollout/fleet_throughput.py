"""Generation throughput of a fleet: two CPU vLLM servers on a core each against one server on one core.

No training: the rollout worker's generation path alone (``grpo_core.rollout.routing_client.RoutingClient``, groups routed by
``router.Router``, a group's first turns coalesced into one request), on the tiny model (``grpo_core.tiny``),
arithmetic prompts, ``--tokens`` completion tokens each (``ignore_eos``, so every completion costs the same),
temperature 1, ``--group`` completions per group. Two servers of one spec are started side by side, server 0
pinned to core 0 and server 1 to core 1 (``VLLMServer`` placements: their processes and their engine's OpenMP
thread); then, in rounds of ``--groups`` groups each with ``--in-flight`` groups per server in flight, each
round running the two in turn (the first alternating between rounds):

    one    the routing client over server 0 only (one server on one core; server 1 idles)
    two    the routing client over both servers

The client runs in this process on whatever core the OS gives it (with one server, the idle core; with two, it
shares them): what the worker costs beside a fleet is part of the figure. Prints each round, then tok/s per
configuration (median of rounds) and the ratio two / one (the median of each round's ratio: a round's two runs
share the machine's load); the report goes to
``benchmarks/results/fleet_throughput.json``.

    .venv/bin/python -m benchmarks.rollout.fleet_throughput
    .venv/bin/python -m benchmarks.rollout.fleet_throughput --rounds 3 --groups 24    # quicker
    .venv/bin/python -m benchmarks.rollout.fleet_throughput --smoke --server-url URL --out /tmp/fleet_throughput.json   # one server only
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from benchmarks.bench_io import write_report  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def prompt_ids(model_path: str, count: int) -> list[list[int]]:
    from transformers import AutoTokenizer

    from grpo_core.tiny import arithmetic_dataset

    tok = AutoTokenizer.from_pretrained(model_path)
    rows = arithmetic_dataset(num_train=count, num_eval=8, seed=0)["train"]
    return [tok(tok.apply_chat_template(r["prompt"], tokenize=False, add_generation_prompt=True),
                add_special_tokens=False)["input_ids"] for r in rows]


async def generate_round(urls: list[str], prompts: list[list[int]], args: argparse.Namespace) -> dict[str, Any]:
    """``len(prompts)`` groups through a routing client over ``urls``; tok/s over the round's wall clock."""
    from grpo_core.rollout.routing_client import ROUTE, RoutingClient

    fleet = RoutingClient.for_urls(urls, timeout=600.0, tokens_endpoint=True, unavailable_timeout_s=60.0,
                                 drain_after_s=60.0)
    await fleet.start(ceiling=args.in_flight * args.group * len(urls))
    params = {"max_tokens": args.tokens, "temperature": 1.0, "ignore_eos": True}
    room = asyncio.Semaphore(args.in_flight * len(urls))
    tokens = 0
    per_server: dict[str, int] = {}

    async def group(ids: list[int]) -> None:
        nonlocal tokens
        async with room:
            # The server with the most room under its cap (the groups open on each count against it).
            route = fleet.router.open_route(fleet.router.pick() or fleet.router.serving()[0], args.group)
            ROUTE.set(route)
            # The group's rollouts start together and their identical first turns go out as one request.
            choices = await asyncio.gather(*(fleet.generate(ids, params, num_top=args.top) for _ in range(args.group)))
            fleet.router.close(route)
            n = sum(len(c[0].token_ids) for c in choices)
            tokens += n
            per_server[route.server] = per_server.get(route.server, 0) + n

    await asyncio.gather(*(group(p) for p in prompts[:2]))  # warm: connections, first prefill
    tokens, per_server = 0, {}
    cpu0, start = time.process_time(), time.perf_counter()
    await asyncio.gather(*(group(p) for p in prompts))
    wall = time.perf_counter() - start
    cpu = time.process_time() - cpu0
    await fleet.aclose()
    return {"tok_s": tokens / wall, "tokens": tokens, "wall_s": wall, "client_cpu_s": cpu, "per_server": per_server}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--groups", type=int, default=48, help="groups per round")
    parser.add_argument("--group", type=int, default=8, help="completions per group")
    parser.add_argument("--tokens", type=int, default=128, help="completion tokens (ignore_eos)")
    parser.add_argument("--top", type=int, default=4, help="top sampler log-probs per token (num_sampler_logprobs)")
    parser.add_argument("--in-flight", type=int, default=4, help="groups in flight per server")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "fleet_throughput.json"))
    parser.add_argument("--smoke", action="store_true", help="start nothing: one short round of the routing client over "
                        "the server at --server-url alone (two servers take minutes to start on two cores)")
    parser.add_argument("--server-url", default=None, help="--smoke: a running server of the tiny model")
    args = parser.parse_args()

    from grpo_core.tiny import build_tiny_model

    if args.smoke:
        if not args.server_url:
            parser.error("--smoke needs --server-url (a running server of the tiny model)")
        args.rounds, args.groups, args.group, args.tokens, args.in_flight = 1, 4, 4, 8, 2
        result = asyncio.run(generate_round([args.server_url], prompt_ids(str(build_tiny_model()), args.groups + 2)[2:], args))
        print(f"one server: {result['tok_s']:.0f} tok/s ({result['tokens']} tokens)", flush=True)
        write_report(args.out, {"config": vars(args), "smoke": True, "rounds": {"one": [result]}, "ratio": None})
        return

    from grpo_core.vllm_server.cpu_placement import CpuPlacement
    from grpo_core.vllm_server.process import VLLMServer, VLLMServerSpec

    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        raise SystemExit("needs two cores: one per server")
    model = str(build_tiny_model())
    logs = Path(tempfile.mkdtemp(prefix="fleet-throughput-"))
    # Eager: on the tiny model it generates as fast as compiled and starts sooner (benchmarks/README.md, "CPU server
    # start-up"); both configurations use the same servers, so the ratio does not depend on it.
    spec = VLLMServerSpec(model=model, max_model_len=512, max_logprobs=20, enforce_eager=True)
    # Server i alone on core i: its processes start there and its engine binds its OpenMP thread to it.
    placements = [CpuPlacement(trainer=(cores[1 - i],), generation=(cores[i],), engine=(cores[i],)) for i in range(2)]
    servers = [VLLMServer(spec.for_replica(i), logs / f"server-{i}", placement=placements[i]) for i in range(2)]
    started = time.monotonic()
    try:
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(lambda s: s.start(timeout_s=1800), servers))
        print(f"two servers serving after {time.monotonic() - started:.0f} s (logs in {logs})", flush=True)
        prompts = prompt_ids(model, args.groups + 2)
        urls = [s.base_url for s in servers]
        results: dict[str, list[dict[str, Any]]] = {"one": [], "two": []}
        for r in range(args.rounds):
            order = (("one", urls[:1]), ("two", urls))
            for name, fleet_urls in order if r % 2 == 0 else order[::-1]:  # alternated: no side always goes first
                result = asyncio.run(generate_round(fleet_urls, prompts[2:], args))
                results[name].append(result)
                print(f"round {r + 1} {name}: {result['tok_s']:.0f} tok/s ({result['tokens']} tokens in "
                      f"{result['wall_s']:.1f} s; client CPU {result['client_cpu_s']:.1f} s; per server "
                      f"{result['per_server']})", flush=True)
    finally:
        for server in servers:
            server.stop()
    median = {name: statistics.median(r["tok_s"] for r in rs) for name, rs in results.items()}
    # Each round's two configurations ran back to back, under the same load from the rest of the machine: the
    # ratio within a round is the paired figure, and their median the one quoted.
    paired = [two["tok_s"] / one["tok_s"] for one, two in zip(results["one"], results["two"])]
    ratio = statistics.median(paired)
    print(f"\none server, one core:     {median['one']:6.0f} tok/s (median of {args.rounds})")
    print(f"two servers, a core each: {median['two']:6.0f} tok/s")
    print(f"ratio two / one per round: {', '.join(f'{r:.2f}' for r in paired)}; median {ratio:.2f} "
          f"(ratio of the medians {median['two'] / median['one']:.2f})")
    write_report(args.out, {"config": vars(args), "cores": cores, "median_tok_s": median, "ratio": ratio,
                            "ratio_per_round": paired, "ratio_of_medians": median["two"] / median["one"],
                            "rounds": results})


if __name__ == "__main__":
    main()

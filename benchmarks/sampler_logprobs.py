"""What ``num_sampler_logprobs`` costs: generation throughput and trainer step time, N in {0, 8, 20}.

Score centering needs the sampler's top-N log-probs of every generated token. They cost the server
(it computes and serializes N entries per token), the rollout worker (it parses them into arrays),
the process boundary (bigger samples) and the trainer (it gathers N log-probs per trained token and
adds the centering term). One run, side by side, on the real CPU vLLM server and the tiny model:

1. **Generation.** The real rollout path (``RolloutScheduler`` over ``AsyncRolloutLoop``, as in the
   worker process) generates groups for a fresh slice of prompts with each N, in rotating order
   over ``--rounds`` rounds so that drift in machine load hits every N alike. Reported: generated
   tokens per second of wall time (median over rounds), as a ratio to N = 0, and pickled bytes per
   sample (what crosses the process boundary).
2. **Trainer step.** The samples generated with N = 20 are cut to each N (N = 0 drops the arrays),
   planned into one step, and trained by ``AsyncGRPOTrainer._optimizer_step`` of a trainer built
   with that N (score centering on whenever N > 0). The same step is timed ``--repeats`` times per N,
   interleaved. Reported: median step seconds as a ratio to N = 0.

    .venv/bin/python benchmarks/sampler_logprobs.py --out benchmarks/results/sampler_logprobs.json

Absolute numbers depend on the machine's load; the ratios are what this measures.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import pickle
import platform
import statistics
import sys
import tempfile
import threading
import time
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from grpo_core.batching import StepBatch  # noqa: E402
from grpo_core.config import AsyncGRPOConfig  # noqa: E402
from grpo_core.packing.planner import plan_step  # noqa: E402
from grpo_core.rewards import accuracy_reward  # noqa: E402
from grpo_core.rollout.loop import AsyncRolloutLoop  # noqa: E402
from grpo_core.rollout.scheduler import END_OF_DATA, RolloutScheduler  # noqa: E402
from grpo_core.rollout.types import GroupReport, RolloutSample  # noqa: E402

NUM_TOP = (0, 8, 20)


def rollout_config(num_top: int, args: argparse.Namespace, url: str) -> AsyncGRPOConfig:
    return AsyncGRPOConfig(
        vllm_server_base_url=url, report_to="none", num_generations=args.group_size,
        max_completion_length=args.max_tokens, num_sampler_logprobs=num_top, max_steps=0, num_train_epochs=1,
        max_concurrent_rollouts=args.concurrency, temperature=1.0, token_budget=4096,
        per_device_train_batch_size=args.prompts * args.group_size,
    )


def generate(rows: list[dict[str, Any]], num_top: int, tokenizer: Any, url: str, args: argparse.Namespace):
    """Runs the worker's rollout path over ``rows``; returns (seconds, generated tokens, samples)."""
    items: list[Any] = []

    async def emit(item: Any) -> float:
        items.append(item)
        return 0.0

    loop = AsyncRolloutLoop(rollout_config(num_top, args, url), tokenizer, rows, [accuracy_reward], url, emit)
    start = time.perf_counter()
    asyncio.run(RolloutScheduler(loop, threading.Event()).run())
    seconds = time.perf_counter() - start
    assert items[-1] == END_OF_DATA
    tokens = sum(i.generated_tokens for i in items if isinstance(i, GroupReport))
    return seconds, tokens, [i for i in items if isinstance(i, RolloutSample)]


def cut_top(sample: RolloutSample, num_top: int) -> RolloutSample:
    if num_top == 0:
        return dataclasses.replace(sample, sampler_top_ids=None, sampler_top_logprobs=None)
    assert sample.sampler_top_ids is not None and sample.sampler_top_ids.shape[1] >= num_top
    return dataclasses.replace(sample, sampler_top_ids=np.ascontiguousarray(sample.sampler_top_ids[:, :num_top]),
                               sampler_top_logprobs=np.ascontiguousarray(sample.sampler_top_logprobs[:, :num_top]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    parser.add_argument("--server-url", default=None, help="use a running server (--max-logprobs >= 21)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=24, help="prompts per generation run")
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5, help="timed trainer steps per N")
    args = parser.parse_args()

    import torch
    from transformers import AutoTokenizer

    from grpo_core.server import VLLMServer, VLLMServerSpec
    from grpo_core.tiny import arithmetic_dataset, build_tiny_model
    from grpo_core.trainer import AsyncGRPOTrainer

    torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    model_path = build_tiny_model()
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    data = arithmetic_dataset()["train"]
    needed = args.rounds * len(NUM_TOP) * args.prompts
    assert len(data) >= needed, f"--rounds x 3 x --prompts = {needed} prompts; the dataset has {len(data)}"
    slices = iter(range(0, needed, args.prompts))

    results: dict[str, Any] = {"config": vars(args), "machine": platform.platform(), "cpus": os.cpu_count()}
    with tempfile.TemporaryDirectory() as tmp:
        server = None
        if args.server_url is None:
            server = VLLMServer(VLLMServerSpec(model=model_path, max_model_len=512, max_logprobs=max(NUM_TOP) + 1), tmp)
            server.start()
        url = args.server_url or server.base_url
        try:
            generate([data[i] for i in range(4)], max(NUM_TOP), tokenizer, url, args)  # warm-up
            gen: dict[int, list[float]] = {n: [] for n in NUM_TOP}
            sample_bytes: dict[int, list[int]] = {n: [] for n in NUM_TOP}
            top_samples: list[RolloutSample] = []
            for r in range(args.rounds):
                order = NUM_TOP[r % 3:] + NUM_TOP[: r % 3]
                for n in order:
                    start = next(slices)
                    seconds, tokens, samples = generate([data[i] for i in range(start, start + args.prompts)], n, tokenizer, url, args)
                    gen[n].append(tokens / seconds)
                    sample_bytes[n].extend(len(pickle.dumps(s)) for s in samples)
                    if n == max(NUM_TOP):
                        top_samples.extend(samples)
                    print(f"round {r} N={n:2d}: {tokens} tokens in {seconds:.1f} s = {tokens / seconds:.0f} tok/s, "
                          f"{len(samples)} samples", flush=True)
        finally:
            if server is not None:
                server.stop()

    base = statistics.median(gen[0])
    results["generation"] = {
        str(n): {"tokens_per_s_median": statistics.median(gen[n]), "tokens_per_s": gen[n],
                 "ratio_to_0": statistics.median(gen[n]) / base,
                 "pickled_bytes_per_sample": statistics.mean(sample_bytes[n]) if sample_bytes[n] else None}
        for n in NUM_TOP
    }

    # ---- trainer step time on the same samples, cut to each N
    trainers = {}
    for n in NUM_TOP:
        trainers[n] = AsyncGRPOTrainer(
            model=model_path, reward_funcs=[accuracy_reward], train_dataset=data,
            args=AsyncGRPOConfig(output_dir=os.path.join(tempfile.gettempdir(), "sampler-logprobs-bench"),
                                 report_to="none", num_sampler_logprobs=n, score_centering=True, save_strategy="no",
                                 token_budget=1 << 16, per_device_train_batch_size=len(top_samples)),
        )
        assert trainers[n].loss_config.score_centering == (n > 0)
    batches = {}
    for n in NUM_TOP:
        cut = [cut_top(s, n) for s in top_samples]
        plan = plan_step(cut, world_size=1, gradient_accumulation_steps=1, token_budget=1 << 16)
        assert not plan.leftover, "every sample fits one row"
        batches[n] = StepBatch(plan=plan, samples=cut, reports=[], stale_dropped=0, staleness=[], wait_s=0.0)
    for n in NUM_TOP:
        trainers[n]._optimizer_step(batches[n])  # warm-up
    step_s: dict[int, list[float]] = {n: [] for n in NUM_TOP}
    for r in range(args.repeats):
        for n in NUM_TOP[r % 3:] + NUM_TOP[: r % 3]:
            start = time.perf_counter()
            trainers[n]._optimizer_step(batches[n])
            step_s[n].append(time.perf_counter() - start)
    base_step = statistics.median(step_s[0])
    trained = sum(s.num_trained for s in top_samples)
    results["trainer_step"] = {
        "samples": len(top_samples), "trained_tokens": trained,
        **{str(n): {"seconds_median": statistics.median(step_s[n]), "seconds": step_s[n],
                    "ratio_to_0": statistics.median(step_s[n]) / base_step} for n in NUM_TOP},
    }

    print("\nN   gen tok/s   gen ratio   bytes/sample   step s   step ratio")
    for n in NUM_TOP:
        g, t = results["generation"][str(n)], results["trainer_step"][str(n)]
        print(f"{n:<3} {g['tokens_per_s_median']:>9.0f}   {g['ratio_to_0']:>9.3f}   {g['pickled_bytes_per_sample']:>12.0f}"
              f"   {t['seconds_median']:>6.3f}   {t['ratio_to_0']:>10.3f}")
    print(f"(trainer step: {len(top_samples)} samples, {trained} trained tokens)")
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

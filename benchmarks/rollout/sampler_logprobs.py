"""What ``num_sampler_logprobs`` costs: generation throughput and trainer step time, N in {0, 8, 20}.

Score centering needs the sampler's top-N log-probs of every generated token. They cost the server
(it computes and serializes N entries per token), the rollout worker (it parses them into arrays),
the process boundary (bigger samples) and the trainer (it gathers N log-probs per trained token and
adds the centering term). One run, side by side, on the real CPU vLLM server and the tiny model:

1. **Generation.** Fixed-length requests (``ignore_eos``, ``--max-tokens`` each, ``--concurrency``
   at once) go through the worker's own client (``VLLMGenerateClient.generate``, which asks for
   N + 1 log-probs and parses them into arrays), for each N in rotating order over ``--rounds``
   rounds so that drift in machine load hits every N alike. Reported: generated tokens per second
   (median over rounds) as a ratio to N = 0. Fixed lengths keep the work per round identical; the
   tiny model's own answers end after about 20 tokens, too few to time.
2. **Trainer step.** ``--step-samples`` samples from the real rollout path (``RolloutScheduler`` over
   ``AsyncRolloutLoop``, as in the worker process) with N = 20 are cut to each N (N = 0 drops the arrays),
   planned into one step, and trained by ``AsyncGRPOTrainer.training_step`` of a trainer built
   with that N (score centering on whenever N > 0). The same step is timed ``--repeats`` times per N,
   interleaved. Reported: median step seconds as a ratio to N = 0, and pickled bytes per sample
   (what crosses the process boundary).

    .venv/bin/python -m benchmarks.rollout.sampler_logprobs --out benchmarks/results/sampler_logprobs.json
    .venv/bin/python -m benchmarks.rollout.sampler_logprobs --smoke --server-url URL --out /tmp/sampler_logprobs.json

Absolute numbers depend on the machine's load; the ratios are what this measures.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import pickle
import platform
import signal
import statistics
import sys
import tempfile
import threading
import time
from typing import Any

import numpy as np


from grpo_core.config import AsyncGRPOConfig  # noqa: E402
from grpo_core.packing.planner import plan_step  # noqa: E402
from grpo_core.rewards import accuracy_reward  # noqa: E402
from grpo_core.rollout.scheduler import END_OF_DATA, RolloutScheduler  # noqa: E402
from grpo_core.rollout.stages import AsyncRolloutLoop  # noqa: E402
from grpo_core.rollout.types import GroupReport, RolloutSample  # noqa: E402
from grpo_core.training.collector import StepBatch  # noqa: E402
from benchmarks.bench_io import write_report  # noqa: E402

NUM_TOP = (0, 8, 20)
SMOKE_TOP = (0, 4, 19)  # the test session's server returns up to 20 log-probs: N + 1


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


def fixed_length_rate(url: str, prompts: list[list[int]], num_top: int, max_tokens: int, concurrency: int) -> float:
    """Generated tokens per second for ``len(prompts)`` fixed-length requests, ``concurrency`` at a time."""
    from grpo_core.rollout.generation import VLLMGenerateClient

    async def run() -> int:
        client = VLLMGenerateClient(url, timeout=600)
        gate = asyncio.Semaphore(concurrency)
        params = {"max_tokens": max_tokens, "temperature": 1.0, "ignore_eos": True}

        async def one(ids: list[int]) -> int:
            async with gate:
                (choice,) = await client.generate(ids, params, num_top=num_top)
            assert num_top == 0 or choice.top_ids.shape == (max_tokens, num_top)
            return len(choice.token_ids)

        try:
            return sum(await asyncio.gather(*(one(ids) for ids in prompts)))
        finally:
            await client.aclose()

    start = time.perf_counter()
    tokens = asyncio.run(run())
    return tokens / (time.perf_counter() - start)


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
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--prompts", type=int, default=128, help="fixed-length requests per round and N")
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens per fixed-length request")
    parser.add_argument("--concurrency", type=int, default=64, help="requests in flight")
    parser.add_argument("--repeats", type=int, default=3, help="timed trainer steps per N")
    parser.add_argument("--step-samples", type=int, default=512, help="samples in the timed trainer step")
    parser.add_argument("--smoke", action="store_true", help="one short round, a 32-sample step, N up to 19 (a server "
                        "with 20 log-probs): checks the script")
    args = parser.parse_args()
    tops = SMOKE_TOP if args.smoke else NUM_TOP
    if args.smoke:
        args.rounds, args.prompts, args.max_tokens, args.concurrency, args.repeats, args.step_samples = 1, 8, 8, 8, 1, 32
    # A terminated run still stops the server it started (its process group outlives us otherwise).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    import torch
    from transformers import AutoTokenizer

    from grpo_core.tiny import arithmetic_dataset, build_tiny_model
    from grpo_core.training.trainer import AsyncGRPOTrainer
    from grpo_core.vllm_server.process import VLLMServer, VLLMServerSpec

    torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    model_path = str(build_tiny_model())
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    data = arithmetic_dataset()["train"]
    step_rows = [data[i] for i in range(args.step_samples // args.group_size + 16)]
    texts = [tokenizer.apply_chat_template(data[i]["prompt"], add_generation_prompt=True, tokenize=False)
             for i in range(len(step_rows), len(step_rows) + args.prompts)]
    prompt_ids = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]

    results: dict[str, Any] = {"config": vars(args), "machine": platform.platform(), "cpus": os.cpu_count()}
    with tempfile.TemporaryDirectory() as tmp:
        server = None
        if args.server_url is None:
            server = VLLMServer(VLLMServerSpec(model=model_path, max_model_len=512, max_logprobs=max(tops) + 1), tmp)
            server.start()
        url = args.server_url or server.base_url
        try:
            fixed_length_rate(url, prompt_ids[:8], max(tops), 8, 8)  # warm-up
            gen: dict[int, list[float]] = {n: [] for n in tops}
            for r in range(args.rounds):
                for n in tops[r % 3:] + tops[: r % 3]:
                    rate = fixed_length_rate(url, prompt_ids, n, args.max_tokens, args.concurrency)
                    gen[n].append(rate)
                    print(f"round {r} N={n:2d}: {rate:.0f} tok/s", flush=True)
            _, _, samples = generate(step_rows, max(tops), tokenizer, url, args)
            top_samples = samples[: args.step_samples]
        finally:
            if server is not None:
                server.stop()

    base = statistics.median(gen[0])
    results["generation"] = {
        str(n): {"tokens_per_s_median": statistics.median(gen[n]), "tokens_per_s": gen[n],
                 "ratio_to_0": statistics.median(gen[n]) / base,
                 "pickled_bytes_per_sample": statistics.mean(len(pickle.dumps(cut_top(s, n))) for s in top_samples)}
        for n in tops
    }

    # ---- trainer step time on the same samples, cut to each N
    trainers = {}
    for n in tops:
        trainers[n] = AsyncGRPOTrainer(
            model=model_path, reward_funcs=[accuracy_reward], train_dataset=data,
            args=AsyncGRPOConfig(output_dir=os.path.join(tempfile.gettempdir(), "sampler-logprobs-bench"),
                                 report_to="none", num_sampler_logprobs=n, score_centering=True, save_strategy="no",
                                 token_budget=1 << 16, per_device_train_batch_size=len(top_samples)),
        )
        assert trainers[n].loss_config.score_centering == (n > 0)
    batches = {}
    for n in tops:
        cut = [cut_top(s, n) for s in top_samples]
        plan = plan_step(cut, world_size=1, gradient_accumulation_steps=1, token_budget=1 << 16)
        assert not plan.leftover, "every sample fits one row"
        batches[n] = StepBatch(plan=plan, samples=cut, reports=[], stale_dropped=0, staleness=[], wait_s=0.0)
    for n in tops:
        trainers[n].training_step(batches[n])  # warm-up
    step_s: dict[int, list[float]] = {n: [] for n in tops}
    for r in range(args.repeats):
        for n in tops[r % 3:] + tops[: r % 3]:
            start = time.perf_counter()
            trainers[n].training_step(batches[n])
            step_s[n].append(time.perf_counter() - start)
    base_step = statistics.median(step_s[0])
    trained = sum(s.num_trained for s in top_samples)
    results["trainer_step"] = {
        "samples": len(top_samples), "trained_tokens": trained,
        **{str(n): {"seconds_median": statistics.median(step_s[n]), "seconds": step_s[n],
                    "ratio_to_0": statistics.median(step_s[n]) / base_step} for n in tops},
    }

    print("\nN   gen tok/s   gen ratio   bytes/sample   step s   step ratio")
    for n in tops:
        g, t = results["generation"][str(n)], results["trainer_step"][str(n)]
        print(f"{n:<3} {g['tokens_per_s_median']:>9.0f}   {g['ratio_to_0']:>9.3f}   {g['pickled_bytes_per_sample']:>12.0f}"
              f"   {t['seconds_median']:>6.3f}   {t['ratio_to_0']:>10.3f}")
    print(f"(trainer step: {len(top_samples)} samples, {trained} trained tokens)")
    if args.out:
        write_report(args.out, results, indent=2)


if __name__ == "__main__":
    main()

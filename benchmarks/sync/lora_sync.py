"""LoRA weight sync, merged vs adapter-only: bytes and seconds per sync, and the server's generation speed.

One run, side by side:

1. **Sync cost, tiny model, real CPU vLLM server.** The same LoRA policy (random non-zero B, so every
   push carries new values) is pushed ``--repeats`` times in each mode through ``make_weight_sync``:
   ``merged`` sends every base weight with the adapter merged in over the gloo weight-transfer
   protocol; ``adapter`` writes the adapter folder and loads it by name (its first push, which also
   sends the base weights, is reported separately). Median and max seconds, bytes per push.
2. **Sync bytes, 7B shape (computed, not timed).** A Qwen2.5-7B-shaped model is built on the meta
   device and wrapped with the same peft config; merged bytes come from the merged weight source's
   metadata and adapter bytes from the adapter's state dict, both in bf16 as a GPU server would
   take them.
3. **Generation throughput, adapter vs merged weights, same server.** Concurrent requests of a fixed
   length (``ignore_eos``) are sent to the base name (merged weights) and to the adapter's name in
   alternating rounds; the ratio of generated tokens per second is adapter / merged.

    .venv/bin/python -m benchmarks.sync.lora_sync --out benchmarks/results/lora_sync.json
    .venv/bin/python -m benchmarks.sync.lora_sync --smoke --server-url URL --out /tmp/lora_sync.json

Starts its own CPU server for the tiny model (``--server-url`` reuses a running one that has
``--enable-lora`` and runtime LoRA updating on).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import platform
import signal
import statistics
import sys
import tempfile
import time
import dataclasses

import httpx
import torch


from grpo_core.config import AsyncGRPOConfig  # noqa: E402
from grpo_core.models.loading import load_policy  # noqa: E402
from grpo_core.models.lora import adapter_state, apply_lora  # noqa: E402
from grpo_core.ranks import DistInfo  # noqa: E402
from grpo_core.sync.factory import SyncSetup, make_weight_sync  # noqa: E402
from grpo_core.vllm_server.checks import lora_command  # noqa: E402
from grpo_core.vllm_server.control import VLLMControlClient  # noqa: E402
from benchmarks.bench_io import write_report  # noqa: E402

SEVEN_B = dict(  # Qwen2.5-7B config.json
    architectures=["Qwen2ForCausalLM"], hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
    num_attention_heads=28, num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False,
)


def lora_config(rank: int):
    from peft import LoraConfig

    return LoraConfig(r=rank, lora_alpha=2 * rank, target_modules="all-linear")


def randomize_adapter(model: torch.nn.Module, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.05)


# ---- 1. sync cost on the tiny model ------------------------------------------------------------------------
def time_syncs(url: str, model_path: str, mode: str, rank: int, repeats: int, out_dir: str) -> dict:
    model, _ = load_policy(model_path, torch.device("cpu"))
    model = apply_lora(model, lora_config(rank)).eval()
    args = AsyncGRPOConfig(output_dir=out_dir, vllm_server_base_url=url, report_to="none", lora_sync_mode=mode, max_staleness=1)
    setup = SyncSetup(config=args.sync, model=model, rank=DistInfo().rank, backend="gloo", wire_dtype=None,
                      model_path=model_path, peft_config=lora_config(rank),
                      lora_command=lora_command(args, rank, model_path))
    control = VLLMControlClient(url)
    sync = make_weight_sync(setup, control)
    try:
        randomize_adapter(model, 0)
        first = sync.push(0)  # adapter mode: base weights + adapter; merged: a normal push
        seconds, sizes = [], []
        for version in range(1, repeats + 1):
            randomize_adapter(model, version)
            stats = sync.push(version)
            seconds.append(stats.seconds)
            sizes.append(stats.bytes)
    finally:
        sync.close()
        control.close()
    return {
        "mode": sync.mode, "rank": rank, "first_push_bytes": first.bytes, "first_push_s": first.seconds,
        "bytes": statistics.median(sizes), "median_s": statistics.median(seconds), "max_s": max(seconds),
        "all_s": seconds,
    }


# ---- 2. bytes for a 7B-shaped model ------------------------------------------------------------------------
def seven_b_bytes(ranks: list[int]) -> list[dict]:
    from peft import get_peft_model_state_dict
    from transformers import AutoConfig, AutoModelForCausalLM

    from grpo_core.models.lora import merged_named_tensors
    from grpo_core.sync.source import ModelWeightSource

    config = AutoConfig.for_model("qwen2", **SEVEN_B)
    rows = []
    for rank in ranks:
        with torch.device("meta"):
            base = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        model = apply_lora(base, lora_config(rank))
        source = ModelWeightSource(model, wire_dtype=torch.bfloat16, named_tensors=lambda m=model: merged_named_tensors(m))
        merged = sum(m.dtype.itemsize * _numel(m.shape) for m in source.metadata())
        adapter = sum(t.numel() * torch.bfloat16.itemsize for t in get_peft_model_state_dict(model).values())
        params = sum(p.numel() for n, p in model.named_parameters() if ".lora_" not in n)
        rows.append({"rank": rank, "base_params": params, "merged_bytes": merged, "adapter_bytes": adapter,
                     "adapter_share": adapter / merged})
    return rows


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


# ---- 3. generation throughput --------------------------------------------------------------------------------
def throughput(url: str, model_name: str | None, concurrency: int, max_tokens: int, seed: int) -> float:
    """Generated tokens per second for ``concurrency`` simultaneous fixed-length requests."""
    params = {"max_tokens": max_tokens, "temperature": 1.0, "ignore_eos": True, "logprobs": 0}

    def one(i: int) -> int:
        # Unseeded (the CPU engine fails on a seeded request whose prefill is split); the first token varies instead.
        body: dict = {"token_ids": [5 + (i + seed) % 50, *range(6, 30)], "sampling_params": params}
        if model_name is not None:
            body["model"] = model_name
        reply = httpx.post(f"{url}/inference/v1/generate", json=body, timeout=600)
        reply.raise_for_status()
        return len(reply.json()["choices"][0]["token_ids"])

    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        tokens = sum(pool.map(one, range(concurrency)))
    return tokens / (time.perf_counter() - start)


def compare_generation(url: str, model_path: str, rank: int, rounds: int, concurrency: int, max_tokens: int, out_dir: str) -> dict:
    model, _ = load_policy(model_path, torch.device("cpu"))
    model = apply_lora(model, lora_config(rank)).eval()
    randomize_adapter(model, 0)
    control = VLLMControlClient(url)
    args = AsyncGRPOConfig(output_dir=out_dir, vllm_server_base_url=url, report_to="none", lora_sync_mode="adapter", max_staleness=1)
    setup = SyncSetup(config=args.sync, model=model, rank=DistInfo().rank, backend="gloo", wire_dtype=None,
                      model_path=model_path, peft_config=lora_config(rank),
                      lora_command=lora_command(args, rank, model_path))
    adapter_sync = make_weight_sync(setup, control)
    try:
        adapter_sync.push(0)
        name = adapter_sync.served_model_name(0)
        # The same policy as merged weights on the base name.
        merged_sync = make_weight_sync(dataclasses.replace(setup, config=args.replace(lora_sync_mode="merged").sync), control)
        merged_sync.push(1)
        merged_sync.close()
        throughput(url, None, concurrency, 8, seed=999)  # warm-up both paths
        throughput(url, name, concurrency, 8, seed=999)
        merged, adapter = [], []
        for r in range(rounds):  # alternate, so drift in machine load hits both alike
            merged.append(throughput(url, None, concurrency, max_tokens, seed=r * 100))
            adapter.append(throughput(url, name, concurrency, max_tokens, seed=r * 100))
    finally:
        adapter_sync.close()
        control.close()
    m, a = statistics.median(merged), statistics.median(adapter)
    return {"rank": rank, "concurrency": concurrency, "max_tokens": max_tokens, "merged_tok_s": merged,
            "adapter_tok_s": adapter, "median_merged_tok_s": m, "median_adapter_tok_s": a, "adapter_over_merged": a / m}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--server-url", default=None, help="reuse a running LoRA-enabled server instead of starting one")
    parser.add_argument("--rank", type=int, default=8, help="adapter rank on the tiny model")
    parser.add_argument("--repeats", type=int, default=10, help="timed pushes per mode")
    parser.add_argument("--rounds", type=int, default=3, help="alternating generation rounds per variant")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--seven-b-ranks", default="8,16,32,64")
    parser.add_argument("--out", default="benchmarks/results/lora_sync.json")
    parser.add_argument("--smoke", action="store_true", help="2 pushes per mode, one short generation round: checks the script")
    args = parser.parse_args()
    if args.smoke:
        args.repeats, args.rounds, args.concurrency, args.max_tokens = 2, 1, 4, 8
    # A terminated run still stops the server it started (its process group outlives us otherwise).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    from grpo_core.tiny import build_tiny_model
    from grpo_core.vllm_server.process import VLLMServer, VLLMServerSpec

    model_path = str(build_tiny_model())
    work = tempfile.mkdtemp(prefix="lora-sync-bench-")
    server = None
    url = args.server_url
    if url is None:
        server = VLLMServer(VLLMServerSpec(model=model_path, enable_lora=True, max_loras=4, max_lora_rank=16), work)
        server.start(timeout_s=900)
        url = server.base_url
    try:
        syncs = [time_syncs(url, model_path, mode, args.rank, args.repeats, f"{work}/{mode}") for mode in ("merged", "adapter")]
        generation = compare_generation(url, model_path, args.rank, args.rounds, args.concurrency, args.max_tokens, f"{work}/gen")
    finally:
        if server is not None:
            server.stop()
    seven_b = seven_b_bytes([int(r) for r in args.seven_b_ranks.split(",")])
    result = {
        "tiny_sync": syncs, "seven_b_bytes": seven_b, "generation": generation,
        "env": {"python": platform.python_version(), "torch": torch.__version__, "cpus": os.cpu_count(),
                "load_avg_at_end": os.getloadavg()},
    }
    write_report(args.out, result, indent=2, announce=False)

    print("\nsync per push, tiny model (rank %d), CPU server" % args.rank)
    print("| mode | bytes/push | median s | max s | first push (bytes, s) |")
    for row in syncs:
        print(f"| {row['mode']} | {row['bytes']:,.0f} | {row['median_s']:.3f} | {row['max_s']:.3f} | "
              f"{row['first_push_bytes']:,} B, {row['first_push_s']:.2f} s |")
    print("\nsync bytes per push, Qwen2.5-7B shape, bf16, all-linear")
    print("| rank | merged | adapter | adapter / merged |")
    for row in seven_b:
        print(f"| {row['rank']} | {row['merged_bytes'] / 1e9:.2f} GB | {row['adapter_bytes'] / 1e6:.1f} MB | {row['adapter_share']:.2%} |")
    g = generation
    print(f"\ngeneration, {g['concurrency']} concurrent x {g['max_tokens']} tokens: merged {g['median_merged_tok_s']:.0f} tok/s, "
          f"adapter {g['median_adapter_tok_s']:.0f} tok/s, adapter/merged = {g['adapter_over_merged']:.2f}")
    print(f"raw figures: {args.out}")


if __name__ == "__main__":
    main()

"""One sparse MoE block, forward and backward, under each experts implementation of transformers, side by side.

The trainer runs experts as ``grouped_mm`` (``grpo_core.models.moe.experts``); this measures it against
``eager`` (a loop over the experts that got tokens) and ``batched_mm`` (a weight matrix gathered per
(token, slot) pair) on the Qwen3-30B-A3B block (hidden 2048, 128 experts of width 768, 8 per token) at
several row lengths, bf16 on a GPU. The router is the model's own, routing random hidden states;
every implementation sees the same weights and inputs, and its output and input gradient are compared
with ``grouped_mm``'s. An implementation that runs out of memory is reported as such.

    python3 -m benchmarks.models.moe_experts --out $OUT/moe_experts.json
    python3 -m benchmarks.models.moe_experts --smoke        # tiny block on a CPU, fp32: checks the script
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch


from grpo_core.training.perf import synchronize  # noqa: E402
from benchmarks.bench_io import write_report  # noqa: E402

IMPLEMENTATIONS = ("grouped_mm", "eager", "batched_mm")


def make_block(smoke: bool, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    sizes = (dict(hidden_size=64, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32) if smoke else
             dict(hidden_size=2048, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768))
    config = Qwen3MoeConfig(**sizes, norm_topk_prob=True)
    torch.manual_seed(0)
    block = Qwen3MoeSparseMoeBlock(config).to(device, dtype)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.02)
    return block


def run(block, impl: str, tokens: int, repeats: int, device: torch.device, dtype: torch.dtype) -> dict:
    block.experts.config._experts_implementation = impl
    gen = torch.Generator(device="cpu").manual_seed(tokens)
    x = torch.randn(1, tokens, block.gate.weight.shape[1], generator=gen).to(device, dtype).requires_grad_()
    grad = torch.randn(x.shape, generator=gen).to(device, dtype)
    times = []
    for i in range(repeats + 1):
        x.grad = None
        block.zero_grad(set_to_none=True)
        synchronize(device)
        start = time.perf_counter()
        out = block(x)
        out.backward(grad)
        synchronize(device)
        if i:
            times.append(time.perf_counter() - start)
    return {"seconds": statistics.median(times), "out": out.detach().float(), "dx": x.grad.detach().float()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", default="1024,4096,16384")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default="benchmarks/results/moe_experts.json")
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    block = make_block(args.smoke, device, dtype)
    report = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "dtype": str(dtype),
              "torch": torch.__version__, "command": " ".join(sys.argv), "results": []}
    for tokens in [int(t) for t in (("64,256" if args.smoke else args.tokens).split(","))]:
        base = None
        for impl in IMPLEMENTATIONS:
            try:
                r = run(block, impl, tokens, args.repeats, device, dtype)
            except torch.OutOfMemoryError as exc:
                report["results"].append({"tokens": tokens, "implementation": impl, "error": f"OOM: {str(exc)[:120]}"})
                print(f"{tokens:6d} {impl:11s} out of memory", flush=True)
                torch.cuda.empty_cache()
                continue
            if base is None:
                base = r
            entry = {"tokens": tokens, "implementation": impl, "seconds": r["seconds"],
                     "tokens_per_s": tokens / r["seconds"], "vs_grouped_mm": r["seconds"] / base["seconds"],
                     "out_max_diff": (r["out"] - base["out"]).abs().max().item(),
                     "dx_max_diff": (r["dx"] - base["dx"]).abs().max().item()}
            report["results"].append(entry)
            print(f"{tokens:6d} {impl:11s} {1e3 * r['seconds']:9.2f} ms  {entry['vs_grouped_mm']:6.2f}x grouped_mm  "
                  f"|out - grouped| {entry['out_max_diff']:.2e}", flush=True)
        write_report(args.out, report, announce=False)
    write_report(args.out, report)


if __name__ == "__main__":
    main()

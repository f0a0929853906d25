"""One sparse MoE block, forward and backward, under each experts implementation, eager and compiled, side by side.

The trainer runs experts as ``grouped_mm`` (``grpo_core.models.moe.experts``). This times the block alone, at
several row lengths, bf16 on a GPU, with each listed implementation:

* ``grouped_mm``: transformers' sort and grouped GEMMs (the trainer's);
* ``grpo_grouped_mm``: the same GEMMs with gather-only permutations (``sorted_experts_forward``);
* ``eager``, ``batched_mm``: transformers' loop over the experts and its per-pair weight gather (slow, or out of
  memory at training rows: list them to see it).

Each runs ``eager`` and ``compiled`` (``torch.compile(dynamic=True)``, as the trainer compiles a decoder layer).
Shapes: the Qwen3-30B-A3B block (hidden 2048, 128 experts of width 768, 8 per token) and the Qwen3.5-MoE block
(256 experts of width 512, 8 per token, a gated shared expert of width 512). The router is the block's own, on
random hidden states; every run sees the same weights and inputs, and its output and input gradient are compared
with the first run's. ``tflops`` counts the block's matmuls (router, the ``k`` experts a token runs, the shared
expert), 3x the forward for forward and backward. ``--profile`` records the kernels of one call of each run at the
largest row (CUDA).

    python3 -m benchmarks.models.moe_experts --shape qwen3-30b-a3b,qwen3.5-moe --profile --out $OUT/moe_experts.json
    python3 -m benchmarks.models.moe_experts --smoke        # tiny blocks on a CPU, fp32: checks the script
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch


from grpo_core.models.moe.experts import EXPERTS_IMPLEMENTATIONS, register_sorted_experts  # noqa: E402
from grpo_core.training.perf import device_peak_flops, synchronize  # noqa: E402
from benchmarks.bench_io import listed_choices, write_report  # noqa: E402

IMPLEMENTATIONS = (*EXPERTS_IMPLEMENTATIONS, "eager", "batched_mm")
MODES = ("eager", "compiled")
SHAPES = {
    "qwen3-30b-a3b": ("qwen3_moe", dict(hidden_size=2048, num_experts=128, num_experts_per_tok=8,
                                        moe_intermediate_size=768)),
    "qwen3.5-moe": ("qwen3_5_moe", dict(hidden_size=2048, num_experts=256, num_experts_per_tok=8,
                                        moe_intermediate_size=512, shared_expert_intermediate_size=512)),
    "tiny": ("qwen3_moe", dict(hidden_size=64, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)),
    "tiny-shared": ("qwen3_5_moe", dict(hidden_size=64, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                        shared_expert_intermediate_size=32)),
}
PROFILE_TOP = 20


def make_block(shape: str, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    arch, sizes = SHAPES[shape]
    if arch == "qwen3_moe":
        from transformers import Qwen3MoeConfig
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

        block = Qwen3MoeSparseMoeBlock(Qwen3MoeConfig(**sizes, norm_topk_prob=True))
    else:
        from transformers import Qwen3_5MoeTextConfig
        from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeSparseMoeBlock

        block = Qwen3_5MoeSparseMoeBlock(Qwen3_5MoeTextConfig(**sizes))
    torch.manual_seed(0)
    block = block.to(device, dtype)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.02)
    return block


def block_flops(shape: str, tokens: int) -> float:
    """Forward+backward FLOPs of the block's matmuls for ``tokens``: 3 x 2 x tokens x the weights a token runs
    through (router, ``k`` experts of ``3 x hidden x width``, the shared expert and its gate)."""
    s = SHAPES[shape][1]
    hidden, width = s["hidden_size"], s["moe_intermediate_size"]
    per_token = hidden * s["num_experts"] + s["num_experts_per_tok"] * 3 * hidden * width
    if "shared_expert_intermediate_size" in s:
        per_token += 3 * hidden * s["shared_expert_intermediate_size"] + hidden
    return 6.0 * tokens * per_token


def run(call, block, tokens: int, repeats: int, device: torch.device, dtype: torch.dtype) -> dict:
    gen = torch.Generator(device="cpu").manual_seed(tokens)
    x = torch.randn(1, tokens, block.gate.weight.shape[1], generator=gen).to(device, dtype).requires_grad_()
    grad = torch.randn(x.shape, generator=gen).to(device, dtype)
    times = []
    for i in range(repeats + 2):  # two untimed calls: a compiled block compiles on the first, may on the second
        x.grad = None
        block.zero_grad(set_to_none=True)
        synchronize(device)
        start = time.perf_counter()
        out = call(x)
        out.backward(grad)
        synchronize(device)
        if i >= 2:
            times.append(time.perf_counter() - start)

    def step() -> None:
        x.grad = None
        block.zero_grad(set_to_none=True)
        call(x).backward(grad)

    return {"seconds": statistics.median(times), "out": out.detach().float(), "dx": x.grad.detach().float(),
            "step": step}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="qwen3-30b-a3b,qwen3.5-moe", help="blocks, comma-separated: " + ",".join(SHAPES))
    ap.add_argument("--tokens", default="4096,16384")
    ap.add_argument("--implementations", default=",".join(EXPERTS_IMPLEMENTATIONS),
                    help="comma-separated, the first is the others' reference: " + ",".join(IMPLEMENTATIONS))
    ap.add_argument("--modes", default=",".join(MODES), help="eager and/or compiled")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--profile", action="store_true", help="CUDA: the kernels of one call per run, at the largest row")
    ap.add_argument("--out", default="benchmarks/results/moe_experts.json")
    ap.add_argument("--smoke", action="store_true", help="tiny blocks on the CPU, fp32: checks the script only")
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shapes = ["tiny", "tiny-shared"] if args.smoke else listed_choices(args.shape, tuple(SHAPES), "--shape")
    impls = listed_choices(args.implementations, IMPLEMENTATIONS, "--implementations")
    modes = listed_choices(args.modes, MODES, "--modes")
    token_counts = [int(t) for t in ("64" if args.smoke else args.tokens).split(",")]
    register_sorted_experts()
    peak = device_peak_flops(device, dtype == torch.bfloat16)
    report = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "dtype": str(dtype),
              "torch": torch.__version__, "peak_flops": peak, "command": " ".join(sys.argv), "results": []}
    repeats = 1 if args.smoke else args.repeats
    for shape in shapes:
        # The smoke compiles one block: a CPU compiles slowly, and both blocks run the same experts code.
        shape_modes = [m for m in modes if not (args.smoke and m == "compiled" and shape != shapes[-1])]
        block = make_block(shape, device, dtype)
        compiled = torch.compile(block, dynamic=True) if "compiled" in shape_modes else None
        for tokens in token_counts:
            base = None
            for impl in impls:
                for mode in shape_modes:
                    block.experts.config._experts_implementation = impl
                    call = compiled if mode == "compiled" else block
                    label = {"shape": shape, "tokens": tokens, "implementation": impl, "mode": mode}
                    try:
                        r = run(call, block, tokens, repeats, device, dtype)
                    except torch.OutOfMemoryError as exc:
                        report["results"].append({**label, "error": f"OOM: {str(exc)[:120]}"})
                        print(f"{shape:14s} {tokens:6d} {impl:15s} {mode:8s} out of memory", flush=True)
                        torch.cuda.empty_cache()
                        continue
                    base = base or r
                    flops = block_flops(shape, tokens)
                    entry = {**label, "seconds": r["seconds"], "tokens_per_s": tokens / r["seconds"],
                             "tflops": flops / r["seconds"] / 1e12, "mfu": flops / r["seconds"] / peak if peak else None,
                             "vs_first": r["seconds"] / base["seconds"],
                             "out_max_diff": (r["out"] - base["out"]).abs().max().item(),
                             "dx_max_diff": (r["dx"] - base["dx"]).abs().max().item()}
                    if args.profile and device.type == "cuda" and tokens == max(token_counts):
                        from benchmarks import profiling

                        entry["profile"] = profiling.profile_call(r["step"], top=PROFILE_TOP)
                        profiling.print_profile(f"{shape} {tokens} {impl} {mode}", entry["profile"])
                    report["results"].append(entry)
                    print(f"{shape:14s} {tokens:6d} {impl:15s} {mode:8s} {1e3 * r['seconds']:9.2f} ms "
                          f"{entry['tflops']:7.1f} TFLOP/s  {entry['vs_first']:5.2f}x first  "
                          f"|out - first| {entry['out_max_diff']:.2e}", flush=True)
                    del r
            write_report(args.out, report, announce=False)
        del block, compiled
    write_report(args.out, report)


if __name__ == "__main__":
    main()

"""Tree rows vs flat packing on a Gated DeltaNet hybrid (Qwen3.5-style): tokens per second, bf16.

The same comparison as ``benchmarks/packing/tree_packing.py`` (same workloads, planner and loss heads), on a
hybrid of 3 Gated DeltaNet layers to 1 attention layer at about 2B parameters with random weights.
In a tree row every Gated DeltaNet segment starts from its parent's final state and its short
convolution reads its parent's last tokens (``grpo_core.models.attention.gated_delta``); segments of one depth
run as one varlen call of the selected backend.

Modes: ``fwd`` times forward passes only (no graph kept); ``fwd+bwd`` adds the backward pass and
needs a backend whose backward runs on the device. flash-linear-attention's backward refuses Triton
< 3.7.1 on Hopper (it produces wrong gradients there), so on such a machine the script times the
forward with fla and reports the backward's error instead of a number.

Before timing, a bf16 check compares packed (tree and flat) trained-token log-probs with each sample
forwarded alone through the unpatched transformers path, next to the spread between two unpacked
runs of the same samples (alone vs one padded batch).

    python -m benchmarks.packing.gdn_tree_packing --out benchmarks/results/gdn_tree_packing.json
    python -m benchmarks.packing.gdn_tree_packing --smoke          # tiny model on a CPU, reference backend
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import numpy as np
import torch


from benchmarks.packing import tree_packing as tp  # noqa: E402

from grpo_core.models.attention import gated_delta as gd  # noqa: E402
from grpo_core.models.attention import tree as ta  # noqa: E402
from grpo_core.models.attention.hybrid import install_gated_delta  # noqa: E402
from grpo_core.packing.collator import pack_row  # noqa: E402
from grpo_core.packing.planner import plan_step  # noqa: E402
from benchmarks.bench_io import write_report  # noqa: E402

# A Qwen3.5-style hybrid of about 2B parameters (sizes chosen for the benchmark, not read from a
# checkpoint): 24 layers, every fourth full attention with an output gate, 16 key and 16 value heads
# of 128 in the Gated DeltaNet layers, untied 248k vocabulary.
SHAPES = {
    "qwen3.5-2b-like": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=24, num_attention_heads=8,
                            num_key_value_heads=2, head_dim=256, vocab_size=248320, tie_word_embeddings=False,
                            linear_num_key_heads=16, linear_num_value_heads=16, linear_key_head_dim=128,
                            linear_value_head_dim=128, linear_conv_kernel_dim=4),
    "tiny": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=64, vocab_size=512, tie_word_embeddings=True,
                 linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=64,
                 linear_value_head_dim=64, linear_conv_kernel_dim=4),
}


def build_model(shape: str, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    s = SHAPES[shape]
    layer_types = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(s["num_hidden_layers"])]
    config = Qwen3_5TextConfig(**s, layer_types=layer_types, max_position_embeddings=40960)
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen3_5ForCausalLM(config).to(dtype)
    return model


def forward_flops(model: torch.nn.Module, rows) -> float:
    """Forward FLOPs, approximately: 2 x body parameters x tokens, 2 x head x trained tokens, attention
    pairs of the full-attention layers, and the chunked delta rule's state work (4 x Dk x Dv per token
    and value head: one state read and one state update)."""
    c = model.config
    body = sum(p.numel() for n, p in model.named_parameters() if "embed_tokens" not in n and "lm_head" not in n)
    tokens = sum(r.num_tokens for r in rows)
    trained = sum(r.num_trained for r in rows)
    pairs = sum(tp.attention_pairs(r) for r in rows)
    full = sum(t == "full_attention" for t in c.layer_types)
    linear = len(c.layer_types) - full
    attention = 4 * pairs * c.num_attention_heads * c.head_dim * full
    delta = 4 * tokens * c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim * linear
    return 2 * body * tokens + 2 * c.hidden_size * c.vocab_size * trained + attention + delta


def exactness(model, device, vocab: int) -> dict:
    """``tree_packing.exactness_check`` on the hybrid: the unpacked forwards go through transformers' own
    Gated DeltaNet path (the patches pass unpacked calls through unchanged)."""
    return tp.exactness_check(model, device, next(model.parameters()).dtype, vocab)


def time_step(model, rows, trained: int, head: str, backward: bool, device: torch.device) -> float:
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    for row in rows:
        if backward:
            tp.row_loss(model, row, trained, head).backward()
        else:
            with torch.no_grad():
                tp.row_loss(model, row, trained, head)
    sync()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="qwen3.5-2b-like")
    ap.add_argument("--token-budget", type=int, default=16384)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--workloads", default="ratio~1,ratio~3.4")
    ap.add_argument("--head", default="chunked", help="loss head (see tree_packing.row_loss)")
    ap.add_argument("--gdn-backend", default="fla", help="fla or reference")
    ap.add_argument("--out", default="benchmarks/results/gdn_tree_packing.json")
    ap.add_argument("--passes", default="fwd,fwd+bwd", help="which of fwd and fwd+bwd to time (fwd+bwd where the backward runs)")
    ap.add_argument("--skip-exactness", action="store_true", help="leave out the packed-vs-alone log-prob check")
    ap.add_argument("--smoke", action="store_true", help="tiny model on CPU: checks the script, times nothing real")
    args = ap.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shape = "tiny" if args.smoke else args.shape
    wanted = args.workloads.split(",")
    workloads = tp.SMOKE_WORKLOADS if args.smoke else [w for w in tp.WORKLOADS if w.name in wanted]
    budget = 256 if args.smoke else args.token_budget
    attention = ta.register_tree_attention("auto" if device.type == "cuda" else "varlen_emulated", device)
    import transformers

    model = build_model(shape, device, dtype)
    model.set_attn_implementation(ta.TREE_ATTENTION)
    gdn_name = "reference" if args.smoke else args.gdn_backend
    install_gated_delta(model, "reference")
    # fla is chosen directly: its start-up probe includes a backward pass, which the device may refuse
    # (the forward is what this run can measure then; the backward's error is reported below).
    gd._active = gd.GDN_BACKENDS[gdn_name]
    report = {
        "env": {"torch": torch.__version__, "transformers": transformers.__version__,
                "python": platform.python_version(),
                "device": torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu",
                "dtype": str(dtype), "tree_attention_backend": attention, "gdn_backend": gdn_name},
        "shape": shape, "params_b": sum(p.numel() for p in model.parameters()) / 1e9,
        "token_budget": budget, "repeats": args.repeats, "head": args.head, "command": " ".join(sys.argv),
        "results": [],
    }
    try:
        import triton

        report["env"]["triton"] = triton.__version__
    except ImportError:
        pass
    print(json.dumps(report["env"]), f"{report['params_b']:.2f}B params", flush=True)

    # Does this backend's backward run here?
    try:
        err = gd.probe_gdn(gd.GDN_BACKENDS[gdn_name], device)
        report["backward"] = {"runs": True, "probe_rel_error": err}
    except Exception as exc:  # noqa: BLE001 - the reason is the result
        report["backward"] = {"runs": False, "error": f"{type(exc).__name__}: {str(exc)[:400]}"}
    print("backward", json.dumps(report["backward"]), flush=True)
    passes = [p for p in args.passes.split(",") if p == "fwd" or report["backward"]["runs"]]

    if not args.skip_exactness:
        model.eval()
        report["exactness"] = exactness(model, device, SHAPES[shape]["vocab_size"])
        print("exactness", json.dumps(report["exactness"]), flush=True)
        model.train()

    for i, w in enumerate(workloads):
        samples = tp.make_samples(w, SHAPES[shape]["vocab_size"], seed=100 + i)
        modes, meta = {}, {}
        for mode in ("flat", "tree"):
            plan = plan_step(samples, world_size=1, gradient_accumulation_steps=10**6, token_budget=budget,
                             flat=mode == "flat")
            rows = [pack_row(r).to(device) for r in plan.rows]
            assert not plan.leftover and plan.dropped_too_long == 0
            trained = sum(r.num_trained for r in rows)
            modes[mode] = (rows, trained)
            meta[mode] = {"rows": len(rows), "forwarded_tokens": sum(r.num_tokens for r in rows),
                          "trained_tokens": trained, "fwd_flops": forward_flops(model, rows)}
        for p in passes:
            backward = p == "fwd+bwd"
            times = {m: [] for m in modes}
            peak = {}
            for m, (rows, trained) in modes.items():  # warm-up: kernels, autotuning, allocator
                model.zero_grad(set_to_none=True)
                time_step(model, rows, trained, args.head, backward, device)
            for _ in range(args.repeats):
                for m, (rows, trained) in modes.items():
                    model.zero_grad(set_to_none=True)
                    if device.type == "cuda":
                        torch.cuda.reset_peak_memory_stats()
                    times[m].append(time_step(model, rows, trained, args.head, backward, device))
                    if device.type == "cuda":
                        peak[m] = max(peak.get(m, 0.0), torch.cuda.max_memory_allocated() / 2**30)
            res = {m: dict(meta[m]) for m in modes}
            for m in modes:
                t = float(np.median(times[m]))
                res[m].update(time_s=t, times_s=times[m], peak_mem_gib=peak.get(m),
                              trained_tok_per_s=res[m]["trained_tokens"] / t)
            ratio = res["flat"]["forwarded_tokens"] / res["tree"]["forwarded_tokens"]
            speedup = res["tree"]["trained_tok_per_s"] / res["flat"]["trained_tok_per_s"]
            ideal = res["flat"]["fwd_flops"] / res["tree"]["fwd_flops"]
            entry = {"workload": w.name, "pass": p, "packing_ratio": ratio, "speedup": speedup,
                     "flop_ideal_speedup": ideal, "speedup_over_ideal": speedup / ideal, **res}
            report["results"].append(entry)
            print(f"{shape} {w.name:10s} {p:8s} ratio {ratio:5.2f} speedup {speedup:5.2f} (ideal {ideal:4.2f}, "
                  f"{speedup / ideal:4.2f}x of it)  flat {res['flat']['time_s']:.3f}s {res['flat']['peak_mem_gib'] or 0:.1f}GiB  "
                  f"tree {res['tree']['time_s']:.3f}s {res['tree']['peak_mem_gib'] or 0:.1f}GiB", flush=True)
            write_report(args.out, report)  # after each entry: a run cut short keeps what it measured


if __name__ == "__main__":
    main()

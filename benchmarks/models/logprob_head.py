"""The trainer's log-prob head alone: fused (``grpo_core.models.head.fused``) against the reference
(autograd through ``grpo_core.training.loss``), dense and in chunks, side by side in one run.

One row's trained tokens: hidden states ``[T, d]`` and an LM head ``[V, d]`` (bf16 on the GPU), the log-probs of
sampled ids (and optionally of ``N`` top ids), a GRPO-like weighted sum, backward to hidden and weight. Per
variant: median step time, counted TFLOP/s (6·T·d·V, the matmuls' forward and backward, not the chunked
variants' recompute), peak memory above the inputs, and errors against an fp32 oracle (the reference head,
dense, on fp32 copies of the same inputs): log-probs (max |Δ|) and the gradients (relative norm). Ratios are
against the reference dense head.

    python -m benchmarks.models.logprob_head --out benchmarks/results/logprob_head.json     # GPU: Qwen3 sizes
    python -m benchmarks.models.logprob_head --smoke                                         # CPU: checks the script
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time

import torch
import torch.nn.functional as F


from grpo_core.config import AUTO_CHUNK_LOGITS  # noqa: E402
from grpo_core.models.head.fused import fused_head_logprobs, fused_token_logprobs  # noqa: E402
from grpo_core.models.head.reference import head_token_logprobs, token_logprobs  # noqa: E402
from benchmarks.bench_io import write_report  # noqa: E402

VARIANTS = {  # name -> (fused, chunked)
    "reference": (False, False), "fused": (True, False),
    "reference_chunked": (False, True), "fused_chunked": (True, True),
}


def head_loss(hidden, weight, targets, top_ids, weights, fused: bool, chunk: int | None) -> torch.Tensor:
    if chunk is None:
        logprobs = fused_token_logprobs if fused else token_logprobs
        # Fused, the logits' gradient takes their place, as the trainer's head (row_logprobs) runs it.
        extra = {"overwrite_logits": True} if fused else {}
        lp, top = logprobs(F.linear(hidden, weight), targets, 1.0, top_ids, **extra)
    else:
        logprobs = fused_head_logprobs if fused else head_token_logprobs
        lp, top = logprobs(hidden, weight, targets, 1.0, top_ids, chunk_size=chunk)
    loss = (lp * weights).sum()
    return loss if top is None else loss + 0.1 * (top * weights[:, None]).sum()


def run(hidden, weight, targets, top_ids, weights, fused, chunk):
    h, w = (x.detach().clone().requires_grad_() for x in (hidden, weight))
    loss = head_loss(h, w, targets, top_ids, weights, fused, chunk)
    loss.backward()
    return loss.detach(), h.grad, w.grad


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=15360, help="trained tokens of the row (T)")
    ap.add_argument("--hidden", type=int, default=2048, help="hidden size (d; Qwen3-1.7B)")
    ap.add_argument("--vocab", type=int, default=151936, help="vocabulary (V; Qwen3)")
    ap.add_argument("--top-ids", type=int, default=0, help="the sampler's top ids per token (N)")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated; ratios need 'reference' first")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="benchmarks/results/logprob_head.json")
    ap.add_argument("--smoke", action="store_true", help="small sizes on the CPU: checks the script only")
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    t, d, v = (args.tokens, args.hidden, args.vocab) if not args.smoke else (64, 32, 1000)
    chunk = max(1, AUTO_CHUNK_LOGITS // v) if not args.smoke else 16
    gen = torch.Generator().manual_seed(0)
    hidden = (torch.randn(t, d, generator=gen)).to(device, dtype)
    weight = (torch.randn(v, d, generator=gen) * d**-0.5 * 3).to(device, dtype)  # logits of a few units
    targets = torch.randint(0, v, (t,), generator=gen).to(device)
    top_ids = torch.randint(0, v, (t, args.top_ids), generator=gen).to(device) if args.top_ids else None
    weights = torch.randn(t, generator=gen).to(device) / t
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    oracle = run(hidden.float(), weight.float(), targets, top_ids, weights, False, None)
    flops = 6 * t * d * v
    report = {"env": {"torch": torch.__version__, "python": platform.python_version(),
                      "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "dtype": str(dtype)},
              "tokens": t, "hidden": d, "vocab": v, "top_ids": args.top_ids, "chunk": chunk,
              "command": " ".join(sys.argv), "results": []}
    print(report["env"], flush=True)
    base = None
    for name in args.variants.split(","):
        fused, chunked = VARIANTS[name]
        c = chunk if chunked else None
        got = run(hidden, weight, targets, top_ids, weights, fused, c)  # warm-up (compiles on CUDA)
        times, peak = [], None
        for _ in range(args.repeats):
            if device.type == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
                before = torch.cuda.memory_allocated()
            sync()
            t0 = time.perf_counter()
            got = run(hidden, weight, targets, top_ids, weights, fused, c)
            sync()
            times.append(time.perf_counter() - t0)
            if device.type == "cuda":
                peak = (torch.cuda.max_memory_allocated() - before) / 2**30
        median = statistics.median(times)
        base = median if name == "reference" else base
        speedup = base / median if base else None
        rel = lambda a, b: float((a.float() - b.float()).norm() / b.float().norm())  # noqa: E731
        entry = {"variant": name, "fused": fused, "chunk": c, "time_s": median, "times_s": times,
                 "tflops": flops / median / 1e12, "speedup_over_reference": speedup,
                 "peak_gib_above_inputs": peak, "loss_abs_err": float((got[0].float() - oracle[0]).abs()),
                 "grad_hidden_rel_err": rel(got[1], oracle[1]), "grad_weight_rel_err": rel(got[2], oracle[2])}
        report["results"].append(entry)
        print(f"{name:18s} {median * 1e3:8.1f} ms  {entry['tflops']:6.1f} TFLOP/s  x{speedup or float('nan'):4.2f} vs reference  "
              f"peak {peak if peak is not None else float('nan'):6.2f} GiB  loss err {entry['loss_abs_err']:.2e}  "
              f"grad rel err h {entry['grad_hidden_rel_err']:.2e} W {entry['grad_weight_rel_err']:.2e}", flush=True)
        write_report(args.out, report, announce=False)
    write_report(args.out, report)


if __name__ == "__main__":
    main()

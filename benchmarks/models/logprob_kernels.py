"""The fused log-prob head's two passes over the ``[T, V]`` logits, side by side: the statistics (log-normaliser,
sampled log-probs) and the logits' gradient, each compiled from its PyTorch form (``fused.chunk_stats``,
``fused.chunk_grad``, ``torch.compile(dynamic=True)``) and by the Triton kernels (``stats_triton``, ``grad_triton``)
under several launches (columns per program / block / warps; the kernels' defaults first, and for the gradient the
launch of one program per row it had before).

The default shape is one micro-batch of the Qwen3-30B-A3B profile's: 15,436 trained tokens of a 151,936-id
vocabulary in bf16, with the sampler's 8 top ids per token. Each is timed over ``--repeats`` calls after five warm-up calls (``profiling.time_ms``); the report gives ms, the bytes
each pass must move per ms (``tb_s``: the logits read once, the gradient written once), every launch's time over
the compiled form's (``over_compiled``), and its largest difference from the compiled form's result (``max_abs_diff``;
the log-normaliser in fp32, the gradient in bf16).

    python3 -m benchmarks.models.logprob_kernels --out $OUT/logprob_kernels.json      # a GPU with Triton
    python -m benchmarks.models.logprob_kernels --smoke --out /tmp/logprob_kernels.json  # CPU: small, interpreted

``--smoke`` runs small logits on the CPU, the kernels under Triton's interpreter where ``.triton-interpreter/``
holds Triton (``scripts/triton_interpreter.sh``), uncompiled forms in the compiled ones' place: it checks the
script, and its times mean nothing.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

GRAD_LAUNCHES = {"8192/2048/4": (8192, 2048, 4, False), "4096/1024/4": (4096, 1024, 4, False),
                 "16384/4096/8": (16384, 4096, 8, False), "8192/2048/4 inline": (8192, 2048, 4, True),
                 "row/4096/8 inline": (None, 4096, 8, True)}
"""The gradient kernel's launches: columns per program (None: the whole row) / block / warps, and ``inline`` where
every entry is compared with every top id (``grad_triton.triton_chunk_grad``'s ``inline_top``). The first is the
default; ``row/4096/8 inline`` is the launch it had before (one program per row)."""
STATS_LAUNCHES = {"8192/2048/4": (8192, 2048, 4), "4096/1024/4": (4096, 1024, 4), "16384/4096/8": (16384, 4096, 8),
                  "32768/4096/8": (32768, 4096, 8)}
"""The statistics kernel's launches; the first is ``stats_triton``'s default."""


def use_interpreter_for_smoke() -> bool:
    """On the CPU, Triton's interpreter with Triton from ``.triton-interpreter/``, where it is there (set before
    Triton is first imported). Returns whether the kernels can run."""
    site = Path(__file__).resolve().parents[2] / ".triton-interpreter"
    if (site / "triton").is_dir():
        os.environ["TRITON_INTERPRET"] = "1"
        sys.path.insert(0, str(site))
    import importlib.util

    return importlib.util.find_spec("triton") is not None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=15436)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--top-ids", type=int, default=8, help="the sampler's top ids per token (the profile's 8)")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--out", default="benchmarks/results/logprob_kernels.json")
    ap.add_argument("--smoke", action="store_true", help="CPU, small logits, kernels interpreted: checks the script")
    args = ap.parse_args()
    kernels = use_interpreter_for_smoke() if args.smoke else True
    from benchmarks.bench_io import write_report
    from benchmarks.profiling import time_ms
    from grpo_core.models.head import grad_triton, stats_triton
    from grpo_core.models.head.fused import chunk_grad, chunk_stats

    tokens, vocab = (5, 700) if args.smoke else (args.tokens, args.vocab)
    device = torch.device("cpu" if args.smoke else "cuda")
    cuda = device.type == "cuda"
    gen = torch.Generator(device=device).manual_seed(0)
    logits = (torch.randn(tokens, vocab, device=device, generator=gen) * 3).to(torch.bfloat16)
    targets = torch.randint(0, vocab, (tokens,), device=device, generator=gen)
    upstream = torch.randn(tokens, device=device, generator=gen)
    tops = torch.randint(0, vocab, (tokens, args.top_ids), device=device, generator=gen) if args.top_ids else None
    upstream_top = torch.randn(tokens, args.top_ids, device=device, generator=gen) if args.top_ids else None
    compiled_stats = chunk_stats if args.smoke else torch.compile(chunk_stats, dynamic=True)
    compiled_grad = chunk_grad if args.smoke else torch.compile(chunk_grad, dynamic=True)
    repeats = 2 if args.smoke else args.repeats
    logits_mb = logits.numel() * logits.element_size() / 1e6

    lse_want = compiled_stats(logits, targets, 1.0, tops, None)[0]
    stats = {"compiled": {"ms": time_ms(lambda: compiled_stats(logits, targets, 1.0, tops, None), repeats, device)}}
    grad_want = compiled_grad(logits, lse_want, targets, upstream, tops, upstream_top, None, 1.0)
    grad = {"compiled": {"ms": time_ms(lambda: compiled_grad(logits, lse_want, targets, upstream, tops, upstream_top,
                                                              None, 1.0), repeats, device)}}
    if kernels:
        for name, (columns, block, warps) in STATS_LAUNCHES.items():
            stats[name] = {"ms": time_ms(lambda: stats_triton.triton_lse(logits, 1.0, None, columns, block, warps),
                                          repeats, device),
                           "max_abs_diff": (stats_triton.triton_lse(logits, 1.0, None, columns, block, warps)
                                            - lse_want).abs().max().item()}
        # the whole statistics as the head runs them: the default launch's log-normaliser, the ids gathered apart
        stats["triton_chunk_stats"] = {
            "ms": time_ms(lambda: stats_triton.triton_chunk_stats(logits, targets, 1.0, tops, None), repeats, device),
            "max_abs_diff": (stats_triton.triton_chunk_stats(logits, targets, 1.0, tops, None)[1]
                             - compiled_stats(logits, targets, 1.0, tops, None)[1]).abs().max().item()}
        out = torch.empty_like(logits)
        for name, (columns, block, warps, inline) in GRAD_LAUNCHES.items():
            run = lambda: grad_triton.triton_chunk_grad(out, logits, lse_want, targets, upstream, tops,  # noqa: E731
                                                        upstream_top, None, 1.0, columns, block, warps, inline)
            grad[name] = {"ms": time_ms(run, repeats, device),
                          "max_abs_diff": (run().float() - grad_want.float()).abs().max().item()}
    for part, results, moved_mb in (("stats", stats, logits_mb), ("grad", grad, 2 * logits_mb)):
        for name, r in results.items():
            r["tb_s"] = moved_mb / r["ms"] / 1e3  # MB per ms is GB/s
            r["over_compiled"] = r["ms"] / results["compiled"]["ms"]
            print(f"{part:5s} {name:18s} {r['ms']:8.3f} ms  {r['tb_s']:6.2f} TB/s  {r['over_compiled']:.3f}x compiled"
                  + (f"  max |diff| {r['max_abs_diff']:.2e}" if "max_abs_diff" in r else ""), flush=True)
    report = {"device": torch.cuda.get_device_name(device) if cuda else "cpu", "torch": torch.__version__,
              "tokens": tokens, "vocab": vocab, "top_ids": args.top_ids, "dtype": "bfloat16", "repeats": repeats,
              "kernels": "triton" if kernels else "absent (no Triton here)", "stats": stats, "grad": grad}
    write_report(args.out, report)


if __name__ == "__main__":
    main()

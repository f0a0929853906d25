"""The backward of a tree row's K/V gather: summing the gradient copies of shared rows in fp32, three ways.

A tree row gathers its K/V along every root-to-segment path (``models.attention.gather._GatherRows``): ``K``
gathered rows from ``U`` row positions, a prompt's rows copied once per path through it. Backward adds
each copy's gradient back to its source row, in fp32 so that 16 copies round once, not 15 times.
Timed side by side on one GPU, at the shape of the Qwen3-1.7B ratio-6 row of benchmarks/README.md
("Why tree rows run at a lower FLOP rate": U = 16,335, K = 113,955, 8 K/V heads of 128), per layer:

* ``index_add``: today's: ``grad.float()`` then ``index_add_`` into an fp32 buffer (atomics);
* ``sorted_segments``: the copies sorted by source row once per row (shared by all layers), then
  ``torch.segment_reduce`` over the bf16 gradient (fp32 accumulation inside the kernel);
* ``sorted_index_add``: the same sort, then ``index_add_`` of the sorted fp32 copies (neighbouring
  atomics hit the same row).

Each is checked against an fp64 sum. Prints times and ratios to ``index_add``.

    python3 -m benchmarks.packing.gather_grad_sum --out $OUT/gather_grad_sum.json
    python -m benchmarks.packing.gather_grad_sum --smoke --out /tmp/gather_grad_sum.json   # CPU, small shape
"""

from __future__ import annotations

import argparse
import time

import torch
from benchmarks.bench_io import write_report
from benchmarks.profiling import time_ms


def make_index(u: int, k: int, gen: torch.Generator) -> torch.Tensor:
    # Prompts of ~1/16 of the row shared by many paths, completions gathered once: the first half of
    # the gathered rows come from a small shared prefix region, the rest covers every row once.
    shared = torch.randint(0, u // 16, (k - u,), generator=gen)
    return torch.cat([torch.arange(u), shared]).sort().values  # paths list positions in row order


def index_add(grad, index, u, plan):
    acc = grad.new_zeros((u, *grad.shape[1:]), dtype=torch.float32)
    acc.index_add_(0, index, grad.float())
    return acc.to(grad.dtype)


def sorted_segments(grad, index, u, plan):
    perm, lengths = plan
    return torch.segment_reduce(grad.index_select(0, perm).float(), "sum", lengths=lengths, axis=0).to(grad.dtype)


def sorted_index_add(grad, index, u, plan):
    perm, _ = plan
    acc = grad.new_zeros((u, *grad.shape[1:]), dtype=torch.float32)
    acc.index_add_(0, index.index_select(0, perm), grad.index_select(0, perm).float())
    return acc.to(grad.dtype)


def synchronize(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--u", type=int, default=16335)
    ap.add_argument("--k", type=int, default=113955)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--out", default="benchmarks/results/gather_grad_sum.json")
    ap.add_argument("--smoke", action="store_true", help="CPU, a small shape: checks the script, times nothing real")
    args = ap.parse_args()
    if args.smoke:
        args.u, args.k, args.heads, args.dim, args.repeats = 512, 2048, 2, 16, 2
    dev = torch.device("cpu" if args.smoke else "cuda")
    gen = torch.Generator().manual_seed(0)
    index = make_index(args.u, args.k, gen).to(dev)
    grad = torch.randn(args.k, args.heads, args.dim, generator=gen).to(dev, torch.bfloat16)
    # Once per row, shared by every layer: the copies ordered by source row, and how many each row has.
    t0 = time.perf_counter()
    perm = torch.argsort(index, stable=True)
    lengths = torch.bincount(index, minlength=args.u)
    synchronize(dev)
    plan_ms = (time.perf_counter() - t0) * 1e3
    exact = torch.zeros(args.u, args.heads, args.dim, dtype=torch.float64, device=dev).index_add_(0, index, grad.double())
    report = {"u": args.u, "k": args.k, "heads": args.heads, "dim": args.dim, "plan_ms_per_row": plan_ms,
              "device": torch.cuda.get_device_name(0) if dev.type == "cuda" else "cpu", "torch": torch.__version__,
              "methods": {}}
    for name, fn in (("index_add", index_add), ("sorted_segments", sorted_segments), ("sorted_index_add", sorted_index_add)):
        out = fn(grad, index, args.u, (perm, lengths))
        err = float(((out.double() - exact).abs().max()))
        ref_err = float(((exact.to(torch.bfloat16).double() - exact).abs().max()))  # one rounding of the exact sum
        ms = time_ms(lambda: fn(grad, index, args.u, (perm, lengths)), args.repeats, dev)
        report["methods"][name] = {"ms_per_layer": ms, "max_abs_err": err, "one_rounding_err": ref_err}
    base = report["methods"]["index_add"]["ms_per_layer"]
    for name, m in report["methods"].items():
        m["ratio_to_index_add"] = m["ms_per_layer"] / base
        print(f"{name:18s} {m['ms_per_layer']:7.3f} ms/layer  x{m['ratio_to_index_add']:.2f}  max err {m['max_abs_err']:.3e} "
              f"(one rounding {m['one_rounding_err']:.3e})")
    print(f"plan (argsort + bincount, once per row): {plan_ms:.2f} ms")
    write_report(args.out, report, indent=2)


if __name__ == "__main__":
    main()

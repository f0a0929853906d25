"""On a GPU: the split plan's Triton kernels (the merge reading row-sized results, the row add) against their
PyTorch-op versions, on random rows of Qwen3-1.7B's head shape. Prints the largest differences.

    python3 -m benchmarks.device.check_split_kernels
    python -m benchmarks.device.check_split_kernels --smoke   # CPU, small rows: the dispatch's CPU path against the ops
"""

import argparse

import torch

from grpo_core.models.attention import split as tree_split


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="CPU, small rows (no Triton: checks the script and the CPU path)")
    args = ap.parse_args()
    dev = torch.device("cpu" if args.smoke else "cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    u, heads, d = (90, 4, 16) if args.smoke else (9000, 16, 128)
    rows = torch.randperm(u, device=dev, generator=gen)[:u * 7 // 9].sort().values
    for dtype in (torch.bfloat16, torch.float32):
        acc = torch.randn(u, heads, d, device=dev, generator=gen).to(dtype)
        lse = torch.randn(heads, u, device=dev, generator=gen)
        part = torch.randn(u, heads, d, device=dev, generator=gen).to(dtype)
        part_lse = torch.randn(heads, u, device=dev, generator=gen)
        got_acc, got_lse = acc.clone(), lse.clone()
        tree_split._merge(got_acc, got_lse, rows, part, part_lse, at_rows=True)
        want_acc, want_lse = acc.clone(), lse.clone()
        tree_split._merge_eager(want_acc, want_lse, rows, part, part_lse, at_rows=True)
        print(f"merge at rows {dtype}: max |Δout| {(got_acc.float() - want_acc.float()).abs().max():.3e} "
              f"max |Δlse| {(got_lse - want_lse).abs().max():.3e} untouched rows equal "
              f"{bool(torch.equal(got_acc[~torch.isin(torch.arange(u, device=dev), rows)], acc[~torch.isin(torch.arange(u, device=dev), rows)]))}")
        for width_heads in (16, 8):
            dst = torch.randn(u, width_heads, d, device=dev, generator=gen).to(dtype)
            src = torch.randn(u, width_heads, d, device=dev, generator=gen).to(torch.bfloat16)
            got = dst.clone()
            tree_split._add_rows(got, rows, src)
            want = dst.clone()
            want.index_add_(0, rows, src.index_select(0, rows).to(dtype))
            print(f"add rows {dtype} heads {width_heads}: max |Δ| {(got.float() - want.float()).abs().max():.3e}")


if __name__ == "__main__":
    main()

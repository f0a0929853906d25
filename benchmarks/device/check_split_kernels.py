"""On a GPU: the split plan's Triton kernels (the merge reading row-sized results, the row add) against their
PyTorch-op versions, on random rows of Qwen3-1.7B's head shape. Prints the largest differences.

    python3 benchmarks/device/check_split_kernels.py
"""

import os
import sys

import torch


from grpo_core.models.attention import split as tree_split  # noqa: E402


def main() -> None:
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    u, heads, d = 9000, 16, 128
    rows = torch.randperm(u, device=dev, generator=gen)[:7000].sort().values
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

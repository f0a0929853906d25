"""On a GPU: the fused head's logits gradient by the Triton kernel (``models.head.grad_triton``) against
``chunk_grad`` uncompiled (correctness: sampled and top ids with duplicates, candidate sets, temperature, bf16
and fp32) and against ``chunk_grad`` compiled with dynamic shapes (time, at 8k tokens of a 152k vocabulary).

    python3 -m benchmarks.device.check_logprob_grad
    python -m benchmarks.device.check_logprob_grad --smoke   # CPU, small vocabularies, chunk_grad only (Triton is GPU-only)
"""

import argparse
import time

import torch

from grpo_core.models.head.fused import chunk_grad, chunk_stats


def case(t, v, n_top, masked, dtype, temperature, dev, gen):
    logits = (torch.randn(t, v, device=dev, generator=gen) * 3).to(dtype)
    targets = torch.randint(0, v, (t,), device=dev, generator=gen)
    tops = torch.randint(0, v, (t, n_top), device=dev, generator=gen) if n_top else None
    if tops is not None and n_top > 1:
        tops[0, 1] = tops[0, 0]
    masks = torch.rand(t, v, device=dev, generator=gen) < 0.7 if masked else None
    if masks is not None:
        masks[torch.arange(t), targets] = True
    lse = chunk_stats(logits, targets, temperature, tops, masks)[0]
    g = torch.randn(t, device=dev, generator=gen)
    g_top = torch.randn(t, n_top, device=dev, generator=gen) if n_top else None
    return logits, lse, targets, g, tops, g_top, masks


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true",
                    help="CPU, small sizes: the cases and the timing loop run with chunk_grad in the kernel's place")
    args = ap.parse_args()
    dev = torch.device("cpu" if args.smoke else "cuda")
    if args.smoke:  # Triton compiles for a GPU only: the uncompiled function stands in, so the check is of the script
        def kernel(out, logits, *rest):
            out.copy_(chunk_grad(logits, *rest))
            return out
    else:
        from grpo_core.models.head.grad_triton import triton_chunk_grad as kernel
    gen = torch.Generator(device=dev).manual_seed(0)
    cases = ((37, 1000, 3, True, torch.float32, 0.7), (37, 1000, 0, False, torch.bfloat16, 1.0),
             (300, 5003, 4, False, torch.bfloat16, 1.3), (64, 151936, 2, True, torch.bfloat16, 0.9))
    for t, v, n_top, masked, dtype, temp in cases[:2] if args.smoke else cases:
        logits, lse, targets, g, tops, g_top, masks = case(t, v, n_top, masked, dtype, temp, dev, gen)
        want = chunk_grad(logits, lse, targets, g, tops, g_top, masks, temp)
        got = kernel(torch.empty_like(logits), logits, lse, targets, g, tops, g_top, masks, temp)
        over = logits.clone()
        kernel(over, over, lse, targets, g, tops, g_top, masks, temp)
        err = ((got.float() - want.float()).abs() / (want.float().abs() + 1e-30)).max()
        scale = (want.float().abs().max())
        print(f"T={t} V={v} top={n_top} masked={masked} {dtype} temp={temp}: max |Δ| {(got.float() - want.float()).abs().max():.3e} "
              f"(|grad| max {scale:.3e}), in place equal {bool(torch.equal(over, got))}, max rel {err:.3e}")
    t, v = (64, 1000) if args.smoke else (8192, 151936)
    logits, lse, targets, g, tops, g_top, masks = case(t, v, 0, False, torch.bfloat16, 1.0, dev, gen)
    # Compiling on the CPU costs the smoke run a minute: there the uncompiled function is timed in its place.
    compiled = chunk_grad if args.smoke else torch.compile(chunk_grad, dynamic=True)
    out = torch.empty_like(logits)
    runs = {"compiled (dynamic)": lambda: compiled(logits, lse, targets, g, None, None, None, 1.0),
            "triton": lambda: kernel(out, logits, lse, targets, g, None, None, None, 1.0)}
    times = {}
    for name, fn in runs.items():
        for _ in range(3):
            fn()
        if dev.type == "cuda":
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(10):
                fn()
            end.record()
            torch.cuda.synchronize()
            times[name] = start.elapsed_time(end) / 10
        else:
            start_s = time.perf_counter()
            for _ in range(10):
                fn()
            times[name] = (time.perf_counter() - start_s) * 1e3 / 10
        print(f"{name:20s} {times[name]:.3f} ms  {2 * logits.numel() * 2 / times[name] / 1e9:.2f} TB/s (bf16 read + write)")
    print(f"triton / compiled time: {times['triton'] / times['compiled (dynamic)']:.3f}")


if __name__ == "__main__":
    main()

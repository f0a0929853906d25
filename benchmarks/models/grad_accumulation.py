"""One rank's fp32 gradient accumulation, side by side: PyTorch's mixed-dtype cast and add (what FSDP2 runs after
each micro-batch's backward when a step's gradients stay unsharded) against the Triton kernels of
``grpo_core.models.grad_accumulation`` under several launches (block / warps; the kernels' default first).

The default size is one decoder layer of the Qwen3-30B-A3B shape, 623,120,640 parameters (its experts' weights
make up nearly all of it): a bf16 gradient widened into a new fp32 tensor (``upcast``, ``grad.to(float32)``), and
a bf16 gradient added into an fp32 one (``add_into``, ``accumulated += grad``). Each is timed over ``--repeats``
calls after five warm-up calls (``profiling.time_ms``); the report gives ms, the bytes each moves per ms (``tb_s``:
2 + 4 bytes an element for the cast, 2 + 4 + 4 for the add), each launch's time over PyTorch's
(``over_pytorch``), and whether its result equals PyTorch's bit for bit (``bit_equal``).

    python3 -m benchmarks.models.grad_accumulation --out $OUT/grad_accumulation.json      # a GPU with Triton
    python -m benchmarks.models.grad_accumulation --smoke --out /tmp/grad_accumulation.json  # CPU: small, interpreted

``--smoke`` runs a small gradient on the CPU, the kernels under Triton's interpreter where ``.triton-interpreter/``
holds Triton (``scripts/triton_interpreter.sh``): it checks the script, and its times mean nothing.
"""

from __future__ import annotations

import argparse

import torch

LAUNCHES = {"4096/8": (4096, 8), "2048/4": (2048, 4), "8192/8": (8192, 8), "16384/16": (16384, 16)}
"""Block / warps; the first is ``grad_accumulation``'s default."""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--elements", type=int, default=623_120_640, help="one Qwen3-30B-A3B decoder layer's parameters")
    ap.add_argument("--dtype", choices=("bfloat16", "float16"), default="bfloat16")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--out", default="benchmarks/results/grad_accumulation.json")
    ap.add_argument("--smoke", action="store_true", help="CPU, a small gradient, kernels interpreted: checks the script")
    args = ap.parse_args()
    from benchmarks.models.logprob_kernels import use_interpreter_for_smoke

    kernels = use_interpreter_for_smoke() if args.smoke else True
    from benchmarks.bench_io import write_report
    from benchmarks.profiling import time_ms
    from grpo_core.models import grad_accumulation

    elements = 3000 if args.smoke else args.elements
    device = torch.device("cpu" if args.smoke else "cuda")
    repeats = 2 if args.smoke else args.repeats
    dtype = getattr(torch, args.dtype)
    gen = torch.Generator(device=device).manual_seed(0)
    grad = torch.randn(elements, device=device, generator=gen).to(dtype)
    accumulated = torch.randn(elements, device=device, generator=gen)
    want_upcast = grad.to(torch.float32)

    def add_pytorch():
        accumulated.add_(grad)  # the same kernel as FSDP2's ``+=``; the value drifts, the time does not

    upcast = {"pytorch": {"ms": time_ms(lambda: grad.to(torch.float32), repeats, device)}}
    add = {"pytorch": {"ms": time_ms(add_pytorch, repeats, device)}}
    if kernels:
        for name, (block, warps) in LAUNCHES.items():
            upcast[name] = {"ms": time_ms(lambda: grad_accumulation.upcast(grad, block, warps), repeats, device),
                            "bit_equal": torch.equal(grad_accumulation.upcast(grad, block, warps), want_upcast)}
            add[name] = {"ms": time_ms(lambda: grad_accumulation.add_into(accumulated, grad, block, warps), repeats,
                                       device)}
            start = torch.randn(elements, device=device, generator=gen)
            expected = start.clone()
            expected += grad
            grad_accumulation.add_into(start, grad, block, warps)
            add[name]["bit_equal"] = torch.equal(start, expected)
    for part, results, bytes_per_element in (("upcast", upcast, 6), ("add_into", add, 10)):
        moved_mb = elements * bytes_per_element / 1e6
        for name, r in results.items():
            r["tb_s"] = moved_mb / r["ms"] / 1e3  # MB per ms is GB/s
            r["over_pytorch"] = r["ms"] / results["pytorch"]["ms"]
            print(f"{part:8s} {name:9s} {r['ms']:8.3f} ms  {r['tb_s']:6.2f} TB/s  {r['over_pytorch']:.3f}x PyTorch"
                  + (f"  bit-equal {r['bit_equal']}" if "bit_equal" in r else ""), flush=True)
    report = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "elements": elements, "dtype": args.dtype, "repeats": repeats,
              "kernels": "triton" if kernels else "absent (no Triton here)", "upcast": upcast, "add_into": add}
    write_report(args.out, report)


if __name__ == "__main__":
    main()

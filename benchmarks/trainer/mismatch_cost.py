"""What the mismatch metrics and the correction modes add to the GRPO loss of one packed row, on one device.

Times ``grpo_loss`` forward and backward over a row's trained tokens (random log-probs of a shape the trainer
sees: ``--tokens`` trained tokens in ``--samples`` samples, top-``--top`` sampler log-probs, score centering on)
with each correction mode, and in the default mode once more with the ``mismatch/*`` parts left out, so the
difference is what the metrics cost per row; and ``finalize_metrics`` over ``--rows`` rows' parts (the step's
one host copy). Only the loss is timed: compare the figures with a whole step's (benchmarks/README.md,
"MFU"), which holds the model's forward and backward too.

    python3 benchmarks/trainer/mismatch_cost.py --tokens 12288 --samples 16 --out $OUT/mismatch_cost.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

from grpo_core.training.loss import LossConfig, LossInputs, finalize_metrics, grpo_loss  # noqa: E402
from benchmarks.bench_io import write_report  # noqa: E402

MODES = ("token_mask", "token_truncate", "sequence_mask", "sequence_truncate")


def config(mode: str, metrics: bool = True) -> LossConfig:
    return LossConfig(epsilon=0.2, epsilon_high=0.28, score_centering=True, score_centering_weights="importance",
                      vllm_importance_sampling_clip_min=0.5, vllm_importance_sampling_clip_max=2.0,
                      vllm_importance_sampling_correction=True, vllm_importance_sampling_mode=mode,
                      vllm_importance_sampling_cap=2.0, max_staleness=4, mismatch_metrics=metrics)


def row_inputs(tokens: int, samples: int, top: int, device: torch.device) -> dict[str, torch.Tensor]:
    g = torch.Generator(device="cpu").manual_seed(0)
    sampler_top = torch.log_softmax(torch.randn(tokens, top, generator=g) * 2, -1)
    trainer_top = sampler_top + 0.05 * torch.randn(tokens, top, generator=g)
    sampler = sampler_top[:, 0].clone()
    trainer = trainer_top[:, 0].clone()
    sample_index = torch.sort(torch.randint(0, samples, (tokens,), generator=g)).values
    adv = torch.randn(samples, generator=g)[sample_index]
    staleness = torch.randint(0, 5, (samples,), generator=g)
    cpu = dict(trainer=trainer, sampler=sampler, adv=adv, trainer_top=trainer_top, sampler_top=sampler_top,
               sample_index=sample_index, staleness=staleness)
    return {k: v.to(device) for k, v in cpu.items()}


def make_inputs(t: dict[str, torch.Tensor]) -> LossInputs:
    return LossInputs(
        logprobs=t["trainer"].clone().requires_grad_(), sampler_logprobs=t["sampler"], advantages=t["adv"],
        top_logprobs=t["trainer_top"].clone().requires_grad_(), sampler_top_logprobs=t["sampler_top"],
        sample_index=t["sample_index"], sample_staleness=t["staleness"],
    )


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_loss(t: dict[str, torch.Tensor], cfg: LossConfig, device: torch.device, iters: int, tokens: int) -> float:
    """Median ms of one forward and backward of the row's loss."""
    times = []
    for i in range(iters + 5):
        inputs = make_inputs(t)
        sync(device)
        start = time.perf_counter()
        loss, _ = grpo_loss(inputs, cfg, tokens)
        loss.backward()
        sync(device)
        if i >= 5:
            times.append((time.perf_counter() - start) * 1e3)
    return sorted(times)[len(times) // 2]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=12288)
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--top", type=int, default=8)
    parser.add_argument("--rows", type=int, default=16, help="rows (micro-batches) of a step, for finalize_metrics")
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--out", default=None)
    parser.add_argument("--smoke", action="store_true", help="small sizes and few repeats: checks the script")
    args = parser.parse_args()
    if args.smoke:
        args.tokens, args.samples, args.rows, args.iters = 512, 4, 2, 2
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    t = row_inputs(args.tokens, args.samples, args.top, device)
    report: dict[str, object] = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                                 "torch": torch.__version__, "tokens": args.tokens, "samples": args.samples,
                                 "top": args.top, "loss_ms": {}}
    for mode in MODES:
        report["loss_ms"][mode] = time_loss(t, config(mode), device, args.iters, args.tokens)  # type: ignore[index]
    report["loss_ms_default_without_metrics"] = time_loss(t, config("token_mask", metrics=False), device, args.iters,
                                                          args.tokens)
    parts = [grpo_loss(make_inputs(t), config("token_mask"), args.tokens)[1] for _ in range(args.rows)]
    times = []
    for _ in range(20):
        sync(device)
        start = time.perf_counter()
        finalize_metrics(parts)
        times.append((time.perf_counter() - start) * 1e3)
    report["finalize_ms_per_step"] = sorted(times)[len(times) // 2]
    report["parts_per_row"] = len(parts[0])
    default = report["loss_ms"]["token_mask"]  # type: ignore[index]
    report["metrics_ms_per_row"] = default - report["loss_ms_default_without_metrics"]  # type: ignore[operator]
    print(json.dumps(report, indent=2))
    if args.out:
        write_report(args.out, report)


if __name__ == "__main__":
    main()

"""``compile_mode`` numerics: bf16 eager and compiled layers against an fp32 reference on real tree rows.

Which ``compile_mode`` may be the default is a question of error, not of speed alone: the issue's rule
is "the fastest mode whose error against fp32 is no larger than eager bf16's". This script measures
that error. One training step (``--rows`` micro-batches of one planned step, the workload of
``benchmarks/trainer/fsdp_mfu.py``: Qwen3-1.7B shape with random weights, groups of 8 sharing prompts, top-8
sampler log-probs, tree rows of ``--budget`` tokens; the sampled tokens' sampler log-probs are
redrawn near the reference policy's own, so that the PPO clip, not the importance-sampling bounds,
decides which tokens train) runs through the trainer's own path
(``grpo_core.models.fsdp.shard_policy``, tree attention, ``row_logprobs``, ``grpo_loss``) in:

* ``reference``: fp32. fp32 weights and compute, TF32 off, eager, attention on the fp32 gather
  path (``varlen_emulated``: per segment, the same mask as every fused kernel);
* ``eager`` (twice: its attention backward sums in a nondeterministic order, so the two runs show
  the noise that any bf16 mode carries), ``pointwise`` and ``layers``: bf16 compute with fp32 master
  weights (FSDP2 mixed precision, as the trainer on a GPU), attention through ``--attention-backend``.

Each mode runs the step twice (the first compiles) and reports the second: the step's loss, every
trained token's log-prob and the full gradient, against the reference: |loss error|, max and mean
|log-prob error|, ||g − g_ref|| / ||g_ref|| and the relative error of the gradient norm. A mode is
"within eager" when none of its errors on every trained token's log-prob (mean) and on the whole gradient exceeds the larger of
the two eager runs' (``DECIDING``; the loss, the norm and the largest log-prob error are single draws
of rounding noise, reported beside them).

On one GPU (about 5 minutes; prints a table, writes the JSON)::

    python -m benchmarks.trainer.compile_numerics --out benchmarks/results/compile_numerics.json

``--smoke`` runs a tiny model on the CPU, fp32 candidates against an fp64 reference (checks the
script only; its numbers say nothing about bf16). On the CPU, ``layers`` may fail inside inductor's
dynamic-shape arithmetic (seen with torch 2.13); the failure is recorded as that mode's result.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import sys
import time

import torch


from benchmarks.trainer.fsdp_mfu import SHAPES, build_model, lengths, make_samples  # noqa: E402 - the MFU benchmark's workload

from grpo_core.config import AsyncGRPOConfig  # noqa: E402
from grpo_core.models.attention import tree as ta  # noqa: E402
from grpo_core.models.fsdp import FSDPSettings, full_value, shard_policy  # noqa: E402
from grpo_core.packing.collator import pack_row  # noqa: E402
from grpo_core.packing.planner import plan_step  # noqa: E402
from grpo_core.ranks import DistInfo, init_distributed  # noqa: E402
from grpo_core.training.forward import row_logprobs  # noqa: E402
from grpo_core.training.loss import LossConfig, LossInputs, grpo_loss  # noqa: E402
from grpo_core.training.perf import synchronize  # noqa: E402
from benchmarks.bench_io import write_report  # noqa: E402

CANDIDATES = (("eager", "none"), ("eager_repeat", "none"), ("pointwise", "pointwise"), ("layers", "layers"))
ERRORS = ("loss_abs", "logprob_max_abs", "logprob_mean_abs", "grad_rel", "grad_norm_rel")
DECIDING = ("logprob_mean_abs", "grad_rel")
"""Errors aggregated over many values (every trained token, every weight), which a mode's rounding moves
systematically; the others are single draws (one loss, one norm, one extreme), reported beside them."""


def plan_rows(args, device: torch.device):
    shape = "tiny" if args.smoke else args.model
    budget = 256 if args.smoke else args.budget
    samples = make_samples(8 * args.rows, 8, *lengths(args, budget), SHAPES[shape]["vocab_size"], seed=budget)
    plan = plan_step(samples, world_size=1, gradient_accumulation_steps=args.rows, token_budget=budget)
    rows = [pack_row(r).to(device) for r in plan.rows]
    return rows, sum(r.num_trained_tokens for r in plan.rows), plan.metrics()


def sample_near_the_policy(model, rows, seed: int = 0, spread: float = 0.2) -> None:
    """Give each trained token a sampler log-prob within ``spread`` (normal) of the reference model's own.

    The workload's sampler log-probs are drawn blind, far from a random model's (about -log V), so the
    importance-sampling bounds would drop every token and leave loss and gradient at zero. Drawn
    around the policy, the ratios spread over the PPO clip as in training, and both the clipped and the
    unclipped branches carry gradient."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for row in rows:
            logprobs = row_logprobs(model, row, 1.0).logprobs.float().cpu()
            noise = spread * torch.randn(logprobs.shape, generator=gen)
            row.sampler_logprobs = (logprobs + noise).clamp(max=0.0).to(row.sampler_logprobs.device)


def run_step(model, rows, num_tokens: int, chunk: int | None) -> tuple[float, torch.Tensor]:
    """The trainer's micro-batches of one step: summed loss, every trained token's log-prob (fp64, host)."""
    config = LossConfig.from_config(AsyncGRPOConfig())
    loss_sum, logprobs = 0.0, []
    for row in rows:
        head = row_logprobs(model, row, 1.0, top_ids=row.sampler_top_ids.clamp(min=0), chunk_size=chunk)
        inputs = LossInputs(logprobs=head.logprobs, sampler_logprobs=row.sampler_logprobs, advantages=row.advantages,
                            top_logprobs=head.top_logprobs, sampler_top_logprobs=row.sampler_top_logprobs,
                            top_valid=row.top_valid)
        loss, _ = grpo_loss(inputs, config, num_tokens)
        loss.backward()
        loss_sum += float(loss.detach())
        logprobs.append(head.logprobs.detach().double().cpu())
    return loss_sum, torch.cat(logprobs)


def run_mode(args, device, rows, num_tokens, name: str, compile_mode: str,
             reference: dict | None) -> tuple[dict, dict | None]:
    """One mode's step; its errors against ``reference``, or (``reference=None``) the reference's own tensors."""
    shape = "tiny" if args.smoke else args.model
    is_reference = reference is None
    if is_reference:
        ta.register_tree_attention("varlen_emulated")
    else:
        ta.register_tree_attention(args.attention_backend if device.type == "cuda" else "varlen_emulated", device,
                                   args.attention_kernel)
    model = build_model(shape, device)
    if is_reference and args.smoke:
        model = model.double()
    model.set_attn_implementation(ta.TREE_ATTENTION)
    bf16 = device.type == "cuda" and not is_reference
    shard_policy(model, FSDPSettings(bf16=bf16, activation_checkpointing=args.ac, compile=compile_mode), device)
    if is_reference:
        sample_near_the_policy(model, rows)  # every later mode sees these sampler log-probs
    model.train()
    times = []
    for _ in range(2):  # the first pass compiles (and warms the allocator); the second is measured
        model.zero_grad(set_to_none=True)
        synchronize(device)
        start = time.perf_counter()
        loss, logprobs = run_step(model, rows, num_tokens, args.chunk)
        synchronize(device)
        times.append(time.perf_counter() - start)
    grads = {n: full_value(p.grad).detach() for n, p in model.named_parameters() if p.grad is not None}
    result = {"mode": name, "compile_mode": compile_mode, "attention_backend": ta.active_backend(),
              "precision": ("fp64" if args.smoke else "fp32") if is_reference else ("bf16" if bf16 else "fp32"),
              "loss": loss, "step_s": times[1], "first_step_s": times[0]}
    if is_reference:
        result["grad_norm"] = math.sqrt(sum(float(g.double().pow(2).sum()) for g in grads.values()))
        kept = {"grads": {n: g.clone() for n, g in grads.items()}, "logprobs": logprobs, "loss": loss,
                "grad_norm": result["grad_norm"]}
    else:
        ref = reference
        diff2 = sum(float((g.double() - ref["grads"][n].double()).pow(2).sum()) for n, g in grads.items())
        norm = math.sqrt(sum(float(g.double().pow(2).sum()) for g in grads.values()))
        err = (logprobs - ref["logprobs"]).abs()
        result.update(grad_norm=norm, loss_abs=abs(loss - ref["loss"]), loss_rel=abs(loss - ref["loss"]) / max(abs(ref["loss"]), 1e-30),
                      logprob_max_abs=float(err.max()), logprob_mean_abs=float(err.mean()),
                      logprob_mean_abs_se=float(err.std() / math.sqrt(err.numel())),
                      grad_rel=math.sqrt(diff2) / max(ref["grad_norm"], 1e-30),
                      grad_norm_rel=abs(norm - ref["grad_norm"]) / max(ref["grad_norm"], 1e-30))
        kept = None
    del model, grads
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result, kept


def verdicts(results: list[dict]) -> dict:
    """Per compiled mode: each error over the larger of the two eager runs' (the eager envelope), and
    whether it is within eager on the ``DECIDING`` errors, with room for their own noise: the mean
    log-prob error may exceed eager's by two standard errors of the difference of two means (each
    the mean of |error| over the trained tokens); the gradient error by twice the gap between the two
    eager runs (the spread of the nondeterministic backward; zero where eager repeats exactly)."""
    eager = [r for r in results if r["compile_mode"] == "none" and "loss_abs" in r]
    if not eager:
        return {"eager_envelope": None, "modes": {}}
    envelope = {e: max(r[e] for r in eager) for e in ERRORS}
    eager_se = max(r["logprob_mean_abs_se"] for r in eager)
    grad_spread = max(r["grad_rel"] for r in eager) - min(r["grad_rel"] for r in eager)
    out = {}
    for r in results:
        if r["compile_mode"] == "none" or "loss_abs" not in r:
            continue
        ratios = {e: (r[e] / envelope[e] if envelope[e] > 0 else (0.0 if r[e] == 0 else math.inf)) for e in ERRORS}
        allowed = {"logprob_mean_abs": envelope["logprob_mean_abs"] + 2 * math.hypot(r["logprob_mean_abs_se"], eager_se),
                   "grad_rel": envelope["grad_rel"] + 2 * grad_spread}
        out[r["mode"]] = {"within_eager": all(r[e] <= allowed[e] for e in DECIDING), "allowed": allowed,
                          "error_over_eager": ratios}
    return {"eager_envelope": envelope, "modes": out}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="qwen3-1.7b")
    ap.add_argument("--budget", type=int, default=16384, help="token_budget of each tree row")
    ap.add_argument("--rows", type=int, default=2, help="micro-batches (rows) in the step")
    ap.add_argument("--ac", action=argparse.BooleanOptionalAction, default=True,
                    help="activation checkpointing in every mode (the fp32 reference needs it at 16k on one H200)")
    ap.add_argument("--chunk", type=int, default=None, help="logprob chunk size of the head (None: dense, the default)")
    ap.add_argument("--attention-backend", default="auto", help="tree attention of the bf16 modes (AsyncGRPOConfig names)")
    ap.add_argument("--attention-kernel", default=None, help="the kernels backend's Hub id or folder")
    ap.add_argument("--modes", default=",".join(n for n, _ in CANDIDATES), help="candidates to run, by name")
    ap.add_argument("--out", default="benchmarks/results/compile_numerics.json")
    ap.add_argument("--smoke", action="store_true", help="tiny model on the CPU: checks the script only")
    args = ap.parse_args()

    info = DistInfo.from_env()
    device = info.device() if not args.smoke else torch.device("cpu")
    init_distributed(info, device, timeout_s=1800)  # FSDP2 needs a group, even of one rank
    if device.type == "cuda":
        # The reference is fp32 in earnest: no TF32 in matmuls or convolutions.
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    rows, num_tokens, metrics = plan_rows(args, device)
    import transformers

    report = {"env": {"torch": torch.__version__, "transformers": transformers.__version__,
                      "python": platform.python_version(),
                      "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"},
              "model": "tiny" if args.smoke else args.model, "command": " ".join(sys.argv),
              "rows": len(rows), "forwarded_tokens": int(metrics["batch/forwarded_tokens_per_step"]),
              "trained_tokens": num_tokens, "packing_ratio": metrics["batch/packing_ratio"],
              "activation_checkpointing": args.ac, "logprob_chunk": args.chunk, "results": []}
    print(json.dumps({k: v for k, v in report.items() if k != "results"}), flush=True)

    ref_result, reference = run_mode(args, device, rows, num_tokens, "reference", "none", None)
    report["results"].append(ref_result)
    print(json.dumps(ref_result), flush=True)
    wanted = args.modes.split(",")
    for name, compile_mode in CANDIDATES:
        if name not in wanted:
            continue
        try:
            result, _ = run_mode(args, device, rows, num_tokens, name, compile_mode, reference)
        except Exception as exc:  # noqa: BLE001 - a compile failure is a result too
            result = {"mode": name, "compile_mode": compile_mode, "error": f"{type(exc).__name__}: {str(exc)[:400]}"}
        report["results"].append(result)
        print(json.dumps(result), flush=True)
    report["verdicts"] = verdicts(report["results"])

    print(f"\n{'mode':>13} {'precision':>9} {'attention':>16} {'loss err':>9} {'lp max':>8} {'lp mean':>9} "
          f"{'grad rel':>9} {'|g| rel':>9} {'step s':>7}")
    for r in report["results"]:
        if "error" in r:
            print(f"{r['mode']:>13} {r['error'][:90]}")
            continue
        e = lambda k: f"{r[k]:.2e}" if k in r else "-"  # noqa: E731
        print(f"{r['mode']:>13} {r['precision']:>9} {r['attention_backend']:>16} {e('loss_abs'):>9} "
              f"{e('logprob_max_abs'):>8} {e('logprob_mean_abs'):>9} {e('grad_rel'):>9} {e('grad_norm_rel'):>9} "
              f"{r['step_s']:7.2f}")
    for mode, v in report["verdicts"]["modes"].items():
        ratios = ", ".join(f"{e} {v['error_over_eager'][e]:.2f}" for e in ERRORS)
        print(f"{mode}: {'within' if v['within_eager'] else 'NOT within'} eager's errors on {' and '.join(DECIDING)} "
              f"(error / eager's: {ratios})")
    write_report(args.out, report)


if __name__ == "__main__":
    main()

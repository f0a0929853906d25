"""FSDP2 training step of a Qwen3-shaped policy on tree-packed rows: MFU, peak memory, weight-sync gathers.

Each configuration (token budget, activation checkpointing, pointwise compile) trains the same way
the trainer does: the policy is sharded by ``grpo_core.models.fsdp.shard_policy`` (bf16 compute,
fp32 master weights, fp32 gradient sums), every rank forwards its planned row of each micro-batch
through tree attention, the GRPO loss of ``grpo_core.training.loss`` is backpropagated, then gradients are
clipped and AdamW steps. Reported per configuration (medians over the timed steps):

* MFU on the forward+backward time base and on the full step (optimizer included), with the FLOP
  formula of ``grpo_core.training.perf`` over the rows actually planned, against the device's dense bf16 peak;
* forwarded tokens per second, and peak allocated device memory against ``token_budget``.

Then one full weight-sync gather: every parameter gathered with ``full_tensor()`` one decoder layer
at a time (what the sync does before each broadcast), timed in fp32, cast to bf16, and copied to
host memory; with the largest full layer held at once.

One GPU or many (same script under torchrun)::

    python -m benchmarks.trainer.fsdp_mfu --out benchmarks/results/fsdp_mfu.json
    torchrun --standalone --nproc-per-node 8 -m benchmarks.trainer.fsdp_mfu --out ...

``--smoke`` runs a tiny model on the CPU (gloo, fp32): checks the script, times nothing real.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import platform
import statistics
import sys
import time

import numpy as np
import torch
import torch.distributed as dist


from grpo_core.config import AsyncGRPOConfig  # noqa: E402
from grpo_core.models.attention import tree as ta  # noqa: E402
from grpo_core.models.fsdp import (FSDPSettings, before_micro_batch, iter_full_layers,  # noqa: E402
                                   resolve_keep_weights, shard_policy)
from grpo_core.models.head.lm_head import vocab_size  # noqa: E402
from grpo_core.models.head.reference import token_logprobs  # noqa: E402
from grpo_core.packing.collator import pack_row  # noqa: E402
from grpo_core.packing.planner import plan_step  # noqa: E402
from grpo_core.ranks import DistInfo, init_distributed  # noqa: E402
from grpo_core.rollout.types import RolloutSample  # noqa: E402
from grpo_core.training.forward import row_logprobs  # noqa: E402
from grpo_core.training.loss import LossConfig, LossInputs, finalize_metrics, grpo_loss  # noqa: E402
from grpo_core.training.perf import ModelFlops, device_peak_flops, synchronize  # noqa: E402
from benchmarks.bench_io import percent, print_table, record, write_report  # noqa: E402

SHAPES = {  # Qwen3 dense shapes (config.json of the public checkpoints)
    "qwen3-1.7b": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, vocab_size=512, tie_word_embeddings=True),
}


def make_samples(n_groups: int, group: int, prompt: tuple[int, int], completion: tuple[int, int], vocab: int,
                 seed: int) -> list[RolloutSample]:
    """GRPO-like groups: ``group`` rollouts share a prompt; completions are trained, with top-8 log-probs."""
    rng = np.random.default_rng(seed)
    samples = []
    for g in range(n_groups):
        p = int(rng.integers(*prompt))
        prompt_ids = rng.integers(0, vocab, p)
        for r in range(group):
            c = int(rng.integers(*completion))
            tokens = np.concatenate([prompt_ids, rng.integers(0, vocab, c)]).astype(np.int32)
            mask = np.zeros(len(tokens), dtype=bool)
            mask[p:] = True
            logprobs = np.where(mask, rng.uniform(-3.0, -0.05, len(tokens)), 0.0).astype(np.float32)
            samples.append(RolloutSample(
                token_ids=tokens, completion_mask=mask, sampler_logprobs=logprobs,
                advantage=float(rng.normal()), reward=0.0, group_id=g, row_index=g, epoch=0,
                rollout_id=f"{g}-{r}", policy_version=0,
                sampler_top_ids=rng.integers(0, vocab, (c, 8)).astype(np.int32),
                sampler_top_logprobs=np.sort(rng.uniform(-8.0, -0.05, (c, 8)), axis=1)[:, ::-1].astype(np.float32),
            ))
    return samples


def build_model(shape: str, device: torch.device):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(**SHAPES[shape], rope_theta=1_000_000.0, max_position_embeddings=131072)
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen3ForCausalLM(config)  # fp32 master weights, as load_policy gives the trainer
    model.config.use_cache = False
    return model


def lengths(args, budget: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """Prompt and completion length ranges: at 16k, prompts 512-2048 and completions 512-4096, scaled
    with the budget so that every budget packs rows of the same make-up."""
    if args.smoke:
        return (8, 40), (4, 60)
    scale = budget / 16384
    return (int(512 * scale), int(2048 * scale)), (int(512 * scale), int(4096 * scale))


def row_backward(model, row, num_tokens: int, loss_config: LossConfig, chunk: int | str | None,
                 fused: bool | None = None) -> dict:
    """The trainer's micro-batch: tree-attention forward, the trainer's log-prob head (``row_logprobs``;
    ``chunk`` is ``AsyncGRPOConfig.logprob_chunk_size``; ``fused=False``: the reference head, else the trainer's), GRPO loss on
    trained tokens, backward. Returns the loss's metric parts (none for a row without trained tokens)."""
    chunk_size = AsyncGRPOConfig(logprob_chunk_size=chunk).resolved_logprob_chunk_size(row.num_trained, vocab_size(model))
    head = row_logprobs(model, row, 1.0, top_ids=row.sampler_top_ids.clamp(min=0), chunk_size=chunk_size, fused=fused)
    if row.num_trained == 0:
        head.anchor.backward()
        return {}
    inputs = LossInputs(logprobs=head.logprobs, sampler_logprobs=row.sampler_logprobs, advantages=row.advantages,
                        top_logprobs=head.top_logprobs, sampler_top_logprobs=row.sampler_top_logprobs,
                        top_valid=row.top_valid, sample_index=row.sample_index,
                        sample_staleness=row.sample_staleness)  # as the trainer: per-sample weights and metrics
    loss, parts = grpo_loss(inputs, loss_config, num_tokens)
    loss.backward()
    return parts


def max_over_ranks(value: float, device: torch.device) -> float:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def run_config(args, shape, device, info, budget, ac, compiled, chunk, reshard, attention, plan="auto",
               fused=None, keep_weights: bool | None = None) -> dict:
    """One config's steps; ``keep_weights`` None: what the default config resolves to here
    (``AsyncGRPOConfig.fsdp_keep_weights_between_micro_batches="auto"``)."""
    world = dist.get_world_size()
    if keep_weights is None:
        keep_weights = resolve_keep_weights("auto", world, cpu_offload=False)
    cpu_name = "split_emulated" if plan == "split" else "varlen_emulated"
    backend = ta.register_tree_attention(attention if device.type == "cuda" else cpu_name, device,
                                         args.attention_kernel, plan)
    model = build_model(shape, device)
    ta.check_supported_architecture(model)
    model.set_attn_implementation(ta.TREE_ATTENTION)
    flops_model = ModelFlops.from_model(model)
    settings = FSDPSettings(bf16=device.type == "cuda", activation_checkpointing=ac, compile=compiled,
                            reshard_after_forward=reshard, keep_weights_between_micro_batches=keep_weights)
    shard_policy(model, settings, device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    vocab = SHAPES[shape]["vocab_size"]
    prompt, completion = lengths(args, budget)
    needed_groups = 8 * world * args.rows_per_rank  # plenty: the plan takes what fits
    samples = make_samples(needed_groups, 8, prompt, completion, vocab, seed=budget)
    t0 = time.perf_counter()
    # --same-rows: every rank forwards the rows a one-rank plan makes, so a scaling comparison sees the
    # same work per GPU (a plan for more ranks draws a different mix of rows from the sample set).
    plan_world = 1 if args.same_rows else world
    plan = plan_step(samples, world_size=plan_world, gradient_accumulation_steps=args.rows_per_rank, token_budget=budget)
    plan_s = time.perf_counter() - t0
    rows = [pack_row(r).to(device) for r in plan.rows_for_rank(0 if args.same_rows else info.rank)]
    all_rows = plan.rows * (world // plan_world)
    num_trained = sum(r.num_trained_tokens for r in all_rows)
    step_flops = flops_model.rows_flops(all_rows)
    metrics = plan.metrics()
    if args.same_rows:
        metrics["batch/forwarded_tokens_per_step"] *= world
    # The default objective (AsyncGRPOConfig's defaults), with its mismatch/* metrics; --mismatch-metrics both
    # alternates steps with and without them, so that drift over the run falls on both alike.
    with_metrics = LossConfig.from_config(AsyncGRPOConfig())
    variants = {"on": [True], "off": [False], "both": [True, False]}[args.mismatch_metrics]
    times_fb, times_step = [], []
    times_by_variant: dict[bool, list[float]] = {v: [] for v in variants}
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for step in range(args.warmup * len(variants) + args.steps * len(variants)):
        metrics_on = variants[step % len(variants)]
        loss_config = dataclasses.replace(with_metrics, mismatch_metrics=metrics_on)
        model.train()
        synchronize(device)
        start = time.perf_counter()
        parts = []
        for i, row in enumerate(rows):
            before_micro_batch(model, i == len(rows) - 1, settings.keep_weights_between_micro_batches)  # as the trainer
            parts.append(row_backward(model, row, num_trained, loss_config, chunk, fused))
        synchronize(device)
        fb = time.perf_counter() - start
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        finalize_metrics([p for p in parts if p])  # the step's one host copy of its metrics, as the trainer's
        synchronize(device)
        full = time.perf_counter() - start
        if step >= args.warmup * len(variants):
            times_by_variant[metrics_on].append(max_over_ranks(full, device))
            if metrics_on == variants[0]:
                times_fb.append(max_over_ranks(fb, device))
                times_step.append(times_by_variant[metrics_on][-1])
    peak = device_peak_flops(device, settings.bf16)
    fb, st = statistics.median(times_fb), statistics.median(times_step)
    result = {
        "token_budget": budget, "activation_checkpointing": ac, "compile": compiled, "attention_backend": backend,
        "nested_graph_breaks": settings.nested_graph_breaks if compiled == "layers" else None,
        "reshard_after_forward": reshard, "logprob_chunk": chunk, "logprob_head": "reference" if fused is False else "default",
        # what ran: without FSDP2 (one fp32 rank) there are no gathered weights to keep
        "keep_weights_between_micro_batches": settings.keeps_weights(world),
        "world_size": world, "rows_per_rank": len(rows),
        "same_rows": args.same_rows,
        "forwarded_tokens_per_step": int(metrics["batch/forwarded_tokens_per_step"]),
        "trained_tokens_per_step": num_trained, "row_fill_frac": metrics["batch/row_fill_frac"],
        "packing_ratio": metrics["batch/packing_ratio"], "samples_per_row": metrics["batch/samples_per_row"],
        "plan_s": plan_s, "step_flops": step_flops, "fwd_bwd_s": fb, "step_s": st,
        "fwd_bwd_times_s": times_fb, "step_times_s": times_step,
        "tokens_per_s_fwd_bwd": metrics["batch/forwarded_tokens_per_step"] / fb,
        "tflops_per_device_fwd_bwd": step_flops / fb / world / 1e12,
        "mfu_fwd_bwd": step_flops / (fb * world * peak) if peak else None,
        "mfu_wall_clock": step_flops / (st * world * peak) if peak else None,
        "peak_allocated_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
        "peak_reserved_gib": torch.cuda.max_memory_reserved(device) / 2**30 if device.type == "cuda" else None,
    }
    if args.mismatch_metrics == "both":
        without = statistics.median(times_by_variant[False])
        result.update({"mismatch_metrics": "both", "step_s_without_mismatch_metrics": without,
                       "step_times_s_without_mismatch_metrics": times_by_variant[False],
                       "mismatch_metrics_step_cost": st / without - 1.0})
    else:
        result["mismatch_metrics"] = args.mismatch_metrics
    if args.gather:
        result["weight_gather"] = time_gathers(model, device)
    del model, optimizer, rows
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def compile_check(args, shape, device, info, budget: int, mode: str) -> dict:
    """Loss and gradients of one step's first row: eager twice (the kernels' own noise) vs compiled."""
    samples = make_samples(8, 8, *lengths(args, budget), SHAPES[shape]["vocab_size"], seed=budget)
    plan = plan_step(samples, world_size=dist.get_world_size(), gradient_accumulation_steps=1, token_budget=budget)
    row = pack_row(plan.rows_for_rank(info.rank)[0]).to(device)
    trained = sum(r.num_trained_tokens for r in plan.rows)
    runs = []
    for compiled in ("none", "none", mode):
        model = build_model(shape, device)
        model.set_attn_implementation(ta.TREE_ATTENTION)
        shard_policy(model, FSDPSettings(bf16=device.type == "cuda", compile=compiled), device)
        model.train()
        logits = model(**row.model_inputs(), logits_to_keep=row.logit_index).logits[0]
        logprobs, _ = token_logprobs(logits, row.target_ids, 1.0)
        loss = -(logprobs * row.advantages).sum() / trained
        loss.backward()
        grads = [p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad for p in model.parameters()]
        runs.append((float(loss), [g.detach().float().clone() for g in grads], logprobs.detach().float()))
        del model, logits, loss, grads
        gc.collect()

    def rel(a, b):
        num = sum(float((x - y).pow(2).sum()) for x, y in zip(a, b)) ** 0.5
        return num / sum(float(x.pow(2).sum()) for x in a) ** 0.5

    (l0, g0, p0), (l1, g1, p1), (l2, g2, p2) = runs
    return {"mode": mode, "row_tokens": row.num_tokens, "loss": [l0, l1, l2],
            "eager_vs_eager": {"loss_abs": abs(l0 - l1), "grad_rel": rel(g0, g1),
                               "logprob_max_abs": float((p0 - p1).abs().max())},
            "eager_vs_compiled": {"loss_abs": abs(l0 - l2), "grad_rel": rel(g0, g2),
                                  "logprob_max_abs": float((p0 - p2).abs().max())}}


def time_gathers(model, device) -> dict:
    """One full sync's gathers, a layer at a time: fp32 as sharded, bf16 as sent to a bf16 server, to host."""
    out = {}
    full_bytes = sum(p.numel() * 4 for p in model.parameters())
    for label, dtype, to in (("fp32", None, None), ("bf16", torch.bfloat16, None), ("bf16_to_host", torch.bfloat16, "cpu")):
        runs, largest = [], 0
        for _ in range(3):
            synchronize(device)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
            start = time.perf_counter()
            for group in iter_full_layers(model, dtype=dtype, device=to):
                largest = max(largest, sum(t.numel() * t.element_size() for _, t in group))
                del group
            synchronize(device)
            runs.append(max_over_ranks(time.perf_counter() - start, device))
            extra = torch.cuda.max_memory_allocated(device) - base if device.type == "cuda" else None
        out[label] = {"seconds": statistics.median(runs), "runs_s": runs, "largest_group_bytes": largest,
                      "peak_extra_device_bytes": extra}
    out["full_model_fp32_bytes"] = full_bytes
    return out


def feed_cost(world: int, budget: int, rows_per_rank: int) -> dict:
    """What ``StepFeed`` ships per step: pickled bytes, pickle/unpickle and trie-rebuild time (CPU only)."""
    import pickle

    from grpo_core.packing.planner import Planner
    from grpo_core.training.collector import StepBatch
    from grpo_core.training.distributed import rebuild_batch, step_message

    class Args:
        smoke = False

    samples = make_samples(8 * world * rows_per_rank, 8, *lengths(Args, budget), 151936, seed=budget)
    planner = Planner(world_size=world, gradient_accumulation_steps=rows_per_rank, token_budget=budget)
    taken = []
    for sample in samples:
        if not planner.offer(sample):
            break
        taken.append(sample)
    plan = planner.finish()
    batch = StepBatch(plan=plan, samples=taken, reports=[], stale_dropped=0, staleness=[0] * len(taken), wait_s=0.0)
    t0 = time.perf_counter()
    blob = pickle.dumps(step_message(batch, 0), protocol=pickle.HIGHEST_PROTOCOL)
    t1 = time.perf_counter()
    msg = pickle.loads(blob)
    t2 = time.perf_counter()
    rebuilt = rebuild_batch(msg, planner)
    t3 = time.perf_counter()
    assert [len(r.samples) for r in rebuilt.plan.rows] == [len(r.samples) for r in plan.rows]
    return {"world_size": world, "token_budget": budget, "rows_per_rank": rows_per_rank, "samples": len(taken),
            "raw_tokens": int(sum(len(s.token_ids) for s in taken)),
            "forwarded_tokens": int(sum(r.num_unique_tokens for r in plan.rows)),
            "message_bytes": len(blob), "pickle_s": t1 - t0, "unpickle_s": t2 - t1, "rebuild_s": t3 - t2}


def keep_weights_comparison(results: list[dict]) -> list[dict]:
    """Pairs of configs that differ only in ``keep_weights_between_micro_batches`` (``:keepmb``/``:freemb``): the
    kept config's fwd+bwd time and peak memory over the freed one's."""
    varied = ("keep_weights_between_micro_batches", "fwd_bwd_s", "step_s", "fwd_bwd_times_s", "step_times_s",
              "tokens_per_s_fwd_bwd", "tflops_per_device_fwd_bwd", "mfu_fwd_bwd", "mfu_wall_clock", "plan_s",
              "peak_allocated_gib", "peak_reserved_gib", "weight_gather", "mismatch_metrics_step_cost",
              "step_s_without_mismatch_metrics", "step_times_s_without_mismatch_metrics")

    def key(r: dict) -> tuple:
        return tuple(sorted((k, repr(v)) for k, v in r.items() if k not in varied))

    ok = [r for r in results if "error" not in r]
    out = []
    for kept in (r for r in ok if r.get("keep_weights_between_micro_batches")):
        freed = next((r for r in ok if r.get("keep_weights_between_micro_batches") is False and key(r) == key(kept)), None)
        if freed:
            peak = (kept["peak_allocated_gib"] / freed["peak_allocated_gib"]) if freed.get("peak_allocated_gib") else None
            out.append({"token_budget": kept["token_budget"], "fwd_bwd_ratio": kept["fwd_bwd_s"] / freed["fwd_bwd_s"],
                        "peak_ratio": peak, "kept_peak_gib": kept.get("peak_allocated_gib"),
                        "freed_peak_gib": freed.get("peak_allocated_gib")})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="qwen3-1.7b")
    ap.add_argument("--configs", default="16384:noac,16384:ac,32768:ac,65536:ac",
                    help="budget:ac|noac[:pointwise|:layers][:keep][:freemb|:keepmb][:chunkN|:chunkauto][:attn=NAME]"
                         "[:plan=NAME][:reference], comma-separated (keep: no reshard after forward; freemb/keepmb: "
                         "free the gathered weights after each micro-batch's backward, or keep them to the next "
                         "(AsyncGRPOConfig.fsdp_keep_weights_between_micro_batches; neither: its auto); chunk: "
                         "AsyncGRPOConfig.logprob_chunk_size; reference: the reference log-prob head, not the fused one; "
                         "attn: AsyncGRPOConfig.attention_backend, else --attention-backend; plan: "
                         "AsyncGRPOConfig.tree_attention_plan, else auto)")
    ap.add_argument("--attention-backend", default="auto", help="tree attention backend (AsyncGRPOConfig names)")
    ap.add_argument("--attention-kernel", default=None, help="the kernels backend's Hub id or local folder")
    ap.add_argument("--rows-per-rank", type=int, default=4, help="micro-batches per step")
    ap.add_argument("--same-rows", action="store_true", help="every rank forwards the rows of a one-rank plan "
                    "(same work per GPU at any world size, for scaling figures)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--gather", action="store_true", help="time one full weight-sync gather after the first config")
    ap.add_argument("--check-compile", default="", help="pointwise|layers: compare one row's loss and "
                    "gradients with eager first")
    ap.add_argument("--mismatch-metrics", choices=("on", "off", "both"), default="on",
                    help="the loss's mismatch/* metrics (LossConfig.mismatch_metrics; the trainer computes them): "
                         "both alternates steps with and without them and reports the step's cost of them")
    ap.add_argument("--out", default="benchmarks/results/fsdp_mfu.json")
    ap.add_argument("--smoke", action="store_true", help="tiny model on the CPU: checks the script only")
    ap.add_argument("--feed-cost", type=int, default=0, metavar="WORLD",
                    help="only measure the step broadcast's payload for WORLD ranks (CPU, no model)")
    args = ap.parse_args()
    if args.feed_cost:
        budget = int(args.configs.split(",")[0].split(":")[0])
        print(json.dumps(feed_cost(args.feed_cost, budget, args.rows_per_rank)))
        return

    info = DistInfo.from_env()
    device = info.device() if not args.smoke else torch.device("cpu")
    init_distributed(info, device, timeout_s=1800)
    shape = "tiny" if args.smoke else args.model
    backend = ta.register_tree_attention(args.attention_backend if device.type == "cuda" else "varlen_emulated", device,
                                         args.attention_kernel)
    import transformers

    report = {
        "env": {"torch": torch.__version__, "transformers": transformers.__version__,
                "python": platform.python_version(), "world_size": dist.get_world_size(),
                "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                "peak_bf16_flops": device_peak_flops(device, True), "tree_attention_backend": backend},
        "model": shape, "command": " ".join(sys.argv), "results": [],
    }
    if info.rank == 0:
        print(json.dumps(report["env"]), flush=True)
    if args.check_compile:
        report["compile_check"] = compile_check(args, shape, device, info, 16384 if not args.smoke else 256,
                                                args.check_compile)
        if info.rank == 0:
            print("compile check", json.dumps(report["compile_check"]), flush=True)
    gather = args.gather
    for spec in args.configs.split(","):
        parts = spec.split(":")
        budget = int(parts[0]) if not args.smoke else 256
        ac = parts[1] == "ac"
        compiled = next((p for p in parts[2:] if p in ("pointwise", "layers")), "none")
        reshard = "keep" not in parts[2:]
        keep_weights = True if "keepmb" in parts[2:] else False if "freemb" in parts[2:] else None
        chunk = next((p[5:] if p == "chunkauto" else int(p[5:]) for p in parts[2:] if p.startswith("chunk")), None)
        attention = next((p[5:] for p in parts[2:] if p.startswith("attn=")), args.attention_backend)
        plan = next((p[5:] for p in parts[2:] if p.startswith("plan=")), "auto")
        args.gather = gather and not any("weight_gather" in r for r in report["results"])
        try:
            result = run_config(args, shape, device, info, budget, ac, compiled, chunk, reshard, attention, plan,
                                False if "reference" in parts[2:] else None, keep_weights)
        except Exception as exc:  # noqa: BLE001 - an OOM or a compile failure is a result too
            result = {"token_budget": budget, "activation_checkpointing": ac, "compile": compiled,
                      "attention_backend": attention, "reshard_after_forward": reshard, "logprob_chunk": chunk,
                      "error": f"{type(exc).__name__}: {str(exc)[:300]}"}
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
        record(report, result, args.out, is_main=info.rank == 0)
    kept = keep_weights_comparison(report["results"])
    if kept and info.rank == 0:
        report["keep_weights_vs_free"] = kept
        write_report(args.out, report)
    if info.rank == 0:
        print_table(report["results"], f"{'budget':>7} {'AC':>3} {'compile':>9} {'attention':>16} {'reshard':>7} "
                    f"{'chunk':>5} {'tok/s':>8} {'MFU fb':>7} {'MFU step':>8} {'peak GiB':>8}",
                    lambda r: f"{r['token_budget']:>7} {int(r['activation_checkpointing']):>3} {r['compile']:>9} "
                              f"{r['attention_backend']:>16} {int(r['reshard_after_forward']):>7} "
                              f"{str(r['logprob_chunk']):>5} {r['tokens_per_s_fwd_bwd']:8.0f} {percent(r['mfu_fwd_bwd'])} "
                              f"{percent(r['mfu_wall_clock']):>8} {r['peak_allocated_gib'] or 0:8.1f}",
                    lambda r: f"{r['token_budget']:>7} {r['activation_checkpointing']!s:>3}")
        for r in report["results"]:
            if "mismatch_metrics_step_cost" in r:
                print(f"budget {r['token_budget']}: the step with the mismatch/* metrics ÷ without = "
                      f"{1 + r['mismatch_metrics_step_cost']:.4f} (median of {args.steps} steps each, alternated)")
        for k in kept:
            print(f"budget {k['token_budget']}: weights kept between micro-batches ÷ freed after each: fwd+bwd time "
                  f"{k['fwd_bwd_ratio']:.4f}, peak memory {k['peak_ratio'] or float('nan'):.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

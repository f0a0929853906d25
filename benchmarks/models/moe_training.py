"""Mixture-of-experts training step with the trainer's default config: MFU on active parameters, tree vs flat.

Shapes (random weights, reduced depth; widths of the public configs):

* ``qwen3-30b-a3b``: Qwen3-MoE, hidden 2048, 32 query / 4 key-value heads of 128, 128 experts of width
  768, 8 per token (renormalised), vocabulary 151936, untied head; ``--layers`` of its 48 layers;
* ``qwen3.5-moe``: Qwen3.5-MoE as transformers' ``Qwen3_5MoeTextConfig`` defaults it (hidden 2048, 256
  experts of width 512 and a shared expert of 512, 8 per token, Gated DeltaNet layers with 16 key / 32
  value heads of 128 and every fourth layer full attention with 16 / 2 heads of 256, vocabulary 248320);
  its Gated DeltaNet backward needs flash-linear-attention with tilelang (or Triton >= 3.7.1) on Hopper,
  else the trainer's PyTorch reference runs (``gdn_backend`` in the report);
* ``tiny`` / ``tiny-hybrid`` with ``--smoke``: CPU, fp32, checks the script only.

The model is built and run as the trainer runs it (``AsyncGRPOConfig()`` defaults on CUDA): fp32 master
weights sharded by FSDP2 per decoder layer with bf16 compute, decoder layers compiled
(``compile_mode="auto"``), tree attention with the ``auto`` backend, experts as grouped GEMMs
(``grpo_core.models.moe.experts``), the routers replaying the samples' routes (random, uniform over the
experts, as a balanced router's; ``--no-replay``: the routers route), the log-prob head and GRPO loss of
the trainer, then AdamW. Per configuration and packing mode: medians over ``--steps`` timed steps.

Workloads: ``mfu`` (fsdp_mfu.py's: groups of 8, prompts 512-2048, completions 512-4096 at 16k rows, tree
rows only) and ``ratio~3.4`` (tree_packing.py's: groups of 8, prompts 2048-2816, completions 128-1024),
planned flat and as trees at the same ``token_budget``. FLOPs count active parameters
(``grpo_core.perf.ModelFlops``): the FLOP-ideal speed-up is flat FLOPs over tree FLOPs, and
``speedup_over_flop_ideal`` how much of it the tree rows reach.

    python3 -m benchmarks.models.moe_training --shape qwen3-30b-a3b --layers 8 --out $OUT/moe_qwen3_30b_a3b.json
    python3 -m benchmarks.models.moe_training --smoke --out /tmp/moe_smoke.json
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import os
import platform
import statistics
import sys
import time

import numpy as np
import torch


from grpo_core.config import AsyncGRPOConfig  # noqa: E402
from grpo_core.models.attention import tree as ta  # noqa: E402
from grpo_core.models.attention.gated_delta import active_gdn_backend, fla_kernel  # noqa: E402
from grpo_core.models.attention.short_conv import active_conv_backend  # noqa: E402
from grpo_core.models.attention.hybrid import gated_delta_layers, head_sizes  # noqa: E402
from grpo_core.models.fsdp import FSDPSettings, before_micro_batch, needs_fsdp, shard_policy  # noqa: E402
from grpo_core.models import grad_accumulation  # noqa: E402
from grpo_core.models.moe.experts import active_expert_params, use_grouped_experts  # noqa: E402
from grpo_core.models.moe.policy import MoEPolicy  # noqa: E402
from grpo_core.packing.collator import pack_row  # noqa: E402
from grpo_core.packing.planner import plan_step  # noqa: E402
from grpo_core.ranks import DistInfo, init_distributed  # noqa: E402
from grpo_core.training.forward import row_logprobs  # noqa: E402
from grpo_core.training.loss import LossConfig, LossInputs, grpo_loss  # noqa: E402
from grpo_core.training.perf import ModelFlops, device_peak_flops, synchronize  # noqa: E402
from benchmarks import profiling  # noqa: E402
from benchmarks.bench_io import percent, print_table, record, write_report  # noqa: E402
from benchmarks.trainer import fsdp_mfu  # noqa: E402
from benchmarks.packing import tree_packing  # noqa: E402

SHAPES = {
    "qwen3-30b-a3b": ("qwen3_moe", dict(hidden_size=2048, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                                        num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
                                        norm_topk_prob=True, vocab_size=151936, tie_word_embeddings=False)),
    "qwen3.5-moe": ("qwen3_5_moe", {}),  # Qwen3_5MoeTextConfig's defaults
    "tiny": ("qwen3_moe", dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8,
                               num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True, vocab_size=512)),
    "tiny-hybrid": ("qwen3_5_moe", dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                        shared_expert_intermediate_size=32, linear_num_key_heads=2,
                                        linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                                        vocab_size=512)),
}


def build_model(shape: str, layers: int, device: torch.device) -> torch.nn.Module:
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig, Qwen3MoeConfig, Qwen3MoeForCausalLM

    arch, sizes = SHAPES[shape]
    common = dict(num_hidden_layers=layers, max_position_embeddings=131072, rope_parameters={"rope_type": "default",
                                                                                              "rope_theta": 1e6})
    torch.manual_seed(0)
    with torch.device(device):
        if arch == "qwen3_moe":
            model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**sizes, **common))
        else:  # every fourth layer full attention, the rest Gated DeltaNet, as the defaults lay out 40
            kinds = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)]
            model = Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**sizes, **common, layer_types=kinds))
    model.config.use_cache = False
    return model


def random_routes(rng: np.random.Generator, tokens: int, layers: int, experts: int, k: int) -> np.ndarray:
    """[tokens - 1, layers, k] distinct experts per position, uniform: a balanced router's load."""
    out = np.empty((max(tokens - 1, 0), layers, k), dtype=np.uint8 if experts <= 256 else np.uint16)
    for start in range(0, len(out), 4096):  # a chunk of scores at a time: [tokens, layers, experts] is large
        scores = rng.random((len(out[start : start + 4096]), layers, experts), dtype=np.float32)
        out[start : start + 4096] = np.argpartition(scores, k, axis=-1)[..., :k]
    return out


def with_routes(samples, model, seed: int):
    config = model.config
    if not getattr(config, "num_experts", None):  # a dense model: nothing to replay
        return samples
    rng = np.random.default_rng(seed)
    for s in samples:
        s.routed_experts = random_routes(rng, len(s.token_ids), config.num_hidden_layers, config.num_experts,
                                         config.num_experts_per_tok)
    return samples


def workload_samples(name: str, args, vocab: int, budget: int, world: int):
    if name == "mfu":
        prompt, completion = fsdp_mfu.lengths(args, budget)
        return fsdp_mfu.make_samples(8 * world * args.rows_per_rank, 8, prompt, completion, vocab, seed=budget)
    workloads = tree_packing.SMOKE_WORKLOADS if args.smoke else tree_packing.WORKLOADS
    (w,) = [w for w in workloads if w.name == name] or [workloads[-1]]
    return tree_packing.make_samples(w, vocab, seed=101)


def row_backward(model, row, num_trained: int, loss_config: LossConfig) -> None:
    """The trainer's micro-batch (``row_logprobs`` with the default head, GRPO loss, backward)."""
    top_ids = row.sampler_top_ids.clamp(min=0) if row.sampler_top_ids is not None else None
    head = row_logprobs(model, row, 1.0, top_ids=top_ids)
    if row.num_trained == 0:
        head.anchor.backward()
        return
    inputs = LossInputs(logprobs=head.logprobs, sampler_logprobs=row.sampler_logprobs, advantages=row.advantages,
                        top_logprobs=head.top_logprobs, sampler_top_logprobs=row.sampler_top_logprobs,
                        top_valid=row.top_valid, sample_index=row.sample_index,
                        sample_staleness=row.sample_staleness)  # as the trainer: per-sample weights and metrics
    grpo_loss(inputs, loss_config, num_trained)[0].backward()


def weight_gathers(settings: FSDPSettings, keep_weights: bool, sharded: bool) -> str | None:
    """How often a step gathers each layer's weights (``qwen35_speed.WEIGHT_GATHERS``' names); None without FSDP2."""
    if not sharded:
        return None
    if keep_weights:
        return "per_micro_batch" if settings.reshard_after_forward else "per_step"
    return "per_pass" if settings.reshard_after_forward else "per_pass_kept_to_backward"


def rows_backward(model, moe, rows, num_trained: int, loss_config: LossConfig, keep_weights: bool = False) -> None:
    """Forward and backward over every row of a step, with the expert routes replayed where the model has them;
    ``keep_weights``: FSDPSettings.keep_weights_between_micro_batches."""
    for i, row in enumerate(rows):
        before_micro_batch(model, i == len(rows) - 1, keep_weights)  # as the trainer's step
        if moe is not None:
            moe.before_forward(row.routes)
        row_backward(model, row, num_trained, loss_config)
        if moe is not None:
            moe.after_backward()


def time_rows(model, moe, rows, num_trained: int, optimizer, args, device,
              keep_weights: bool = False) -> tuple[list[float], list[float]]:
    loss_config = LossConfig.from_config(AsyncGRPOConfig())
    times_fb, times_step = [], []
    for step in range(args.warmup + args.steps):
        model.train()
        synchronize(device)
        start = time.perf_counter()
        rows_backward(model, moe, rows, num_trained, loss_config, keep_weights)
        synchronize(device)
        fb = time.perf_counter() - start
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        synchronize(device)
        if step >= args.warmup:
            times_fb.append(fsdp_mfu.max_over_ranks(fb, device))
            times_step.append(fsdp_mfu.max_over_ranks(time.perf_counter() - start, device))
    return times_fb, times_step


def gdn_backend_label(model: torch.nn.Module) -> str | None:
    """The delta-rule backend of the model's Gated DeltaNet layers (``fla/<kernels>`` for fla), None without any."""
    layers = gated_delta_layers(model)
    if not layers:
        return None
    name = active_gdn_backend().name
    return f"fla/{fla_kernel(*head_sizes(layers[0]))}" if name == "fla" else name


def gdn_conv_label(model: torch.nn.Module) -> str | None:
    """The short convolution's backend of the model's Gated DeltaNet layers (``fla`` or ``torch``), None without any."""
    return active_conv_backend().name if gated_delta_layers(model) else None


PROFILE_TOP = 30
"""Kernels listed by name in a ``--profile``'s record (the rest are summed by kind)."""


def profile_step(step, optimizer, break_sites, label: str) -> dict:
    """``--profile``'s record of one ``step()`` (``profiling.profile_call`` with the host waits' sites), then the
    misaligned matmuls of one more, and the graph breaks of the shape's compiled layers with their lines
    (``break_sites``, collected while they compiled); printed under ``label``. Gradients are cleared after each."""
    profile = profiling.profile_call(step, top=PROFILE_TOP, wait_sites=True)
    optimizer.zero_grad(set_to_none=True)
    gc.collect()
    torch.cuda.empty_cache()  # the profiler's step leaves cached blocks that a second step on 80 GB could not use
    try:
        profile["misaligned_matmuls"] = profiling.misaligned_matmuls(step)
    except Exception as exc:  # noqa: BLE001 - a diagnostic: its failure is recorded, the figures stand
        profile["misaligned_matmuls"] = f"{type(exc).__name__}: {str(exc)[:200]}"
    optimizer.zero_grad(set_to_none=True)
    breaks = torch._dynamo.utils.counters["graph_break"]
    profile["graph_breaks"] = {"total": sum(breaks.values()),
                               "unique_graphs": torch._dynamo.utils.counters["stats"]["unique_graphs"],
                               "reasons": {k[:200]: v for k, v in breaks.most_common(8)},
                               "sites": dict(break_sites.most_common(12))}
    profiling.print_profile(label, profile)
    print("graph breaks", profile["graph_breaks"], flush=True)
    print("misaligned matmuls", profile["misaligned_matmuls"], flush=True)
    return profile


def run_shape(args, shape: str, device: torch.device, rank: int, world: int, build=build_model,
              config: AsyncGRPOConfig | None = None, packings: tuple[str, ...] = ("flat", "tree"),
              experts: str | None = None) -> list[dict]:
    """The shape's rows per workload, in each of ``packings`` (the ``mfu`` workload: tree only), timed as the trainer
    runs them (``config``, default ``AsyncGRPOConfig()``), with the routed experts run by ``experts``
    (``grpo_core.models.moe.experts.EXPERTS_IMPLEMENTATIONS``; None: the trainer's choice); ``build(shape, layers, device)`` makes the fp32 model
    (``benchmarks/models/qwen35_speed.py`` passes its dense shapes)."""
    config = config or AsyncGRPOConfig()
    cuda = device.type == "cuda"
    settings = FSDPSettings.from_config(config, bf16=cuda, device_type=device.type, world_size=world)
    model = build(shape, args.layers, device)
    torch._dynamo.utils.counters.clear()  # graph breaks of this shape's compiled layers (the profile's record)
    experts_impl = use_grouped_experts(model, experts)
    attention = ta.enable_tree_attention(model, backend=config.attention_backend if cuda else "varlen_emulated",
                                         linear_backend=config.gdn_backend if cuda else "reference",
                                         compute_dtype=torch.bfloat16 if cuda else torch.float32,
                                         plan=config.tree_attention_plan)
    moe = MoEPolicy.for_model(model, replay=not args.no_replay)
    flops_model = ModelFlops.from_model(model)
    active, total = active_expert_params(model.model.layers)
    params = sum(p.numel() for p in model.parameters())
    shard_policy(model, settings, device)
    keep_weights = settings.keeps_weights(world)  # as the trainer's policy
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    peak = device_peak_flops(device, settings.bf16)
    budget = 256 if args.smoke else args.token_budget
    common = {"model": shape, "layers": args.layers, "params": params, "expert_params": total,
              "active_expert_params": active, "active_params_per_token": flops_model.layer_params + flops_model.head_params,
              "experts_implementation": experts_impl, "routing_replay": not args.no_replay,
              "attention_backend": attention, "gdn_backend": gdn_backend_label(model),
              "gdn_conv_backend": gdn_conv_label(model),
              "gdn_layers": len(gated_delta_layers(model)),
              "token_budget": budget, "compile": settings.compile,
              "compile_graph_breaks": (("nested" if settings.nested_graph_breaks else "outer")
                                       if settings.compile == "layers" else None),
              "activation_checkpointing": settings.activation_checkpointing,
              "weight_gathers": weight_gathers(settings, keep_weights, needs_fsdp(settings, world)),
              "world_size": world,
              # FSDP2 parameters whose one-rank fp32 accumulation runs grpo_core.models.grad_accumulation's kernels
              "grad_accumulation_kernels_on": grad_accumulation.installed_on(model),
              # the caching allocator's settings (expandable segments change how fragmented a full card gets)
              "cuda_alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or os.environ.get("PYTORCH_ALLOC_CONF")}
    results = []
    # where the compiled layers break their graphs (logged while they compile, in the first steps), for the profile
    with (profiling.graph_break_sites() if cuda and args.profile else contextlib.nullcontext()) as break_sites:
        for workload in args.workloads.split(","):
            samples = with_routes(workload_samples(workload, args, model.config.vocab_size, budget, world), model, seed=7)
            modes = ("tree",) if workload == "mfu" else packings
            per_mode = {}
            for mode in modes:
                rows_per_rank = args.rows_per_rank if workload == "mfu" else 10**6
                plan = plan_step(samples, world_size=world, gradient_accumulation_steps=rows_per_rank, token_budget=budget,
                                 flat=mode == "flat")
                rows = [pack_row(r).to(device) for r in plan.rows_for_rank(rank)]
                num_trained = sum(r.num_trained_tokens for r in plan.rows)
                metrics = plan.metrics()
                if cuda:
                    torch.cuda.reset_peak_memory_stats(device)
                retries = torch.cuda.memory_stats(device).get("num_alloc_retries", 0) if cuda else 0
                try:
                    fb_times, step_times = time_rows(model, moe, rows, num_trained, optimizer, args, device, keep_weights)
                except torch.OutOfMemoryError as exc:
                    per_mode[mode] = {**common, "workload": workload, "packing": mode, "error": f"OOM: {str(exc)[:600]}"}
                    rows.clear()  # the packed rows on the device, freed before the next workload or mode
                    gc.collect()
                    torch.cuda.empty_cache()
                    continue
                fb, st = statistics.median(fb_times), statistics.median(step_times)
                profile = None
                if cuda and args.profile and mode == "tree":
                    loss_config = LossConfig.from_config(config)
                    step = functools.partial(rows_backward, model, moe, rows, num_trained, loss_config, keep_weights)
                    profile = profile_step(step, optimizer, break_sites, f"{shape} {workload} {mode}")
                step_flops = flops_model.rows_flops(plan.rows)
                forwarded = int(metrics["batch/forwarded_tokens_per_step"])
                per_mode[mode] = {
                    **common, "workload": workload, "packing": mode, "rows_per_rank": len(rows),
                    "forwarded_tokens_per_step": forwarded, "trained_tokens_per_step": num_trained,
                    "row_fill_frac": metrics["batch/row_fill_frac"], "packing_ratio": metrics["batch/packing_ratio"],
                    "samples_per_row": metrics["batch/samples_per_row"], "step_flops": step_flops,
                    "step_gdn_flops": sum(flops_model.gdn_flops(r) for r in plan.rows),
                    "fwd_bwd_s": fb, "step_s": st, "fwd_bwd_times_s": fb_times, "step_times_s": step_times,
                    "tokens_per_s_fwd_bwd": forwarded / fb, "trained_tokens_per_s": num_trained / fb,
                    "tflops_per_device_fwd_bwd": step_flops / fb / world / 1e12,
                    "mfu_fwd_bwd": step_flops / (fb * world * peak) if peak else None,
                    "mfu_wall_clock": step_flops / (st * world * peak) if peak else None,
                    "peak_allocated_gib": torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None,
                    "peak_reserved_gib": torch.cuda.max_memory_reserved(device) / 2**30 if cuda else None,
                    # times the allocator freed its cache and retried (each synchronizes with the GPU): a card near full
                    "alloc_retries": torch.cuda.memory_stats(device).get("num_alloc_retries", 0) - retries if cuda else None,
                    **({"profile": profile} if profile else {}),
                }
                rows.clear()  # the packed rows on the device, freed before the next workload or mode
            if set(per_mode) == {"flat", "tree"} and all("error" not in r for r in per_mode.values()):
                flat, tree = per_mode["flat"], per_mode["tree"]
                speedup = tree["trained_tokens_per_s"] / flat["trained_tokens_per_s"]
                flop_ratio = flat["step_flops"] / tree["step_flops"]
                tree.update(packing_ratio_vs_flat=flat["forwarded_tokens_per_step"] / tree["forwarded_tokens_per_step"],
                            speedup=speedup, flop_ideal_speedup=flop_ratio, speedup_over_flop_ideal=speedup / flop_ratio)
            results += list(per_mode.values())
    del model, optimizer
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="qwen3-30b-a3b", choices=[s for s in SHAPES if not s.startswith("tiny")])
    ap.add_argument("--layers", type=int, default=8, help="decoder layers (the public models have 48 and 40)")
    ap.add_argument("--token-budget", type=int, default=16384)
    ap.add_argument("--workloads", default="mfu,ratio~3.4", help="mfu (tree rows) and/or ratio~3.4 (flat vs tree)")
    ap.add_argument("--rows-per-rank", type=int, default=4, help="micro-batches per step of the mfu workload")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--no-replay", action="store_true", help="the routers route (no replayed routes)")
    ap.add_argument("--profile", action="store_true", help="CUDA: profile one step of the tree rows (kernels by kind)")
    ap.add_argument("--out", default="benchmarks/results/moe_training.json")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU: checks the script only")
    args = ap.parse_args()
    info = DistInfo.from_env()
    device = torch.device("cpu") if args.smoke else info.device()
    init_distributed(info, device, timeout_s=1800)
    import torch.distributed as dist
    import transformers

    shapes = ["tiny", "tiny-hybrid"] if args.smoke else [args.shape]
    if args.smoke:
        args.layers = 4
    report = {"env": {"torch": torch.__version__, "transformers": transformers.__version__,
                      "python": platform.python_version(), "world_size": dist.get_world_size(),
                      "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                      "peak_bf16_flops": device_peak_flops(device, True)},
              "command": " ".join(sys.argv), "results": []}
    for shape in shapes:
        for result in run_shape(args, shape, device, info.rank, dist.get_world_size()):
            record(report, result, args.out, is_main=info.rank == 0)
    if info.rank == 0:
        def row(r: dict) -> str:
            extra = (f"{r['speedup']:8.2f} {r['flop_ideal_speedup']:10.2f} {r['speedup_over_flop_ideal']:7.2f}"
                     if "speedup" in r else "")
            return (f"{r['model']:14} {r['workload']:9} {r['packing']:5} {r['tokens_per_s_fwd_bwd']:8.0f} "
                    f"{percent(r['mfu_fwd_bwd'] or None)} {r['peak_allocated_gib'] or 0:8.1f} {extra}")

        print_table(report["results"], f"{'shape':14} {'workload':9} {'mode':5} {'tok/s':>8} {'MFU fb':>7} {'peak GiB':>8} "
                    f"{'speed-up':>8} {'FLOP-ideal':>10} {'reached':>7}", row,
                    lambda r: f"{r['model']:14} {r['workload']:9} {r['packing']:5}")
        write_report(args.out, report)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""The Qwen3.5 family on one GPU with the trainer's default config: hybrid vs dense per parameter, MoE MFU, log-prob gap.

One run measures, all with random weights and 16k-token rows:

* ``speed``: the dense Qwen3-1.7B shape (28 layers, hidden 2048, 16 / 8 heads of 128, tied 152k vocabulary)
  and the Qwen3.5-style dense hybrid of ``benchmarks/packing/gdn_tree_packing.py`` (24 layers, 3 Gated DeltaNet
  to 1 gated attention, untied 248k vocabulary, 2.39B) on tree_packing.py's ``ratio~1`` and ``ratio~3.4``
  workloads, flat and tree rows, each step as the trainer runs it (``moe_training.run_shape``: fp32 master
  weights under FSDP2 with bf16 compute, compiled decoder layers, tree attention and Gated DeltaNet backends
  ``auto``, the trainer's log-prob head and GRPO loss, AdamW). ``per_param`` of a workload = (hybrid trained
  tokens/s x hybrid parameters) / (dense trained tokens/s x dense parameters), tree rows;
* ``moe``: MFU (fwd+bwd, active parameters, ``ModelFlops``) of the Qwen3.5-MoE shape (4 layers) and the
  Qwen3-30B-A3B shape (8 layers) on fsdp_mfu.py's ``mfu`` workload;
* ``gap``: mean |log-prob| difference of trained tokens, a tree row against each sample forwarded alone
  through transformers' unpatched path, bf16, for both dense models (tree_packing.py's exactness samples),
  decomposed: each sample as a row of its own through the same kernels (``single``), and for the hybrid the
  packed row with the fp32 PyTorch delta rule (``reference``) instead of flash-linear-attention;
* ``delta``: the delta rule alone on a ratio~1 and a ratio~3.4 row, fwd+bwd: the trainer's tree form against the
  kernel on the same tokens as flat sequences and as one sequence;
* ``conv``: the tree short convolution with its silu at a 16k row of the hybrid's width, fwd+bwd: the PyTorch
  channel-last multiply-adds and a grouped ``conv1d``, each eager and compiled, flash-linear-attention's
  varlen kernel (what the trainer runs with fla) and the project's Triton kernels (``tree_conv_triton``).

``summary`` holds ``hybrid_per_param_vs_dense`` (per workload), ``qwen3_5_moe_mfu``, ``qwen3_30b_a3b_mfu``
(fractions) and ``hybrid_logprob_gap_vs_dense`` (hybrid gap / dense gap), with the targets.

    python3 -m benchmarks.models.qwen35_speed --out $OUT/qwen35_speed.json
    python3 -m benchmarks.models.qwen35_speed --parts moe --resume benchmarks/results/qwen35_speed.json --out ...
    python3 -m benchmarks.models.qwen35_speed --parts speed --gdn-kernels triton,flash_qla --profile --out ...
    python3 -m benchmarks.models.qwen35_speed --parts conv,speed --gdn-convs torch,auto,triton --out ...
    python3 -m benchmarks.models.qwen35_speed --parts speed --packings tree --graph-breaks nested,outer --out ...
    python3 -m benchmarks.models.qwen35_speed --parts moe --weight-gathers per_pass,per_micro_batch,per_step --out ...
    python3 -m benchmarks.models.qwen35_speed --smoke --out /tmp/qwen35_smoke.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from unittest import mock

import numpy as np
import torch
import torch.nn.functional as F

from grpo_core.config import AsyncGRPOConfig  # noqa: E402
from grpo_core.models.attention import gated_delta as gd  # noqa: E402
from grpo_core.models.attention import short_conv as sc  # noqa: E402
from grpo_core.models.attention import tree as ta  # noqa: E402
from grpo_core.models.attention.hybrid import gated_delta_layers, head_sizes, value_heads  # noqa: E402
from grpo_core.models.moe.experts import EXPERTS_IMPLEMENTATIONS  # noqa: E402
from grpo_core.packing.collator import pack_row  # noqa: E402
from grpo_core.packing.planner import plan_step  # noqa: E402
from grpo_core.ranks import DistInfo, init_distributed  # noqa: E402
from grpo_core.training.perf import device_peak_flops, synchronize  # noqa: E402
from benchmarks import profiling  # noqa: E402
from benchmarks.bench_io import listed_choices, write_report  # noqa: E402
from benchmarks.models import moe_training  # noqa: E402
from benchmarks.models.qwen35_summary import MOE, PAIRS, summarize  # noqa: E402
from benchmarks.packing import gdn_tree_packing, tree_packing  # noqa: E402

DENSE = {
    "qwen3-1.7b": ("qwen3", dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                                 num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True)),
    "qwen3.5-2b-like": ("qwen3_5", gdn_tree_packing.SHAPES["qwen3.5-2b-like"]),
    "tiny-dense": ("qwen3", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, head_dim=16, vocab_size=512, tie_word_embeddings=True)),
    "tiny-gdn": ("qwen3_5", gdn_tree_packing.SHAPES["tiny"]),
}
def build_dense(shape: str, layers: int, device: torch.device, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """The fp32 model of a dense shape (every fourth layer full attention in the hybrid); MoE shapes: moe_training's."""
    if shape not in DENSE:
        return moe_training.build_model(shape, layers, device)
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig, Qwen3Config, Qwen3ForCausalLM

    arch, sizes = DENSE[shape]
    common = dict(max_position_embeddings=40960, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    torch.manual_seed(0)
    with torch.device(device):
        if arch == "qwen3":
            model = Qwen3ForCausalLM(Qwen3Config(**sizes, **common))
        else:
            kinds = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(sizes["num_hidden_layers"])]
            model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**sizes, **common, layer_types=kinds))
    model.config.use_cache = False
    return model.to(dtype)


def shape_results(args, shape: str, device, info, world, build, config: AsyncGRPOConfig | None = None,
                  **options) -> list[dict]:
    """``moe_training.run_shape`` with ``config`` (default: the default config; ``options``: its ``packings`` and
    ``experts``); where that fails, the error and a run with layers compiled pointwise only (the error says what the
    config could not do)."""
    try:
        return moe_training.run_shape(args, shape, device, info.rank, world, build=build, config=config, **options)
    except Exception as exc:  # noqa: BLE001 - recorded, then the fallback runs
        error = f"{type(exc).__name__}: {str(exc)[:600]}"
        print("failed", shape, error, flush=True)
        torch.cuda.empty_cache() if device.type == "cuda" else None
        config = AsyncGRPOConfig(compile_mode="pointwise")
        results = moe_training.run_shape(args, shape, device, info.rank, world, build=build, config=config, **options)
        return [{**r, "compile_mode": "pointwise", "default_config_error": error} for r in results]


def side_by_side(value: str, default: str, known: tuple[str, ...], flag: str) -> list[str | None]:
    """The runs of a side-by-side option: one run as configured (None) for ``default``, else one per listed choice."""
    if value == default:
        return [None]
    return listed_choices(value, known, flag, default)


def gdn_kernel_choices(args) -> list[str | None]:
    """``--gdn-kernels``: None runs once with what fla picks; ``triton`` and ``flash_qla`` set ``FLA_FLASH_QLA``
    (which fla reads at every call) for a run each, side by side."""
    return side_by_side(args.gdn_kernels, "auto", ("triton", "flash_qla"), "--gdn-kernels")


def with_gdn_kernel(choice: str | None, run):
    """``run()`` with fla's FlashQLA dispatch switched off (``triton``) or on (``flash_qla``); None: as set."""
    if choice is None:
        return run()
    with mock.patch.dict(os.environ, {"FLA_FLASH_QLA": "1" if choice == "flash_qla" else "0"}):
        return run()


def gdn_conv_choices(args) -> list[str | None]:
    """``--gdn-convs``: None runs once with what the trainer picks; ``torch`` keeps the short convolutions on the
    PyTorch form, ``auto`` lets them take fla's kernel where it passes its probe, ``triton`` runs the project's
    kernels (``short_conv``'s ``triton`` backend), for a run each."""
    return side_by_side(args.gdn_convs, "default", ("torch", "auto", "triton"), "--gdn-convs")


def held_conv_backend(name: str):
    """A ``select_conv_backend`` that gives ``name``'s backend, after it passes the trainer's probe at the layers' width
    (``short_conv.probe_failure``)."""
    def select(gdn_backend, device, channels, kernel):
        failure = None if name == "torch" else sc.probe_failure(name, device, channels, kernel)
        if failure is not None:
            raise RuntimeError(f"--gdn-convs {name}: {failure}")
        return sc.CONV_BACKENDS[name]
    return select


def with_gdn_conv(choice: str | None, run):
    """``run()`` with the short convolutions held to the PyTorch form (``torch``) or the project's kernels
    (``triton``); None or ``auto``: as the trainer picks (``short_conv.select_conv_backend``)."""
    if choice in (None, "auto"):
        return run()
    with mock.patch.object(sc, "select_conv_backend", held_conv_backend(choice)):
        return run()


def graph_breaks_choices(args) -> list[str | None]:
    """``--graph-breaks``: None runs once with the default config's ``compile_graph_breaks`` (``auto``); ``nested`` and
    ``outer`` a run each of both models, side by side (``AsyncGRPOConfig.compile_graph_breaks``)."""
    return side_by_side(args.graph_breaks, "default", ("nested", "outer"), "--graph-breaks")


def run_speed(args, device, info, world, results: list[dict], save) -> list[dict]:
    """The speed part's rows, appended to ``results``; ``save()`` after each model's (a run cut short keeps them)."""
    dense, hybrid = PAIRS[args.smoke]
    models = args.models.split(",")
    runs = [run for breaks in graph_breaks_choices(args) for run in (
        ([(dense, None, None, breaks)] if "dense" in models else []) + (
            [(hybrid, kernel, conv, breaks) for kernel in gdn_kernel_choices(args) for conv in gdn_conv_choices(args)]
            if "hybrid" in models else []))]
    compiled_with = graph_breaks_choices(args)[0]
    for shape, kernel, conv, breaks in runs:
        if breaks != compiled_with:
            # Compiled frames are kept per code object and shared by every model of a class, whatever setting they
            # were traced under: start afresh so that each setting's runs trace their own.
            torch._dynamo.reset()
            compiled_with = breaks
        args.layers = DENSE[shape][1]["num_hidden_layers"]
        args.workloads = args.speed_workloads if not args.smoke else args.speed_workloads.replace("ratio~3.4", "ratio~3")
        config = None if breaks is None else AsyncGRPOConfig(compile_graph_breaks=breaks)
        run = lambda: shape_results(args, shape, device, info, world, build_dense, config=config,  # noqa: E731
                                    packings=tuple(args.packings.split(",")))
        for r in with_gdn_kernel(kernel, lambda: with_gdn_conv(conv, run)):
            results.append(r)
            print("speed", json.dumps({k: r.get(k) for k in ("model", "gdn_backend", "gdn_conv_backend",
                                                               "compile_graph_breaks", "workload",
                                                               "packing", "trained_tokens_per_s", "mfu_fwd_bwd",
                                                               "speedup_over_flop_ideal", "error")}), flush=True)
        save()
    return results


def experts_choices(args) -> list[str | None]:
    """``--experts``: None runs once with the trainer's experts (``DEFAULT_EXPERTS`` where they apply); else one run per
    listed implementation (``grpo_core.models.moe.experts.EXPERTS_IMPLEMENTATIONS``), side by side."""
    return side_by_side(args.experts, "default", EXPERTS_IMPLEMENTATIONS, "--experts")


WEIGHT_GATHERS = {
    "per_pass": dict(fsdp_reshard_after_forward=True, fsdp_keep_weights_between_micro_batches=False),
    "per_micro_batch": dict(fsdp_reshard_after_forward=True, fsdp_keep_weights_between_micro_batches=True),
    "per_step": dict(fsdp_reshard_after_forward=False, fsdp_keep_weights_between_micro_batches=True),
}
"""How often FSDP2 gathers (on one GPU: casts to bf16) each layer's weights in a step, as config fields:
``per_pass`` before each forward and each backward (FSDP2's own schedule), ``per_micro_batch`` before each
backward and once more (the default config on one rank), ``per_step`` once (kept from forward to backward too, at
2 bytes a parameter more)."""


def weight_gathers_choices(args) -> list[str | None]:
    """``--weight-gathers``: None runs once with the default config; any of ``WEIGHT_GATHERS`` a run each of every
    MoE shape, side by side."""
    return side_by_side(args.weight_gathers, "default", tuple(WEIGHT_GATHERS), "--weight-gathers")


def run_moe(args, device, info, world, results: list[dict], save) -> list[dict]:
    """The moe part's rows, appended to ``results``; ``save()`` after each shape's (a run cut short keeps them)."""
    for shape, layers in MOE[args.smoke]:
        if args.moe_shapes != "all" and shape not in args.moe_shapes.split(","):
            continue
        for experts in experts_choices(args):
            for gathers in weight_gathers_choices(args):
                args.layers, args.workloads = args.moe_layers or layers, "mfu"
                config = None if gathers is None else AsyncGRPOConfig(**WEIGHT_GATHERS[gathers])
                for r in shape_results(args, shape, device, info, world, moe_training.build_model, config=config,
                                       experts=experts):
                    results.append(r)
                    print("moe", json.dumps({k: r.get(k) for k in (
                        "model", "experts_implementation", "weight_gathers", "mfu_fwd_bwd",
                        "tokens_per_s_fwd_bwd", "peak_allocated_gib", "error")}), flush=True)
                save()
    return results


# ---- the packed-vs-unpacked log-prob gap ------------------------------------------------------------
def row_logprobs(model, samples, device) -> torch.Tensor:
    """Trained-token log-probs of ``samples`` packed as one tree row (sample order, as ``exactness_check``)."""
    plan = plan_step(samples, world_size=1, gradient_accumulation_steps=1, token_budget=10**6)
    row = pack_row(plan.rows[0]).to(device)
    logits = model(**row.model_inputs(), logits_to_keep=row.logit_index).logits[0]
    return torch.log_softmax(logits.float(), -1).gather(-1, row.target_ids[:, None])[:, 0]


def alone_logprobs(model, samples, device) -> torch.Tensor:
    """Each sample alone through transformers' own path (no row metadata: the patches pass it through)."""
    impl = model.config._attn_implementation
    model.set_attn_implementation("sdpa")
    out = []
    for s in samples:
        ids = torch.as_tensor(s.token_ids, dtype=torch.long, device=device)
        t = torch.as_tensor(np.flatnonzero(s.completion_mask), device=device)
        lg = model(input_ids=ids[None]).logits[0]
        out.append(torch.log_softmax(lg.float(), -1)[t - 1].gather(-1, ids[t][:, None])[:, 0])
    model.set_attn_implementation(impl)
    return torch.cat(out)


def gap(a: torch.Tensor, b: torch.Tensor) -> dict:
    d = (a - b).abs()
    return {"mean": d.mean().item(), "max": d.max().item()}


def logprob_gap(shape: str, device: torch.device, dtype: torch.dtype) -> dict:
    model = build_dense(shape, 0, device, dtype).eval()
    attention = ta.enable_tree_attention(model, backend="auto" if device.type == "cuda" else "varlen_emulated",
                                         linear_backend="auto" if device.type == "cuda" else "reference",
                                         compute_dtype=dtype)
    hybrid = any(t == "linear_attention" for t in getattr(model.config, "layer_types", None) or ())
    samples = tree_packing.exactness_samples(model.config.vocab_size)
    out = {"model": shape, "dtype": str(dtype), "attention_backend": attention,
           "gdn_backend": moe_training.gdn_backend_label(model)}
    with torch.no_grad():
        alone = alone_logprobs(model, samples, device)
        tree = row_logprobs(model, samples, device)
        single = torch.cat([row_logprobs(model, [s], device) for s in samples])
        out.update(trained_tokens=int(alone.numel()), tree_vs_alone=gap(tree, alone), single_vs_alone=gap(single, alone),
                   tree_vs_single=gap(tree, single))
        if hybrid and gd.active_gdn_backend().name != "reference":
            kept, layer = gd.active_gdn_backend().name, gated_delta_layers(model)[0]
            gd.register_gdn_backend("reference", device)  # the fp32 PyTorch delta rule, same rows
            try:
                ref_tree = row_logprobs(model, samples, device)
                ref_single = torch.cat([row_logprobs(model, [s], device) for s in samples])
            finally:
                gd.register_gdn_backend(kept, device, *head_sizes(layer), heads=value_heads(layer))
            out.update(reference_tree_vs_alone=gap(ref_tree, alone), reference_single_vs_alone=gap(ref_single, alone),
                       reference_tree_vs_single=gap(ref_tree, ref_single), fla_vs_reference_tree=gap(tree, ref_tree))
    print("gap", json.dumps(out), flush=True)
    del model
    return out


# ---- the short convolution --------------------------------------------------------------------------
def conv_timing(device: torch.device, smoke: bool) -> dict:
    """fwd+bwd of the tree convolution with its silu, as a layer runs it, on one ratio~3.4 row at the hybrid's width
    (16 + 16 + 16 heads of 128): the trainer's channel-last multiply-adds and a grouped ``conv1d``, each eager and
    compiled, flash-linear-attention's varlen kernel and the project's Triton kernels where usable (``<form>_ms``;
    ``fla_error``/``triton_error`` else), each
    also in row copies (``<form>_passes``: its time over ``row_copy_ms``, one read and one write of the row fwd+bwd)."""

    budget, channels = (256, 64) if smoke else (16384, 6144)
    workload = (tree_packing.SMOKE_WORKLOADS if smoke else tree_packing.WORKLOADS)[-1 if smoke else 2]
    samples = tree_packing.make_samples(workload, 1000, seed=5)
    plan = plan_step(samples, world_size=1, gradient_accumulation_steps=10**6, token_budget=budget)
    meta = pack_row(plan.rows[0]).to(device).attention
    u = int(meta.cu_seq_q[-1])
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    x = torch.randn(1, u, channels, device=device, dtype=dtype).transpose(1, 2)  # a layer's transposed projection
    w = torch.randn(channels, 4, device=device, dtype=dtype, requires_grad=True)
    out = {"tokens": u, "channels": channels}
    # Each form eagerly and compiled as a layer compiles it (dynamic shapes): the channel-last form is written
    # for the compiler, which fuses its shifted multiply-adds; eagerly each one is a kernel of its own.
    torch_conv = sc.CONV_BACKENDS["torch"]
    forms = [("channel_last", lambda x, w, meta: sc.tree_conv(x, w, None, "silu", meta, backend=torch_conv)),
             ("grouped_conv1d", lambda x, w, meta: F.silu(sc.tree_causal_conv1d_grouped(x, w, None, meta)))]
    forms += [(f"{name}_compiled", torch.compile(fn, dynamic=True)) for name, fn in forms]
    for kernel in ("fla", "triton"):
        try:
            err = sc.probe_conv(sc.CONV_BACKENDS[kernel], device, channels)
            backend = sc.CONV_BACKENDS[kernel]
            forms.append((kernel, lambda x, w, meta, backend=backend: sc.tree_conv(x, w, None, "silu", meta, backend=backend)))
            out[f"{kernel}_probe_error"] = err
        except Exception as exc:  # noqa: BLE001 - not importable here (the CPU smoke), or a kernel that fails
            out[f"{kernel}_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    # The gradient comes in the layout a layer hands back (the transpose of a contiguous [1, U, C]), so the times
    # hold the convolution's passes and nothing of a loss's: a loss over the transposed output would add
    # strided fp32 copies of the whole row to every form.
    grad = torch.randn(1, u, channels, device=device, dtype=dtype).transpose(1, 2)
    # One read and one write of the row in its dtype (a clone; its backward hands the gradient on): the unit the
    # forms' times are read in (``<form>_passes``), the memory floor of a kernel that reads the input once.
    forms.insert(0, ("row_copy", lambda x, w, meta: x.clone()))
    for name, fn in forms:
        xr = x.detach().clone().requires_grad_()
        times = []
        for i in range(3 if smoke else 12):
            xr.grad = w.grad = None  # the gradient is handed over, not added to the last one's (as in a layer)
            synchronize(device)
            start = time.perf_counter()
            fn(xr, w, meta).backward(grad)
            synchronize(device)
            if i >= 2:
                times.append(time.perf_counter() - start)
        out[f"{name}_ms"] = 1e3 * float(np.median(times))
    for name, _ in forms[1:]:
        out[f"{name}_passes"] = out[f"{name}_ms"] / out["row_copy_ms"]
    print("conv", json.dumps(out), flush=True)
    return out


# ---- the delta rule ------------------------------------------------------------------------------------
def delta_timing(device: torch.device, smoke: bool, profile: bool = False) -> dict:
    """fwd+bwd of the hybrid's delta rule (16 heads of 128) on one row of ``ratio~1`` and one of ``ratio~3.4``, with
    the delta-rule backend the trainer picks: ``tree`` (``gated_delta.tree_gated_delta_rule``: the l2 norms, one
    kernel call per depth of the segment tree with the parents' states, the gathers), against the kernel alone on
    the same tokens as flat variable-length sequences (``varlen``: one call over the row's segments, no states) and
    as one sequence (``one_sequence``): what the tree costs over the kernel, and the kernel's floor. ``profile`` (CUDA):
    also one profiled fwd+bwd per form, for its host waits and where they come from (``<form>_profile``): a wait
    per call of the kernel drains the launch queue once per layer in a model."""
    heads, dim = (2, 16) if smoke else (16, 128)
    backend = gd.select_gdn_backend("auto", device, dim, dim, heads)
    out: dict = {"heads": heads, "head_dim": dim, "backend": backend.name,
                 "kernels": gd.fla_kernel(dim, dim) if backend.name == "fla" else None, "rows": []}
    workloads = tree_packing.SMOKE_WORKLOADS if smoke else tree_packing.WORKLOADS
    budget = 256 if smoke else 16384
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    for workload in (workloads[0], workloads[-1] if smoke else workloads[2]):
        plan = plan_step(tree_packing.make_samples(workload, 1000, seed=5), world_size=1,
                         gradient_accumulation_steps=10**6, token_budget=budget)
        meta = pack_row(plan.rows[0]).to(device).attention
        u = int(meta.cu_seq_q[-1])
        gen = torch.Generator(device=device).manual_seed(0)
        q, k = (torch.randn(u, heads, dim, device=device, dtype=dtype, generator=gen) for _ in range(2))
        v = torch.randn(u, heads, dim, device=device, dtype=dtype, generator=gen)
        g = -F.softplus(torch.randn(u, heads, device=device, generator=gen))
        beta = torch.rand(u, heads, device=device, dtype=dtype, generator=gen)
        grad = torch.randn(u, heads, dim, device=device, dtype=dtype, generator=gen)
        row = {"workload": workload.name, "tokens": u, "segments": len(meta.cu_seq_q) - 1,
               "depths": len(gd.build_segment_tree(meta, device).depths)}
        forms = {"tree": lambda xs: gd.tree_gated_delta_rule(*xs, meta, l2norm=True, backend=backend)}
        if backend.name == "fla" and out["kernels"] == "flash_qla":
            # the same tree with no chunk plans attached (``gated_delta.plan_varlen_chunks``): what the plans save.
            # Its row's tree is built here first, without them, and every call of the form reads that one.
            unplanned = pack_row(plan.rows[0]).to(device).attention
            gd.segment_tree(unplanned, unplanned.cu_seq_q.device, plan_chunks=False)  # the device the layers look up
            forms["tree_unplanned"] = lambda xs: gd.tree_gated_delta_rule(*xs, unplanned, l2norm=True, backend=backend)
        if backend.name == "fla":
            from fla.ops.gated_delta_rule import chunk_gated_delta_rule

            for name, cu in (("varlen", meta.cu_seq_q.to(torch.int64)),
                             ("one_sequence", torch.tensor([0, u], device=device, dtype=torch.int64))):
                forms[name] = lambda xs, cu=cu: chunk_gated_delta_rule(
                    *(x.unsqueeze(0) for x in xs), use_qk_l2norm_in_kernel=True, cu_seqlens=cu,
                    cu_seqlens_cpu=cu.cpu())[0][0]
        for name, fn in forms.items():
            times = []
            for i in range(3 if smoke else 10):
                xs = [x.detach().requires_grad_() for x in (q, k, v, g, beta)]
                synchronize(device)
                start = time.perf_counter()
                fn(xs).backward(grad)
                synchronize(device)
                if i >= 2:
                    times.append(time.perf_counter() - start)
            row[f"{name}_ms"] = 1e3 * float(np.median(times))
            if profile and device.type == "cuda":
                xs = [x.detach().requires_grad_() for x in (q, k, v, g, beta)]
                prof = profiling.profile_call(lambda: fn(xs).backward(grad), top=8, wait_sites=True)
                row[f"{name}_profile"] = {key: prof[key] for key in
                                          ("busy_ms", "wall_ms", "kernels", "host_waits", "host_wait_sites")}
        out["rows"].append(row)
        print("delta", json.dumps(row), flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--parts", default="conv,delta,gap,speed,moe", help="which of conv, delta, gap, speed, moe to run (in this order)")
    ap.add_argument("--resume", default=None, help="a report of an earlier run: its parts are kept, the others run")
    ap.add_argument("--token-budget", type=int, default=16384)
    ap.add_argument("--rows-per-rank", type=int, default=4, help="micro-batches per step of the MoE mfu workload")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--out", default="benchmarks/results/qwen35_speed.json")
    ap.add_argument("--gdn-kernels", default="auto",
                    help="the hybrid's delta-rule kernels: auto (what fla picks), or triton and/or flash_qla, each "
                         "timed in turn (FLA_FLASH_QLA=0/1; flash_qla needs the flash-qla package: pack_gdn.sh)")
    ap.add_argument("--gdn-convs", default="default",
                    help="the hybrid's short convolutions: default (what the trainer picks), or any of torch, auto and "
                         "triton, each timed in turn (torch: the PyTorch form; auto: fla's kernel where it passes its "
                         "probe; triton: the project's kernels)")
    ap.add_argument("--weight-gathers", default="default",
                    help="the moe part's FSDP2 gathers of each layer's weights in a step: default (the config's), or "
                         "any of per_pass, per_micro_batch and per_step, each a run of every shape (WEIGHT_GATHERS)")
    ap.add_argument("--graph-breaks", default="default",
                    help="the speed part's compiled layers: default (the config's compile_graph_breaks, auto), or "
                         "nested and/or outer, each a run of both models in turn")
    ap.add_argument("--models", default="dense,hybrid",
                    help="the speed part's models: dense and/or hybrid (both for the per-parameter ratio)")
    ap.add_argument("--speed-workloads", default="ratio~1,ratio~3.4", help="the speed part's workloads")
    ap.add_argument("--packings", default="flat,tree",
                    help="the speed part's rows: flat and/or tree (both for the tree speed-up); e.g. tree with --profile")
    ap.add_argument("--moe-shapes", default="all",
                    help="the moe part's shapes: all, or some of " + ",".join(s for s, _ in MOE[False]) + " (the smoke's: "
                         + ",".join(s for s, _ in MOE[True]) + "), e.g. to time one shape in a call of its own")
    ap.add_argument("--moe-layers", type=int, default=None,
                    help="decoder layers of every MoE shape (default: each shape's, as the summary's targets count "
                         "them); fewer fit a smaller card, for comparisons within one run")
    ap.add_argument("--experts", default="default",
                    help="the MoE shapes' experts: default (the trainer's), or grouped_mm and/or grpo_grouped_mm, each "
                         "timed in turn (grpo_core.models.moe.experts)")
    ap.add_argument("--profile", action="store_true",
                    help="CUDA: profile one step of each shape's tree rows (top kernels, time per kind of kernel)")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU: checks the script only")
    args = ap.parse_args()
    gdn_kernel_choices(args), gdn_conv_choices(args), experts_choices(args), graph_breaks_choices(args)  # a typo fails here, not after the parts before the speed part
    for flag, value, known in (("--models", args.models, {"dense", "hybrid"}),
                               ("--moe-shapes", args.moe_shapes, {"all"} | {s for s, _ in MOE[args.smoke]}),
                               ("--packings", args.packings, {"flat", "tree"})):
        if not value or set(value.split(",")) - known:
            raise SystemExit(f"{flag}: {value!r}; use any of {','.join(sorted(known))}, comma-separated")
    args.no_replay = False
    info = DistInfo.from_env()
    device = torch.device("cpu") if args.smoke else info.device()
    init_distributed(info, device, timeout_s=1800)
    import torch.distributed as dist
    import transformers

    report: dict = {}
    if args.resume and os.path.exists(args.resume):
        with open(args.resume) as f:
            report = json.load(f)
    report.setdefault("env", {"torch": torch.__version__, "transformers": transformers.__version__,
                              "python": platform.python_version(),
                              "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                              "peak_bf16_flops": device_peak_flops(device, True)})
    for name in ("fla", "tilelang", "flash_attn", "triton"):
        try:
            report["env"][name] = getattr(__import__(name), "__version__", "present")
        except Exception as exc:  # noqa: BLE001 - what is missing is part of the record
            report["env"][name] = f"absent ({type(exc).__name__})"
    report.setdefault("commands", []).append(" ".join(sys.argv))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    world = dist.get_world_size()
    def save(report: dict) -> None:
        report["summary"] = summarize(report, args.smoke)
        if info.rank == 0:
            write_report(args.out, report)  # after each part, and each model of a part: a run cut short keeps them

    for part in ("conv", "delta", "gap", "speed", "moe"):
        if part not in args.parts.split(",") or part in report:
            continue
        if part == "conv":
            report["conv"] = conv_timing(device, args.smoke)
        elif part == "delta":
            report["delta"] = delta_timing(device, args.smoke, args.profile)
        elif part == "gap":
            report["gap"] = [logprob_gap(shape, device, dtype) for shape in PAIRS[args.smoke]]
        elif part == "speed":
            run_speed(args, device, info, world, report.setdefault("speed", []), lambda: save(report))
        else:
            run_moe(args, device, info, world, report.setdefault("moe", []), lambda: save(report))
        save(report)
    if info.rank == 0:
        print("summary", json.dumps(report.get("summary")), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

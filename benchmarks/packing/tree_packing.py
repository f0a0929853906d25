"""Tree rows vs flat padding-free packing: trained tokens per second, bf16 forward+backward.

One run, same samples for both modes: each workload is planned twice with the same ``token_budget``
(tree rows share prompts; flat rows make every sample its own segment), every row of the step is
forwarded and backpropagated through a Qwen3-shaped model with random weights, and the step's time
gives trained tokens per second. Both modes use the same varlen attention kernel and compute logits
only where a trained token is predicted, so the ratio isolates what sharing buys. Before timing, a
bf16 check compares packed and one-by-one log-probs with the spread between two unpacked runs.

On the GPU (results under benchmarks/results/):

    python -m benchmarks.packing.tree_packing --out benchmarks/results/tree_packing.json

On a CPU, a smoke run with a tiny model (no timing claims): ``--smoke``.

``--kv-regather off,on`` times tree rows with the gathered K/V saved for backward and re-gathered in
backward (``models.attention.gather.set_kv_regather``), side by side (``break``: with ``--compile-layers``, also
in compiled layers, through a graph break); ``--plan gather,split`` times the two plans of fused-kernel
tree attention side by side (``AsyncGRPOConfig.tree_attention_plan``; the re-gather settings apply to
``gather`` only); ``--profile ratio~6`` adds a CUDA-kernel
profile of one step of each mode of that workload (top kernels, and time per kind of kernel).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import itertools
import statistics
import sys
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.utils.checkpoint


from grpo_core.config import AUTO_CHUNK_LOGITS  # noqa: E402
from grpo_core.models.attention import tree as ta  # noqa: E402
from grpo_core.models.head.lm_head import vocab_size  # noqa: E402
from grpo_core.packing.collator import pack_row  # noqa: E402
from grpo_core.packing.planner import plan_step  # noqa: E402
from grpo_core.rollout.types import RolloutSample  # noqa: E402
from grpo_core.training.forward import row_logprobs  # noqa: E402
from benchmarks.bench_io import write_report  # noqa: E402
from benchmarks import profiling  # noqa: E402

SHAPES = {  # Qwen3 dense shapes (config.json of the public checkpoints)
    "qwen3-0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True),
    "qwen3-1.7b": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, vocab_size=512, tie_word_embeddings=True),
}


@dataclass
class Workload:
    name: str
    groups: int
    group_size: int
    prompt: tuple[int, int]  # prompt length range [lo, hi)
    completion: tuple[int, int]
    shared_prompt: bool = True


WORKLOADS = [  # tuned (on the CPU, planning only) for packing ratios of about 1, 2, 3.4 and 6
    Workload("ratio~1", 16, 8, (256, 257), (128, 1024), shared_prompt=False),
    Workload("ratio~2", 10, 8, (512, 1024), (128, 1024)),
    Workload("ratio~3.4", 6, 8, (2048, 2816), (128, 1024)),
    Workload("ratio~6", 3, 16, (3072, 3328), (128, 512)),
]
SMOKE_WORKLOADS = [Workload("ratio~1", 3, 4, (8, 9), (4, 40), False), Workload("ratio~3", 3, 4, (60, 90), (4, 30))]


def make_samples(w: Workload, vocab: int, seed: int) -> list[RolloutSample]:
    rng = np.random.default_rng(seed)
    samples = []
    for g in range(w.groups):
        p = int(rng.integers(*w.prompt))
        prompt = rng.integers(0, vocab, p)
        for r in range(w.group_size):
            if not w.shared_prompt:
                prompt = rng.integers(0, vocab, p)
            c = int(rng.integers(*w.completion))
            tokens = np.concatenate([prompt, rng.integers(0, vocab, c)]).astype(np.int32)
            mask = np.zeros(len(tokens), dtype=bool)
            mask[p:] = True
            samples.append(RolloutSample(
                token_ids=tokens, completion_mask=mask,
                sampler_logprobs=np.where(mask, -1.0, 0.0).astype(np.float32),
                advantage=float(rng.normal()), reward=0.0, group_id=g, row_index=g, epoch=0,
                rollout_id=f"{w.name}-{g}-{r}", policy_version=0,
            ))
    return samples


def build_model(shape: str, device: torch.device, dtype: torch.dtype):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(**SHAPES[shape], rope_theta=1_000_000.0, max_position_embeddings=40960)
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen3ForCausalLM(config).to(dtype)
    return model


def _chunk_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = (hidden @ weight.T).float()
    return logits.gather(-1, targets[:, None])[:, 0] - logits.logsumexp(-1)


TRAINER_HEADS = {  # name -> (fused, chunked): the trainer's own head (row_logprobs), dense or in chunks
    "fused": (True, False), "fused_chunked": (True, True),
    "reference": (False, False), "reference_chunked": (False, True),
}
"""The trainer's log-prob head: ``fused`` (``models.head.fused``, the default) or ``reference`` (autograd through
``grpo_core.training.loss``); dense (the default at 16k rows) or ``_chunked`` (``AUTO_CHUNK_LOGITS`` per chunk, as
``logprob_chunk_size="auto"`` takes above 2^32 logits)."""


def row_loss(model, row, total_trained: int, head: str = "full", chunk: int = 4096) -> torch.Tensor:
    """GRPO-like loss of one row. ``full``: the model's own head on the trained positions
    (``logits_to_keep``), fp32 log-softmax of ``[T, V]`` logits. ``chunked``: the same log-probs
    ``chunk`` trained tokens at a time, recomputed in backward, so ``[T, V]`` logits never exist. ``none``:
    no head, the decoder layers alone (a linear function of the trained positions' hidden states), to
    tell the layers' share of a gap from the head's; its FLOP counts leave the head out. The names of
    ``TRAINER_HEADS``: the trainer's ``row_logprobs``."""
    if head == "none":
        hidden = model.model(**row.model_inputs()).last_hidden_state[0, row.logit_index]
        return -(hidden[:, 0].float() * row.advantages).sum() / total_trained
    if head in TRAINER_HEADS:
        fused, chunked = TRAINER_HEADS[head]
        chunk_size = max(1, AUTO_CHUNK_LOGITS // vocab_size(model)) if chunked else None
        logprobs = row_logprobs(model, row, 1.0, chunk_size=chunk_size, fused=fused).logprobs
        return -(logprobs * row.advantages).sum() / total_trained
    if head == "full":
        out = model(**row.model_inputs(), logits_to_keep=row.logit_index)
        logprobs = torch.log_softmax(out.logits[0].float(), -1).gather(-1, row.target_ids[:, None])[:, 0]
    else:
        hidden = model.model(**row.model_inputs()).last_hidden_state[0, row.logit_index]
        weight = model.lm_head.weight
        logprobs = torch.cat([
            torch.utils.checkpoint.checkpoint(_chunk_logprobs, hidden[i : i + chunk], weight,
                                              row.target_ids[i : i + chunk], use_reentrant=False)
            for i in range(0, hidden.shape[0], chunk)
        ])
    return -(logprobs * row.advantages).sum() / total_trained


def attention_pairs(row) -> int:
    q = np.diff(row.attention.cu_seq_q.cpu().numpy()).astype(np.int64)
    k = np.diff(row.attention.cu_seq_k.cpu().numpy()).astype(np.int64)
    return int((q * k - q * (q - 1) // 2).sum())


def step_flop_parts(shape: str, rows) -> dict[str, float]:
    """Forward+backward FLOPs: 6 x body params x tokens, 6 x head x trained, 3.5 x attention fwd."""
    s = SHAPES[shape]
    h, layers, heads, d = s["hidden_size"], s["num_hidden_layers"], s["num_attention_heads"], s["head_dim"]
    kv = s["num_key_value_heads"]
    per_layer = h * heads * d * 2 + h * kv * d * 2 + 3 * h * s["intermediate_size"]
    tokens = sum(r.num_tokens for r in rows)
    trained = sum(r.num_trained for r in rows)
    pairs = sum(attention_pairs(r) for r in rows)
    return {"layers": 6 * layers * per_layer * tokens, "head": 6 * h * s["vocab_size"] * trained,
            "attention": 3.5 * 4 * pairs * heads * d * layers}


def step_flops(shape: str, rows) -> float:
    return sum(step_flop_parts(shape, rows).values())


def run_step(model, rows, total_trained: int, head: str) -> None:
    for row in rows:
        row_loss(model, row, total_trained, head).backward()


def time_modes(model, modes: dict, repeats: int, device: torch.device, head: str) -> dict:
    """Median wall time of one full step per mode; the modes are interleaved to share any drift."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    times = {m: [] for m in modes}
    peak = {}
    for m, (rows, trained) in modes.items():  # warm-up: kernels, allocator
        model.zero_grad(set_to_none=True)
        run_step(model, rows, trained, head)
    for rep in range(repeats):
        for m, (rows, trained) in modes.items():
            model.zero_grad(set_to_none=True)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            sync()
            t0 = time.perf_counter()
            run_step(model, rows, trained, head)
            sync()
            times[m].append(time.perf_counter() - t0)
            if device.type == "cuda":
                peak[m] = max(peak.get(m, 0.0), torch.cuda.max_memory_allocated() / 2**30)
    return {m: (statistics.median(t), t, peak.get(m)) for m, t in times.items()}


def exactness_samples(vocab: int, seed: int = 1) -> list[RolloutSample]:
    """The exactness check's samples: 3 groups of 4, prompts of 200-600 tokens, completions forking off
    shared stems of random length."""
    rng = np.random.default_rng(seed)
    samples = []
    for g in range(3):
        prompt = rng.integers(0, vocab, int(rng.integers(200, 600)))
        stem = rng.integers(0, vocab, 120)  # completions share stems of random length: deep forks
        for r in range(4):
            cut = int(rng.integers(0, 120))  # (draw order kept: the recorded results used it)
            comp = np.concatenate([stem[:cut], rng.integers(0, vocab, int(rng.integers(20, 300)))])
            tokens = np.concatenate([prompt, comp]).astype(np.int32)
            mask = np.zeros(len(tokens), dtype=bool)
            mask[len(prompt):] = True
            samples.append(RolloutSample(token_ids=tokens, completion_mask=mask,
                                         sampler_logprobs=np.zeros(len(tokens), np.float32), advantage=1.0,
                                         reward=0.0, group_id=g, row_index=g, epoch=0, rollout_id=f"x{g}{r}",
                                         policy_version=0))
    return samples


def exactness_check(model, device, dtype, vocab: int, seed: int = 1) -> dict:
    """Trained-token log-probs: packed row vs alone (batch 1) vs all samples in one padded batch."""
    samples = exactness_samples(vocab, seed)
    with torch.no_grad():
        out = {}
        for mode in ("tree", "flat"):
            plan = plan_step(samples, world_size=1, gradient_accumulation_steps=1, token_budget=10**6,
                             flat=mode == "flat")
            row = pack_row(plan.rows[0]).to(device)
            logits = model(**row.model_inputs(), logits_to_keep=row.logit_index).logits[0]
            out[mode] = torch.log_softmax(logits.float(), -1).gather(-1, row.target_ids[:, None])[:, 0]
            if mode == "tree":
                out["packing_ratio"] = plan.metrics()["batch/packing_ratio"]
        impl = model.config._attn_implementation
        model.set_attn_implementation("sdpa")
        alone, batched = [], []
        for s in samples:
            ids = torch.as_tensor(s.token_ids, dtype=torch.long, device=device)
            t = torch.as_tensor(np.flatnonzero(s.completion_mask), device=device)
            lg = model(input_ids=ids[None]).logits[0]
            alone.append(torch.log_softmax(lg.float(), -1)[t - 1].gather(-1, ids[t][:, None])[:, 0])
        longest = max(len(s) for s in samples)
        ids = torch.zeros(len(samples), longest, dtype=torch.long, device=device)
        mask = torch.zeros(len(samples), longest, dtype=torch.long, device=device)
        for i, s in enumerate(samples):
            ids[i, : len(s)] = torch.as_tensor(s.token_ids, device=device)
            mask[i, : len(s)] = 1
        lg = model(input_ids=ids, attention_mask=mask).logits
        for i, s in enumerate(samples):
            t = torch.as_tensor(np.flatnonzero(s.completion_mask), device=device)
            batched.append(torch.log_softmax(lg[i].float(), -1)[t - 1].gather(-1, ids[i, t][:, None])[:, 0])
        model.set_attn_implementation(impl)
    alone_t, batched_t = torch.cat(alone), torch.cat(batched)

    def diff(a, b):
        d = (a - b).abs()
        return {"max": d.max().item(), "mean": d.mean().item()}

    result = {
        "dtype": str(dtype), "trained_tokens": int(alone_t.numel()), "packing_ratio": out["packing_ratio"],
        "tree_vs_alone": diff(out["tree"], alone_t), "flat_vs_alone": diff(out["flat"], alone_t),
        "batched_vs_alone": diff(batched_t, alone_t),
    }
    ref = result["batched_vs_alone"]
    result["pass"] = all(result["tree_vs_alone"][k] <= 2 * ref[k] + 1e-6 for k in ("max", "mean"))
    return result


GATHERED = "-gathered"  # a plan name's suffix: level calls on gathered queries and keys


def register_plan(name: str, plan: str, device: torch.device, attention_kernel: str | None) -> str:
    """Register backend ``name`` with ``plan`` (``GATHERED`` suffix allowed) and return its label."""
    from grpo_core.models.attention import split as tree_split

    gathered = plan.endswith(GATHERED)
    plan = plan.removesuffix(GATHERED)
    tree_split.set_level_windows(not gathered)
    if name == "emulated":  # the CPU's stand-ins of a fused kernel, one per plan
        name = {"split": "split_emulated", "auto": "split_or_gather_emulated"}.get(plan, "varlen_emulated")
    label = ta.register_tree_attention(name, device, attention_kernel, plan)
    return label + (" (levels gathered)" if gathered and plan != "gather" else "")


def plan_check(row, shape: str, device: torch.device, dtype: torch.dtype, kernel: str, plans: list[str]) -> dict:
    """One attention call per plan on ``row``'s segments against an fp32 oracle (the gather plan with the
    emulated kernel, fp32 inputs): relative error norms of output and q/k/v gradients, per plan of backend
    ``kernel``; "split, merge in PyTorch ops" repeats the split plan without the Triton merge
    (that kernel's check)."""
    from grpo_core.models.attention import split as tree_split

    s = SHAPES[shape]
    gen = torch.Generator().manual_seed(0)
    heads, kv, d = s["num_attention_heads"], s["num_key_value_heads"], s["head_dim"]
    inputs = [torch.randn(row.num_tokens, h, d, generator=gen).to(device) for h in (heads, kv, kv)]
    grad = torch.randn(row.num_tokens, heads, d, generator=gen).to(device)

    def once(backend: ta.Backend, dt: torch.dtype) -> list[torch.Tensor]:
        xs = [t.detach().to(dt).clone().requires_grad_() for t in inputs]
        out = backend.run(*xs, row.attention, d**-0.5)
        out.backward(grad.to(dt))
        return [out.detach().float()] + [x.grad.float() for x in xs]

    oracle = once(ta.BACKENDS["varlen_emulated"], torch.float32)
    results = {}
    for plan in plans:
        label = register_plan(kernel, plan, device, None)
        results[label] = once(ta._active, dtype)
    tree_split.set_level_windows(True)
    if "split" in plans:
        fused, tree_split._merge_kernel = tree_split._merge_kernel, False  # PyTorch ops for the merge
        try:
            ta.register_tree_attention(kernel, device, None, "split")
            results["split, merge in PyTorch ops"] = once(ta._active, dtype)
        finally:
            tree_split._merge_kernel = fused
    names = ("out", "dq", "dk", "dv")
    return {label: {n: float((x - y).norm() / y.norm()) for n, x, y in zip(names, got, oracle)}
            for label, got in results.items()}


def regather_check(row, shape: str, device: torch.device, dtype: torch.dtype) -> dict:
    """One attention call of the active backend on ``row``'s segments, K/V saved vs re-gathered (eager): the
    largest |difference| of output and q/k/v gradients, and, for scale, the same between two runs that
    both save (a kernel whose backward adds with atomics is not bitwise repeatable)."""
    s = SHAPES[shape]
    gen = torch.Generator().manual_seed(0)
    heads, kv, d = s["num_attention_heads"], s["num_key_value_heads"], s["head_dim"]
    inputs = [torch.randn(row.num_tokens, h, d, generator=gen).to(device, dtype) for h in (heads, kv, kv)]
    grad = torch.randn(row.num_tokens, heads, d, generator=gen).to(device, dtype)

    def once(regather: bool) -> list[torch.Tensor]:
        ta.set_kv_regather(regather)
        xs = [t.clone().requires_grad_() for t in inputs]
        out = ta._active.run(*xs, row.attention, d**-0.5)
        out.backward(grad)
        return [out.detach()] + [x.grad for x in xs]

    saved, saved_again, regathered = once(False), once(False), once(True)
    names = ("out", "dq", "dk", "dv")
    diff = lambda a, b: {n: (x.float() - y.float()).abs().max().item() for n, x, y in zip(names, a, b)}  # noqa: E731
    return {"regather_vs_saved": diff(regathered, saved), "saved_vs_saved": diff(saved_again, saved)}


def profile_step(model, rows, total_trained: int, head: str, top: int = 15) -> dict:
    """CUDA kernel time of one step: the ``top`` kernels by time, and the time per kind (``profiling.profile_call``)."""
    model.zero_grad(set_to_none=True)
    return profiling.profile_call(lambda: run_step(model, rows, total_trained, head), top)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="qwen3-0.6b,qwen3-1.7b")
    ap.add_argument("--token-budget", type=int, default=16384)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--heads", default="full,chunked",
                    help="loss heads to time (row_loss: full, chunked, none (layers only), and the trainer's: "
                         + ", ".join(TRAINER_HEADS) + ")")
    ap.add_argument("--backend", default="auto",
                    help="tree attention backend(s), comma-separated (AsyncGRPOConfig.attention_backend names): "
                         "each workload is timed with each, side by side")
    ap.add_argument("--attention-kernel", default=None, help="the kernels backend's Hub id or local folder")
    ap.add_argument("--kv-regather", default="on",
                    help="tree rows' gathered K/V re-gathered in backward ('on') or saved ('off'); 'break': 'on' "
                         "and, in compiled layers, a graph break around tree attention so that it applies there "
                         "too (tree_attention.set_kv_regather, set_kv_regather_compiled); 'off,on' times both, "
                         "side by side")
    ap.add_argument("--plan", default="auto",
                    help="tree attention plan(s), comma-separated (AsyncGRPOConfig.tree_attention_plan: auto, split, "
                         "gather): each workload is timed with each, side by side; 'split-gathered' and "
                         "'auto-gathered' run the split plan's level calls on gathered queries and keys even where "
                         "the kernel reads the row in place (tree_split.set_level_windows(False))")
    ap.add_argument("--workloads", default=None, help="comma-separated workload names (default: all)")
    ap.add_argument("--profile", default=None,
                    help="workload name(s), comma-separated: after timing each, profile one step of each mode "
                         "(CUDA kernels, GPU busy against wall time)")
    ap.add_argument("--compile-layers", action="store_true",
                    help="torch.compile each decoder layer (dynamic shapes), as the trainer's compile_mode='layers'; "
                         "skips the exactness check (it would compile the sdpa path too)")
    ap.add_argument("--out", default="benchmarks/results/tree_packing.json")
    ap.add_argument("--smoke", action="store_true", help="tiny model on CPU: checks the script, times nothing real")
    args = ap.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    models = ["tiny"] if args.smoke else args.models.split(",")
    # (seed, workload): each workload's samples depend on its place in the full list, not on --workloads
    workloads = list(enumerate(SMOKE_WORKLOADS if args.smoke else WORKLOADS, start=100))
    if args.workloads:
        workloads = [(seed, w) for seed, w in workloads if w.name in args.workloads.split(",")]
    regather_settings = args.kv_regather.split(",")
    if not set(regather_settings) <= {"off", "on", "break"}:
        ap.error(f"--kv-regather takes off, on and break, got {args.kv_regather!r}")
    budget = 256 if args.smoke else args.token_budget
    wanted = args.backend.split(",") if device.type == "cuda" else ["emulated"]
    plans = args.plan.split(",")
    for p in plans:
        ta._check_plan(p.removesuffix(GATHERED))

    def register(name: str, plan: str) -> str:
        return register_plan(name, plan, device, args.attention_kernel)

    backends = [register(b, p) for b in wanted for p in plans]  # each one's probe
    backend = register(wanted[0], plans[0])
    import transformers

    report = {
        "env": {"torch": torch.__version__, "transformers": transformers.__version__,
                "python": platform.python_version(),
                "device": torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu",
                "dtype": str(dtype), "tree_attention_backend": backend, "tree_attention_backends": backends,
                "kv_regather": regather_settings, "plans": plans,
                "compile_layers": args.compile_layers},
        "token_budget": budget, "repeats": args.repeats, "command": " ".join(sys.argv), "results": [],
    }
    try:
        import inspect

        from torch.nn.attention.varlen import varlen_attn
        report["env"]["varlen_attn_signature"] = str(inspect.signature(varlen_attn))
    except ImportError as exc:
        report["env"]["varlen_attn_signature"] = f"unavailable: {exc}"
    print(json.dumps(report["env"], indent=1), flush=True)

    for shape in models:
        model = build_model(shape, device, dtype)
        ta.check_supported_architecture(model)
        model.set_attn_implementation(ta.TREE_ATTENTION)
        vocab = SHAPES[shape]["vocab_size"]
        if args.compile_layers:
            # Each switch setting (a guarded global) and each row-length range compiles its own graph;
            # three settings side by side passed dynamo's default limit of 8, after which new shapes run
            # eagerly and the figures mix compiled and eager steps.
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
            for layer in model.model.layers:
                layer.compile(dynamic=True)
        if shape == models[0] and not args.compile_layers:
            report["exactness"] = exactness_check(model, device, dtype, vocab)
            print("exactness", json.dumps(report["exactness"]), flush=True)
        model.train()
        for seed, w in workloads:
            samples = make_samples(w, vocab, seed=seed)
            modes, meta = {}, {}
            for mode in ("flat", "tree"):
                t0 = time.perf_counter()
                plan = plan_step(samples, world_size=1, gradient_accumulation_steps=10**6, token_budget=budget,
                                 flat=mode == "flat")
                rows = [pack_row(r) for r in plan.rows]
                cpu_s = time.perf_counter() - t0
                assert not plan.leftover and plan.dropped_too_long == 0
                rows = [r.to(device) for r in rows]
                trained = sum(r.num_trained for r in rows)
                modes[mode] = (rows, trained)
                m = plan.metrics()
                meta[mode] = {"rows": len(rows), "forwarded_tokens": int(m["batch/forwarded_tokens_per_step"]),
                              "trained_tokens": trained, "row_fill_frac": m["batch/row_fill_frac"],
                              "samples_per_row": m["batch/samples_per_row"], "plan_and_pack_cpu_s": cpu_s,
                              "flops": step_flops(shape, rows), "flop_parts": step_flop_parts(shape, rows)}
            gathered = lambda r: 0 if r.attention.kv_index is None else r.attention.kv_index.numel()  # noqa: E731
            longest = max(modes["tree"][0], key=gathered)
            check = None
            if len(regather_settings) > 1 and longest.attention.kv_index is not None:
                check = regather_check(longest, shape, device, dtype)
                print(f"regather check {w.name}", json.dumps(check), flush=True)
            if len(plans) > 1 and longest.attention.kv_index is not None and device.type == "cuda":
                pc = plan_check(longest, shape, device, dtype, wanted[0], plans)
                print(f"plan check {w.name} (relative error vs fp32)", json.dumps(pc), flush=True)
                check = {**(check or {}), "plans_vs_fp32": pc}
            for head, name, plan, regather in itertools.product(args.heads.split(","), wanted, plans, regather_settings):
                attention = register(name, plan)
                if "split" in attention and regather != regather_settings[0]:
                    continue  # re-gathering is the gather plan's; the split plan is timed once
                ta.set_kv_regather(regather != "off")
                ta.set_kv_regather_compiled(regather == "break")
                timed = time_modes(model, modes, args.repeats, device, head)
                res = {m: dict(meta[m]) for m in modes}
                for mode, (median, all_times, peak) in timed.items():
                    if head == "none":
                        res[mode]["flops"] -= res[mode]["flop_parts"]["head"]
                    res[mode].update(time_s=median, times_s=all_times, peak_mem_gib=peak,
                                     trained_tok_per_s=res[mode]["trained_tokens"] / median,
                                     tflops=res[mode]["flops"] / median / 1e12)
                ratio = res["flat"]["forwarded_tokens"] / res["tree"]["forwarded_tokens"]
                speedup = res["tree"]["trained_tok_per_s"] / res["flat"]["trained_tok_per_s"]
                flop_ratio = res["flat"]["flops"] / res["tree"]["flops"]
                entry = {"model": shape, "workload": w.name, "head": head, "backend": attention, "plan": plan,
                         "kv_regather": regather, "regather_check": check,
                         "group_size": w.group_size, "prompt": w.prompt, "completion": w.completion,
                         "shared_prompt": w.shared_prompt, "samples": len(samples), "packing_ratio": ratio,
                         "speedup": speedup, "speedup_over_ratio": speedup / ratio, "flop_ratio": flop_ratio,
                         "speedup_over_flop_ideal": speedup / flop_ratio,
                         "tree_over_flat_peak_mem": (res["tree"]["peak_mem_gib"] / res["flat"]["peak_mem_gib"]
                                                     if res["flat"]["peak_mem_gib"] else None), **res}
                if w.name in (args.profile or "").split(",") and device.type == "cuda" and (regather == regather_settings[-1]
                                                                          or "split" in attention):
                    entry["profile"] = {m: profile_step(model, rows, trained, head)
                                        for m, (rows, trained) in modes.items()}
                    for m, prof in entry["profile"].items():
                        profiling.print_profile(m, prof)
                report["results"].append(entry)
                print(f"{shape:11s} {w.name:10s} {head:7s} {attention:16s} regather {regather:5s} "
                      f"ratio {ratio:5.2f} speedup {speedup:5.2f} "
                      f"({speedup / flop_ratio:4.2f}x FLOP-ideal {flop_ratio:4.2f}; {speedup / ratio:4.2f}x ratio)  "
                      f"flat {res['flat']['time_s']:.3f}s {res['flat']['peak_mem_gib'] or 0:.1f}GiB  "
                      f"tree {res['tree']['time_s']:.3f}s {res['tree']['peak_mem_gib'] or 0:.1f}GiB", flush=True)
            write_report(args.out, report, announce=False)  # what is measured so far survives a cut-off run
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()

    write_report(args.out, report)


if __name__ == "__main__":
    main()

"""Share of the bf16 weight elements an optimizer step changes, and the bytes of a sparse patch against dense.

Our trainer (``AsyncGRPOTrainer``'s own loop, as ``peer_trl_gpu.py`` drives it: the rollout source replaced by
the fixed stream of ``peer_gpu_stream.py``, weight sync off) trains a Qwen3-1.7B-shaped policy (random
weights, seed 0; fp32 master weights, bf16 compute, AdamW with the config's defaults: betas 0.9/0.999, eps
1e-8, no weight decay, gradients clipped to norm 1) on rows of the ratio ~3.4 workload, one 16k-token row per
step, with real gradients of the GRPO loss. For each learning rate a fresh trainer starts from the same weights
and takes the same steps. Around every ``optimizer.step()`` each parameter is cast to bf16 (what a bf16 server
receives) before and after, and the elements whose bf16 bits differ are counted.

Bytes per step: dense = 2 bytes per element; sparse = 6 bytes per changed element (an int32 flat index and a
bf16 value, per parameter); "sparse, dense where smaller" takes per parameter the smaller of the two.

    python3 -m benchmarks.sync.sparse_share --out $OUT/sparse_share.json        # one GPU (about 2 minutes)
    python -m benchmarks.sync.sparse_share --smoke                               # CPU, tiny model
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch


from benchmarks.peers.peer_gpu_runs import ours_config, stream_trainer  # noqa: E402
from benchmarks.peers.peer_gpu_stream import SHAPES, SMOKE_BUDGET, SMOKE_WORKLOADS, WORKLOADS, make_stream, write_model_folder  # noqa: E402
from benchmarks.bench_io import write_report  # noqa: E402

LEARNING_RATES = (1e-6, 3e-6, 1e-5)
INDEX_BYTES, VALUE_BYTES = 4, 2


def kind_of(name: str) -> str:
    for key, kind in (("embed_tokens", "embedding (tied head)"), ("lm_head", "embedding (tied head)"),
                      ("norm", "norms"), ("self_attn", "attention"), ("mlp", "mlp")):
        if key in name:
            return kind
    return "other"


class ChangeMeter:
    """Wraps ``optimizer.step``: counts, per parameter, the elements whose bf16 cast changed."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer):
        self.params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.steps: list[dict[str, Any]] = []
        inner = optimizer.step

        def measured(*a: Any, **kw: Any) -> Any:
            before = [self._bf16_bits(p) for _, p in self.params]
            out = inner(*a, **kw)
            self.steps.append(self._compare(before))
            return out

        optimizer.step = measured

    @staticmethod
    def _bf16_bits(p: torch.Tensor) -> torch.Tensor:
        local = p.to_local() if hasattr(p, "to_local") else p  # one rank: an FSDP2 shard holds the whole tensor
        return local.detach().to(torch.bfloat16).view(torch.int16)

    @torch.no_grad()
    def _compare(self, before: list[torch.Tensor]) -> dict[str, Any]:
        per_kind: dict[str, list[int]] = {}
        changed_total = numel_total = sparse = best = 0
        for (name, p), old in zip(self.params, before):
            changed = int((self._bf16_bits(p) != old).sum())
            numel = old.numel()
            patch = changed * (INDEX_BYTES + VALUE_BYTES)
            changed_total += changed
            numel_total += numel
            sparse += patch
            best += min(patch, numel * VALUE_BYTES)
            counts = per_kind.setdefault(kind_of(name), [0, 0])
            counts[0] += changed
            counts[1] += numel
        return {"changed": changed_total, "elements": numel_total, "share": changed_total / numel_total,
                "dense_bytes": numel_total * VALUE_BYTES, "sparse_bytes": sparse, "sparse_or_dense_bytes": best,
                "sparse_over_dense": sparse / (numel_total * VALUE_BYTES),
                "share_by_kind": {k: c / n for k, (c, n) in per_kind.items()}}


def run_lr(model_dir: str, stream: Any, lr: float, smoke: bool) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as out:
        # Eager layers: the gradients are the same function as compiled ones, and no compile time is spent.
        config = ours_config(out, stream, len(stream.rows), lr, compile_mode="none", bf16=False if smoke else None)
        trainer = stream_trainer(model_dir, stream, config)
        meter = ChangeMeter(trainer.model, trainer.optimizer)
        start = time.perf_counter()
        history = trainer.train()
    steps = [{"step": i + 1, "loss": h.get("loss"), "grad_norm": h.get("grad_norm"), **m}
             for i, (h, m) in enumerate(zip(history, meter.steps))]
    return {"learning_rate": lr, "attention": trainer.attention_backend, "compile_mode": trainer.compile_mode,
            "bf16": trainer.bf16, "seconds": time.perf_counter() - start, "steps": steps}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--out", default="benchmarks/results/sparse_share.json")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny model (fp32 training): checks the script")
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    shape, budget = ("tiny", SMOKE_BUDGET) if args.smoke else ("qwen3-1.7b", 16384)
    workload = (SMOKE_WORKLOADS if args.smoke else WORKLOADS)[1]  # ratio~3.4
    work = Path(tempfile.mkdtemp(prefix="sparse_share_"))
    model_dir = str(write_model_folder(shape, work / "model", device))
    stream = make_stream([workload], args.steps, budget, SHAPES[shape]["vocab_size"], seed=1, check_trl=False)
    report: dict[str, Any] = {
        "env": {"torch": torch.__version__, "python": platform.python_version(),
                "device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu"},
        "command": " ".join(sys.argv), "shape": shape, "workload": workload.name, "token_budget": budget,
        "rows": [{"samples": len(r), "trained_tokens": int(sum(stream.samples[i].num_trained for i in r))}
                 for r in stream.rows],
        "runs": [run_lr(model_dir, stream, lr, args.smoke) for lr in LEARNING_RATES],
    }
    report["summary"] = {f"{r['learning_rate']:g}": {
        "share_per_step": [s["share"] for s in r["steps"]],
        "sparse_over_dense_per_step": [s["sparse_over_dense"] for s in r["steps"]],
        "share_mean": sum(s["share"] for s in r["steps"]) / len(r["steps"])} for r in report["runs"]}
    write_report(args.out, report)
    for lr, s in report["summary"].items():
        print(f"lr {lr}: changed share per step " + " ".join(f"{x:.4f}" for x in s["share_per_step"])
              + "; sparse/dense " + " ".join(f"{x:.3f}" for x in s["sparse_over_dense_per_step"]), flush=True)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

"""Weight sync on a CPU vLLM server, side by side: dense and delta pushes over gloo, storage patches, the checks.

One run, one server (the tiny model, fp32 weights served, bf16 on the wire as a bf16 trainer sends):

1. For each learning rate, AdamW takes ``--pushes`` steps of the tiny model on next-token loss over the
   arithmetic task (real gradients, fp32 master weights); the bf16 cast of every step is kept.
2. The same sequence of versions is pushed three ways, one after the other: ``dense`` (every weight,
   ``ProtocolWeightSync``), ``delta`` (changed elements where smaller, the same engine) and ``storage``
   (a patch written to a local folder, the server told to apply it: ``StoragePatchSync``, a keyframe
   first). Per push: bytes moved, seconds, changed share; after the last push of each way the
   server's probe log-probs are compared with the trainer's (``PushVerifier``).
3. The checks' own cost: the probe request to the server, the trainer's probe forward, the digest of
   the model's bytes; and the delta encoder on its own.

    flock /tmp/grpo-cpu.lock .venv/bin/python -m benchmarks.sync.weight_sync_trust --out benchmarks/results/weight_sync_trust.json
    .venv/bin/python -m benchmarks.sync.weight_sync_trust --smoke --server-url URL --out /tmp/weight_sync_trust.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from benchmarks.bench_io import write_report


def train_versions(model_path: str, lr: float, pushes: int) -> list[dict[str, torch.Tensor]]:
    """The fp32 weights after each of ``pushes`` AdamW steps (version 0: before any)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from grpo_core.tiny import arithmetic_dataset

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(model_path)
    tok.pad_token = tok.pad_token or tok.eos_token
    rows = arithmetic_dataset()["train"]
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    versions = [{n: p.detach().clone() for n, p in model.named_parameters()}]
    for step in range(pushes):
        texts = [tok.apply_chat_template(rows[8 * step + i]["prompt"], tokenize=False, add_generation_prompt=True)
                 + f"The answer is \\boxed{{{rows[8 * step + i]['solution']}}}." for i in range(8)]
        batch = tok(texts, return_tensors="pt", padding=True)
        loss = model(**batch, labels=batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        versions.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return versions


def push_all(make_sync: Any, model: torch.nn.Module, versions: list[dict[str, torch.Tensor]], first: int) -> list[dict]:
    sync = make_sync()
    rows = []
    try:
        for i, weights in enumerate(versions):
            with torch.no_grad():
                for name, p in model.named_parameters():
                    p.copy_(weights[name])
            stats = sync.push(first + i)
            rows.append({"version": first + i, "bytes": stats.bytes, "dense_bytes": stats.dense_bytes,
                         "seconds": stats.seconds, "changed_share": stats.changed_share})
    finally:
        sync.close()
    return rows


def probe_against_bf16_server(model_path: str, folder: Path, versions: list[dict[str, torch.Tensor]]) -> dict[str, Any]:
    """The probe's |server - trainer| on a server computing in bf16, fed the fp32 trainer's weights (every
    version of the last learning rate), and how far one version moves the probe: the scale a 16-bit
    server's tolerance must cover and the one it must still see."""
    from transformers import AutoModelForCausalLM

    from grpo_core.fleet.verify import PushVerifier, VerifyConfig
    from grpo_core.sync.protocol import ProtocolWeightSync
    from grpo_core.sync.source import ModelWeightSource
    from grpo_core.vllm_server.control import VLLMControlClient
    from grpo_core.vllm_server.process import VLLMServer, VLLMServerSpec

    server = VLLMServer(VLLMServerSpec(model=model_path, max_model_len=512, max_logprobs=20, dtype="bfloat16"),
                        folder / "server-bf16")
    server.start(timeout_s=1800)
    control = VLLMControlClient(server.base_url)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    verifier = PushVerifier(VerifyConfig(logprob_atol=1e9), model.config.vocab_size)  # measure, never refuse
    sync = ProtocolWeightSync(control, ModelWeightSource(model), backend="gloo")
    diffs, moved = [], []
    try:
        for version, weights in enumerate(versions):
            with torch.no_grad():
                for name, p in model.named_parameters():
                    p.copy_(weights[name])
                ids = verifier.token_ids
                logp = model(torch.tensor([ids]), use_cache=False).logits[0].double().log_softmax(-1)
            sync.push(version)
            report = verifier.check_logprobs(control, version, torch.stack([logp[t - 1, ids[t]] for t in range(1, len(ids))]))
            diffs.append(report.max_diff)
            if report.moved is not None:
                moved.append(report.moved)
    finally:
        sync.close()
        control.close()
        server.stop()
    return {"served_dtype": "bfloat16", "max_diff": max(diffs), "median_diff": statistics.median(diffs),
            "moved_median": statistics.median(moved) if moved else None, "diffs": diffs, "moved": moved}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pushes", type=int, default=10)
    ap.add_argument("--lrs", default="1e-6,1e-5,1e-4")
    ap.add_argument("--out", default="benchmarks/results/weight_sync_trust.json")
    ap.add_argument("--server-url", default=None, help="push to this running server of the tiny model (gloo weight "
                    "transfer) instead of starting one")
    ap.add_argument("--smoke", action="store_true", help="two pushes at one learning rate, no second (bf16) server: "
                    "checks the script")
    args = ap.parse_args()
    if args.smoke:
        args.pushes, args.lrs = 2, "1e-4"

    from transformers import AutoModelForCausalLM

    from grpo_core.fleet.verify import PushVerifier, VerifyConfig
    from grpo_core.sync.protocol import ProtocolWeightSync
    from grpo_core.sync.source import ModelWeightSource
    from grpo_core.sync.storage_sync import PatchPublisher, StoragePatchSync
    from grpo_core.sync.wire.buckets import plan_buckets
    from grpo_core.sync.wire.delta import encode_bucket
    from grpo_core.sync.wire.digest import tensor_digest
    from grpo_core.tiny import build_tiny_model
    from grpo_core.vllm_server.control import VLLMControlClient
    from grpo_core.vllm_server.process import VLLMServer, VLLMServerSpec

    model_path = str(build_tiny_model())
    torch.set_num_threads(1)
    report: dict[str, Any] = {"pushes": args.pushes, "lrs": {}}
    with tempfile.TemporaryDirectory() as tmp:
        server = None
        if args.server_url is None:
            server = VLLMServer(VLLMServerSpec(model=model_path, max_model_len=512, max_logprobs=20), Path(tmp) / "server")
            server.start(timeout_s=1800)
        control = VLLMControlClient(args.server_url or server.base_url)
        try:
            model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
            source = ModelWeightSource(model, wire_dtype=torch.bfloat16)
            verifier = PushVerifier(VerifyConfig(), model.config.vocab_size)
            first = 1000
            for lr_text in args.lrs.split(","):
                lr = float(lr_text)
                versions = train_versions(model_path, lr, args.pushes)
                ways = {
                    "dense": lambda: ProtocolWeightSync(control, source, backend="gloo"),
                    "delta": lambda: ProtocolWeightSync(control, source, backend="gloo", encoding="delta"),
                    "storage": lambda: StoragePatchSync(control, PatchPublisher(
                        source, f"{tmp}/patches-{lr_text}-{time.monotonic_ns()}", rank=0, keyframe_every=10_000)),
                }
                result: dict[str, Any] = {}
                for way, make in ways.items():
                    rows = push_all(make, model, versions, first)
                    first += len(versions)
                    later = rows[1:]  # the first push of each way is whole
                    result[way] = {
                        "rows": rows,
                        "median_bytes": statistics.median(r["bytes"] for r in later),
                        "median_s": statistics.median(r["seconds"] for r in later),
                    }
                shares = [r["changed_share"] for r in result["delta"]["rows"][1:]]
                result["changed_share_median"] = statistics.median(shares)
                dense = result["dense"]
                for way in ("delta", "storage"):
                    result[way]["bytes_vs_dense"] = result[way]["median_bytes"] / dense["median_bytes"]
                    result[way]["seconds_vs_dense"] = result[way]["median_s"] / dense["median_s"]
                report["lrs"][lr_text] = result
                print(f"lr {lr_text}: changed share {result['changed_share_median']:.4f}; median bytes dense "
                      f"{dense['median_bytes']:.0f}, delta {result['delta']['median_bytes']:.0f} "
                      f"({result['delta']['bytes_vs_dense']:.3f}x), storage patch {result['storage']['median_bytes']:.0f} "
                      f"({result['storage']['bytes_vs_dense']:.3f}x); median s dense {dense['median_s']:.3f}, delta "
                      f"{result['delta']['median_s']:.3f}, storage {result['storage']['median_s']:.3f}", flush=True)

            # The checks' cost, on the weights the server holds now (the last storage push).
            expected = verifier.token_ids
            with torch.no_grad():
                start = time.perf_counter()
                logp = model(torch.tensor([expected]), use_cache=False).logits[0].double().log_softmax(-1)
                forward_s = time.perf_counter() - start
            own = torch.stack([logp[t - 1, expected[t]] for t in range(1, len(expected))])
            checks = [verifier.check_logprobs(control, first - 1, own) for _ in range(10)]
            if checks[0] is None:  # a server that cannot answer the probe (LoRA serving on the CPU): nothing to time
                report["verify"] = {"probe_tokens": len(expected), "trainer_forward_s": forward_s,
                                    "request_s_median": None, "max_diff": None, "probe": "not served"}
            else:
                report["verify"] = {"probe_tokens": len(expected), "trainer_forward_s": forward_s,
                                    "request_s_median": statistics.median(c.seconds for c in checks),
                                    "max_diff": checks[-1].max_diff}
            big = torch.randn(32 << 20).to(torch.bfloat16)  # 64 MiB
            start = time.perf_counter()
            tensor_digest(big)
            report["digest_mb_s"] = big.numel() * 2 / 1e6 / (time.perf_counter() - start)
            plan = plan_buckets(source.metadata(), 256 << 20)
            flat = torch.cat([t.to(torch.bfloat16).reshape(-1).view(torch.uint8) for _, t in model.named_parameters()])
            old = flat.clone()
            old.view(torch.int16)[::50] ^= 1  # 2% of the elements differ
            start = time.perf_counter()
            encode_bucket(plan[0], flat[: plan[0].nbytes], old[: plan[0].nbytes])
            report["delta_encode_mb_s"] = plan[0].nbytes / 1e6 / (time.perf_counter() - start)
            probe = report["verify"]
            served = (f"probe request {probe['request_s_median'] * 1e3:.1f} ms (median of 10), probe diff "
                      f"{probe['max_diff']:.2e}" if probe["max_diff"] is not None else "no probe served")
            print(f"checks: {served}, trainer probe forward {forward_s * 1e3:.1f} ms; digest "
                  f"{report['digest_mb_s']:.0f} MB/s; delta encoding {report['delta_encode_mb_s']:.0f} MB/s", flush=True)
            if not args.smoke:  # a second server, in bf16: minutes to start on two cores
                report["bf16_server"] = probe_against_bf16_server(model_path, Path(tmp), versions)
                print(f"bf16 server: probe diff up to {report['bf16_server']['max_diff']:.3g} (median "
                      f"{report['bf16_server']['median_diff']:.3g}), one version moves it by "
                      f"{report['bf16_server']['moved_median']} (median)", flush=True)
        finally:
            control.close()
            if server is not None:
                server.stop()
    write_report(args.out, report)


if __name__ == "__main__":
    main()

"""The trainer's own loop on GPUs, fed a rollout stream recorded from the CPU server, 1 rank against 2.

``AsyncGRPOTrainer``'s loop runs unchanged (``train()``: collect a step from the stream, plan tree
rows, FSDP2 forward/backward with the loss, optimizer step, ledger, weight sync, metrics), with its two
replaceable parts given through its arguments: ``rollout_worker=`` the recording (``ReplayRollouts``), and
``weight_transfer=`` a push to the stand-in receiver of ``nccl_sync_receiver.py`` on the last GPU (``ReceiverSync``:
the packed bucket protocol over a ``torch.distributed`` NCCL group, ``--transport torch`` there, since
vLLM cannot be installed on the GPU machine). After every push, off the clock, the receiver sends each
tensor back and rank 0 checks it equals the trainer's full weight in bf16.

Three roles:

* ``record`` (CPU, against a running CPU vLLM server serving the tiny arithmetic model): trains
  ``--steps`` steps with the live worker and writes every item the trainer took from it (samples and
  group reports, in order) with the server's checked capabilities to ``--recording``;
* ``launch`` (the GPU machine): starts the receiver, then replays the recording under ``torchrun``
  with 1 rank and with 2 ranks (bf16, FSDP2, the trainer's defaults), and once more with 1 rank in
  fp32: the bf16-vs-fp32 gap per step is the noise floor the 2-rank-vs-1-rank gap is compared with;
* ``replay``: one such run (started by ``launch``).

Both replays are fed the same samples per step: 64 per step, as 1 rank x 2 rows or 2 ranks x 1 row
(the same planner capacity), so they train the same sample sets and differ only in how rows are
split over ranks and in reduction order.

Commands::

    # here (CPU), with the session's or any CPU server on the tiny model:
    python -m benchmarks.trainer.trainer_loop record --steps 10      # starts a CPU server (or --server-url URL)
    # on 2 GPUs:
    python3 -m benchmarks.trainer.trainer_loop launch --out $OUT/trainer_loop.json
    # the same on the CPU (gloo, fp32 only), to check the script:
    python -m benchmarks.trainer.trainer_loop launch --smoke
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch


from grpo_core import AsyncGRPOConfig, AsyncGRPOTrainer  # noqa: E402
from grpo_core.sync.base import SyncStats  # noqa: E402
from grpo_core.training.sources import RecordingSource, ReplayRollouts  # noqa: E402
from benchmarks.bench_io import ROOT, write_report  # noqa: E402

DEFAULT_RECORDING = ROOT / "benchmarks" / "results" / "trainer_loop_recording.pkl"
SAMPLES_PER_STEP = 64
# The demo's settings (flows/cli.py), with a fixed number of samples per step for both rank counts.
SETTINGS = dict(learning_rate=2e-4, num_generations=8, max_completion_length=24, max_staleness=2,
                num_sampler_logprobs=8, token_budget=4096, logging_steps=1, save_strategy="no",
                weight_sync_steps=1, seed=0, report_to="none")


def config_for(output_dir: str, world_size: int, server_url: str, bf16: bool | None) -> AsyncGRPOConfig:
    rows = 2  # rows per step in all: 2 per rank on one rank, 1 per rank on two
    return AsyncGRPOConfig(output_dir=output_dir, vllm_server_base_url=server_url, bf16=bf16,
                           per_device_train_batch_size=SAMPLES_PER_STEP // rows,
                           gradient_accumulation_steps=rows // world_size, **SETTINGS)


# ------------------------------------------------------------------------------------------ record
def record(args) -> None:
    from grpo_core.rewards import accuracy_reward, format_reward
    from grpo_core.tiny import arithmetic_dataset, build_tiny_model

    from grpo_core.vllm_server.process import VLLMServer, VLLMServerSpec

    model_path = build_tiny_model()
    with tempfile.TemporaryDirectory() as out:
        server = None
        if not args.server_url:  # a CPU server of our own, launched as the flow launches one
            server = VLLMServer(VLLMServerSpec(model=model_path, max_model_len=512, max_logprobs=20), out).start(900)
        try:
            config = config_for(out, 1, args.server_url or server.base_url, bf16=None)
            config.max_steps = args.steps
            recorded: list[RecordingSource] = []  # the run's worker, wrapped once it has started

            def record_worker(worker: Any) -> RecordingSource:
                recorded.append(RecordingSource(worker))
                return recorded[-1]

            trainer = AsyncGRPOTrainer(model=str(model_path), reward_funcs=[accuracy_reward, format_reward],
                                       train_dataset=arithmetic_dataset()["train"], args=config,
                                       rollout_worker=record_worker)
            history = trainer.train()
        finally:
            if server is not None:
                server.stop()
    items = recorded[0].items
    Path(args.recording).parent.mkdir(parents=True, exist_ok=True)
    with open(args.recording, "wb") as f:
        rows = [dict(r) for r in arithmetic_dataset()["train"].select(range(64))]  # the replay's dataset stand-in
        pickle.dump({"server": trainer.run.server, "items": items, "steps": args.steps, "dataset_rows": rows,
                     "losses": [h.get("loss") for h in history]}, f)
    print(f"recorded {len(items)} items over {args.steps} steps to {args.recording}")


# ------------------------------------------------------------------------------------------ replay
class ReceiverSync:
    """The trainer's ``weight_transfer``: a full-weight push to the stand-in receiver, then (off the clock) every
    tensor checked. The trainer hands it the policy to send (``attach``) when training starts."""

    mode = "full"

    def __init__(self, url: str, rank: int, device: torch.device, bucket_mb: float):
        self.url, self.rank, self.device, self.bucket_bytes = url, rank, device, int(bucket_mb * 2**20)
        self.control = self.source = self.sender = None
        self.checks: list[dict[str, Any]] = []

    def attach(self, model: torch.nn.Module) -> None:
        from grpo_core.sync.wire.address import parse_port_range
        from grpo_core.vllm_server.control import VLLMControlClient
        from benchmarks.sync.nccl_sync import HarnessSource, TorchSender

        self.control = VLLMControlClient(self.url) if self.rank == 0 else None
        self.source = HarnessSource(model)
        self.sender = TorchSender(self.control, self.source, self.rank, parse_port_range("40000-40100"),
                                  self.bucket_bytes, self.device)

    def push(self, version: int) -> SyncStats:
        from benchmarks.sync.nccl_sync import verify

        start = time.perf_counter()
        self.sender.send_weights()
        seconds = time.perf_counter() - start
        equal, count = verify(self.source, self.sender.comm, self.url if self.rank == 0 else None)
        self.checks.append({"version": version, "equal": bool(equal), "tensors": count, "seconds": seconds})
        stats = self.sender.last_stats
        return SyncStats(mode="full", bytes=int(stats.bytes) if stats is not None else 0, seconds=seconds)

    def adapter_pointer(self) -> None:
        return None

    def close(self) -> None:
        if self.control is not None:
            self.control.close()


def with_current_fields(item: Any) -> Any:
    """A recorded sample or report as the current code's dataclass: fields added since the recording was made
    get their defaults (unpickling restores only the fields the recording holds)."""
    import dataclasses

    if dataclasses.is_dataclass(item):
        for f in dataclasses.fields(item):
            if not hasattr(item, f.name):
                if f.default_factory is not dataclasses.MISSING:
                    setattr(item, f.name, f.default_factory())
                elif f.default is not dataclasses.MISSING:
                    setattr(item, f.name, f.default)
    return item


def replay(args) -> None:
    from grpo_core.rewards import accuracy_reward, format_reward

    with open(args.recording, "rb") as f:
        recording = pickle.load(f)
    recording["items"] = [with_current_fields(i) for i in recording["items"]]
    # The samples come scored from the recording; the dataset is only checked (the GPU machine has no
    # `datasets` package), so the recorded run's first rows stand in for it.
    world = int(os.environ.get("WORLD_SIZE", "1"))
    bf16 = None if args.precision == "bf16" else False
    rank = int(os.environ.get("RANK", "0"))
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}") if torch.cuda.is_available() else torch.device("cpu")
    transfer = ReceiverSync(args.receiver_url, rank, device, bucket_mb=256)
    with tempfile.TemporaryDirectory() as out:
        config = config_for(out, world, args.receiver_url, bf16=bf16)
        # The trainer's own loop, with its two replaceable parts given: the recorded stream and the stand-in push.
        trainer = AsyncGRPOTrainer(model=args.model_path, reward_funcs=[accuracy_reward, format_reward],
                                   train_dataset=recording["dataset_rows"], args=config,
                                   rollout_worker=ReplayRollouts(recording["items"], recording["server"]),
                                   weight_transfer=transfer)
        history = trainer.train()
    if int(os.environ.get("RANK", "0")) == 0:
        keys = ("loss", "reward", "grad_norm", "perf/fwd_bwd_s", "perf/step_s", "sync/seconds", "sync/bytes",
                "perf/mfu", "batch/packing_ratio", "sample/stale_dropped", "perf/trained_tokens_per_s")
        report = {"world_size": world, "precision": args.precision, "bf16": trainer.bf16,
                  "compile_mode": trainer.compile_mode, "compile_graph_breaks": trainer.compile_graph_breaks,
                  "attention_backend": trainer.attention_backend,
                  "steps": [{k: h[k] for k in keys if k in h} for h in history], "sync_checks": transfer.checks,
                  "metric_names": sorted(history[0]) if history else []}
        write_report(args.out, report, announce=False)


# ------------------------------------------------------------------------------------------ launch
def launch(args) -> None:
    from grpo_core.tiny import build_tiny_model
    from benchmarks.sync.nccl_sync import running_receiver

    model_path = args.model_path or str(build_tiny_model())
    gpus = torch.cuda.device_count() if not args.smoke else 0
    receiver_gpu = gpus - 1 if gpus else -1
    runs = [(1, "bf16"), (2, "bf16"), (1, "fp32")] if not args.smoke else [(1, "fp32"), (2, "fp32")]
    report: dict[str, Any] = {"env": {"torch": torch.__version__, "gpus": gpus,
                                      "device": torch.cuda.get_device_name(0) if gpus else "cpu"},
                              "recording": str(args.recording), "command": " ".join(sys.argv), "runs": {}}
    for world, precision in runs:
        name = f"{world}rank_{precision}"
        with running_receiver("--device", str(receiver_gpu), "--transport", "torch", "--model-path", model_path) as url:
            with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as tmp:
                out = tmp.name
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
                   "-m", "benchmarks.trainer.trainer_loop", "replay", "--receiver-url", url, "--model-path", model_path,
                   "--recording", str(args.recording), "--precision", precision, "--out", out]
            try:
                subprocess.run(cmd, check=True, timeout=args.timeout, cwd=ROOT)
                report["runs"][name] = json.loads(Path(out).read_text())
            except (subprocess.SubprocessError, OSError, ValueError) as exc:
                report["runs"][name] = {"error": f"{type(exc).__name__}: {exc}"}
    report["comparison"] = compare(report["runs"], "bf16" if not args.smoke else "fp32")
    with open(args.recording, "rb") as f:
        recorded = pickle.load(f)["losses"]
    one_fp32 = report["runs"].get("1rank_fp32", {}).get("steps", [])
    # The CPU run that recorded the stream trained in fp32 on these samples: its losses again.
    report["comparison"]["loss_recorded_cpu_fp32"] = recorded
    report["comparison"]["abs_diff_fp32_replay_vs_recorded"] = [abs(s["loss"] - r) for s, r in zip(one_fp32, recorded)]
    write_report(args.out, report)
    print(json.dumps(report["comparison"], indent=1))


def compare(runs: dict[str, Any], precision: str) -> dict[str, Any]:
    """Per step: |loss(2 ranks) - loss(1 rank)|, and where an fp32 run exists, |loss(bf16) - loss(fp32)|
    on one rank (the noise floor); plus every sync's check."""
    one, two = runs.get(f"1rank_{precision}", {}), runs.get(f"2rank_{precision}", {})
    if "steps" not in one or "steps" not in two:
        return {"error": "a run failed; see runs"}
    l1 = [s["loss"] for s in one["steps"]]
    l2 = [s["loss"] for s in two["steps"]]
    result: dict[str, Any] = {
        "steps": [len(l1), len(l2)],
        "loss_1rank": l1, "loss_2rank": l2,
        "abs_diff_2rank_vs_1rank": [abs(a - b) for a, b in zip(l1, l2)],
        "syncs_all_equal": all(c["equal"] for r in (one, two) for c in r["sync_checks"]),
        "syncs": sum(len(r["sync_checks"]) for r in (one, two)),
        "same_metric_names": one.get("metric_names") == two.get("metric_names"),
    }
    fp32 = runs.get("1rank_fp32", {})
    if precision == "bf16" and "steps" in fp32:
        l0 = [s["loss"] for s in fp32["steps"]]
        result["loss_1rank_fp32"] = l0
        result["abs_diff_bf16_vs_fp32"] = [abs(a - b) for a, b in zip(l1, l0)]
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("role", choices=("record", "launch", "replay"))
    ap.add_argument("--server-url", help="record: a CPU vLLM server serving the tiny model (default: start one)")
    ap.add_argument("--steps", type=int, default=10, help="record: steps to record")
    ap.add_argument("--recording", default=str(DEFAULT_RECORDING))
    ap.add_argument("--receiver-url")
    ap.add_argument("--model-path", help="the tiny model's folder (launch: default, build it)")
    ap.add_argument("--precision", choices=("bf16", "fp32"), default="bf16")
    ap.add_argument("--timeout", type=float, default=400)
    ap.add_argument("--out", default="benchmarks/results/trainer_loop.json")
    ap.add_argument("--smoke", action="store_true", help="launch on the CPU (gloo, fp32): checks the script")
    args = ap.parse_args()
    {"record": record, "launch": launch, "replay": replay}[args.role](args)


if __name__ == "__main__":
    main()

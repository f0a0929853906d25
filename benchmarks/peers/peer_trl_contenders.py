"""Inside one contender's process of ``benchmarks/peers/peer_trl.py``: the run itself, recorded step by step.

``contender_main`` runs one of this project's trainers (``run_ours``) or TRL's (``run_trl_sync``,
``run_trl_async``, in TRL's own environment) on the shared settings, with a ``Recorder`` that keeps each
step's wall clock and metrics and copies the weights at the evaluation steps; ``peer_trl.py`` starts it in
a subprocess and scores the copies afterwards.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

# The demo's settings (flows/cli.py DEMO_TRAINER), shared by every contender.
SHARED = {
    "learning_rate": 2e-4,
    "num_generations": 8,
    "batch_completions": 64,  # completions trained per optimizer step (8 prompts x 8)
    "max_completion_length": 24,
    "temperature": 1.0,
    "epsilon": 0.2,
    "epsilon_high": 0.28,
    "max_grad_norm": 1.0,
    "seed": 0,
    "max_model_len": 512,
    "max_staleness": 2,  # the demo's; TRL's async trainer gets the same
}


class Recorder:
    """Per-step wall clock and metrics, and weight copies at the evaluation steps."""

    def __init__(self, spec: dict[str, Any]):
        self.spec = spec
        self.snapshot_steps = set(spec["snapshot_steps"])
        self.t0: float | None = None
        self.steps: list[dict[str, float]] = []
        self.snapshots: dict[int, tuple[float, dict[str, Any]]] = {}

    def start(self) -> None:
        self.t0 = time.perf_counter()

    def step_end(self, step: int, model: Any, metrics: dict[str, float]) -> None:
        now = time.perf_counter() - self.t0
        prev = self.steps[-1]["t_end"] if self.steps else 0.0
        self.steps.append({"step": step, "t_end": now, "wall_s": now - prev, **metrics})
        if step in self.snapshot_steps:
            # The tiny model has about a million weights: a copy costs well under a millisecond per step.
            state = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
            self.snapshots[step] = (now, state)

    def write(self, out: Path, extra: dict[str, Any]) -> None:
        import torch

        snaps = []
        for step, (t, state) in sorted(self.snapshots.items()):
            path = out.parent / f"{out.stem}-step{step}.pt"
            torch.save(state, path)
            snaps.append({"step": step, "t": t, "path": str(path)})
        out.write_text(json.dumps({"steps": self.steps, "snapshots": snaps, **extra}, indent=1))


def _datasets(spec: dict[str, Any]) -> tuple[Any, Any]:
    from grpo_core.tiny import arithmetic_dataset

    ds = arithmetic_dataset(num_train=spec["num_train"], num_eval=spec["num_eval"], seed=spec["seed"])
    return ds["train"], ds["eval"]


def _threads() -> dict[str, Any]:
    import torch

    return {"torch_threads": torch.get_num_threads(), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS")}


# ---- this project --------------------------------------------------------------------------------------------
def run_ours(spec: dict[str, Any], out: Path, sync: bool) -> dict[str, Any]:
    from grpo_core import AsyncGRPOConfig, AsyncGRPOTrainer
    from grpo_core.rewards import accuracy_reward, format_reward

    from grpo_core.tracking.tracker import NullTracker

    rec = Recorder(spec)

    class StepEnds(NullTracker):
        """The trainer's metric sink: each step's end, with the model and the step's whole log entry."""

        trainer: Any = None

        def log_metrics(self, metrics: dict[str, float], step: int) -> None:
            if not rec.steps or rec.steps[-1]["step"] != step:  # a second call for a step is its checkpoint's
                rec.step_end(step, self.trainer.model, self.trainer.state.log_history[-1])

    s = SHARED
    knobs: dict[str, Any] = {"max_staleness": s["max_staleness"]}
    if sync:
        knobs = {"max_staleness": 0, "max_concurrent_rollouts": s["batch_completions"]}
    config = AsyncGRPOConfig(
        output_dir=str(out.parent / f"{out.stem}-output"),
        report_to="none",
        save_strategy="no",
        bf16=False,
        max_steps=spec["steps"],
        learning_rate=s["learning_rate"],
        num_generations=s["num_generations"],
        per_device_train_batch_size=s["batch_completions"],
        max_completion_length=s["max_completion_length"],
        temperature=s["temperature"],
        epsilon=s["epsilon"],
        epsilon_high=s["epsilon_high"],
        max_grad_norm=s["max_grad_norm"],
        num_sampler_logprobs=8,
        token_budget=4096,
        seed=s["seed"],
        logging_steps=1,  # the sink hears of every step
        vllm_server_base_url=spec["server_url"],
        **knobs,
    )
    train, _ = _datasets(spec)
    sink = StepEnds()
    trainer = AsyncGRPOTrainer(spec["model_path"], reward_funcs=[accuracy_reward, format_reward], args=config,
                               train_dataset=train, tracker=sink)
    sink.trainer = trainer
    rec.start()
    trainer.train()
    rec.write(out, {"config": {k: getattr(config, k) for k in ("max_staleness", "max_concurrent_rollouts", "queue_maxsize")},
                    **_threads()})
    return {}


# ---- TRL -----------------------------------------------------------------------------------------------------
def _trl_callback(rec: Recorder) -> Any:
    from transformers import TrainerCallback

    class RecordSteps(TrainerCallback):
        """Step ends and their logged metrics (TRL logs once per step with ``logging_steps=1``)."""

        def __init__(self) -> None:
            self.logs: dict[int, dict[str, float]] = {}

        def on_train_begin(self, args, state, control, **kw):  # noqa: ANN001, ARG002
            rec.start()

        def on_log(self, args, state, control, logs=None, **kw):  # noqa: ANN001, ARG002
            self.logs.setdefault(state.global_step, {}).update({k: float(v) for k, v in (logs or {}).items()
                                                                  if isinstance(v, (int, float))})

        def on_step_end(self, args, state, control, model=None, **kw):  # noqa: ANN001, ARG002
            rec.step_end(state.global_step, model, {})

    return RecordSteps()


def _merge_trl_logs(rec: Recorder, callback: Any, phase_times: dict[int, dict[str, float]]) -> None:
    # on_log runs after on_step_end for the same step; join them here.
    for row in rec.steps:
        row.update(callback.logs.get(row["step"], {}))
        row.update(phase_times.get(row["step"], {}))


def run_trl_sync(spec: dict[str, Any], out: Path) -> dict[str, Any]:
    from trl import GRPOConfig, GRPOTrainer

    from grpo_core.rewards import accuracy_reward, format_reward

    s = SHARED
    rec = Recorder(spec)
    phase: dict[int, dict[str, float]] = {}

    class Timed(GRPOTrainer):
        """Times generation + scoring (one call per step: steps_per_generation = 1); TRL's code is unchanged."""

        def _generate_and_score_completions(self, inputs):  # noqa: ANN001
            start = time.perf_counter()
            result = super()._generate_and_score_completions(inputs)
            phase[self.state.global_step + 1] = {"gen_s": time.perf_counter() - start,
                                                 "gen_tokens": float(result["completion_mask"].sum())}
            return result

    common = dict(
        max_steps=spec["steps"], learning_rate=s["learning_rate"], lr_scheduler_type="constant",
        per_device_train_batch_size=s["batch_completions"], gradient_accumulation_steps=1,
        num_generations=s["num_generations"], max_completion_length=s["max_completion_length"],
        temperature=s["temperature"], top_p=1.0, top_k=0, epsilon=s["epsilon"], epsilon_high=s["epsilon_high"],
        max_grad_norm=s["max_grad_norm"], beta=0.0, bf16=False, use_cpu=True, logging_steps=1,
        save_strategy="no", report_to="none", seed=s["seed"], dataloader_num_workers=0,
    )
    train, _ = _datasets(spec)
    use_vllm = spec.get("trl_generation", "vllm colocate") == "vllm colocate"
    extra = dict(use_vllm=True, vllm_mode="colocate", vllm_max_model_length=s["max_model_len"]) if use_vllm else {}
    config = GRPOConfig(output_dir=str(out.parent / f"{out.stem}-output"), **common, **extra)
    callback = _trl_callback(rec)
    try:
        trainer = Timed(model=spec["model_path"], reward_funcs=[accuracy_reward, format_reward], args=config,
                        train_dataset=train, callbacks=[callback])
        trainer.train()
    except Exception as err:  # noqa: BLE001 - recorded as what stops this mode on the CPU build
        attempt = {"mode": "vllm colocate" if use_vllm else "transformers generate", "error": _error(err)}
        print(f"trl_sync {attempt['mode']} failed:\n{attempt['error']}", file=sys.stderr, flush=True)
        out.write_text(json.dumps({"error": attempt["error"], "attempts": [attempt]}, indent=1))
        return {"failed": True}
    _merge_trl_logs(rec, callback, phase)
    rec.write(out, {"generation": "vllm colocate" if use_vllm else "transformers generate", **_threads()})
    return {}


class GlooWeightTransfer:
    """TRL's ``WeightTransferProtocol`` over this project's gloo backend (handed in through the trainer's public
    ``weight_transfer`` argument; TRL's code is unchanged). ``ProtocolWeightSync.push`` pauses (``mode=keep``),
    sends and resumes by itself, so ``pause``/``resume`` have nothing left to do."""

    def __init__(self, model: Any, base_url: str):
        self.model, self.base_url = model, base_url
        self.sync: Any = None
        self.control: Any = None
        self.version = 0

    def init_weight_transfer(self) -> None:
        from grpo_core.sync.protocol import ProtocolWeightSync
        from grpo_core.sync.source import ModelWeightSource
        from grpo_core.vllm_server.control import VLLMControlClient

        self.control = VLLMControlClient(self.base_url, timeout=600)
        self.sync = ProtocolWeightSync(self.control, ModelWeightSource(self.model), backend="gloo")

    def pause(self) -> None:
        pass

    def send_weights(self, iterator: Any) -> None:
        for _ in iterator:  # the same parameters, read from the model by the source (one process: no gathers)
            pass
        self.version += 1
        self.sync.push(self.version)

    def resume(self) -> None:
        pass

    def destroy(self) -> None:
        if self.sync is not None:
            self.sync.close()
            self.control.close()


def run_trl_async(spec: dict[str, Any], out: Path) -> dict[str, Any]:
    """TRL's async trainer as a user builds it (default NCCL transfer), then with this project's gloo transfer
    through its public ``weight_transfer`` argument; whatever stops each is recorded. Two probes name what would
    stop it next, past its constructor: the trainer side of its NCCL transfer, and its tree-attention kernel."""
    from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer

    from grpo_core.rewards import accuracy_reward, format_reward

    s = SHARED
    rec = Recorder(spec)
    train, _ = _datasets(spec)
    attempts: list[dict[str, str]] = []
    for backend in ("nccl (TRL default)", "gloo (grpo_core, through weight_transfer=)"):
        config = AsyncGRPOConfig(
            output_dir=str(out.parent / f"{out.stem}-output"), max_steps=spec["steps"],
            learning_rate=s["learning_rate"], per_device_train_batch_size=s["batch_completions"],
            gradient_accumulation_steps=1, num_generations=s["num_generations"],
            max_completion_length=s["max_completion_length"], temperature=s["temperature"],
            epsilon=s["epsilon"], epsilon_high=s["epsilon_high"], max_grad_norm=s["max_grad_norm"],
            max_staleness=s["max_staleness"], token_budget=0, vllm_server_base_url=spec["server_url"],
            bf16=False, use_cpu=True, logging_steps=1, save_strategy="no", report_to="none", seed=s["seed"],
        )
        rec.steps.clear()
        rec.snapshots.clear()
        callback = _trl_callback(rec)
        trainer = None
        try:
            # The trainer loads its own model from the path; the gloo transfer is bound to that object after
            # construction (the protocol's init_weight_transfer runs at train begin).
            transfer = GlooWeightTransfer(None, spec["server_url"]) if backend.startswith("gloo") else None
            trainer = AsyncGRPOTrainer(model=spec["model_path"], reward_funcs=[accuracy_reward, format_reward],
                                       args=config, train_dataset=train, callbacks=[callback], weight_transfer=transfer)
            if transfer is not None:
                transfer.model = trainer.accelerator.unwrap_model(trainer.model)
            trainer.train()
        except Exception as err:  # noqa: BLE001 - recorded as what stops this backend on the CPU build
            attempts.append({"weight_transfer": backend, "error": _error(err)})
            print(f"trl_async {backend} failed:\n{attempts[-1]['error']}", file=sys.stderr, flush=True)
            _stop_trl_worker(trainer)
            continue
        _merge_trl_logs(rec, callback, {})
        rec.write(out, {"weight_transfer": backend, "attempts": attempts, **_threads()})
        return {}
    attempts += _trl_async_probes(spec)
    out.write_text(json.dumps({"error": "TRL's AsyncGRPOTrainer cannot train on this CPU build without changes to TRL",
                               "attempts": attempts}, indent=1))
    return {"failed": True}


def _trl_async_probes(spec: dict[str, Any]) -> list[dict[str, str]]:
    import threading

    from grpo_core.vllm_server.process import free_port

    probes = []
    # 1. The trainer side of TRL's default transfer, exactly as WeightTransferClient.init_weight_transfer calls it.
    from trl.experimental.async_grpo import weight_transfer as trl_wt

    box: list[str] = []

    def nccl() -> None:
        try:
            trl_wt.open_trainer_endpoint({"master_address": "127.0.0.1", "master_port": free_port(), "rank_offset": 1,
                                          "world_size": 2, "packed": True})
            box.append("returned")
        except BaseException as err:  # noqa: BLE001
            box.append(_error(err))

    thread = threading.Thread(target=nccl, daemon=True)
    thread.start()
    thread.join(60)
    probes.append({"probe": "NCCL weight transfer, trainer side (weight_transfer.open_trainer_endpoint)",
                   "error": box[0] if box else "blocked for 60 s waiting for the server's ranks"})
    # 2. The attention kernel every training forward uses (packing.tree_attention -> _flash_attn()).
    from trl.experimental.async_grpo import packing as trl_packing

    try:
        trl_packing._flash_attn()
        probes.append({"probe": "tree attention kernel (packing._flash_attn)", "error": "loaded"})
    except Exception as err:  # noqa: BLE001
        probes.append({"probe": "tree attention kernel (packing._flash_attn)", "error": _error(err)})
    for p in probes:
        print(f"trl_async probe {p['probe']}:\n{p['error']}", file=sys.stderr, flush=True)
    return probes


def _stop_trl_worker(trainer: Any) -> None:
    worker = getattr(trainer, "rollout_worker", None)
    if worker is not None:
        try:
            worker.stop()
        except Exception:  # noqa: BLE001 - it may never have started
            pass


def _error(err: BaseException) -> str:
    """The exception chain, innermost cause last, each with the frames that led to it (innermost last)."""
    parts = []
    while err is not None:
        frames, seen = [], set()
        for f in reversed(traceback.extract_tb(err.__traceback__)):
            label = f"{_short(f.filename)}:{f.lineno} {f.name}"
            if label not in seen:  # a recursive loader repeats its frame
                seen.add(label)
                frames.append(label)
        where = " <- ".join(frames[:8])
        parts.append(f"{type(err).__module__}.{type(err).__qualname__}: {err}\n    at {where}")
        err = err.__cause__ or err.__context__
    return "\n  caused by ".join(parts)


def _short(filename: str) -> str:
    marker = "site-packages/"
    return filename.split(marker, 1)[1] if marker in filename else Path(filename).name


def contender_main(name: str, spec_path: str, out: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    out_path = Path(out)
    runners = {
        "trl_sync": lambda: run_trl_sync(spec, out_path),
        "trl_async": lambda: run_trl_async(spec, out_path),
        "ours_async": lambda: run_ours(spec, out_path, sync=False),
        "ours_sync": lambda: run_ours(spec, out_path, sync=True),
    }
    result = runners[name]()
    return 3 if result.get("failed") else 0

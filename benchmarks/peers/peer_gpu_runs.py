"""One trainer on the fixed stream, in a process of its own: ours, or TRL 1.16.0's ``AsyncGRPOTrainer``.

Both are driven through their own public classes and their own loops (``train()``). What is replaced:

* ours: through the trainer's own arguments, the rollout worker by the stream (``rollout_worker=``
  ``ReplayRollouts``, with the sampler's capabilities: no candidate sets) and the weight sync by ``NoSync``
  (``weight_transfer=``, a push that sends nothing); the step clock is its metric sink (``tracker=``);
* TRL: its rollout worker by ``StreamWorker`` (its ``rollout_worker=`` argument: a queue preloaded with the
  stream's samples) and its weight transfer by ``NoWeightTransfer`` (its ``weight_transfer=`` argument;
  ``send_weights`` does not read the parameter iterator, so nothing is gathered or sent). Its tree
  attention fetches ``kernels-community/flash-attn3`` from the Hugging Face Hub through ``kernels``
  (``trl.experimental.async_grpo.packing._flash_attn``), which an offline machine cannot do: that one
  function is pointed at ``TreeKernel``, which takes the same call and runs a kernel that is installed.

Each process records, at every step end (after a device synchronisation): the wall time since the last
step end, the peak allocated device memory since then (the peak is reset there), and the step's loss.
"""

from __future__ import annotations

import dataclasses
import os
import queue
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import torch


from grpo_core import AsyncGRPOConfig, AsyncGRPOTrainer  # noqa: E402
# grpo_core internals used here (module paths may move): these four lines only.
from grpo_core.models.attention.backends import load_flash_attn_cute, load_torch_varlen  # noqa: E402
from grpo_core.models.attention.gather import _emulated_kernel  # noqa: E402
from grpo_core.vllm_server.checks import ServerCapabilities  # noqa: E402
from grpo_core.sync.base import SyncStats  # noqa: E402
from grpo_core.tracking.tracker import NullTracker  # noqa: E402
from grpo_core.training.sources import ReplayRollouts  # noqa: E402
from benchmarks.peers.peer_gpu_stream import EPSILON, EPSILON_HIGH, Stream, trl_fields  # noqa: E402

LEARNING_RATE = 1e-12
"""The step benchmark's learning rate: AdamW does all its arithmetic, but a weight moves by at most about 1e-12
per step, which rounds away for every fp32 weight larger than 2e-5 in magnitude, so every step's loss is taken at
the initial weights in both trainers and can be compared between them and with the fp32 reference."""


def constant_reward(completions: list[Any], **kwargs: Any) -> list[float]:
    """Never called (the stream comes scored); ``AsyncGRPOTrainer`` checks that one is given."""
    return [0.0] * len(completions)


class StepClock(NullTracker):
    """Wall time and peak allocated device memory between consecutive step ends: the trainer's metric sink, which
    it hands each step's metrics once the step is done (``log_metrics``; a later call for the same step, the
    checkpoint's, is not a step end)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.last: float | None = None
        self.last_step: int | None = None
        self.steps: list[dict[str, Any]] = []

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        if step != self.last_step:
            self.last_step = step
            self.mark()

    def mark(self) -> None:
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        peak = torch.cuda.max_memory_allocated(self.device) / 2**30 if cuda else None
        reserved = torch.cuda.max_memory_reserved(self.device) / 2**30 if cuda else None
        if cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        self.steps.append({"time_s": None if self.last is None else now - self.last, "peak_gib": peak,
                           "peak_reserved_gib": reserved})
        self.last = now


# ------------------------------------------------------------------------------------------ ours
class NoSync:
    """A push that sends nothing: the step benchmark leaves weight sync out on both sides."""

    mode = "full"

    def push(self, version: int) -> SyncStats:
        return SyncStats(mode="full", bytes=0, seconds=0.0)

    def adapter_pointer(self) -> None:
        return None

    def close(self) -> None:
        return None


def ours_config(output_dir: str, stream: Stream, steps: int, learning_rate: float, **overrides: Any) -> AsyncGRPOConfig:
    """Our defaults, with the step's shape and the objective set to TRL's: the same clip, no score
    centering (TRL has no sampler top-N), and the importance-sampling mask opened to [0, 1e9] (TRL has none)."""
    return AsyncGRPOConfig(
        output_dir=output_dir, max_steps=steps, logging_steps=1, report_to="none", save_strategy="no", seed=0,
        learning_rate=learning_rate, token_budget=stream.token_budget, gradient_accumulation_steps=1,
        per_device_train_batch_size=100_000, num_generations=8, max_staleness=4, weight_sync_steps=1,
        epsilon=EPSILON, epsilon_high=EPSILON_HIGH, num_sampler_logprobs=0, score_centering=False,
        vllm_importance_sampling_clip_min=0.0, vllm_importance_sampling_clip_max=1e9, **overrides)


def stream_trainer(model_dir: str, stream: Stream, config: AsyncGRPOConfig, tracker: Any = None) -> AsyncGRPOTrainer:
    """Our trainer on the stream, through its public arguments: the stream as its rollout source (a sampler with no
    candidate sets), a push that sends nothing, and ``tracker`` as its metric sink."""
    sampler = ServerCapabilities(max_model_len=stream.token_budget, served_model="stream", tokens_endpoint=True,
                                 candidate_sets=False)
    return AsyncGRPOTrainer(model=model_dir, reward_funcs=[constant_reward], train_dataset=[{"prompt": "p"}],
                            args=config, rollout_worker=ReplayRollouts(stream.samples, sampler),
                            weight_transfer=NoSync(), tracker=tracker)


def run_ours(model_dir: str, stream: Stream, smoke: bool) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as out:
        config = ours_config(out, stream, len(stream.rows), LEARNING_RATE, bf16=False if smoke else None)
        clock = StepClock(torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu"))
        trainer = stream_trainer(model_dir, stream, config, tracker=clock)
        clock.device = trainer.device
        history = trainer.train()
    steps = []
    for h, step_clock in zip(history, clock.steps):
        steps.append({**step_clock, "loss": h.get("loss"), "trained_tokens": h.get("batch/trained_tokens_per_step"),
                      "packing_ratio": h.get("batch/packing_ratio"), "fwd_bwd_s": h.get("perf/fwd_bwd_s")})
    return {"trainer": "ours", "attention": trainer.attention_backend, "compile_mode": trainer.compile_mode,
            "bf16": trainer.bf16, "config": {k: v for k, v in dataclasses.asdict(config).items() if k != "output_dir"},
            "steps": steps}


# ------------------------------------------------------------------------------------------ TRL
class TreeKernel:
    """What TRL's tree attention calls where it would call the Hub's FA3 build: ``flash_attn_varlen_func``
    with FA3's arguments, run by an installed kernel (``fa4``: FlashAttention-4, ``fa2``: PyTorch's
    varlen FlashAttention-2, ``emulated``: a PyTorch loop for the CPU)."""

    LOADERS = {"fa4": load_flash_attn_cute, "fa2": load_torch_varlen, "emulated": lambda: _emulated_kernel}

    def __init__(self, name: str):
        self.name = name
        self.kernel = self.LOADERS[name]()

    def flash_attn_varlen_func(self, q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=None, causal=False,
                               window_size=(-1, -1), **kwargs):
        if not causal or tuple(window_size) != (-1, -1) or kwargs:
            raise ValueError(f"TreeKernel takes causal attention without window or softcap, got causal={causal}, "
                             f"window_size={window_size}, {sorted(kwargs)}")
        scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
        return self.kernel(q, k, v, cu_q, cu_k, int(max_q), int(max_k), scale)


class StreamWorker:
    """TRL's ``RolloutWorkerProtocol`` over the stream: its queue holds every sample from the start."""

    def __init__(self, samples: list[Any]):
        self.rollout_buffer: queue.Queue = queue.Queue()
        self.metrics_queue: queue.Queue = queue.Queue()
        for s in samples:
            self.rollout_buffer.put_nowait(s)

    def start(self) -> None:
        return None

    def stop(self) -> None:
        return None

    def update_model_version(self, model_version: int) -> None:
        return None

    def check_health(self, stale_after_s: float) -> None:
        raise RuntimeError("the stream is exhausted: the trainer asked for more samples than it holds")


class NoWeightTransfer:
    """TRL's ``WeightTransferProtocol``, sending nothing (its documented way to turn trainer-side sync off)."""

    def init_weight_transfer(self) -> None:
        return None

    def pause(self) -> None:
        return None

    def send_weights(self, iterator: Any) -> None:
        return None  # the iterator is not read: no parameter is gathered or copied

    def resume(self) -> None:
        return None

    def destroy(self) -> None:
        return None


def trl_samples(stream: Stream) -> list[Any]:
    """The stream as TRL's ``RolloutSample``s; TRL's first push is version 1 where ours is 0, hence +1
    (the same staleness on both sides)."""
    from trl.experimental.async_grpo.async_rollout_worker import RolloutSample as TRLSample

    return [TRLSample(prompt=[], completion=[], **trl_fields(s, s.policy_version + 1)) for s in stream.samples]


def run_trl(model_dir: str, stream: Stream, smoke: bool, kernel: str, gradient_checkpointing: bool,
            attn_override: str | None = None) -> dict[str, Any]:
    import datasets
    from transformers import AutoTokenizer, TrainerCallback
    from trl.experimental.async_grpo import AsyncGRPOConfig as TRLConfig, AsyncGRPOTrainer as TRLTrainer
    from trl.experimental.async_grpo import packing as trl_packing

    tree_kernel = TreeKernel(kernel)
    trl_packing._flash_attn = lambda: tree_kernel  # the one replaced lookup (see the module docstring)
    if smoke:  # a CPU build of torch: TRL reads the GPU's name for its MFU at construction (smoke runs only)
        import trl.experimental.async_grpo.async_grpo_trainer as trl_trainer

        trl_trainer.get_peak_flops_per_device = lambda *a, **k: None
    device = torch.device("cuda" if torch.cuda.is_available() and not smoke else "cpu")
    clock, step_logs, losses = StepClock(device), [], []

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            clock.mark()

        def on_log(self, args, state, control, logs=None, **kw):
            if logs is not None and "loss" in logs:  # a step's log (the end-of-training summary has none)
                step_logs.append(dict(logs))

    class ObservedTRL(TRLTrainer):
        def compute_loss(self, *a, **kw):  # records the loss TRL computes, then hands it back unchanged
            loss = super().compute_loss(*a, **kw)
            losses.append(loss.detach())
            return loss

    with tempfile.TemporaryDirectory() as out:
        config = TRLConfig(output_dir=out, max_steps=len(stream.rows), logging_steps=1, report_to="none",
                           save_strategy="no", seed=0, learning_rate=LEARNING_RATE, gradient_accumulation_steps=1,
                           token_budget=stream.token_budget, max_staleness=4, epsilon=EPSILON,
                           epsilon_high=EPSILON_HIGH, temperature=1.0, num_generations=8,
                           gradient_checkpointing=gradient_checkpointing, bf16=not smoke, use_cpu=smoke)
        trainer = ObservedTRL(model=model_dir, reward_funcs=[constant_reward], args=config,
                              train_dataset=datasets.Dataset.from_dict({"prompt": ["p"]}),
                              processing_class=AutoTokenizer.from_pretrained(model_dir), callbacks=[Clock()],
                              rollout_worker=StreamWorker(trl_samples(stream)), weight_transfer=NoWeightTransfer())
        if attn_override is not None:
            trainer.model.set_attn_implementation(attn_override)
        trainer.train()
    steps = []
    for k, c in enumerate(clock.steps):
        log = step_logs[k] if k < len(step_logs) else {}
        steps.append({**c, "loss": float(losses[k]) if k < len(losses) else None,
                      "trained_tokens": log.get("batch/trained_tokens_per_step"),
                      "packing_ratio": log.get("batch/packing_ratio"), "fwd_bwd_s": log.get("perf/fwd_bwd_s"),
                      "staleness_mean": log.get("sample/staleness_mean")})
    return {"trainer": "trl", "attention": f"TRL tree attention, kernel {kernel}" + (
            f", model attention switched to {attn_override}" if attn_override else ""),
            "gradient_checkpointing": gradient_checkpointing, "bf16": not smoke,
            "config": {"dtype": config.dtype, "optim": str(config.optim), "torch_compile": config.torch_compile,
                       "gradient_checkpointing": config.gradient_checkpointing, "max_grad_norm": config.max_grad_norm},
            "steps": steps}


def error_record(exc: BaseException) -> dict[str, str]:
    """The exception as recorded in the JSON: type, message and the frame that raised it."""
    frames = traceback.extract_tb(exc.__traceback__)
    where = f"{Path(frames[-1].filename).name}:{frames[-1].lineno} {frames[-1].name}" if frames else ""
    return {"error": f"{type(exc).__name__}: {exc}"[:1500], "raised_at": where}

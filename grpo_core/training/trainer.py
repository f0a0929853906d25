"""``AsyncGRPOTrainer``: the training loop, readable top to bottom.

    setup    check the inputs, build the policy (``training.policy``), restore a checkpoint; the orchestrator
             (``training.orchestrator.RunOrchestrator``) waits for and checks the servers, pushes the current
             weights and starts the rollout worker
    loop     collect one step of samples (stale ones kept or dropped: ``stale_samples``; rows packed)
             → forward/backward every micro-batch → optimizer step → record the prompts consumed
             → push weights every ``weight_sync_steps`` → evaluate every ``eval_steps`` → log
             → checkpoint every ``save_steps``
    teardown stop the worker, close the transport and the tracker

The loop works against three seams the orchestrator holds: the feed it collects each step from, ``push`` (the
weight publisher: every serving server, confirmed there, a failed one recovered from, drained or named,
``fleet.RunServers``) and the step log (the metric sink). Rank 0 owns the rollout worker and talks to vLLM; every
rank trains its own row of each micro-batch. The rollout worker and the weight transfer can be replaced through
the constructor (``training.sources``). The public
surface follows TRL's trainer: ``args``, ``model``, ``processing_class``, ``state`` (``global_step``,
``log_history``), ``train(resume_from_checkpoint=...)``, ``training_step``, ``evaluate()``, ``save_model(dir)``.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from grpo_core.checkpoint import CheckpointParts, Checkpointer, save_policy
from grpo_core.config import AsyncGRPOConfig
from grpo_core.data.inputs import check_trainer_inputs, inputs_with_environment
from grpo_core.data.prompts import is_streaming
from grpo_core.ranks import DistInfo, shutdown_distributed
from grpo_core.rollout.stages import AsyncRolloutLoop
from grpo_core.tracking.tracker import Tracker
from grpo_core.training.collector import COLLECTION_INTERRUPTED, StepBatch, TrainingFrontier, WeightVersions
from grpo_core.training.host_memory import release_free_heap
from grpo_core.training.loss import LossConfig
from grpo_core.training.micro_batch import MicroBatch
from grpo_core.training.optimizer_step import optimizer_step
from grpo_core.training.orchestrator import RolloutInputs, RunOrchestrator
from grpo_core.training.policy import build_policy
from grpo_core.training.sources import RolloutSource, SourceWrapper, WeightTransfer, check_replacements


@dataclass
class TrainerState:
    """Where training stands (TRL's ``trainer.state``): the step and every logged step's metrics."""

    global_step: int = 0
    log_history: list[dict[str, float]] = field(default_factory=list)

    def state_dict(self) -> dict[str, Any]:
        return {"global_step": self.global_step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.global_step = int(state["global_step"])


class AsyncGRPOTrainer:
    """Asynchronous GRPO: a rollout process samples from vLLM while this process trains."""

    loop_cls: type[AsyncRolloutLoop] = AsyncRolloutLoop

    def __init__(
        self,
        model: Any,
        reward_funcs: Any = None,
        args: AsyncGRPOConfig | None = None,
        train_dataset: Any = None,
        processing_class: Any = None,
        *,
        eval_dataset: Any = None,
        peft_config: Any = None,
        tools: list[Any] | None = None,
        environment_factory: Any = None,
        rollout_worker: RolloutSource | SourceWrapper | None = None,
        weight_transfer: WeightTransfer | None = None,
        tracker: Tracker | None = None,
    ):
        """TRL's arguments, and the parts a caller may replace (``training.sources`` says how):
        ``rollout_worker`` (where samples come from; None: a rollout process sampling the run's vLLM servers),
        ``weight_transfer`` (how pushes reach the sampler; None: vLLM's weight-transfer protocol to every server)
        and ``tracker`` (where metrics go; None: ``report_to`` decides). With a ``RolloutSource`` and a
        ``WeightTransfer`` both given, the trainer talks to no vLLM server at all."""
        self.args = args if args is not None else AsyncGRPOConfig(output_dir=f"{_model_name(model)}-AsyncGRPO")
        self.reward_funcs = list(reward_funcs) if isinstance(reward_funcs, (list, tuple)) else [f for f in [reward_funcs] if f]
        # An existing environment (``args.environment``) gives the data and the rewards.
        self.args, self.reward_funcs, train_dataset, eval_dataset = inputs_with_environment(
            self.args, self.reward_funcs, train_dataset, eval_dataset)
        custom_loop = environment_factory is not None or self.loop_cls is not AsyncRolloutLoop
        # Bad input named here, in the main process, before anything is loaded or spawned.
        check_trainer_inputs(self.args, model, self.reward_funcs, train_dataset, eval_dataset, scored_elsewhere=custom_loop)
        self.train_dataset = train_dataset
        self.eval_dataset = eval_dataset
        self.tools = list(tools or [])
        self.environment_factory = environment_factory
        self.peft_config = peft_config
        self.rollout_worker = rollout_worker
        self.weight_transfer = weight_transfer
        check_replacements(rollout_worker, weight_transfer, self.args.server_urls())
        self.dist = DistInfo.from_env()
        self.device = self.dist.device()
        # The policy owns the model and its training parts; the trainer reads them through properties (below).
        self.policy = build_policy(model, processing_class, peft_config, self.args, self.dist, self.device)
        self.loss_config = LossConfig.from_config(self.args.training)
        self.micro_batch = MicroBatch(self.model, self.args.training, self.loss_config, self.vocab_size, self.moe, self.grad_scaler)
        self.state = TrainerState()
        self.frontier = TrainingFrontier()
        self.versions = WeightVersions()
        rollout = RolloutInputs(loop_cls=self.loop_cls, tokenizer=self.processing_class, dataset=train_dataset,
                                reward_funcs=self.reward_funcs, tools=self.tools, environment_factory=environment_factory,
                                custom_loop=custom_loop)
        self.run = RunOrchestrator(self.args, self.dist, rollout, self.versions, self.frontier,
                                   rollout_worker=rollout_worker, weight_transfer=weight_transfer, tracker=tracker,
                                   settings=self._resolved_settings(), log_history=self.state.log_history)
        self.tracker, self.step_log = self.run.tracker, self.run.step_log  # the metric sink
        self.checkpointer = Checkpointer(self.args.checkpoint, self.dist, self._checkpoint_parts(), self.tracker)

    # The policy's parts under the trainer's names (TRL's: model, processing_class, optimizer, lr_scheduler), read from
    # the policy each time: it is their one owner, and nothing here holds a copy that could fall behind it.
    model = property(lambda self: self.policy.model, doc="The model being trained (FSDP2-sharded across ranks).")
    model_path = property(lambda self: self.policy.model_path, doc="The folder the model was loaded from, if any.")
    processing_class = property(lambda self: self.policy.processing_class, doc="The tokenizer.")
    optimizer = property(lambda self: self.policy.optimizer)
    lr_scheduler = property(lambda self: self.policy.lr_scheduler)
    grad_scaler = property(lambda self: self.policy.grad_scaler, doc="fp16's gradient scaler, else None.")
    bf16 = property(lambda self: self.policy.bf16)
    compute_dtype = property(lambda self: self.policy.compute_dtype, doc="What forward and backward run in.")
    compile_mode = property(lambda self: self.policy.compile_mode)
    compile_graph_breaks = property(lambda self: self.policy.compile_graph_breaks)
    keep_weights_between_micro_batches = property(lambda self: self.policy.keep_weights_between_micro_batches)
    attention_backend = property(lambda self: self.policy.attention_backend)
    experts_implementation = property(lambda self: self.policy.experts_implementation)
    moe = property(lambda self: self.policy.moe)
    vocab_size = property(lambda self: self.policy.vocab_size)
    perf = property(lambda self: self.policy.perf)

    # TRL's names for what this trainer holds under its own.
    @property
    def global_step(self) -> int:
        return self.state.global_step

    @property
    def train_dtype_name(self) -> str:
        """The dtype the trainer computes in, as the server checks name it ("float32", "bfloat16", "float16")."""
        return str(self.compute_dtype).removeprefix("torch.")

    @property
    def tokenizer(self) -> Any:
        return self.processing_class

    # The run's servers, rollout worker, feed and pushes are the orchestrator's alone: read them as ``trainer.run.fleet``,
    # ``trainer.run.server`` and so on, never through a second name here.

    # ------------------------------------------------------------------------------------------ train
    def train(self, resume_from_checkpoint: bool | str | None = None) -> list[dict[str, float]]:
        """Train until ``max_steps`` (or the data ends); returns the logged metrics of every step.

        ``resume_from_checkpoint`` (True: the newest good checkpoint under ``output_dir``; a path: that
        one) takes precedence over ``args.resume_from_checkpoint`` for this call.
        """
        self.run.check_crossing()
        wanted = resume_from_checkpoint if resume_from_checkpoint is not None else self.args.resume_from_checkpoint
        finished = False
        try:
            self._setup(wanted)
            while self.args.max_steps <= 0 or self.global_step < self.args.max_steps:
                step_start = time.perf_counter()
                self.run.tend(self.global_step)
                batch = self.run.feed.collect(self.versions)
                if batch is None:
                    break
                if batch == COLLECTION_INTERRUPTED:
                    continue  # a server restarted or came back while this step's samples were collected
                metrics = self.training_step(batch)
                self.state.global_step += 1
                self.run.feed.mark_trained(batch)
                metrics.update(self.checkpointer.record_step(batch, self.run.server_restarts))  # the prompts it consumed
                if self._is_sync_step():
                    metrics.update(self.run.push(self.global_step))
                if self._is_eval_step():  # after the push: the server serves this step's policy
                    metrics.update(self.run.evaluate_step(self.eval_dataset, self.global_step))
                metrics.update(self.run.step_metrics(batch, time.perf_counter() - step_start))
                metrics.update(self.perf.metrics(batch.plan.rows, metrics["perf/fwd_bwd_s"], metrics["perf/step_s"]))
                self.step_log.record(self.global_step, metrics)
                self.step_log.completions(self.global_step, batch)
                for version, evaluated in self.run.evaluations_ended():  # beside training: at the step evaluated
                    self.step_log.record_late(version, evaluated)
                # After the step is logged: a step that a checkpoint holds is always in the run's
                # history, so resuming from it leaves no gap in the logged steps.
                if self.checkpointer.should_save(self.global_step) or self._is_last_step():
                    self.step_log.record(self.global_step, self.checkpointer.save(), same_step=True)
                release_free_heap()  # the step's host tensors are gone; keep resident memory flat
            for version, evaluated in self.run.evaluations_ended(wait_s=self.args.request_timeout):
                self.step_log.record_late(version, evaluated)
            finished = True
        finally:
            self._teardown(finished)
        return self.state.log_history

    def _is_last_step(self) -> bool:
        return self.args.max_steps > 0 and self.global_step >= self.args.max_steps

    def _is_sync_step(self) -> bool:
        return self.global_step % self.args.weight_sync_steps == 0 or self._is_last_step() or self._is_eval_step()

    def _is_eval_step(self) -> bool:
        return (
            self.args.eval_strategy == "steps" and self.eval_dataset is not None and self.global_step % self.args.eval_steps == 0
        )

    # ------------------------------------------------------------------------------------------ setup
    def _resolved_settings(self) -> dict[str, Any]:
        """What the settings left to the run (``auto``, None) became here, under the settings' names."""
        return {
            "bf16": self.bf16,
            "compile_mode": self.compile_mode,
            "compile_graph_breaks": self.compile_graph_breaks,  # None (no tag) unless layers are compiled whole
            "fsdp_keep_weights_between_micro_batches": self.keep_weights_between_micro_batches,
            "attention_backend": self.attention_backend,  # the kernel, and the tree plan where it splits
            "experts_implementation": self.experts_implementation,
            "weight_transfer_backend": self.args.resolved_weight_transfer_backend(self.device.type == "cuda"),
            "max_concurrent_rollouts": self.args.resolved_max_concurrent_rollouts(self.dist.world_size),
            "num_generations_eval": self.args.num_eval_generations(),
        }

    def _checkpoint_parts(self) -> CheckpointParts:
        return CheckpointParts(
            model=self.model,
            optimizer=self.optimizer,
            lr_scheduler=self.lr_scheduler,
            progress=self.state,
            frontier=self.frontier,
            tokenizer=self.processing_class,
            serve_dtype=None if self.compute_dtype == torch.float32 else self.compute_dtype,
            num_prompts=None if is_streaming(self.train_dataset) else len(self.train_dataset),
            adapter_base=(self.model_path or "") if self.peft_config is not None else None,
        )

    def _setup(self, resume_from_checkpoint: bool | str | None) -> None:
        """Restore a checkpoint, then let the orchestrator bring the servers to these weights and start sampling."""
        self.checkpointer.resume(resume_from_checkpoint)
        self.run.start(self.policy, self.global_step, self.peft_config, self.device, self.train_dtype_name,
                       on_server=self._use_server)

    def _use_server(self, capabilities: Any) -> None:
        """What the loss computes follows what the sampler sends: candidate sets, routed experts to replay."""
        self.micro_batch.candidate_sets = capabilities.candidate_sets
        if self.moe is not None:
            self.moe.replay = self.args.routing_replay and capabilities.routed_experts

    # ------------------------------------------------------------------------------------------ one step
    def training_step(self, batch: StepBatch) -> dict[str, float]:
        """One optimizer step on a collected batch (its rows for this rank): forward, loss and backward per row,
        clip, step; returns the step's loss and metrics over all ranks. A subclass may wrap it, e.g. to keep what
        reached the optimizer."""
        self.model.train()
        return optimizer_step(batch, self.dist.rank, self.device, self.micro_batch, self.model, self.optimizer,
                              self.lr_scheduler, self.grad_scaler, self.args.max_grad_norm,
                              keep_weights=self.keep_weights_between_micro_batches)

    # ------------------------------------------------------------------------------------------ evaluation
    def evaluate(self) -> dict[str, float]:
        """Sample ``eval_dataset`` from the server (which serves the last pushed weights) and score it with
        the reward functions; returns ``eval/*`` metrics (empty off rank 0)."""
        if self.eval_dataset is None:
            raise ValueError("evaluate() needs eval_dataset=... passed to the trainer")
        return self.run.evaluate(self.eval_dataset)

    # ------------------------------------------------------------------------------------------ saving
    def save_model(self, output_dir: str | None = None) -> str:
        """Write the policy as a servable Hugging Face folder (weights, config, tokenizer; LoRA: the adapter
        too) to ``output_dir`` (default ``args.output_dir``); every rank calls it. Returns the folder."""
        folder = Path(output_dir or self.args.output_dir)
        save_policy(folder, self.model, self.optimizer, self.processing_class, self.compute_dtype, self.dist.is_main,
                    lora=self.peft_config is not None, model_path=self.model_path)
        return str(folder)

    # ------------------------------------------------------------------------------------------ teardown
    def _teardown(self, finished: bool) -> None:
        self.run.close()
        if self.policy.owns_process_group:
            shutdown_distributed()
            self.policy.owns_process_group = False
        self.run.close_tracking(finished)


def _model_name(model: Any) -> str:
    name = model if isinstance(model, (str, os.PathLike)) else getattr(getattr(model, "config", None), "_name_or_path", "model")
    return os.path.basename(os.fspath(name).rstrip("/")) or "model"

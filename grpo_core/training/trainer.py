"""``AsyncGRPOTrainer``: the training loop, readable top to bottom.

    setup    check the inputs, load the policy, wait for and check the servers (one, or a fleet: every one
             checked, and against the others), open the weight transport, push the current weights, spawn
             the rollout worker
    loop     collect one step of samples (stale ones dropped, rows packed)
             → forward/backward every micro-batch → optimizer step → record the prompts consumed
             → push weights every ``weight_sync_steps`` → evaluate every ``eval_steps`` → log
             → checkpoint every ``save_steps``
    teardown stop the worker, close the transport and the tracker

Rank 0 owns the rollout worker and talks to vLLM; every rank trains its own row of each micro-batch.
Each weight push reaches every serving server, is confirmed there, and a failed one is recovered from, drained
(a fleet) or named (``fleet.ServerFleet``); before each step's collection the fleet is tended. The rollout
worker and the weight transfer can be replaced through the constructor (``training.sources``). The public
surface follows TRL's trainer: ``args``, ``model``, ``processing_class``, ``state`` (``global_step``,
``log_history``), ``train(resume_from_checkpoint=...)``, ``training_step``, ``evaluate()``, ``save_model(dir)``.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from grpo_core.checkpoint import CheckpointParts, Checkpointer
from grpo_core.config import AsyncGRPOConfig
from grpo_core.data.inputs import check_crossing, check_trainer_inputs, model_load_error
from grpo_core.data.prompts import is_streaming
from grpo_core.models.attention.tree import enable_tree_attention
from grpo_core.models.fsdp import FSDPSettings, full_value, needs_fsdp, shard_policy
from grpo_core.models.head.lm_head import output_head, vocab_size
from grpo_core.models.loading import load_policy, load_tokenizer
from grpo_core.models.moe.experts import use_grouped_experts
from grpo_core.models.moe.policy import MoEPolicy, finalize_moe_metrics
from grpo_core.packing.collator import pack_row
from grpo_core.rollout.stages import AsyncRolloutLoop
from grpo_core.rollout.tool_calls import ToolRegistry
from grpo_core.rollout.worker import RolloutWorker, WorkerSpec
from grpo_core.tracking.run_view import constant_metrics, resolved_tags
from grpo_core.tracking.tracker import Tracker, make_tracker
from grpo_core.training.collector import (
    COLLECTION_INTERRUPTED,
    StepBatch,
    StepCollector,
    TrainingFrontier,
    WatchedSource,
    WeightVersions,
)
from grpo_core.training.fleet import ServerFleet, VersionProbe
from grpo_core.training.distributed import (
    DistInfo,
    StepFeed,
    broadcast_object,
    gather_step_results,
    init_distributed,
    shutdown_distributed,
)
from grpo_core.training.host_memory import release_free_heap
from grpo_core.training.loss import LossConfig, finalize_metrics, reduce_metric_parts
from grpo_core.training.micro_batch import MicroBatch
from grpo_core.training.perf import PerfMeter, synchronize
from grpo_core.training.step_log import StepLog
from grpo_core.training.sources import (
    RolloutSource, SourceWrapper, WeightTransfer, assumed_capabilities, call_if_present, check_replacements, is_source)
from grpo_core.training.step_metrics import sample_and_queue_metrics
from grpo_core.training.weight_push import WeightPusher

log = logging.getLogger(__name__)


class ServerRestartError(RuntimeError):
    """The server restarted and this trainer cannot bring it back to its weights by itself."""


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
        if self.args.environment is not None:  # an existing environment gives the data and the rewards
            from grpo_core.environments import environment_inputs

            self.args, self.reward_funcs, train_dataset, eval_dataset = environment_inputs(
                self.args, self.reward_funcs, train_dataset, eval_dataset)
        # Bad input named here, in the main process, before anything is loaded or spawned.
        check_trainer_inputs(self.args, model, self.reward_funcs, train_dataset, eval_dataset,
                             scored_elsewhere=environment_factory is not None or self.loop_cls is not AsyncRolloutLoop)
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
        self.bf16 = self._resolve_precision()
        # What forward/backward run in; weights are served and saved in it too (fp32 stays as it is).
        self.compute_dtype = torch.bfloat16 if self.bf16 else (torch.float16 if self.args.fp16 else torch.float32)
        fsdp_settings = FSDPSettings.from_config(self.args, bf16=self.bf16, device_type=self.device.type)
        self.compile_mode = fsdp_settings.compile
        # Ranks (and 1-rank bf16 through FSDP2) join the process group before anything is sharded.
        self._owns_process_group = needs_fsdp(fsdp_settings, self.dist.world_size) and init_distributed(
            self.dist, self.device, timeout_s=max(3600.0, 2 * self.args.request_timeout)
        )
        torch.manual_seed(self.args.seed)
        try:
            self.model, self.model_path = load_policy(model, self.device)
        except (OSError, ValueError) as exc:
            raise model_load_error(model, exc) from exc
        self.processing_class = load_tokenizer(processing_class, self.model_path)
        if peft_config is not None:
            from grpo_core.models.lora import apply_lora, warn_if_not_saved

            self.model = apply_lora(self.model, peft_config)
            warn_if_not_saved(self.args)
        self.attention_backend = enable_tree_attention(
            self.model, backend=self.args.attention_backend, linear_backend=self.args.gdn_backend,
            kernel=self.args.attention_kernel,
            compute_dtype=self.compute_dtype, kv_regather=self.args.tree_kv_regather,
            plan=self.args.tree_attention_plan,
        )
        # Mixture-of-experts policies: experts as grouped GEMMs, routers that can replay the sampler's routes
        # (switched on in _setup once the server is known to return them).
        self.experts_implementation = use_grouped_experts(self.model)
        self.moe = MoEPolicy.for_model(self.model, replay=False, aux_loss_coef=self.args.moe_aux_loss_coef)
        if self.args.logprob_chunk_size is not None:
            output_head(self.model)  # a model the chunked head cannot run is refused before anything starts
        self.vocab_size = vocab_size(self.model)
        self.perf = PerfMeter(self.model, self.device, self.bf16, self.dist.world_size)
        self.model = shard_policy(self.model, fsdp_settings, self.device)  # before the optimizer sees the weights
        self.optimizer = torch.optim.AdamW(
            [p for p in self.model.parameters() if p.requires_grad],
            lr=self.args.learning_rate,
            betas=(self.args.adam_beta1, self.args.adam_beta2),
            eps=self.args.adam_epsilon,
            weight_decay=self.args.weight_decay,
        )
        self.lr_scheduler = _lr_scheduler(self.args, self.optimizer)
        self.grad_scaler = torch.amp.GradScaler("cuda") if self.args.fp16 else None
        self.loss_config = LossConfig.from_config(self.args)
        self.micro_batch = MicroBatch(self.model, self.args, self.loss_config, self.vocab_size, self.moe, self.grad_scaler)
        self._owns_tracker = tracker is None  # one this trainer made (report_to) is closed when train() ends
        self.tracker: Tracker = tracker or make_tracker(self.args, is_main=self.dist.is_main)
        if self.dist.is_main:
            self.tracker.set_tags(resolved_tags(self._resolved_settings()))
        self.state = TrainerState()
        # Metrics the settings fix go to MLflow as params or tags, not as flat charts (log_history keeps them).
        self.step_log = StepLog(self.args, self.tracker, self.dist.is_main, self.state.log_history, constant_metrics(
            multi_turn=bool(self.tools) or environment_factory is not None or self.loop_cls is not AsyncRolloutLoop,
            world_size=self.dist.world_size, lr_scheduler_type=self.args.lr_scheduler_type,
            weight_sync_encoding=self.args.weight_sync_encoding, weight_sync_transport=self.args.weight_sync_transport,
        ))
        self.frontier = TrainingFrontier()
        self.versions = WeightVersions()
        self.checkpointer = Checkpointer(self.args, self.dist, self._checkpoint_parts(), self.tracker)
        self.worker: RolloutWorker | None = None
        self.fleet: ServerFleet | None = None  # the servers: one pusher each, their checks and restarts (rank 0 talks)
        self.server: Any = None  # ServerCapabilities, once checked
        self.feed: StepFeed | None = None
        self.probe: VersionProbe | None = None  # the trainer's probe log-probs, once per pushed version
        self.server_restarts = 0  # servers that came back (restarted, or lost and answering again) and got the weights

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

    # ------------------------------------------------------------------------------------------ train
    def train(self, resume_from_checkpoint: bool | str | None = None) -> list[dict[str, float]]:
        """Train until ``max_steps`` (or the data ends); returns the logged metrics of every step.

        ``resume_from_checkpoint`` (True: the newest good checkpoint under ``output_dir``; a path: that
        one) takes precedence over ``args.resume_from_checkpoint`` for this call.
        """
        self._check_crossing()
        wanted = resume_from_checkpoint if resume_from_checkpoint is not None else self.args.resume_from_checkpoint
        finished = False
        try:
            self._setup(wanted)
            while self.args.max_steps <= 0 or self.global_step < self.args.max_steps:
                step_start = time.perf_counter()
                self._tend_fleet()
                batch = self.feed.collect(self.versions)
                if batch is None:
                    break
                if batch == COLLECTION_INTERRUPTED:
                    continue  # a server restarted or came back while this step's samples were collected
                metrics = self.training_step(batch)
                self.state.global_step += 1
                self.feed.mark_trained(batch)
                metrics.update(self.checkpointer.record_step(batch, self.server_restarts))  # the prompts it consumed
                if self._is_sync_step():
                    metrics.update(self._sync_weights())
                if self._is_eval_step():
                    metrics.update(self.evaluate())  # after the push: the server serves this step's policy
                metrics.update(sample_and_queue_metrics(
                    batch, time.perf_counter() - step_start, stale_dropped_total=self.feed.stale_dropped_total,
                    server_restarts=self.server_restarts, frontier=self.frontier.position,
                    queue_size=self.worker.queue_size() if self.worker is not None else 0,
                ))
                metrics.update(self.perf.metrics(batch.plan.rows, metrics["perf/fwd_bwd_s"], metrics["perf/step_s"]))
                if self.dist.is_main and self.talks_to_servers:
                    metrics.update(self.fleet.serving_metrics())
                self.step_log.record(self.global_step, metrics)
                self.step_log.completions(self.global_step, batch)
                # After the step is logged: a step that a checkpoint holds is always in the run's
                # history, so resuming from it leaves no gap in the logged steps.
                if self.checkpointer.should_save(self.global_step) or self._is_last_step():
                    self.step_log.record(self.global_step, self.checkpointer.save(), same_step=True)
                release_free_heap()  # the step's host tensors are gone; keep resident memory flat
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
        cuda = self.device.type == "cuda"
        return {
            "bf16": self.bf16,
            "compile_mode": self.compile_mode,
            "attention_backend": self.attention_backend,  # the kernel, and the tree plan where it splits
            "experts_implementation": self.experts_implementation,
            "weight_transfer_backend": self.args.resolved_weight_transfer_backend(cuda),
            "max_concurrent_rollouts": self.args.resolved_max_concurrent_rollouts(self.dist.world_size),
            "num_generations_eval": self.args.num_eval_generations(),
        }

    def _resolve_precision(self) -> bool:
        cuda = self.device.type == "cuda"
        if self.args.fp16 and not cuda:
            raise ValueError("AsyncGRPOConfig.fp16=True needs a CUDA device; on CPU leave fp16 off (training runs fp32)")
        bf16 = self.args.resolved_bf16(cuda and torch.cuda.is_bf16_supported())
        if self.args.bf16 is None and not bf16 and self.dist.is_main:
            log.info("bf16=None: training in fp32 on %s (bf16 is the default on CUDA devices that support it)", self.device)
        return bf16

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

    def _check_crossing(self) -> None:
        check_crossing(
            {
                "reward_funcs": self.reward_funcs,
                "tools": self.tools,
                "environment_factory": self.environment_factory,
                "loop_cls": self.loop_cls,
                "args": self.args,
                "train_dataset": self.train_dataset,
            }
        )
        # Signatures too (typed parameters, module-level, unique names): fail here, not in the worker.
        ToolRegistry(self.tools)

    def _setup(self, resume_from_checkpoint: bool | str | None) -> None:
        from grpo_core.vllm_server.checks import check_server, wait_for_server
        from grpo_core.vllm_server.control import VLLMControlClient

        args = self.args
        checkpoint = self.checkpointer.find_resume_point(resume_from_checkpoint)
        if checkpoint is not None:
            self.checkpointer.restore(checkpoint)
        self.checkpointer.begin_attempt()
        if self.weight_transfer is not None:
            call_if_present(self.weight_transfer, "attach", self.model)
        if not self.talks_to_servers:
            self._setup_without_servers()
            return
        cuda = self.device.type == "cuda"
        model_name = self.model_path or "<model>"
        self.fleet = self._make_fleet()
        if self.dist.is_main:
            self.fleet.connect(lambda control: wait_for_server(control, args, model_name, cuda))
        if broadcast_object(self.dist.is_main and self.fleet.left_paused()):
            # A trainer killed during a weight sync (preemption) left a server paused with half-loaded
            # weights, on which the next request would crash it: complete a push (it resumes) first.
            self._sync_weights()
        if self.dist.is_main:
            self.server = self.fleet.check(lambda control: check_server(
                control, args, model_name, self.model.config, cuda, train_dtype=self.train_dtype_name))
        self.server = broadcast_object(self.server)  # every rank must compute the same loss
        self.micro_batch.candidate_sets = self.server.candidate_sets
        if self.moe is not None:
            self.moe.replay = args.routing_replay and self.server.routed_experts
        if self.dist.is_main:
            self.tracker.set_tags({"sync/mode": self._open_sync().mode,
                                   **{f"fleet/{m.name}": m.url for m in self.fleet.members.values()}})
        # The server may hold other weights than ours (another revision, a resumed run): push first.
        self._sync_weights()
        self.worker = self._start_worker() if self.dist.is_main else None  # rank 0 owns the rollout worker
        self.feed = self._make_feed(WatchedSource(self.worker, self.fleet) if self.worker is not None else None)

    @property
    def talks_to_servers(self) -> bool:
        """Whether the trainer itself talks to vLLM servers: not when both the samples' source and the weight
        transfer are the caller's (``rollout_worker=`` a source, ``weight_transfer=`` given)."""
        return not (is_source(self.rollout_worker) and self.weight_transfer is not None)

    def _setup_without_servers(self) -> None:
        """Both replaceable parts are the caller's: push the starting weights through theirs, collect from theirs."""
        source = self.rollout_worker
        self.server = getattr(source, "server_capabilities", None) or assumed_capabilities(self.args.token_budget)
        self.micro_batch.candidate_sets = self.server.candidate_sets
        if self.moe is not None:
            self.moe.replay = self.args.routing_replay and self.server.routed_experts
        self.fleet = ServerFleet.around(self.weight_transfer, self.dist, self.vocab_size)
        self._sync_weights()  # version 0: what the source's oldest samples count their staleness from
        self.worker = self._start_worker() if self.dist.is_main else None
        self.feed = self._make_feed(source if self.dist.is_main else None)

    def _make_feed(self, source: Any) -> StepFeed:
        """Each step's batch from ``source`` (rank 0's; None on the other ranks, which receive rank 0's
        plan by broadcast and rebuild the same rows)."""
        args = self.args
        collector = StepCollector(
            source=source,
            world_size=self.dist.world_size,
            gradient_accumulation_steps=args.gradient_accumulation_steps,
            token_budget=args.token_budget,
            max_samples_per_step=args.per_device_train_batch_size * args.gradient_accumulation_steps * self.dist.world_size,
            max_staleness=args.max_staleness,
            flat=args.packing == "flat",
            frontier=self.frontier,
            timeout_s=args.request_timeout,
        )
        return StepFeed(collector, self.dist.rank, self.dist.world_size)

    @property
    def pusher(self) -> WeightPusher | None:
        """The first answering server's pusher (None before setup and after teardown)."""
        if self.fleet is None:
            return None
        members = list(self.fleet.members.values())
        return next((m.pusher for m in members if m.state != "lost"), members[0].pusher)

    def _open_sync(self) -> Any:
        """The first answering server's weight sync, its session opened (``training.weight_push``)."""
        return self.pusher.open()

    def _make_fleet(self) -> ServerFleet:
        """The run's servers, one pusher each, the probe computed once per version."""
        from grpo_core.sync.factory import SyncSetup, wire_dtype

        setup = SyncSetup(config=self.args, model=self.model, rank=self.dist.rank,
                          backend=self.args.resolved_weight_transfer_backend(self.device.type == "cuda"),
                          wire_dtype=wire_dtype(self.bf16), model_path=self.model_path, peft_config=self.peft_config)
        self.probe = VersionProbe.for_policy(self.model, self.device, self.train_dtype_name)
        if self.weight_transfer is not None:  # the caller's transport to the one server the rollouts come from
            return ServerFleet.around(self.weight_transfer, self.dist, self.vocab_size, args=self.args)
        return ServerFleet.for_run(self.args, self.dist, setup, self.probe, self.vocab_size)

    def _start_worker(self) -> Any:
        if is_source(self.rollout_worker):  # the caller's source (``rollout_worker=``): no rollout process
            call_if_present(self.rollout_worker, "start")
            call_if_present(self.rollout_worker, "publish_version", self.versions.current, consumed=0)
            return self.rollout_worker
        loop_kwargs = dict(
            config=self.args,
            tokenizer=self.processing_class,
            dataset=self.train_dataset,
            reward_funcs=self.reward_funcs,
            base_url=[m.url for m in self.fleet.members.values()],
            start_position=self.frontier.position,
            num_processes=self.dist.world_size,
            tools=self.tools,
            environment_factory=self.environment_factory,
            tokens_endpoint=self.server.tokens_endpoint,
        )
        pointer = getattr(self._open_sync(), "adapter_pointer", lambda: None)()
        # Adapter sync: requests name the newest registered adapter version, read from shared memory.
        shared = {"adapter": pointer} if pointer is not None else {}
        worker = RolloutWorker(
            WorkerSpec(loop_cls=self.loop_cls, loop_kwargs=loop_kwargs, shared_kwargs=shared),
            queue_maxsize=self.args.queue_maxsize,
            heartbeat_timeout_s=self.args.worker_heartbeat_timeout_s,
            initial_version=self.versions.current,
        )
        # The worker sends only to the servers the fleet says serve, and tells it which ones it drained.
        worker.publish_fleet(self.fleet.view())
        self.fleet.publish = worker.publish_fleet
        self.fleet.drained_by_worker = worker.drained_servers
        worker.start()
        # A wrapper of the caller's (``rollout_worker=`` a function) around the started worker: collect from it.
        return self.rollout_worker(worker) if callable(self.rollout_worker) else worker

    # ------------------------------------------------------------------------------------------ one step
    def training_step(self, batch: StepBatch) -> dict[str, float]:
        """One optimizer step on a collected batch (its rows for this rank): forward, loss and backward per row,
        clip, step; returns the step's loss and metrics over all ranks. A subclass may wrap it, e.g. to keep what
        reached the optimizer."""
        self.model.train()
        rows = [pack_row(row) for row in batch.plan.rows_for_rank(self.dist.rank)]
        num_tokens = max(1, sum(row.num_trained_tokens for row in batch.plan.rows))
        step_positions = sum(row.num_unique_tokens for row in batch.plan.rows)
        parts: list[dict[str, torch.Tensor]] = []
        losses = []
        start = time.perf_counter()
        for row in rows:
            loss, part = self.micro_batch.run(row.to(self.device), num_tokens, step_positions)
            losses.append(loss)
            parts.append(part)
        synchronize(self.device)  # kernels still queued belong to the forward/backward time
        fwd_bwd_s = time.perf_counter() - start
        if self.grad_scaler is not None:
            self.grad_scaler.unscale_(self.optimizer)
        grad_norm = torch.nn.utils.clip_grad_norm_(
            self.model.parameters(), self.args.max_grad_norm if self.args.max_grad_norm > 0 else float("inf")
        )
        if self.grad_scaler is not None:
            self.grad_scaler.step(self.optimizer)
            self.grad_scaler.update()
        else:
            self.optimizer.step()
        self.lr_scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        # The step's loss and metrics over all ranks, and the slowest rank's time.
        parts, loss_sum, fwd_bwd_s = gather_step_results(parts, float(sum(losses)), fwd_bwd_s)
        metrics = finalize_metrics(parts)
        metrics.update(finalize_moe_metrics({k: v.item() for k, v in reduce_metric_parts(parts).items()}))
        metrics.update(
            {
                "loss": loss_sum,
                "grad_norm": float(full_value(grad_norm)),
                "learning_rate": self.lr_scheduler.get_last_lr()[0],
                "perf/fwd_bwd_s": fwd_bwd_s,
            }
        )
        return metrics

    # ------------------------------------------------------------------------------------------ sync
    def _sync_weights(self, force: bool = False, only: list[str] | None = None) -> dict[str, float]:
        """Push this step's weights to every serving server and confirm them (``force``: even if they were pushed
        already; ``only``: to those servers); a failed push is recovered from, drained or named (``training.fleet``)."""
        if not force and self.versions.pushed and self.versions.current == self.global_step:
            return {}  # this step's weights are already on the servers
        self.model.eval()
        metrics = self.fleet.push(self.global_step, only=only)
        self.versions.record(self.global_step)
        if self.worker is not None:
            # With what the trainer consumed so far: the worker keeps its lead within max_staleness.
            call_if_present(self.worker, "publish_version", self.global_step,
                            consumed=self.feed.collector.consumed_total if self.feed else 0)
        return metrics

    def _tend_fleet(self) -> None:
        """Before each step's collection: servers the worker drained or that stopped answering leave service; a
        server that restarted, or answers again after it was lost, passes the start-up checks and gets this step's
        weights before the rollout worker sends it anything (``fleet.ServerFleet.tend``)."""
        ready = self.fleet.tend()
        if not ready:
            return
        if self._open_sync().mode == "adapter":
            raise ServerRestartError(
                f"the vLLM server restarted ({', '.join(ready)}); adapter-only LoRA sync cannot register its adapters "
                "on the new server from here: resume the run (the flow does) or use lora_sync_mode='merged'"
            )
        start = time.perf_counter()
        caught_up = self.versions.pushed and self.versions.current == self.global_step
        # The others hold this step's weights already: only the returning servers need them. Otherwise everyone does.
        self._sync_weights(force=True, only=ready if caught_up else None)
        self.server_restarts = self.fleet.rejoins
        where = "the restarted server" if self.fleet.single else ", ".join(ready) + ", back in service,"
        log.warning("re-pushed weight version %d to %s in %.1f s (server restart %d of this attempt)",
                    self.global_step, where, time.perf_counter() - start, self.server_restarts)

    # ------------------------------------------------------------------------------------------ evaluation
    def evaluate(self) -> dict[str, float]:
        """Sample ``eval_dataset`` from the server (which serves the last pushed weights) and score it with
        the reward functions; returns ``eval/*`` metrics (empty off rank 0)."""
        from grpo_core.training.evaluation import evaluate_on_server

        if self.eval_dataset is None:
            raise ValueError("evaluate() needs eval_dataset=... passed to the trainer")
        if not self.dist.is_main:
            return {}
        # During train(): a server that serves; before or after it (no fleet is held then): the first one configured.
        serving = [url for url in self.fleet.serving_urls() if url] if self.fleet is not None else []
        return evaluate_on_server(serving[0] if serving else self.args.server_urls()[0], self.args,
                                  self.processing_class, self.eval_dataset, self.reward_funcs,
                                  tokens_endpoint=self.server.tokens_endpoint if self.server else True)

    # ------------------------------------------------------------------------------------------ saving
    def save_model(self, output_dir: str | None = None) -> str:
        """Write the policy as a servable Hugging Face folder (weights, config, tokenizer; LoRA: the adapter
        too) to ``output_dir`` (default ``args.output_dir``); every rank calls it. Returns the folder."""
        from pathlib import Path

        from grpo_core.checkpoint.state import save_policy

        folder = Path(output_dir or self.args.output_dir)
        save_policy(folder, self.model, self.optimizer, self.processing_class, self.compute_dtype, self.dist.is_main,
                    lora=self.peft_config is not None, model_path=self.model_path)
        return str(folder)

    # ------------------------------------------------------------------------------------------ teardown
    def _teardown(self, finished: bool) -> None:
        if self.worker is not None:
            call_if_present(self.worker, "stop")
            self.worker = None
        if self.fleet is not None:
            self.fleet.close()
            self.fleet = None
        if self._owns_process_group:
            shutdown_distributed()
            self._owns_process_group = False
        if self._owns_tracker:
            self.tracker.close("FINISHED" if finished else "FAILED")


def _model_name(model: Any) -> str:
    name = model if isinstance(model, (str, os.PathLike)) else getattr(getattr(model, "config", None), "_name_or_path", "model")
    return os.path.basename(os.fspath(name).rstrip("/")) or "model"


def _lr_scheduler(args: AsyncGRPOConfig, optimizer: torch.optim.Optimizer) -> Any:
    """transformers' schedule of that name; decaying ones reach 0 at ``max_steps``."""
    from transformers import get_scheduler

    extra = {} if args.lr_scheduler_type == "constant" else {"num_warmup_steps": args.warmup_steps}
    if args.lr_scheduler_type in ("linear", "cosine"):
        if args.max_steps <= 0:
            raise ValueError(f"lr_scheduler_type={args.lr_scheduler_type!r} decays to 0 at max_steps; set max_steps > 0")
        extra["num_training_steps"] = args.max_steps
    return get_scheduler(args.lr_scheduler_type, optimizer, **extra)

"""``AsyncGRPOTrainer``: the training loop, readable top to bottom.

    setup    load the policy, check the server, open the weight transport, push version 0,
             spawn the rollout worker
    loop     collect one step of samples (stale ones dropped, rows packed)
             → forward/backward every micro-batch → optimizer step → record the prompts consumed
             → push weights every ``weight_sync_steps`` → checkpoint every ``save_steps`` → log
    teardown stop the worker, close the transport and the tracker

Rank 0 owns the rollout worker and talks to vLLM; every rank trains its own row of each micro-batch.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any

import numpy as np
import torch

from grpo_core.batching import StepBatch, StepCollector, TrainingFrontier
from grpo_core.checkpoint import Checkpointer
from grpo_core.config import AsyncGRPOConfig
from grpo_core.distributed import StepFeed, broadcast_object, gather_step_results, init_distributed, shutdown_distributed
from grpo_core.loss import LossConfig, LossInputs, candidate_mask_from_ids, finalize_metrics, grpo_loss, token_logprobs
from grpo_core.models.fsdp import FSDPSettings, full_value, needs_fsdp, shard_policy
from grpo_core.models.loading import DistInfo, load_policy, load_tokenizer
from grpo_core.models.tree_attention import enable_tree_attention
from grpo_core.packing.collator import PackedRow, pack_row
from grpo_core.perf import PerfMeter, synchronize
from grpo_core.rollout.loop import AsyncRolloutLoop
from grpo_core.rollout.tool_calls import ToolRegistry
from grpo_core.rollout.worker import RolloutWorker, WorkerSpec, check_picklable
from grpo_core.step_metrics import group_metrics
from grpo_core.tracking import NullTracker, Tracker

log = logging.getLogger(__name__)


class AsyncGRPOTrainer:
    """Asynchronous GRPO: a rollout process samples from vLLM while this process trains."""

    loop_cls: type[AsyncRolloutLoop] = AsyncRolloutLoop

    def __init__(
        self,
        model: Any,
        reward_funcs: Any,
        train_dataset: Any,
        args: AsyncGRPOConfig | None = None,
        processing_class: Any = None,
        eval_dataset: Any = None,
        peft_config: Any = None,
        tools: list[Any] | None = None,
        environment_factory: Any = None,
        tracker: Tracker | None = None,
    ):
        self.args = args or AsyncGRPOConfig()
        self.reward_funcs = list(reward_funcs) if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]
        if self.args.reward_weights is not None and len(self.args.reward_weights) != len(self.reward_funcs):
            raise ValueError(
                f"AsyncGRPOConfig.reward_weights has {len(self.args.reward_weights)} entries for "
                f"{len(self.reward_funcs)} reward functions; give one weight per function"
            )
        self.train_dataset = train_dataset
        self.eval_dataset = eval_dataset
        self.tools = list(tools or [])
        self.environment_factory = environment_factory
        self.dist = DistInfo.from_env()
        self.device = self.dist.device()
        fsdp_settings = FSDPSettings.from_config(self.args)
        # Ranks (and 1-rank bf16 through FSDP2) join the process group before anything is sharded.
        self._owns_process_group = needs_fsdp(fsdp_settings, self.dist.world_size) and init_distributed(
            self.dist, self.device, timeout_s=max(3600.0, 2 * self.args.request_timeout)
        )
        torch.manual_seed(self.args.seed)
        self.model, self.model_path = load_policy(model, self.device)
        self.tokenizer = load_tokenizer(processing_class, self.model_path)
        self.peft_config = peft_config
        if peft_config is not None:
            from grpo_core.models.lora import apply_lora, warn_if_not_saved

            self.model = apply_lora(self.model, peft_config)
            warn_if_not_saved(self.args)
        self.attention_backend = enable_tree_attention(self.model)
        self.perf = PerfMeter(self.model, self.device, self.args.bf16, self.dist.world_size)
        self.model = shard_policy(self.model, fsdp_settings, self.device)  # before the optimizer sees the weights
        self.optimizer = torch.optim.AdamW(
            [p for p in self.model.parameters() if p.requires_grad],
            lr=self.args.learning_rate,
            betas=(self.args.adam_beta1, self.args.adam_beta2),
            weight_decay=self.args.weight_decay,
        )
        self.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self._lr_lambda)
        self.loss_config = LossConfig(
            epsilon=self.args.epsilon,
            epsilon_high=self.args.epsilon_high,
            score_centering=self.args.score_centering and self.args.num_sampler_logprobs > 0,
            score_centering_weights=self.args.score_centering_weights,  # type: ignore[arg-type]
            vllm_importance_sampling_clip_min=self.args.vllm_importance_sampling_clip_min,
            vllm_importance_sampling_clip_max=self.args.vllm_importance_sampling_clip_max,
        )
        self.tracker: Tracker = tracker or NullTracker()
        self.checkpointer = Checkpointer(self.args, self.dist)
        self.global_step = 0
        self.frontier = TrainingFrontier()
        self.worker: RolloutWorker | None = None
        self.weight_sync: Any = None
        self.candidate_sets = False
        self.history: list[dict[str, float]] = []

    # ------------------------------------------------------------------------------------------ train
    def train(self) -> list[dict[str, float]]:
        """Train until ``max_steps`` (or the data ends); returns the logged metrics of every step."""
        self._check_picklable()
        self._setup()
        try:
            while self.args.max_steps <= 0 or self.global_step < self.args.max_steps:
                step_start = time.perf_counter()
                batch = self.collector.collect(version=self.global_step)
                if batch is None:
                    break
                metrics = self._optimizer_step(batch)
                self.global_step += 1
                self.collector.mark_trained(batch)
                metrics.update(self.checkpointer.record_step(self, batch))  # the prompts it consumed
                if self.global_step % self.args.weight_sync_steps == 0 or self._is_last_step():
                    metrics.update(self._sync_weights())
                metrics.update(self._step_metrics(batch, step_start))
                metrics.update(self.perf.step_metrics(batch.plan.rows, metrics["perf/fwd_bwd_s"], metrics["perf/step_s"]))
                self._log(metrics)
                # After the step is logged: a step that a checkpoint holds is always in the run's
                # history, so resuming from it leaves no gap in the logged steps.
                if self.checkpointer.should_save(self.global_step) or self._is_last_step():
                    self._log(self.checkpointer.save(self), same_step=True)
        finally:
            self._teardown()
        return self.history

    def _is_last_step(self) -> bool:
        return self.args.max_steps > 0 and self.global_step >= self.args.max_steps

    # ------------------------------------------------------------------------------------------ setup
    def _check_picklable(self) -> None:
        check_picklable(
            {
                "reward function": self.reward_funcs,
                "tool": self.tools,
                "environment_factory": [self.environment_factory] if self.environment_factory else [],
                "loop_cls": [self.loop_cls],
            }
        )
        # Signatures too (typed parameters, module-level, unique names): fail here, not in the worker.
        ToolRegistry(self.tools)

    def _setup(self) -> None:
        from grpo_core.rollout.client import VLLMControlClient
        from grpo_core.server_checks import check_server
        from grpo_core.sync.factory import make_weight_sync

        args = self.args
        checkpoint = self.checkpointer.find_resume_point()
        if checkpoint is not None:
            self.checkpointer.restore(self, checkpoint)
        self.checkpointer.begin_attempt(self)
        control = None
        if self.dist.is_main:
            control = VLLMControlClient(args.vllm_server_base_url, timeout=args.request_timeout)
        if broadcast_object(self.dist.is_main and _left_paused(control)):
            # A trainer killed during a weight sync (preemption) left the server paused with half-loaded
            # weights, on which the next request would crash it: complete a push (it resumes) first.
            if self.dist.is_main:
                _close_open_weight_update(control)
            self.weight_sync = make_weight_sync(self, control)
            self._sync_weights()
        if self.dist.is_main:
            caps = check_server(args.vllm_server_base_url, args, self.model_path or "<model>")
            self.candidate_sets = caps.candidate_sets
        self.candidate_sets = broadcast_object(self.candidate_sets)  # every rank must compute the same loss
        self.weight_sync = self.weight_sync or make_weight_sync(self, control)
        if self.dist.is_main:
            self.tracker.set_tags({"sync/mode": self.weight_sync.mode})
        # The server may hold other weights than ours (another revision, a resumed run): push first.
        self._sync_weights()
        self.worker = self._start_worker() if self.dist.is_main else None  # rank 0 owns the rollout worker
        self.collector = StepCollector(
            source=self.worker,
            world_size=self.dist.world_size,
            gradient_accumulation_steps=args.gradient_accumulation_steps,
            token_budget=args.token_budget,
            max_samples_per_step=args.per_device_train_batch_size * args.gradient_accumulation_steps * self.dist.world_size,
            max_staleness=args.max_staleness,
            flat=args.packing == "flat",
            frontier=self.frontier,
            timeout_s=args.request_timeout,
        )
        # Rank 0 collects each step and broadcasts it; the other ranks rebuild the same plan.
        self.collector = StepFeed(self.collector, self.dist.rank, self.dist.world_size)

    def _start_worker(self) -> RolloutWorker:
        loop_kwargs = dict(
            config=self.args,
            tokenizer=self.tokenizer,
            dataset=self.train_dataset,
            reward_funcs=self.reward_funcs,
            base_url=self.args.vllm_server_base_url,
            start_position=self.frontier.position,
            num_processes=self.dist.world_size,
            tools=self.tools,
            environment_factory=self.environment_factory,
        )
        worker = RolloutWorker(
            WorkerSpec(loop_cls=self.loop_cls, loop_kwargs=self._with_adapter(loop_kwargs)),
            queue_maxsize=self.args.queue_maxsize,
            heartbeat_timeout_s=self.args.worker_heartbeat_timeout_s,
        )
        worker.start()
        return worker

    def _lr_lambda(self, step: int) -> float:
        args = self.args
        if args.warmup_steps and step < args.warmup_steps:
            return (step + 1) / args.warmup_steps
        if args.lr_scheduler_type == "constant" or args.max_steps <= 0:
            return 1.0
        progress = min(1.0, (step - args.warmup_steps) / max(1, args.max_steps - args.warmup_steps))
        if args.lr_scheduler_type == "linear":
            return 1.0 - progress
        return 0.5 * (1.0 + math.cos(math.pi * progress))

    # ------------------------------------------------------------------------------------------ one step
    def _optimizer_step(self, batch: StepBatch) -> dict[str, float]:
        self.model.train()
        rows = [pack_row(row) for row in batch.plan.rows_for_rank(self.dist.rank)]
        num_tokens = max(1, sum(row.num_trained_tokens for row in batch.plan.rows))
        parts: list[dict[str, torch.Tensor]] = []
        losses = []
        start = time.perf_counter()
        for row in rows:
            loss, part = self._forward_backward(row.to(self.device), num_tokens)
            losses.append(loss)
            parts.append(part)
        synchronize(self.device)  # kernels still queued belong to the forward/backward time
        fwd_bwd_s = time.perf_counter() - start
        grad_norm = torch.nn.utils.clip_grad_norm_(
            self.model.parameters(), self.args.max_grad_norm if self.args.max_grad_norm > 0 else float("inf")
        )
        self.optimizer.step()
        self.lr_scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        # The step's loss and metrics over all ranks, and the slowest rank's time.
        parts, loss_sum, fwd_bwd_s = gather_step_results(parts, float(sum(losses)), fwd_bwd_s)
        metrics = finalize_metrics(parts)
        metrics.update(
            {
                "loss": loss_sum,
                "grad_norm": float(full_value(grad_norm)),
                "learning_rate": self.lr_scheduler.get_last_lr()[0],
                "perf/fwd_bwd_s": fwd_bwd_s,
            }
        )
        return metrics

    def _forward_backward(self, row: PackedRow, num_tokens: int) -> tuple[float, dict[str, torch.Tensor]]:
        outputs = self.model(**row.model_inputs(), logits_to_keep=row.logit_index)
        logits = outputs.logits[0]
        if row.num_trained == 0:
            # Every rank runs forward and backward so that sharded collectives stay in step.
            (logits.sum() * 0.0).backward()
            return 0.0, {}
        top_ids = None
        if self.loss_config.score_centering and row.sampler_top_ids is not None:
            top_ids = row.sampler_top_ids.clamp(min=0)
        candidates = self._candidate_masks(row, logits.shape[-1])
        logprobs, top_logprobs = token_logprobs(
            logits, row.target_ids, self.args.temperature, top_ids=top_ids, candidate_masks=candidates
        )
        inputs = LossInputs(
            logprobs=logprobs,
            sampler_logprobs=row.sampler_logprobs,
            advantages=row.advantages,
            top_logprobs=top_logprobs,
            sampler_top_logprobs=row.sampler_top_logprobs if top_ids is not None else None,
            top_valid=row.top_valid if top_ids is not None else None,
        )
        loss, part = grpo_loss(inputs, self.loss_config, num_tokens)
        loss.backward()
        return float(loss.detach()), part

    def _candidate_masks(self, row: PackedRow, vocab_size: int) -> torch.Tensor | None:
        if not self.candidate_sets or row.sampling_mask_ids is None:
            return None
        offsets = row.sampling_mask_offsets.tolist()
        ids = [row.sampling_mask_ids[offsets[t] : offsets[t + 1]] for t in range(row.num_trained)]
        return candidate_mask_from_ids(ids, vocab_size, device=row.target_ids.device)

    # ------------------------------------------------------------------------------------------ sync
    def _with_adapter(self, loop_kwargs: dict[str, Any]) -> dict[str, Any]:
        # LoRA adapter sync: the worker names the newest registered adapter version in its requests.
        pointer = getattr(self.weight_sync, "pointer", None)
        return {**loop_kwargs, "adapter": pointer} if pointer is not None else loop_kwargs

    def _sync_weights(self) -> dict[str, float]:
        from grpo_core.sync.factory import SYNC_MODE_CODES

        self.model.eval()
        stats = self.weight_sync.push(self.global_step)
        metrics = {
            "sync/bytes": float(stats.bytes),
            "sync/seconds": stats.seconds,
            "sync/mode": SYNC_MODE_CODES[stats.mode],
            "weight_version": float(self.global_step),
        }
        registered = getattr(self.weight_sync, "registered_versions", None)
        if registered is not None:
            metrics["sync/adapters_registered"] = float(len(registered))
        return metrics

    # ------------------------------------------------------------------------------------------ metrics
    def _step_metrics(self, batch: StepBatch, step_start: float) -> dict[str, float]:
        wall = time.perf_counter() - step_start
        metrics = group_metrics(batch.reports)
        metrics.update(batch.plan.metrics())
        generated = sum(r.generated_tokens for r in batch.reports)
        staleness = np.asarray(batch.staleness, dtype=np.float64)
        metrics.update(
            {
                "sample/staleness_mean": float(staleness.mean()) if staleness.size else 0.0,
                "sample/staleness_max": float(staleness.max()) if staleness.size else 0.0,
                "sample/stale_dropped": float(batch.stale_dropped),
                "sample/stale_dropped_total": float(self.collector.stale_dropped_total),
                "rollout/generated_tok_s": generated / wall if wall > 0 else 0.0,
                "perf/rollout_wait_s": batch.wait_s,
                "perf/step_s": wall,
                "rollout/frontier": float(self.frontier.position),
            }
        )
        return metrics

    def _log(self, metrics: dict[str, float], same_step: bool = False) -> None:
        """Record ``metrics`` for the current step; ``same_step`` adds them to the step logged last."""
        metrics = {k: float(v) for k, v in metrics.items() if v is not None and math.isfinite(float(v))}
        if same_step:
            self.history[-1].update(metrics)
        else:
            self.history.append({"step": float(self.global_step), **metrics})
        if self.dist.is_main and self.global_step % self.args.logging_steps == 0:
            self.tracker.log_metrics(metrics, step=self.global_step)
            if same_step:
                return
            log.info(
                "step %d  reward %.3f  loss %.4f  gen %.0f tok/s  wait %.2fs",
                self.global_step,
                metrics.get("reward", float("nan")),
                metrics.get("loss", float("nan")),
                metrics.get("rollout/generated_tok_s", 0.0),
                metrics.get("perf/rollout_wait_s", 0.0),
            )

    # ------------------------------------------------------------------------------------------ teardown
    def _teardown(self) -> None:
        if self.worker is not None:
            self.worker.stop()
            self.worker = None
        if self.weight_sync is not None:
            self.weight_sync.close()
            self.weight_sync = None
        if self._owns_process_group:
            shutdown_distributed()


def _left_paused(control: Any) -> bool:
    """Whether the server is paused, as a trainer that died during a weight sync leaves it."""
    from grpo_core.rollout.client import VLLMRequestError

    try:
        paused = control.is_paused()
    except VLLMRequestError:
        return False  # no dev-mode routes: check_server names the missing flag
    if paused:
        log.warning("the vLLM server was left paused, by a trainer that died during a weight sync; pushing weights")
    return paused


def _close_open_weight_update(control: Any) -> None:
    """Finish the weight-update session a trainer killed between start and finish left open, so the
    next push can start one. vLLM answers a start while a session is open, and a finish while none
    is, with an error (the engine runs on) and cannot be asked which holds: finish, and accept the
    refusal when there was nothing to finish."""
    from grpo_core.rollout.client import VLLMRequestError

    try:
        control.finish_weight_update()
    except VLLMRequestError as err:
        if "without a matching start" not in str(err):
            raise
        return
    log.warning("closed the weight-update session that the dead trainer left open")

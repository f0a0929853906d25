"""``RunOrchestrator``: what supervises a run around the trainer's step loop.

    start    rank 0 waits for the servers (one, or a fleet: every one checked, and against the others), the
             weight transport opens, the current weights are pushed, the rollout worker starts; every rank gets
             the feed of steps (``training.distributed.StepFeed``)
    tend     before each step's collection: servers the worker drained or that stopped answering leave service;
             one that restarted or came back passes the checks and gets the current weights (``fleet.RunServers``)
    push     a version to every serving server, confirmed there; the worker is told what was consumed
    evaluate held-out rewards from a serving server
    close    stop the worker, close the transport and the tracker

The trainer (``training.trainer``) runs the step loop against three seams: the feed it collects each step
from, ``push`` (the weight publisher) and ``step_log`` (the metric sink). The rollout worker and the weight
transfer can be the caller's (``training.sources``); with both given, no vLLM server is talked to at all.
"""

from __future__ import annotations

import copy
import logging
import time
from dataclasses import dataclass
from typing import Any

from grpo_core.data.inputs import check_crossing
from grpo_core.evaluation.beside import EvaluationBeside
from grpo_core.evaluation.heldout import EvalRollouts, evaluate_on_server
from grpo_core.fleet.probe import VersionProbe
from grpo_core.fleet.servers import RunServers
from grpo_core.fleet.weight_push import WeightPusher
from grpo_core.models.lora import max_rank
from grpo_core.ranks import DistInfo, broadcast_object
from grpo_core.rollout.tool_calls import ToolRegistry
from grpo_core.rollout.worker import RolloutWorker, WorkerSpec
from grpo_core.sync.factory import SyncSetup
from grpo_core.tracking.run_view import constant_metrics, resolved_tags
from grpo_core.tracking.tracker import Tracker, make_tracker
from grpo_core.training.collector import (
    SignalWatch,
    StepCollector,
    TrainingFrontier,
    WatchedSource,
    WeightVersions,
    no_signal_groups,
)
from grpo_core.training.distributed import StepFeed
from grpo_core.training.sources import assumed_capabilities, call_if_present, is_source
from grpo_core.training.step_log import StepLog
from grpo_core.training.step_metrics import sample_and_queue_metrics
from grpo_core.training.waste import WasteLedger
from grpo_core.vllm_server.checks import ServerChecks

log = logging.getLogger(__name__)


class ServerRestartError(RuntimeError):
    """The server restarted and this trainer cannot bring it back to its weights by itself."""


@dataclass
class RolloutInputs:
    """What the rollout worker is built from: the trainer's arguments of the same names."""

    loop_cls: type
    tokenizer: Any
    dataset: Any
    reward_funcs: list[Any]
    tools: list[Any]
    environment_factory: Any
    custom_loop: bool  # an environment or a loop class of the caller's scores the rollouts


class RunOrchestrator:
    """Supervises one trainer's run (module docstring). ``versions`` and ``frontier`` are the trainer's: what was
    pushed, and the first prompt position not yet trained (a checkpoint keeps it)."""

    def __init__(self, args: Any, dist: DistInfo, rollout: RolloutInputs, versions: WeightVersions,
                 frontier: TrainingFrontier, *, rollout_worker: Any = None, weight_transfer: Any = None,
                 tracker: Tracker | None = None, settings: dict[str, Any] | None = None,
                 log_history: list[dict[str, float]] | None = None):
        self.args, self.dist, self.rollout = args, dist, rollout
        self.rollout_worker, self.weight_transfer = rollout_worker, weight_transfer
        self.versions, self.frontier = versions, frontier
        self.owns_tracker = tracker is None  # one made here (report_to) is closed when the run ends
        self.tracker: Tracker = tracker or make_tracker(args, is_main=dist.is_main)
        if dist.is_main:
            self.tracker.set_tags(resolved_tags(settings or {}))
        multi_turn = bool(rollout.tools) or rollout.custom_loop
        # Metrics the settings fix go to MLflow as params or tags, not as flat charts (log_history keeps them).
        self.step_log = StepLog(args.tracking, self.tracker, dist.is_main, log_history if log_history is not None else [],
                                constant_metrics(multi_turn=multi_turn, world_size=dist.world_size,
                                                 lr_scheduler_type=args.lr_scheduler_type,
                                                 weight_sync_encoding=args.weight_sync_encoding,
                                                 weight_sync_transport=args.weight_sync_transport))
        self.model: Any = None
        self.worker: Any = None
        self.fleet: RunServers | None = None  # the servers: one pusher each, their checks and restarts (rank 0 talks)
        self.server: Any = None  # ServerCapabilities, once checked
        self.feed: StepFeed | None = None
        self.server_restarts = 0  # servers that came back (restarted, or lost and answering again) and got the weights
        self.waste = WasteLedger()  # what this attempt generated and did not train (``waste/*``)
        self.beside: EvaluationBeside | None = None  # evaluations beside training (``eval_beside_training``)
        self.beside_tokenizer: Any = None

    def check_crossing(self) -> None:
        """What the rollout process is handed must cross to it: fail here, not in the worker."""
        rollout = self.rollout
        check_crossing({"reward_funcs": rollout.reward_funcs, "tools": rollout.tools,
                        "environment_factory": rollout.environment_factory, "loop_cls": rollout.loop_cls,
                        "args": self.args, "train_dataset": rollout.dataset})
        # Signatures too (typed parameters, module-level, unique names).
        ToolRegistry(rollout.tools)

    @property
    def talks_to_servers(self) -> bool:
        """Whether the trainer itself talks to vLLM servers: not when both the samples' source and the weight
        transfer are the caller's (``rollout_worker=`` a source, ``weight_transfer=`` given)."""
        return not (is_source(self.rollout_worker) and self.weight_transfer is not None)

    # ------------------------------------------------------------------------------------------ start
    def start(self, policy: Any, version: int, peft_config: Any, device: Any, train_dtype: str,
              on_server: Any) -> StepFeed:
        """Bring the servers to the policy's weights as ``version`` and start sampling (``policy``:
        ``training.policy.Policy``); ``on_server(capabilities)`` is called on every rank once the server's
        capabilities are known (what the loss computes depends on them)."""
        self.model = policy.model
        if self.weight_transfer is not None:
            call_if_present(self.weight_transfer, "attach", policy.model)
        self.fleet = self._make_fleet(policy, peft_config, device, train_dtype)
        if not self.talks_to_servers:  # both replaceable parts are the caller's: no server to wait for or check
            self.server = getattr(self.rollout_worker, "server_capabilities", None) or assumed_capabilities(
                self.args.token_budget)
        else:
            if broadcast_object(self.dist.is_main and self.fleet.start()):
                # A trainer killed during a weight sync (preemption) left a server paused with half-loaded
                # weights, on which the next request would crash it: complete a push (it resumes) first.
                self.push(version)
            # Every rank must compute the same loss.
            self.server = broadcast_object(self.fleet.check() if self.dist.is_main else None)
        on_server(self.server)
        if self.dist.is_main and self.talks_to_servers:
            self.tracker.set_tags({"sync/mode": self.pusher.open().mode,
                                   **{f"fleet/{m.name}": m.url for m in self.fleet.members.values()}})
        return self._start_sampling(version, WatchedSource if self.talks_to_servers else None)

    def _start_sampling(self, version: int, watched: Any) -> StepFeed:
        """Push the current weights (the server may hold others: another revision, a resumed run; a replaced
        source counts its samples' staleness from them), start the worker (rank 0) and make the feed."""
        self.push(version)
        self.worker = self._start_worker() if self.dist.is_main else None
        source = self.worker if watched is None or self.worker is None else watched(self.worker, self.fleet)
        self.feed = self._make_feed(source if self.dist.is_main else None)
        return self.feed

    def _make_feed(self, source: Any) -> StepFeed:
        """Each step's batch from ``source`` (rank 0's; None on the other ranks, which receive rank 0's
        plan by broadcast and rebuild the same rows)."""
        args = self.args
        collector = StepCollector(
            source=source, world_size=self.dist.world_size,
            gradient_accumulation_steps=args.gradient_accumulation_steps, token_budget=args.token_budget,
            max_samples_per_step=args.per_device_train_batch_size * args.gradient_accumulation_steps * self.dist.world_size,
            max_staleness=args.max_staleness, flat=args.packing == "flat", frontier=self.frontier,
            timeout_s=args.request_timeout, signal=self._signal_watch(), stale_samples=args.stale_samples)
        return StepFeed(collector, self.dist.rank, self.dist.world_size)

    def _signal_watch(self) -> SignalWatch:
        """``no_signal_patience_steps`` steps' worth of groups without signal in a row end the run."""
        args = self.args
        per_step = args.per_device_train_batch_size * args.gradient_accumulation_steps * self.dist.world_size
        groups = no_signal_groups(args.no_signal_patience_steps, per_step, args.num_generations)
        return SignalWatch(limit=groups, steps=args.no_signal_patience_steps)

    @property
    def pusher(self) -> WeightPusher | None:
        """The first answering server's pusher (None before start and after close)."""
        if self.fleet is None:
            return None
        members = list(self.fleet.members.values())
        return next((m.pusher for m in members if m.state != "lost"), members[0].pusher)

    def _make_fleet(self, policy: Any, peft_config: Any, device: Any, train_dtype: str) -> RunServers:
        """The run's servers, built from what they take of the policy: its model and name, its vocabulary's size, the
        dtypes it computes and sends weights in, and its probe."""
        if not self.talks_to_servers:  # pushes through the caller's transport alone
            return RunServers.around(self.weight_transfer, self.dist, policy.vocab_size)
        cuda = device.type == "cuda"
        checks = ServerChecks(self.args, policy.model_path or "<model>", policy.model.config, cuda, train_dtype)
        if self.weight_transfer is not None:  # the caller's transport to the one server the rollouts come from
            return RunServers.around(self.weight_transfer, self.dist, policy.vocab_size, args=self.args.fleet,
                                     checks=checks)
        # The sync reads its own settings; the LoRA server command it may show spells every part's, so it is written here.
        lora_command = checks.lora_command(max_rank(peft_config)) if peft_config is not None else None
        setup = SyncSetup(config=self.args.sync, model=policy.model, rank=self.dist.rank,
                          backend=self.args.resolved_weight_transfer_backend(cuda), wire_dtype=policy.wire_dtype,
                          model_path=policy.model_path, peft_config=peft_config, lora_command=lora_command)
        probe = VersionProbe.of_model(policy.model, device, train_dtype, checks.server_dtype)
        return RunServers.for_run(self.args.fleet, self.dist, setup, probe, policy.vocab_size, checks)

    def _start_worker(self) -> Any:
        if is_source(self.rollout_worker):  # the caller's source (``rollout_worker=``): no rollout process
            call_if_present(self.rollout_worker, "start")
            call_if_present(self.rollout_worker, "publish_version", self.versions.current, consumed=0)
            return self.rollout_worker
        rollout = self.rollout
        loop_kwargs = dict(
            config=self.args, tokenizer=rollout.tokenizer, dataset=rollout.dataset, reward_funcs=rollout.reward_funcs,
            base_url=[m.url for m in self.fleet.members.values()], start_position=self.frontier.position,
            num_processes=self.dist.world_size, tools=rollout.tools, environment_factory=rollout.environment_factory,
            tokens_endpoint=self.server.tokens_endpoint,
        )
        if self.frontier.done_ahead:  # a resume: what the checkpoint's model trained past its frontier
            loop_kwargs["skip_positions"] = self.frontier.done_ahead
        pointer = getattr(self.pusher.open(), "adapter_pointer", lambda: None)()
        # Adapter sync: requests name the newest registered adapter version, read from shared memory.
        shared = {"adapter": pointer} if pointer is not None else {}
        worker = RolloutWorker(
            WorkerSpec(loop_cls=rollout.loop_cls, loop_kwargs=loop_kwargs, shared_kwargs=shared),
            queue_maxsize=self.args.queue_maxsize, heartbeat_timeout_s=self.args.worker_heartbeat_timeout_s,
            initial_version=self.versions.current,
        )
        self.fleet.inform(worker)
        worker.start()
        # A wrapper of the caller's (``rollout_worker=`` a function) around the started worker: collect from it.
        return self.rollout_worker(worker) if callable(self.rollout_worker) else worker

    # ------------------------------------------------------------------------------------------ during the loop
    def push(self, version: int, force: bool = False, only: list[str] | None = None) -> dict[str, float]:
        """Push the policy's weights as ``version`` to every serving server and confirm them (``force``: even if
        that version was pushed already; ``only``: to those servers); a failed push is recovered from, drained or
        named (``fleet.servers``)."""
        if not force and self.versions.pushed and self.versions.current == version:
            return {}  # this step's weights are already on the servers
        self.model.eval()
        metrics = self.fleet.push(version, only=only)
        self.server_restarts = self.fleet.rejoins  # a push can be what brought a server back
        self.versions.record(version)
        if self.worker is not None:
            # With what the trainer consumed so far: the worker keeps its lead within max_staleness.
            call_if_present(self.worker, "publish_version", version,
                            consumed=self.feed.collector.consumed_total if self.feed else 0)
        return metrics

    def tend(self, version: int) -> None:
        """Before each step's collection: servers the worker drained or that stopped answering leave service; a
        server that restarted, or answers again after it was lost, passes the start-up checks and gets ``version``'s
        weights before the rollout worker sends it anything (``fleet.RunServers.tend``)."""
        ready = self.fleet.tend()
        if not ready:
            return
        if self.pusher.open().mode == "adapter":
            raise ServerRestartError(
                f"the vLLM server restarted ({', '.join(ready)}); adapter-only LoRA sync cannot register its adapters "
                "on the new server from here: resume the run (the flow does) or use lora_sync_mode='merged'"
            )
        start = time.perf_counter()
        caught_up = self.versions.pushed and self.versions.current == version
        # The others hold this version already: only the returning servers need it. Otherwise everyone does.
        self.push(version, force=True, only=ready if caught_up else None)
        self.server_restarts = self.fleet.rejoins
        where = "the restarted server" if self.fleet.single else ", ".join(ready) + ", back in service,"
        log.warning("re-pushed weight version %d to %s in %.1f s (server restart %d of this attempt)",
                    version, where, time.perf_counter() - start, self.server_restarts)

    def evaluate(self, dataset: Any) -> dict[str, float]:
        """Sample ``dataset`` from a serving server (which serves the last pushed weights) and score it with the
        reward functions; ``eval/*`` metrics (empty off rank 0)."""
        return self._evaluation(dataset, self.versions.current, self.rollout.tokenizer)() if self.dist.is_main else {}

    def evaluate_step(self, dataset: Any, version: int) -> dict[str, float]:
        """The held-out evaluation due right after ``version`` was pushed: in the step, or started beside training
        (``eval_beside_training``: its metrics come back through ``evaluations_ended``)."""
        if not self.args.eval_beside_training:
            return self.evaluate(dataset)
        if self.dist.is_main:
            if self.beside is None:
                # Its own tokenizer: the evaluation thread encodes while the trainer's thread may decode.
                self.beside = EvaluationBeside()
                self.beside_tokenizer = copy.deepcopy(self.rollout.tokenizer)
            evaluation = self._evaluation(dataset, version, self.beside_tokenizer,
                                          self.args.eval_beside_prompts_in_flight)
            if not self.beside.start(version, evaluation):
                return {"eval/skipped": 1.0}
        return {}

    def evaluations_ended(self, wait_s: float = 0.0) -> list[tuple[int, dict[str, float]]]:
        """Evaluations beside training that ended, as ``(version, eval/* metrics)``; ``wait_s`` > 0 (the run's end)
        waits that long for a running one."""
        if self.beside is None:
            return []
        return self.beside.wait(wait_s) if wait_s > 0 else self.beside.finished()

    def _evaluation(self, dataset: Any, version: int, tokenizer: Any, prompts_in_flight: int = 32) -> Any:
        """The evaluation of ``version`` on a server serving it now, as a call (run here or on another thread)."""
        # While running: a server that serves; before or after (no fleet is held then): the first one configured.
        serving = [url for url in self.fleet.serving_urls() if url] if self.fleet is not None else []
        url = serving[0] if serving else self.args.server_urls()[0]
        rollouts, tokens_endpoint = self.eval_rollouts(), self.server.tokens_endpoint if self.server else True
        return lambda: evaluate_on_server(url, self.args, tokenizer, dataset, rollouts, tokens_endpoint=tokens_endpoint,
                                          version=version, concurrency=prompts_in_flight)

    def eval_rollouts(self) -> Any:
        """How held-out prompts are rolled out: by the rollout worker's own loop class, tools and environment."""
        rollout = self.rollout
        return EvalRollouts(reward_funcs=list(rollout.reward_funcs), loop_cls=rollout.loop_cls,
                            tools=list(rollout.tools or []), environment_factory=rollout.environment_factory)

    def step_metrics(self, batch: Any, step_s: float) -> dict[str, float]:
        """The step's samples, its queue and, on rank 0, how the servers serve."""
        metrics = sample_and_queue_metrics(
            batch, step_s, stale_dropped_total=self.feed.stale_dropped_total, server_restarts=self.server_restarts,
            frontier=self.frontier.position, queue_size=self.worker.queue_size() if self.worker is not None else 0)
        metrics.update(self.waste.step(batch))
        if self.dist.is_main and self.talks_to_servers:
            metrics.update(self.fleet.serving_metrics())
        return metrics

    # ------------------------------------------------------------------------------------------ close
    def close(self) -> None:
        """Stop the worker and close the servers' transports (the tracker stays open: ``close_tracking``)."""
        if self.beside is not None:
            self.beside.close()
            self.beside = None
        if self.worker is not None:
            call_if_present(self.worker, "stop")
            self.worker = None
        if self.fleet is not None:
            self.fleet.close()
            self.fleet = None

    def close_tracking(self, finished: bool) -> None:
        if self.owns_tracker:
            self.tracker.close("FINISHED" if finished else "FAILED")

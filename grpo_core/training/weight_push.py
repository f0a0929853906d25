"""Pushing the trainer's weights to the vLLM server: after optimizer steps, and again to a restarted server.

``WeightPushing`` is the part of ``AsyncGRPOTrainer`` that owns the weight transport (``grpo_core.sync``):
``_sync_weights`` pushes the current step's weights (every ``weight_sync_steps``, before an evaluation,
at the last step) and records the version; a server that restarted since the last push (rank 0's
``ServerWatch`` says so before each step's collection, or a push fails because the server went away)
gets the weights again over a new transfer session. What the restarted server generated before carries
a weight version never pushed, and the collector drops it.
"""

from __future__ import annotations

import logging
from typing import Any

import httpx
import torch

from grpo_core.config import AsyncGRPOConfig
from grpo_core.training.collector import WeightVersions
from grpo_core.training.distributed import DistInfo, broadcast_object
from grpo_core.vllm_server.control import VLLMRequestError
from grpo_core.vllm_server.watch import ServerWatch

log = logging.getLogger(__name__)

# What a push to a server that went away raises: its HTTP calls, the server's reply, the gloo transfer.
PUSH_FAILURES = (httpx.TransportError, VLLMRequestError, RuntimeError)


class ServerRestartError(RuntimeError):
    """The server restarted and this trainer cannot bring it back to its weights by itself."""


class WeightPushing:
    """The trainer's weight pushes (a part of ``AsyncGRPOTrainer``; its attributes are the trainer's)."""

    # What the pushes read and keep, set by the trainer.
    args: AsyncGRPOConfig
    model: torch.nn.Module
    dist: DistInfo
    device: torch.device
    bf16: bool
    model_path: str | None
    peft_config: Any
    control: Any  # VLLMControlClient on rank 0, None on the others
    versions: WeightVersions
    watch: ServerWatch | None
    worker: Any  # the rollout worker on rank 0
    feed: Any  # StepFeed
    weight_sync: Any  # a WeightSync, once made
    server_restarts: int
    global_step: int  # a property of the trainer

    def _make_weight_sync(self) -> Any:
        from grpo_core.sync.factory import SyncSetup, make_weight_sync, wire_dtype

        setup = SyncSetup(
            config=self.args,
            model=self.model,
            rank=self.dist.rank,
            backend=self.args.resolved_weight_transfer_backend(self.device.type == "cuda"),
            wire_dtype=wire_dtype(self.bf16),
            model_path=self.model_path,
            peft_config=self.peft_config,
        )
        return make_weight_sync(setup, self.control)

    def _sync_weights(self, force: bool = False) -> dict[str, float]:
        """Push this step's weights (``force``: even if they were pushed already, to a restarted server)."""
        from grpo_core.sync.factory import SYNC_MODE_CODES

        if not force and self.versions.pushed and self.versions.current == self.global_step:
            return {}  # this step's weights are already on the server
        self.model.eval()
        try:
            stats = self.weight_sync.push(self.global_step)
        except PUSH_FAILURES as err:
            return self._push_again_after_failed_push(err)
        self.versions.record(self.global_step)
        if self.dist.is_main:
            self.watch.after_push(self.versions.pushed)
        if self.worker is not None:
            # With what the trainer consumed so far: the worker keeps its lead within max_staleness.
            self.worker.publish_version(self.global_step, consumed=self.feed.collector.consumed_total if self.feed else 0)
        metrics = {
            "sync/bytes": float(stats.bytes),
            "sync/seconds": stats.seconds,
            "sync/mode": SYNC_MODE_CODES[stats.mode],
            "weight_version": float(self.global_step),
        }
        if stats.adapters_registered is not None:
            metrics["sync/adapters_registered"] = float(stats.adapters_registered)
        return metrics

    def _push_again_if_server_restarted(self) -> None:
        """Before each step's collection: a server that restarted since the last push (rank 0's
        ``ServerWatch`` says so) gets this step's weights over a new transfer session. What it generated
        before carries a weight version never pushed, and the collector drops it."""
        reason = broadcast_object(self.watch.restarted() if self.dist.is_main else None)
        if reason is not None:
            self._push_to_restarted_server(reason)

    def _push_to_restarted_server(self, reason: str) -> dict[str, float]:
        if self.weight_sync.mode == "adapter":
            raise ServerRestartError(
                f"the vLLM server restarted ({reason}); adapter-only LoRA sync cannot register its adapters on "
                "the new server from here: resume the run (the flow does) or use lora_sync_mode='merged'"
            )
        log.warning("the vLLM server restarted (%s); pushing the weights of step %d again", reason, self.global_step)
        try:
            self.weight_sync.close()  # its session died with the server's workers
        except Exception as err:  # noqa: BLE001 - whatever the dead session says, a new one follows
            log.info("closing the weight transfer to the old server: %s", err)
        self.weight_sync = self._make_weight_sync()
        metrics = self._sync_weights(force=True)
        self.server_restarts += 1
        log.warning("re-pushed weight version %d to the restarted server in %.1f s (server restart %d of this attempt)",
                    self.global_step, metrics.get("sync/seconds", 0.0), self.server_restarts)
        return metrics

    def _push_again_after_failed_push(self, err: Exception) -> dict[str, float]:
        """A push that failed because the server went away (one rank: with several, the others are inside
        the push's collectives and the attempt fails; the flow resumes it) waits for the server, then
        pushes to it again when it restarted; any other failure is raised."""
        reason = self.watch.restarted() if self.dist.world_size == 1 and self.watch is not None else None
        if reason is None:
            raise err
        return self._push_to_restarted_server(f"{reason}; the push failed with {type(err).__name__}: {err}")

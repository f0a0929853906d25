"""``Checkpointer``: the trainer's hooks for saving, finding the newest good checkpoint and resuming.

It sees the run only through ``CheckpointParts``: the model and its optimizer, and small objects
with ``state_dict()`` / ``load_state_dict()`` (the LR scheduler, the trainer's progress, the training
frontier), never the trainer itself.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from grpo_core.checkpoint.folders import (
    MANIFEST,
    MASTER_FILE,
    MODEL_FILE,
    OPTIMIZER_FILE,
    RNG_FILE,
    ROLLOUT_STATE,
    SCHEDULER_FILE,
    TRAINER_STATE,
    CheckpointError,
    build_manifest,
    list_checkpoints,
    read_manifest,
    remove_checkpoint,
    verify_local,
)
from grpo_core.checkpoint.ledger import RunLedger
from grpo_core.checkpoint.state import (
    barrier,
    full_state,
    gather_objects,
    load_weights,
    rng_state,
    set_rng_state,
    tied_aliases,
    write_servable,
)
from grpo_core.models.lora import adapter_files_state, write_adapter
from grpo_core.storage.store import Storage, fsync_dir

log = logging.getLogger(__name__)

LOGGED_EVERY_STEP = "loss"
"""A metric the trainer logs at every logged step: the highest step it reached in the run is where an earlier
attempt's logging stopped."""


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@dataclass
class CheckpointParts:
    """Everything a checkpoint writes and a resume restores."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    lr_scheduler: Stateful
    progress: Stateful  # the trainer's state: ``{"global_step": ...}``
    frontier: Stateful  # ``{"position": first prompt position not yet trained}``
    tokenizer: Any
    serve_dtype: torch.dtype | None  # dtype of the servable weights (None: the master weights')
    num_prompts: int | None  # prompts per epoch (None: a stream)
    adapter_base: str | None = None  # LoRA: the base model the adapter is written against (None: no LoRA)

    @property
    def global_step(self) -> int:
        return int(self.progress.state_dict()["global_step"])

    @property
    def position(self) -> int:
        return int(self.frontier.state_dict()["position"])


@dataclass
class ResumeInfo:
    """Where this process started: the checkpoint (or None), its step and prompt position."""

    checkpoint: str | None
    step: int
    position: int


class Checkpointer:
    """Saves, finds and restores checkpoints of one trainer; the trainer calls it from its loop.

    Every run in an ``output_dir`` has a *lineage* id (written by a fresh start, kept by resumes and
    stored in each manifest), so that ``resume_from_checkpoint=True`` and ``save_total_limit`` only
    ever consider this run's checkpoints, never those an earlier run left in the same folder.
    """

    def __init__(self, args: Any, dist: Any, parts: CheckpointParts, tracker: Any):
        """``args``: the config's checkpoint settings (``config.checkpoint``, ``config.CheckpointSettings``)."""
        self.args = args
        self.dist = dist
        self.parts = parts
        self.tracker = tracker
        self.wanted: bool | str | None = args.resume_from_checkpoint  # what this attempt resumes from
        self.storage = Storage(args.output_dir, args.storage_retry_timeout_s)
        self.ledger = RunLedger(self.storage)
        self.resumed = ResumeInfo(None, 0, 0)
        self.lineage: str | None = None
        self.attempt = 1
        self.rerun_until = 0  # steps up to this one were logged by an earlier attempt
        self._local_copies: dict[str, Path] = {}

    # ---- hooks called by the trainer ----------------------------------------------------------------
    def should_save(self, step: int) -> bool:
        return self.args.save_strategy == "steps" and step % self.args.save_steps == 0

    def find_resume_point(self, wanted: bool | str | None) -> str | None:
        """The checkpoint to resume from, or None to start fresh (``wanted`` as ``resume_from_checkpoint``)."""
        self.wanted = wanted
        if not wanted:
            return None
        if isinstance(wanted, str):
            _, reason = self._check(wanted)
            if reason is not None:
                raise CheckpointError(f"resume_from_checkpoint={wanted!r} cannot be used: {reason}")
            return wanted
        lineage = self.ledger.lineage()
        for _step, path in list_checkpoints(self.storage):
            url = self.storage.url(path)
            manifest, reason = read_manifest(self.storage, path)
            if manifest is not None and lineage is not None and manifest.get("lineage") != lineage:
                log.info("ignoring %s: an earlier run in this folder wrote it", url)
                continue
            if reason is None:
                manifest, reason = self._check(url)
            if reason is None:
                return url
            log.warning("skipping torn checkpoint %s: %s; trying the previous one", url, reason)
        log.info("no good checkpoint of this run under %s; starting from step 0", self.args.output_dir)
        return None

    def restore(self, checkpoint: str) -> None:
        """Load weights, optimizer, scheduler, RNG, progress and frontier of ``checkpoint`` into the parts."""
        from safetensors.torch import load_file
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        parts = self.parts
        manifest, reason = self._check(checkpoint)  # a no-op when find_resume_point just checked it
        if reason is not None:
            raise CheckpointError(f"checkpoint {checkpoint} cannot be restored: {reason}")
        folder = self._local_copies[checkpoint]
        try:
            weights = folder / (MASTER_FILE if (folder / MASTER_FILE).is_file() else MODEL_FILE)
            load_weights(parts.model, load_file(str(weights)))
            optim = torch.load(folder / OPTIMIZER_FILE, map_location="cpu", weights_only=True)
            set_optimizer_state_dict(parts.model, parts.optimizer, optim, options=StateDictOptions(full_state_dict=True))
            parts.lr_scheduler.load_state_dict(json.loads((folder / SCHEDULER_FILE).read_text()))
            rng = torch.load(folder / RNG_FILE, map_location="cpu", weights_only=True)["ranks"]
            set_rng_state(rng[self.dist.rank] if self.dist.rank < len(rng) else rng[0])
            state = json.loads((folder / TRAINER_STATE).read_text())
            rollout = json.loads((folder / ROLLOUT_STATE).read_text())
        finally:
            self._drop_local_copy(checkpoint)
        step = int(state["global_step"])
        position = int(rollout["position"])
        parts.progress.load_state_dict({"global_step": step})
        num_prompts = parts.num_prompts
        if num_prompts is not None and num_prompts != rollout["num_prompts"]:
            log.warning(
                "train_dataset has %d prompts, the checkpoint was written with %s: prompt positions now "
                "name other prompts", num_prompts, rollout["num_prompts"],
            )
        # Positions past the frontier that the checkpoint's model trained on (a checkpoint written before this was
        # recorded has none: its resume admits them again, as it always did).
        parts.frontier.load_state_dict({"position": position, "done_ahead": rollout.get("done_ahead", [])})
        self.lineage = manifest.get("lineage") if manifest else None
        self.resumed = ResumeInfo(checkpoint, step, position)
        log.info("resumed from %s: step %d, prompt position %d", checkpoint, step, position)

    def resume(self, wanted: bool | str | None) -> str | None:
        """Restore the checkpoint ``wanted`` leads to (``find_resume_point``), if any, then number this attempt in
        the ledger (``begin_attempt``); the restored checkpoint, or None for a fresh start."""
        checkpoint = self.find_resume_point(wanted)
        if checkpoint is not None:
            self.restore(checkpoint)
        self.begin_attempt()
        return checkpoint

    def begin_attempt(self) -> None:
        """Number this process's attempt in the ledger and find the steps an earlier attempt logged."""
        if not self.dist.is_main:
            return
        wanted = self.wanted
        if self.resumed.checkpoint is None and not wanted:
            self.lineage = None  # a fresh run: whatever the folder holds belongs to another one
        current = self.ledger.lineage()
        if self.lineage is None:
            self.lineage = current if wanted and current else uuid.uuid4().hex
        if current != self.lineage:
            self.ledger.clear()
            self.ledger.set_lineage(self.lineage)
        self.attempt = self.ledger.start_attempt(self.resumed.checkpoint, self.resumed.step, self.resumed.position)
        self.rerun_until = self.tracker.last_logged_step(LOGGED_EVERY_STEP) or 0
        self.tracker.set_tags({"attempt": str(self.attempt), "resumes": str(self.attempt - 1)})
        if self.rerun_until > self.resumed.step:
            log.info("attempt %d: steps %d..%d were logged before and are marked train/rerun_step=1",
                     self.attempt, self.resumed.step + 1, self.rerun_until)

    def record_step(self, batch: Any, server_restarts: int = 0) -> dict[str, float]:
        """Write this step's consumed prompt positions to the ledger (before the step counts as done);
        returns the metric that tells a re-run step (logged before by an earlier attempt) apart, in a resumed
        attempt only (in a first attempt it would be a flat 0). ``server_restarts``: restarts of the vLLM server
        this attempt has met so far."""
        step = self.parts.global_step
        if self.dist.is_main:
            self.ledger.record(
                attempt=self.attempt,
                step=step,
                trained=sorted({s.position for s in batch.samples}),
                dropped_groups=sorted({r.position for r in batch.reports if r.num_samples == 0}),
                stale_dropped=int(batch.stale_dropped),
                frontier=self.parts.position,
                # The weight versions that sampled what this step trained, and the samples dropped for
                # a version never pushed: an audit that a restarted server's samples were not trained.
                versions=sorted({int(s.policy_version) for s in batch.samples}),
                foreign_dropped=int(getattr(batch, "foreign_dropped", 0)),
                server_restarts=server_restarts,
            )
        return {"train/rerun_step": float(step <= self.rerun_until)} if self.attempt > 1 else {}

    def save(self) -> dict[str, float]:
        """Write ``checkpoint-<global_step>``; every rank calls it (the state gather is a collective).

        ``save_strategy="no"`` is honoured here too, so the trainer's save after the last step writes nothing.
        """
        if self.args.save_strategy == "no":
            return {}
        start = time.perf_counter()
        step = self.parts.global_step
        model_state, optim_state = full_state(self.parts.model, self.parts.optimizer)
        rng = gather_objects(rng_state())
        nbytes = 0
        failed = False
        if self.dist.is_main:
            try:
                url, nbytes = self._write(step, model_state, optim_state, rng)
            except Exception as err:  # noqa: BLE001 - storage, a full disk, or a serializer's report of either
                self._write_failed(step, err)
                failed = True
            else:
                self._rotate(keep=self.storage.path(f"checkpoint-{step}"))
                self.tracker.log_artifact_uri("checkpoint", url, step=step)
        barrier()
        metrics = {"checkpoint/seconds": time.perf_counter() - start, "checkpoint/bytes": float(nbytes)}
        return metrics | ({"checkpoint/failed": 1.0} if failed else {})

    def _write_failed(self, step: int, err: Exception) -> None:
        """A checkpoint that could not be written (after the storage retries) is removed and skipped: the
        newest good one stays the resume point and training goes on, unless it was the last step's."""
        final = self.storage.path(f"checkpoint-{step}")
        where = self.storage.url(final)
        message = f"checkpoint-{step} could not be written to {where}: {type(err).__name__}: {err}{_disk_note(final, self.storage)}"
        try:
            # Without a manifest it would be skipped anyway; removing it frees what it took. Not retried:
            # the store may be the thing that failed.
            self.storage.fs.rm(final, recursive=True)
        except Exception as cleanup:  # noqa: BLE001 - best effort
            log.info("could not remove the unfinished %s: %s", where, cleanup)
        if self.args.max_steps > 0 and step >= self.args.max_steps:
            raise CheckpointError(f"{message}; it was the checkpoint of the last step") from err
        log.error("%s; training goes on, and the newest good checkpoint stays the resume point", message)

    # ---- writing ------------------------------------------------------------------------------------
    def _write(self, step: int, model_state: dict[str, torch.Tensor], optim_state: dict[str, Any], rng: list[Any]) -> tuple[str, int]:
        final = self.storage.path(f"checkpoint-{step}")
        # Debris of an earlier attempt at this step (a torn write, or a run resumed from further back).
        remove_checkpoint(self.storage, final)
        staging = Path(final) if self.storage.is_local else Path(tempfile.mkdtemp(prefix=f"grpo-ckpt-{step}-"))
        staging.mkdir(parents=True, exist_ok=True)
        try:
            self._write_files(staging, step, model_state, optim_state, rng)
            manifest = build_manifest(staging, step, self.lineage or "")
            if not self.storage.is_local:
                for name in manifest["files"]:
                    self.storage.put_file(str(staging / name), self.storage.path_in(final, name))
            self.storage.write_json(self.storage.path_in(final, MANIFEST), manifest)
        finally:
            if not self.storage.is_local:
                shutil.rmtree(staging, ignore_errors=True)
        url = self.storage.url(final)
        log.info("saved checkpoint %s", url)
        return url, sum(f["size"] for f in manifest["files"].values())

    def _write_files(self, folder: Path, step: int, model_state: dict[str, torch.Tensor], optim_state: dict[str, Any], rng: list[Any]) -> None:
        from safetensors.torch import save_file

        parts = self.parts
        master_dtype = next(iter(model_state.values())).dtype
        serve_dtype = parts.serve_dtype or master_dtype
        write_servable(folder, parts.model, model_state, parts.tokenizer, serve_dtype)
        if parts.adapter_base is not None:
            # LoRA: the adapter in PEFT's layout beside the weights, so vLLM (--lora-modules) and peft load
            # it from this folder; .vllm_lora/ is only a serving cache and is not kept.
            write_adapter(parts.model, str(folder), parts.adapter_base, state=adapter_files_state(model_state))
        if serve_dtype != master_dtype:
            aliases = tied_aliases(parts.model)
            save_file({k: v.contiguous() for k, v in model_state.items() if k not in aliases}, str(folder / MASTER_FILE))
        torch.save(optim_state, folder / OPTIMIZER_FILE)
        (folder / SCHEDULER_FILE).write_text(json.dumps(parts.lr_scheduler.state_dict()))
        torch.save({"ranks": rng}, folder / RNG_FILE)
        position = parts.position
        num_prompts = parts.num_prompts
        (folder / TRAINER_STATE).write_text(json.dumps({
            "global_step": step,
            "mlflow_run_id": self.tracker.run_id,
            "attempt": self.attempt,
            "frontier_position": position,
            "world_size": self.dist.world_size,
            "saved_at": time.time(),
        }, indent=1))
        (folder / ROLLOUT_STATE).write_text(json.dumps({
            "position": position,
            "done_ahead": list(parts.frontier.state_dict().get("done_ahead", [])),
            "epoch": position // num_prompts if num_prompts else 0,
            "index_in_epoch": position % num_prompts if num_prompts else position,
            "num_prompts": num_prompts,
            "seed": self.args.seed,
        }, indent=1))
        if self.storage.is_local:
            # Preemption of the process keeps the page cache, losing the machine does not.
            for path in folder.iterdir():
                with open(path, "rb") as f:
                    os.fsync(f.fileno())
            fsync_dir(folder)

    def _rotate(self, keep: str) -> None:
        """Keep this run's newest ``save_total_limit`` good checkpoints; drop torn ones older than the
        newest good one. Checkpoints an earlier run left here are not this run's to delete."""
        limit = self.args.save_total_limit
        good_seen = 0
        try:
            checkpoints = list_checkpoints(self.storage)
        except OSError as err:  # the new checkpoint is written; old ones can go next time
            log.warning("not rotating checkpoints: %s", err)
            return
        for _step, path in checkpoints:
            if path == keep:
                good_seen += 1
                continue
            manifest, _ = read_manifest(self.storage, path)
            if manifest is not None and manifest.get("lineage") != self.lineage:
                continue
            if manifest is not None:
                good_seen += 1
            if (manifest is not None and limit is not None and good_seen > limit) or (manifest is None and good_seen > 0):
                log.info("removing %s checkpoint %s", "old" if manifest else "torn", self.storage.url(path))
                try:
                    remove_checkpoint(self.storage, path)
                except OSError as err:
                    log.warning("could not remove %s (next save tries again): %s", self.storage.url(path), err)

    # ---- reading ------------------------------------------------------------------------------------
    def _check(self, url: str) -> tuple[dict[str, Any] | None, str | None]:
        """``(manifest, None)`` for a good checkpoint (kept downloaded for ``restore`` when remote),
        else ``(None, why not)``. Sizes come from the listing; hashes need the bytes."""
        storage = Storage(url, self.args.storage_retry_timeout_s)
        manifest, reason = read_manifest(storage, storage.root)
        if reason is not None:
            return None, reason
        reason = verify_local(self._local_copy(url))
        if reason is not None:
            self._drop_local_copy(url)
            return None, reason
        return manifest, None

    def _local_copy(self, url: str) -> Path:
        if url in self._local_copies:
            return self._local_copies[url]
        storage = Storage(url, self.args.storage_retry_timeout_s)
        if storage.is_local:
            folder = Path(storage.root)
        else:
            folder = Path(tempfile.mkdtemp(prefix="grpo-resume-"))
            names = [e["name"] for e in storage.ls(storage.root) if e["type"] == "file"]
            storage.get(names, [str(folder / n.rsplit("/", 1)[-1]) for n in names])
        self._local_copies[url] = folder
        return folder

    def _drop_local_copy(self, url: str) -> None:
        folder = self._local_copies.pop(url, None)
        if folder is not None and not Storage(url).is_local:
            shutil.rmtree(folder, ignore_errors=True)


def _disk_note(final: str, storage: Storage) -> str:
    """Free space where the write went (the folder itself, or the local staging area of a remote store),
    so that a full disk reads as one whatever the serializer said."""
    folder = Path(final).parent if storage.is_local else Path(tempfile.gettempdir())
    try:
        free = shutil.disk_usage(folder).free
    except OSError:
        return ""
    return f" (the file system holding {folder} has {free / 2**20:.1f} MiB free)"


@dataclass(frozen=True)
class UnfinishedRun:
    """The newest good checkpoint of the run an ``output_dir`` holds, when that run stopped before its last step."""

    checkpoint: str
    step: int
    mlflow_run_id: str | None


def unfinished_run(output_dir: str, max_steps: int) -> UnfinishedRun | None:
    """The run in ``output_dir`` (its ledger's lineage) if it has a good checkpoint before ``max_steps``; None when
    the folder holds no run, no good checkpoint of it, or one at ``max_steps`` or later (the run finished)."""
    storage = Storage(output_dir)
    lineage = RunLedger(storage).lineage()
    if lineage is None:
        return None
    for step, path in list_checkpoints(storage):
        manifest, reason = read_manifest(storage, path)
        if manifest is None or reason is not None or manifest.get("lineage") != lineage:
            continue
        if step >= max_steps:
            return None
        state = storage.read_json(storage.path_in(path, TRAINER_STATE))
        return UnfinishedRun(storage.url(path), step, state.get("mlflow_run_id"))
    return None


def saved_run_id(output_dir: str, resume: bool | str = True) -> str | None:
    """The MLflow run id stored with the checkpoint ``resume`` names (True: the newest one with a
    manifest under ``output_dir``), so that a run resumed by hand keeps logging into its run."""
    if isinstance(resume, str):
        storage = Storage(resume)
        return storage.read_json(storage.path_in(storage.root, TRAINER_STATE)).get("mlflow_run_id")
    storage = Storage(output_dir)
    for _step, path in list_checkpoints(storage):
        if read_manifest(storage, path)[1] is None:
            return storage.read_json(storage.path_in(path, TRAINER_STATE)).get("mlflow_run_id")
    return None

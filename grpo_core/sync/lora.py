"""Adapter-only weight sync: each version is a PEFT folder on shared storage that vLLM loads by name.

    push(v): write <output_dir>/.vllm_lora/<run>-v<v>/ → /v1/load_lora_adapter → point rollouts at v
             → /v1/unload_lora_adapter for versions that left the window → delete retired folders

The window holds ``max_staleness + 1`` versions: a rollout that started under version ``v`` names
``v`` in every request, and any sample it yields stays trainable until ``v`` leaves the window, so
an older name is never needed by a sample that could still be trained. The new version is loaded
before the oldest is unloaded (the server briefly holds ``max_staleness + 2``, hence the
``max_loras`` minimum). Unloading only drops the name from the API server; requests already
admitted keep running under their adapter, and the engine may re-read its folder if it evicts and
re-activates it, so a folder is deleted only ``delete_grace_s`` (by default the request timeout)
after its unload. No pause is needed: loading an adapter leaves every running request alone.

The very first push also sends the base weights through the full-weight protocol, because the
server may hold other base weights than the trainer (a resumed or earlier run on the same server).

``.vllm_lora/`` is a serving cache, not a checkpoint: it only ever holds the newest versions.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from grpo_core.models.lora import adapter_state, write_adapter
from grpo_core.staleness import versions_in_flight
from grpo_core.storage.store import open_url
from grpo_core.sync.base import SyncStats, WeightSync

log = logging.getLogger(__name__)

CACHE_DIRNAME = ".vllm_lora"
_NAME_BYTES = 256


class AdapterPointer:
    """The newest registered adapter (name and version), shared with the rollout process.

    The trainer sets it after a load succeeded; the worker reads it once per rollout, so a request
    never names an adapter the server does not know yet. It pickles only while a process is being
    spawned (it wraps shared memory), which is how ``WorkerSpec`` reaches the worker.
    """

    def __init__(self) -> None:
        self._raw = mp.get_context("spawn").Array("c", _NAME_BYTES)

    def set(self, name: str, version: int) -> None:
        encoded = f"{version}\t{name}".encode()
        if len(encoded) >= _NAME_BYTES:
            raise ValueError(f"adapter name {name!r} is too long for the shared pointer")
        with self._raw.get_lock():
            self._raw.value = encoded

    def get(self) -> tuple[str, int] | None:
        """``(name, version)`` of the newest adapter, or None before the first push."""
        with self._raw.get_lock():
            raw = self._raw.value
        if not raw:
            return None
        version, name = raw.decode().split("\t", 1)
        return name, int(version)


@dataclass
class WindowStep:
    """What one push must do after writing ``load``: load it, unload ``unload``, delete ``delete``."""

    load: int
    unload: list[int]
    delete: list[int]


@dataclass
class AdapterWindow:
    """Which versions are registered and which folders may go (pure bookkeeping, no I/O)."""

    size: int
    delete_grace_s: float
    registered: deque[int] = field(default_factory=deque)
    retired: list[tuple[int, float]] = field(default_factory=list)  # (version, unloaded at)

    def __post_init__(self) -> None:
        if self.size < 1:
            raise ValueError("the adapter window must hold at least one version")

    def push(self, version: int, now: float) -> WindowStep:
        if self.registered and version <= self.registered[-1]:
            raise ValueError(f"adapter version {version} is not newer than {self.registered[-1]}")
        self.registered.append(version)
        unload = []
        while len(self.registered) > self.size:
            unload.append(self.registered.popleft())
        self.retired.extend((v, now) for v in unload)
        return WindowStep(load=version, unload=unload, delete=self.expired(now))

    def expired(self, now: float) -> list[int]:
        """Retired versions whose grace period is over; they are forgotten once returned."""
        due = [v for v, t in self.retired if now - t >= self.delete_grace_s]
        self.retired = [(v, t) for v, t in self.retired if now - t < self.delete_grace_s]
        return due


def serving_path(url: str) -> str:
    """The path to hand to vLLM: a plain path for local folders, the URL itself otherwise."""
    fs, path = open_url(url)
    protocols = fs.protocol if isinstance(fs.protocol, (list, tuple)) else [fs.protocol]
    return path if "file" in protocols or "local" in protocols else url


class LoraAdapterSync(WeightSync):
    """Pushes the adapter by name through the server's runtime LoRA routes; call on every trainer rank."""

    mode = "adapter"

    def __init__(
        self,
        control: Any,
        model: Any,
        output_dir: str,
        max_staleness: int,
        base_sync: WeightSync | None = None,
        base_model_name_or_path: str | None = None,
        rank: int = 0,
        delete_grace_s: float = 600.0,
        run_tag: str | None = None,
    ):
        if rank == 0 and control is None:
            raise ValueError("trainer rank 0 needs a VLLMControlClient to load adapters")
        self.control = control if rank == 0 else None
        self.model = model
        self.cache_url = f"{output_dir.rstrip('/')}/{CACHE_DIRNAME}"
        self.base_sync = base_sync
        self.base_model_name_or_path = base_model_name_or_path
        # A fresh tag per trainer: a restarted run must not collide with names an earlier
        # process left registered on a long-lived server.
        self.run_tag = run_tag or f"grpo-{uuid.uuid4().hex[:8]}"
        self.window = AdapterWindow(size=versions_in_flight(max_staleness), delete_grace_s=delete_grace_s)
        self.pointer = AdapterPointer()
        if self.control is not None:
            self._forget_earlier_runs()

    # -- naming ---------------------------------------------------------------------------------------
    def adapter_name(self, version: int) -> str:
        return f"{self.run_tag}-v{version}"

    def _url(self, version: int) -> str:
        return f"{self.cache_url}/{self.adapter_name(version)}"

    def served_model_name(self, version: int) -> str | None:
        return self.adapter_name(version) if version in self.window.registered else None

    @property
    def registered_versions(self) -> list[int]:
        return list(self.window.registered)

    def adapter_pointer(self) -> AdapterPointer:
        return self.pointer

    # -- push -----------------------------------------------------------------------------------------
    def push(self, version: int) -> SyncStats:
        start = time.perf_counter()
        state = adapter_state(self.model)  # every rank: FSDP gathers are collectives
        sent = 0
        if self.base_sync is not None:
            sent += self.base_sync.push(version).bytes
            self.base_sync.close()
            self.base_sync = None
        if self.control is None:
            return SyncStats(mode=self.mode, bytes=sent, seconds=time.perf_counter() - start)
        sent += write_adapter(self.model, self._url(version), self.base_model_name_or_path, state=state)
        self.control.load_lora_adapter(self.adapter_name(version), serving_path(self._url(version)))
        self.pointer.set(self.adapter_name(version), version)
        step = self.window.push(version, time.monotonic())
        for old in step.unload:
            self.control.unload_lora_adapter(self.adapter_name(old))
        self._delete(step.delete)
        return SyncStats(
            mode=self.mode, bytes=sent, seconds=time.perf_counter() - start, adapters_registered=len(self.window.registered)
        )

    def _delete(self, versions: list[int]) -> None:
        fs, root = open_url(self.cache_url)
        for version in versions:
            path = f"{root.rstrip('/')}/{self.adapter_name(version)}"
            if fs.exists(path):
                fs.rm(path, recursive=True)

    def _forget_earlier_runs(self) -> None:
        """Unload what an earlier process of this run left registered from our cache, then empty it.

        A crashed or preempted trainer cannot clean up; its worker died with it, so no request of
        its can still need those folders once their names are gone from the server.
        """
        prefix = serving_path(self.cache_url).rstrip("/") + "/"
        for entry in self.control.models():
            root = str(entry.get("root") or "")
            if root.startswith(prefix) and entry.get("id") != entry.get("parent"):
                log.info("unloading adapter %s left by an earlier process of this run", entry["id"])
                self.control.unload_lora_adapter(str(entry["id"]))
        fs, path = open_url(self.cache_url)
        if fs.exists(path):
            for leftover in fs.ls(path, detail=False):
                fs.rm(leftover, recursive=True)

    def close(self) -> None:
        """Unload every version and delete their folders: the cache is for serving this run only."""
        if self.base_sync is not None:
            self.base_sync.close()
            self.base_sync = None
        if self.control is None:
            return
        registered = list(self.window.registered)
        for version in registered:
            try:
                self.control.unload_lora_adapter(self.adapter_name(version))
            except Exception as exc:  # noqa: BLE001 - a dead server must not hide the training error
                log.warning("could not unload adapter %s: %s", self.adapter_name(version), exc)
        self.window.registered.clear()
        self._delete(registered + [v for v, _ in self.window.retired])
        self.window.retired.clear()

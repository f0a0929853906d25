"""The rollout process: spawn it, feed the trainer through a queue, watch its heartbeat.

The worker runs in a *spawned* process with ``CUDA_VISIBLE_DEVICES=""`` so that reward code never
competes with the trainer for the GIL or the GPU. Everything handed to it is pickled, so
``check_picklable`` runs first and names the lambda or closure that would fail.

Trainer side: ``RolloutWorker.start()``, ``get(timeout)`` for the next item, ``check()`` raises
``RolloutWorkerError`` if the process died or its heartbeat stopped, ``stop()``.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import pickle
import queue as queue_lib
import time
import traceback
from dataclasses import dataclass
from typing import Any

_HEARTBEAT_PERIOD_S = 1.0


class RolloutWorkerError(RuntimeError):
    """The rollout process failed, died or stopped sending heartbeats."""


@dataclass
class WorkerSpec:
    """Everything the rollout process needs; must pickle."""

    loop_cls: type
    loop_kwargs: dict[str, Any]


def check_picklable(named_objects: dict[str, Any]) -> None:
    """Raise TypeError naming any object that cannot cross to the spawned rollout process."""
    for label, obj in named_objects.items():
        items = obj if isinstance(obj, (list, tuple)) else [obj]
        for item in items:
            qualname = getattr(item, "__qualname__", "") or ""
            name = getattr(item, "__name__", type(item).__name__)
            if "<lambda>" in qualname or "<locals>" in qualname:
                raise TypeError(
                    f"{label} {name!r} ({qualname}) is a lambda or closure and cannot be sent to the rollout "
                    "process; define it at module level, or use functools.partial or a callable class instance"
                )
            try:
                pickle.dumps(item)
            except Exception as exc:  # noqa: BLE001 - any pickling failure gets the same explanation
                raise TypeError(
                    f"{label} {name!r} cannot be pickled for the rollout process ({exc}); "
                    "use a module-level function, functools.partial or a callable class instance"
                ) from exc


class RolloutWorker:
    """Handle on the rollout process, owned by the trainer (rank 0)."""

    def __init__(self, spec: WorkerSpec, queue_maxsize: int, heartbeat_timeout_s: float):
        self.spec = spec
        self.heartbeat_timeout_s = heartbeat_timeout_s
        ctx = mp.get_context("spawn")
        self.queue: Any = ctx.Queue(maxsize=queue_maxsize)
        self.errors: Any = ctx.Queue()
        self.heartbeat = ctx.Value("d", time.time())
        self.stop_event = ctx.Event()
        self.process = ctx.Process(
            target=_worker_main,
            args=(spec, self.queue, self.errors, self.heartbeat, self.stop_event),
            name="grpo-rollout",
            daemon=True,
        )

    def start(self) -> None:
        # The child must never see the trainer's GPUs; spawn copies the environment at start.
        saved = os.environ.get("CUDA_VISIBLE_DEVICES")
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
        try:
            self.process.start()
        finally:
            if saved is None:
                os.environ.pop("CUDA_VISIBLE_DEVICES", None)
            else:
                os.environ["CUDA_VISIBLE_DEVICES"] = saved
        self.heartbeat.value = time.time()

    def check(self) -> None:
        """Raise ``RolloutWorkerError`` with the worker's own traceback when it failed."""
        error = self._error()
        if error is not None:
            raise RolloutWorkerError(f"rollout worker failed:\n{error}")
        if not self.process.is_alive():
            if self.process.exitcode == 0:
                return  # it finished its epochs; the queue still holds its last items
            raise RolloutWorkerError(f"rollout worker exited unexpectedly (exit code {self.process.exitcode})")
        silent = self.silent_s()
        if silent > self.heartbeat_timeout_s:
            raise RolloutWorkerError(
                f"rollout worker sent no heartbeat for {silent:.0f} s "
                f"(worker_heartbeat_timeout_s={self.heartbeat_timeout_s})"
            )

    def silent_s(self) -> float:
        """Seconds since the worker's last heartbeat."""
        return time.time() - self.heartbeat.value

    def _error(self) -> str | None:
        try:
            return self.errors.get_nowait()
        except queue_lib.Empty:
            return None

    def get(self, timeout_s: float) -> Any:
        """Next GroupReport or RolloutSample; checks the worker's health while waiting."""
        # Check health on every call, not only when the queue runs dry: a frozen worker can leave a
        # full queue behind, and the trainer must not train through it before noticing.
        self.check()
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                return self.queue.get(timeout=min(0.5, max(0.01, deadline - time.monotonic())))
            except queue_lib.Empty:
                self.check()
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"no rollout arrived within {timeout_s:.0f} s") from None

    def stop(self, timeout_s: float = 10.0) -> None:
        self.stop_event.set()
        if self.process.is_alive() and self.silent_s() > self.heartbeat_timeout_s:
            # A silent worker (frozen, or stuck in native code) cannot see the stop event: waiting for
            # it would only delay the error the trainer is about to raise.
            self.process.kill()
        if self.process.is_alive():
            # Drain so a worker blocked on a full queue can see the stop event.
            deadline = time.monotonic() + timeout_s
            while self.process.is_alive() and time.monotonic() < deadline:
                try:
                    self.queue.get(timeout=0.1)
                except queue_lib.Empty:
                    pass
            if self.process.is_alive():
                self.process.kill()
        self.process.join(timeout=5)


# ---------------------------------------------------------------------------- inside the rollout process
def _worker_main(spec: WorkerSpec, out_queue: Any, errors: Any, heartbeat: Any, stop_event: Any) -> None:
    try:
        asyncio.run(_run(spec, out_queue, heartbeat, stop_event))
    except BaseException:  # noqa: BLE001 - every failure must reach the trainer
        errors.put(traceback.format_exc())
        raise SystemExit(1)


async def _run(spec: WorkerSpec, out_queue: Any, heartbeat: Any, stop_event: Any) -> None:
    async def beat() -> None:
        while True:
            heartbeat.value = time.time()
            await asyncio.sleep(_HEARTBEAT_PERIOD_S)

    async def emit(item: Any) -> float:
        """Put on the bounded queue without blocking the event loop; returns seconds of backpressure."""
        start = time.perf_counter()
        while not stop_event.is_set():
            try:
                out_queue.put_nowait(item)
                return time.perf_counter() - start
            except queue_lib.Full:
                await asyncio.sleep(0.05)
        return time.perf_counter() - start

    from grpo_core.rollout.scheduler import RolloutScheduler

    beat_task = asyncio.create_task(beat())
    loop_obj = spec.loop_cls(emit=emit, **spec.loop_kwargs)
    scheduler = RolloutScheduler(loop_obj, stop_event)
    try:
        await scheduler.run()
    finally:
        beat_task.cancel()



"""The rollout process: spawn it, feed the trainer through a queue, watch its heartbeat.

The worker runs in a *spawned* process with ``CUDA_VISIBLE_DEVICES=""`` so that reward code never
competes with the trainer for the GIL or the GPU. What it needs crosses as one cloudpickle payload:
functions, classes and lambdas defined in the user's script go by value, everything importable by
reference. The user's script itself is not run again in the child (multiprocessing's spawn would
re-import ``__main__``, re-running a script without a main guard and starting the trainer twice),
so a script written as the quick start prints it, with everything at module level, works as is;
so does a run under ``torchrun`` or ``accelerate launch``. ``grpo_core.data.inputs.check_crossing``
names, before the spawn, anything that cannot cross (an open socket, a lock, a live client).

Trainer side: ``RolloutWorker.start()``, ``get(timeout)`` for the next item, ``check()`` raises
``RolloutWorkerError`` if the process died or its heartbeat stopped, ``stop()``;
``publish_version(v, consumed)`` tells the worker the weight version the server now serves and how many
samples the trainer has taken off the queue by then (the scheduler's staleness budget); ``publish_fleet(view)``
tells it which servers of the fleet serve, and ``drained_servers()`` returns those it took out of service itself
(``rollout.routing_client``).
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing as mp
import os
import pickle
import queue as queue_lib
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import cloudpickle

from grpo_core.vllm_server.cpu_placement import forked_on, rollout_cpus_from_env

_HEARTBEAT_PERIOD_S = 1.0
_PARENT_CHECK_S = 1.0


class RolloutWorkerError(RuntimeError):
    """The rollout process failed, died or stopped sending heartbeats."""


@dataclass
class WorkerSpec:
    """Everything the rollout process needs."""

    loop_cls: type
    loop_kwargs: dict[str, Any]
    """Sent with cloudpickle (the user's functions and classes by value)."""
    shared_kwargs: dict[str, Any] = field(default_factory=dict)
    """Objects in shared memory (e.g. the adapter pointer), which only the spawn itself may hand over."""


class RolloutWorker:
    """Handle on the rollout process, owned by the trainer (rank 0)."""

    def __init__(self, spec: WorkerSpec, queue_maxsize: int, heartbeat_timeout_s: float, initial_version: int = 0):
        self.spec = spec
        self.heartbeat_timeout_s = heartbeat_timeout_s
        ctx = mp.get_context("spawn")
        self.queue: Any = ctx.Queue(maxsize=queue_maxsize)
        self.errors: Any = ctx.Queue()
        self.heartbeat = ctx.Value("d", time.time())
        self.served_version = ctx.Value("q", initial_version)
        self.consumed = ctx.Value("q", 0)
        self.stop_event = ctx.Event()
        self.fleet_views: Any = ctx.Queue()  # trainer -> worker: FleetView, newest last
        self.fleet_reports: Any = ctx.Queue()  # worker -> trainer: (server name, epoch, reason) of a server it drained
        self.process = ctx.Process(
            target=_worker_main,
            args=(cloudpickle.dumps((spec.loop_cls, spec.loop_kwargs)), spec.shared_kwargs, self.queue, self.errors,
                  self.heartbeat, self.served_version, self.consumed, self.stop_event, os.getpid(),
                  self.fleet_views, self.fleet_reports),
            name="grpo-rollout",
            daemon=True,
        )

    def start(self) -> None:
        # The child must never see the trainer's GPUs; spawn copies the environment at start.
        saved = os.environ.get("CUDA_VISIBLE_DEVICES")
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
        try:
            # A trainer placed beside a local CPU server (grpo_core.vllm_server.cpu_placement) keeps its cores to itself:
            # the worker starts on the generation cores, and every thread it starts inherits them.
            with _main_script_hidden(), forked_on(rollout_cpus_from_env()):
                self.process.start()
        finally:
            if saved is None:
                os.environ.pop("CUDA_VISIBLE_DEVICES", None)
            else:
                os.environ["CUDA_VISIBLE_DEVICES"] = saved
        self.heartbeat.value = time.time()

    def publish_version(self, version: int, consumed: int | None = None) -> None:
        """The weight version the server serves from now on (dates requests where the server reports none),
        and the samples the trainer has consumed (trained or dropped) up to that version."""
        if consumed is not None:
            self.consumed.value = consumed
        self.served_version.value = version

    def publish_fleet(self, view: dict[str, tuple[str, int]]) -> None:
        """Which servers serve from now on (``rollout.routing_client.FleetView``): a newer epoch admits a server again, 0
        takes it out of service."""
        self.fleet_views.put(dict(view))

    def drained_servers(self) -> list[tuple[str, int, str]]:
        """``(name, epoch, reason)`` of each server the worker took out of service since the last call."""
        out = []
        while True:
            try:
                out.append(self.fleet_reports.get_nowait())
            except queue_lib.Empty:
                return out

    def queue_size(self) -> int:
        """Samples and reports waiting for the trainer."""
        try:
            return int(self.queue.qsize())
        except NotImplementedError:  # macOS has no sem_getvalue
            return -1

    def check(self) -> None:
        """Raise ``RolloutWorkerError`` with the worker's own traceback when it failed."""
        error = self._error()
        if error is not None:
            summary, trace = error
            raise RolloutWorkerError(f"{summary}\n\nrollout worker traceback:\n{trace}")
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


@contextlib.contextmanager
def _main_script_hidden() -> Iterator[None]:
    """Start a spawned child without it importing the parent's ``__main__``.

    multiprocessing tells a spawned child to run the parent's main module again (by path, or by
    name under ``python -m``) so that objects defined there can be unpickled by reference. Nothing
    here is sent by reference to ``__main__`` (cloudpickle sends such objects by value), and
    re-running a script without a main guard would start a second trainer. Without a file or a spec
    on the main module, the preparation data carries neither, and the child imports nothing of it.
    """
    main = sys.modules["__main__"]
    missing = object()
    saved_file = main.__dict__.get("__file__", missing)
    saved_spec = getattr(main, "__spec__", None)
    if saved_file is not missing:
        del main.__file__
    main.__spec__ = None
    try:
        yield
    finally:
        main.__spec__ = saved_spec
        if saved_file is not missing:
            main.__file__ = saved_file


# ---------------------------------------------------------------------------- inside the rollout process
def _worker_main(
    payload: bytes, shared: dict[str, Any], out_queue: Any, errors: Any, heartbeat: Any, served_version: Any, consumed: Any,
    stop_event: Any, trainer_pid: int, fleet_views: Any = None, fleet_reports: Any = None,
) -> None:
    threading.Thread(target=exit_with_parent, args=(trainer_pid,), name="rollout-parent-watch", daemon=True).start()
    # Unpickling imports the user's modules and the tokenizer's (transformers: seconds on a loaded
    # machine), before the event loop can beat: a thread beats until the loop's own beat takes over.
    starting = threading.Event()
    threading.Thread(target=_beat_while_starting, args=(heartbeat, starting), daemon=True).start()
    try:
        loop_cls, loop_kwargs = pickle.loads(payload)
        spec = WorkerSpec(loop_cls=loop_cls, loop_kwargs=loop_kwargs, shared_kwargs=shared)
        asyncio.run(_run(spec, out_queue, heartbeat, served_version, consumed, stop_event, starting, fleet_views,
                         fleet_reports))
    except BaseException as exc:  # noqa: BLE001 - every failure must reach the trainer
        summary = f"rollout worker failed: {type(exc).__name__}: {exc}"
        errors.put((summary, traceback.format_exc()))
        raise SystemExit(1) from None


def exit_with_parent(parent_pid: int, period_s: float = _PARENT_CHECK_S) -> None:
    """End this process once ``parent_pid`` is no longer its parent. A trainer that is killed (SIGKILL,
    SIGTERM, a crashed interpreter) never calls ``stop()``, and its orphaned worker would go on
    generating into a queue nobody reads, holding the server's capacity, for as long as the machine runs."""
    while os.getppid() == parent_pid:
        time.sleep(period_s)
    print(f"rollout worker {os.getpid()}: the trainer process {parent_pid} is gone; exiting", file=sys.stderr, flush=True)
    os._exit(1)


def _beat_while_starting(heartbeat: Any, started: threading.Event) -> None:
    while not started.wait(_HEARTBEAT_PERIOD_S):
        heartbeat.value = time.time()


async def _run(
    spec: WorkerSpec, out_queue: Any, heartbeat: Any, served_version: Any, consumed: Any, stop_event: Any,
    started: threading.Event, fleet_views: Any = None, fleet_reports: Any = None,
) -> None:
    async def beat() -> None:
        # From here on a stalled event loop (a blocking reward function, a frozen process) stops the beat.
        started.set()
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
    loop_obj = spec.loop_cls(emit=emit, **spec.loop_kwargs, **spec.shared_kwargs)
    loop_obj.served_version = lambda: int(served_version.value)
    loop_obj.consumed_samples = lambda: int(consumed.value)
    if fleet_views is not None:
        loop_obj.fleet_view = lambda: _newest(fleet_views)
        loop_obj.report_drained = lambda name, epoch, reason: fleet_reports.put((name, epoch, reason))
    scheduler = RolloutScheduler(loop_obj, stop_event)
    try:
        await scheduler.run()
    finally:
        beat_task.cancel()


def _newest(views: Any) -> Any:
    """The newest item on ``views`` (older ones are superseded), or None when there is none."""
    newest = None
    while True:
        try:
            newest = views.get_nowait()
        except queue_lib.Empty:
            return newest

"""Which CPU cores the trainer and the generation side use when both run on one machine without a GPU.

The embedded default (``grpo demo``, a flow with the local provisioner and no GPU) runs the vLLM CPU server,
the trainer and the rollout worker on the same few cores. Left to the scheduler, a one-thread trainer beside a
generating server ran its forward/backward several times slower than alone (benchmarks/README.md, "Where the CPU
goes beside a local CPU server, and the core split"; ``benchmarks/trainer/cpu_share.py``): vLLM binds its
engine worker's OpenMP thread to one core, and the API server, the engine core, the rollout worker and the
trainer then crowd the others. ``embedded_placement`` splits the cores once: the trainer processes alone on
theirs, everything that serves generation (the server's processes, the rollout worker) on the rest, with the
engine worker's OpenMP threads bound inside those.

Linux affinity is per thread, and a new thread or process inherits the affinity of the thread that creates it.
So a child is placed by ``forked_on(cores)``: the calling thread takes the cores while it starts the child, and
gets its own back afterwards. Nothing else in the parent moves, and every thread the child ever starts inherits
them (``os.sched_setaffinity(pid)`` on a running process would move its main thread only).

GPU machines, clusters and servers this process did not start are never placed.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Literal

ROLLOUT_CPUS_ENV = "GRPO_ROLLOUT_CPUS"
"""Set in a placed trainer's environment: the cores its rollout worker starts on."""

PlacementMode = Literal["auto", "off"]

log = logging.getLogger(__name__)


def format_cpus(cpus: Iterable[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2,5"`` (the list syntax of vLLM's OpenMP bind variable, taskset and cgroups)."""
    ids = sorted(set(cpus))
    parts, i = [], 0
    while i < len(ids):
        j = i
        while j + 1 < len(ids) and ids[j + 1] == ids[j] + 1:
            j += 1
        parts.append(str(ids[i]) if i == j else f"{ids[i]}-{ids[j]}")
        i = j + 1
    return ",".join(parts)


def parse_cpus(text: str) -> tuple[int, ...]:
    """``"0-2,5"`` -> ``(0, 1, 2, 5)``; empty text -> ``()``."""
    out: set[int] = set()
    for part in text.replace(" ", "").split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        first, last = int(lo), int(hi or lo)
        if first < 0 or last < first:
            raise ValueError(f"bad CPU range {part!r} in {text!r}")
        out.update(range(first, last + 1))
    return tuple(sorted(out))


@dataclass(frozen=True)
class CpuPlacement:
    """One split of a machine's cores between training and generation."""

    trainer: tuple[int, ...]
    """Cores of the training processes (all ranks of the node share them)."""
    generation: tuple[int, ...]
    """Cores of the vLLM server's processes and the rollout worker."""
    engine: tuple[int, ...]
    """Cores the vLLM engine worker binds its OpenMP threads to (a subset of ``generation``; ``grpo_core.vllm_server.process``
    passes them in vLLM's bind variable)."""

    def __post_init__(self) -> None:
        if not self.trainer or not self.generation:
            raise ValueError(f"a placement needs cores on both sides: trainer {self.trainer}, generation {self.generation}")
        if set(self.trainer) & set(self.generation):
            raise ValueError(f"trainer cores {self.trainer} and generation cores {self.generation} overlap")
        if not self.engine or not set(self.engine) <= set(self.generation):
            raise ValueError(f"engine cores {self.engine} must be a non-empty subset of the generation cores {self.generation}")

    def trainer_threads(self, processes: int = 1) -> int:
        """OpenMP threads of each of ``processes`` training processes sharing the trainer cores."""
        return max(1, len(self.trainer) // max(1, processes))

    def trainer_environment(self, processes: int = 1) -> dict[str, str]:
        """What each of ``processes`` training processes needs in its environment: its thread count and its
        rollout worker's cores."""
        return {"OMP_NUM_THREADS": str(self.trainer_threads(processes)), ROLLOUT_CPUS_ENV: format_cpus(self.generation)}

    def describe(self) -> str:
        return (f"trainer on cores {format_cpus(self.trainer)}; server and rollout worker on "
                f"{format_cpus(self.generation)}, engine bound to {format_cpus(self.engine)}")


def embedded_placement(cpus: Sequence[int]) -> CpuPlacement | None:
    """The embedded single-machine CPU split of ``cpus`` (the cores this process may use); None on one core.

    The trainers get the top half of the cores, the generation side the bottom half; vLLM's engine worker binds
    to all generation cores but the last, which the API server, the engine core and the rollout worker share
    (with the engine too when the generation side has one core). On two cores: the trainer alone on core 1,
    everything else on core 0 (the core vLLM's own ``auto`` binding gives its engine there)."""
    ids = sorted(set(cpus))
    if len(ids) < 2:
        return None
    n_train = len(ids) // 2
    trainer, generation = tuple(ids[-n_train:]), tuple(ids[:-n_train])
    engine = generation[:-1] if len(generation) > 1 else generation
    return CpuPlacement(trainer=trainer, generation=generation, engine=engine)


def replica_placement(cpus: Sequence[int], replica: int, replicas: int) -> CpuPlacement | None:
    """Server ``replica`` of a fleet of ``replicas`` on one machine: the trainers keep the top half of ``cpus`` as
    beside one server, and the generation half is cut into one run of cores per server (the first ones one core
    longer when it does not divide), each server's engine bound inside its own; with fewer generation cores than
    servers, the servers share them in turn (on two cores both servers run on core 0, the trainer alone on core 1).
    None on one core."""
    if not 0 <= replica < replicas:
        raise ValueError(f"replica {replica} of {replicas}: need 0 <= replica < replicas")
    base = embedded_placement(cpus)
    if base is None or replicas == 1:
        return base
    generation = base.generation
    if len(generation) >= replicas:
        size, extra = divmod(len(generation), replicas)
        start = replica * size + min(replica, extra)
        own = generation[start:start + size + (replica < extra)]
    else:
        own = (generation[replica % len(generation)],)
    return CpuPlacement(trainer=base.trainer, generation=own, engine=own[:-1] if len(own) > 1 else own)


def joined(placements: Sequence[CpuPlacement]) -> CpuPlacement:
    """One placement for the trainers of a fleet's servers: their shared trainer cores, and every server's
    generation cores (where the rollout worker runs)."""
    if len({p.trainer for p in placements}) != 1:
        raise ValueError(f"the servers' placements give the trainers different cores: {[p.trainer for p in placements]}")
    generation = tuple(sorted({c for p in placements for c in p.generation}))
    engine = tuple(sorted({c for p in placements for c in p.engine}))
    return CpuPlacement(trainer=placements[0].trainer, generation=generation, engine=engine)


def resolve_placement(mode: PlacementMode, *, cuda: bool, server_started_here: bool,
                      cpus: Sequence[int] | None = None, replica: int = 0, replicas: int = 1) -> CpuPlacement | None:
    """The placement a launcher applies: ``replica_placement`` of this process's cores (``cpus``: these instead)
    when ``mode`` is ``auto``, the trainers run on CPU and the launcher itself starts the vLLM server(s) on this
    machine; otherwise None (GPU trainers, a server elsewhere or started by someone else, ``mode="off"``)."""
    if mode not in ("auto", "off"):
        raise ValueError(f"cpu placement mode {mode!r}: choose 'auto' or 'off'")
    if mode == "off" or cuda or not server_started_here:
        return None
    return replica_placement(sorted(os.sched_getaffinity(0)) if cpus is None else cpus, replica, replicas)


@contextlib.contextmanager
def forked_on(cores: Iterable[int] | None) -> Iterator[None]:
    """Start children inside this block on ``cores``: the calling thread takes them for the duration (a child
    inherits its creator's affinity, and every thread it starts inherits the child's). ``None``: no change."""
    if cores is None or not hasattr(os, "sched_setaffinity"):
        yield
        return
    saved = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, set(cores))
    except OSError as err:  # cores this machine or cgroup does not have (a stale GRPO_ROLLOUT_CPUS): start unplaced
        log.warning("cannot place a child on cores %s (%s); it starts on %s", format_cpus(cores), err, format_cpus(saved))
        yield
        return
    try:
        yield
    finally:
        os.sched_setaffinity(0, saved)


def rollout_cpus_from_env(environ: dict[str, str] | None = None) -> tuple[int, ...] | None:
    """The rollout worker's cores a placed trainer was given (``GRPO_ROLLOUT_CPUS``), None when unplaced."""
    text = (os.environ if environ is None else environ).get(ROLLOUT_CPUS_ENV, "").strip()
    return (parse_cpus(text) or None) if text else None


def process_cpus(pid: int) -> dict[int, tuple[int, ...]]:
    """Each thread's allowed cores (``/proc/PID/task``): what a check or a benchmark reads back."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            out[int(tid)] = tuple(sorted(os.sched_getaffinity(int(tid))))
        except OSError:  # a thread that ended meanwhile
            pass
    return out

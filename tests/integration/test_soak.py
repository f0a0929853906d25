"""Soak: the embedded default trains for 30 minutes with flat memory and file handles (``-m soak``).

The demo's trainer settings (``flows.cli.DEMO_TRAINER``: tiny model, CPU vLLM server, checkpoints
every 40 steps) run against the session's vLLM server until ``GRPO_SOAK_MINUTES`` (default 30) have
passed; then the run is told to end after its current step (``max_steps`` lowered), so it finishes
as a run does. Every 10 s the resident memory and the open file descriptors of the trainer process
and of the rollout worker process are read from ``/proc``. After a warm-up (the first fifth of the
run) both must stay flat: the RSS at the end within 10% of its value at the end of the warm-up, and
no more than 5 descriptors other than sockets above it. Sockets are the generation client's
connection pool, one per request in flight (kept alive for a few seconds after): they follow the
rollouts in flight, so they must stay within the concurrency ceiling, not at one count. The readings
are printed every two minutes and written to ``$GRPO_SOAK_OUT/soak.tsv`` where that is set.

Deselected from the default run (it takes the whole duration); run it with:

    GRPO_SOAK_MINUTES=30 .venv/bin/python -m pytest -q -s -m soak tests/integration/test_soak.py
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from flows.cli import DEMO_TRAINER
from grpo_core.config import AsyncGRPOConfig
from grpo_core.rewards import accuracy_reward, format_reward
from grpo_core.tiny import arithmetic_dataset
from grpo_core.training.trainer import AsyncGRPOTrainer

pytestmark = [pytest.mark.integration, pytest.mark.soak]

MINUTES = float(os.environ.get("GRPO_SOAK_MINUTES", "30"))
SAMPLE_EVERY_S = 10.0
RSS_GROWTH = 0.10
FD_SLACK = 5


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for {pid}")


def open_fds(pid: int) -> tuple[int, int]:
    """(sockets, other descriptors) the process holds open."""
    sockets = other = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue  # closed while listing
        if target.startswith("socket:"):
            sockets += 1
        else:
            other += 1
    return sockets, other


@dataclass
class Sample:
    t: float
    step: int
    trainer_rss: int
    trainer_fds: int  # descriptors other than sockets
    trainer_sockets: int
    worker_rss: int
    worker_fds: int
    worker_sockets: int

    def line(self) -> str:
        mib = 2**20
        return (f"{self.t:5.0f} s  step {self.step:4d}  trainer {self.trainer_rss / mib:5.0f} MiB {self.trainer_fds:3d} fds "
                f"{self.trainer_sockets:3d} sockets  worker {self.worker_rss / mib:5.0f} MiB {self.worker_fds:3d} fds "
                f"{self.worker_sockets:3d} sockets")


@dataclass
class Watcher:
    trainer: AsyncGRPOTrainer
    deadline: float
    samples: list[Sample] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        start = time.monotonic()
        while not self.stop.wait(SAMPLE_EVERY_S):
            worker = self.trainer.run.worker
            if worker is None or not worker.process.is_alive():
                continue
            pid = worker.process.pid
            try:
                trainer_sockets, trainer_fds = open_fds(os.getpid())
                worker_sockets, worker_fds = open_fds(pid)
                sample = Sample(time.monotonic() - start, self.trainer.global_step, rss_bytes(os.getpid()), trainer_fds,
                                trainer_sockets, rss_bytes(pid), worker_fds, worker_sockets)
            except (OSError, RuntimeError):
                continue
            self.samples.append(sample)
            if len(self.samples) % 12 == 1:
                print(sample.line(), flush=True)
            if time.monotonic() >= self.deadline:
                # Ends the loop after the step in progress; the last step saves and syncs as usual.
                self.trainer.args.max_steps = self.trainer.global_step + 1
                return


def test_embedded_default_stays_flat(vllm_server, tiny_model_path, tmp_path):
    values = {**DEMO_TRAINER, "max_steps": 1_000_000, "save_total_limit": 2, "report_to": "none"}
    config = AsyncGRPOConfig(output_dir=str(tmp_path / "soak"), vllm_server_base_url=vllm_server.base_url, **values)
    trainer = AsyncGRPOTrainer(tiny_model_path, [accuracy_reward, format_reward],
                               train_dataset=arithmetic_dataset()["train"], args=config)
    watcher = Watcher(trainer, deadline=time.monotonic() + 60 * MINUTES)
    thread = threading.Thread(target=watcher.run, daemon=True)
    thread.start()
    try:
        history = trainer.train()
    finally:
        watcher.stop.set()
        thread.join(timeout=30)
    samples = watcher.samples
    assert len(samples) >= 10, f"too few samples over {MINUTES} min: {len(samples)}"
    warm = next(s for s in samples if s.t >= samples[-1].t / 5)
    last = samples[-1]
    mib = 2**20
    after = [s for s in samples if s.t >= warm.t]
    ceiling = config.resolved_max_concurrent_rollouts(1)
    report = (f"soak {MINUTES:g} min, {len(history)} steps: trainer RSS {warm.trainer_rss / mib:.0f} -> "
              f"{last.trainer_rss / mib:.0f} MiB (max {max(s.trainer_rss for s in samples) / mib:.0f}), fds "
              f"{warm.trainer_fds} -> {last.trainer_fds} (max {max(s.trainer_fds for s in after)}); worker RSS "
              f"{warm.worker_rss / mib:.0f} -> {last.worker_rss / mib:.0f} MiB (max {max(s.worker_rss for s in samples) / mib:.0f}), "
              f"fds {warm.worker_fds} -> {last.worker_fds} (max {max(s.worker_fds for s in after)}), sockets "
              f"{warm.worker_sockets} -> {last.worker_sockets} (max {max(s.worker_sockets for s in after)}, "
              f"ceiling {ceiling} rollouts in flight)")
    print(last.line())
    print(report)
    table = "\n".join(f"{s.t:.0f}\t{s.step}\t{s.trainer_rss}\t{s.trainer_fds}\t{s.trainer_sockets}\t{s.worker_rss}\t"
                      f"{s.worker_fds}\t{s.worker_sockets}" for s in samples)
    for folder in (tmp_path, os.environ.get("GRPO_SOAK_OUT")):
        if folder:
            Path(folder).mkdir(parents=True, exist_ok=True)
            (Path(folder) / "soak.tsv").write_text(table)
    assert last.trainer_rss <= (1 + RSS_GROWTH) * warm.trainer_rss, report
    assert last.worker_rss <= (1 + RSS_GROWTH) * warm.worker_rss, report
    assert max(s.trainer_fds for s in after) <= warm.trainer_fds + FD_SLACK, report
    assert max(s.worker_fds for s in after) <= warm.worker_fds + FD_SLACK, report
    # One connection per request in flight, plus the trainer's control client and the server's
    # metrics reader: never more than the rollout ceiling allows.
    assert max(s.worker_sockets for s in after) <= ceiling + FD_SLACK, report
    assert max(s.trainer_sockets for s in after) <= warm.trainer_sockets + FD_SLACK, report

"""Soak: the embedded default trains for 30 minutes with flat memory and file handles (``-m soak``).

The demo's trainer settings (``flows.cli.DEMO_TRAINER``: tiny model, CPU vLLM server, checkpoints
every 40 steps) run against the session's vLLM server until ``GRPO_SOAK_MINUTES`` (default 30) have
passed; then the run is told to end after its current step (``max_steps`` lowered), so it finishes
as a run does. Every 10 s the resident memory and the open file descriptors of the trainer process
and of the rollout worker process are read from ``/proc``. After a warm-up (the first fifth of the
run) both must stay flat: the RSS at the end within 10% of its value at the end of the warm-up, and
no more than 5 file descriptors above it.

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
from grpo_core.trainer import AsyncGRPOTrainer

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


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


@dataclass
class Sample:
    t: float
    step: int
    trainer_rss: int
    trainer_fds: int
    worker_rss: int
    worker_fds: int


@dataclass
class Watcher:
    trainer: AsyncGRPOTrainer
    deadline: float
    samples: list[Sample] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        start = time.monotonic()
        while not self.stop.wait(SAMPLE_EVERY_S):
            worker = self.trainer.worker
            if worker is None or not worker.process.is_alive():
                continue
            pid = worker.process.pid
            try:
                self.samples.append(Sample(time.monotonic() - start, self.trainer.global_step, rss_bytes(os.getpid()),
                                           open_fds(os.getpid()), rss_bytes(pid), open_fds(pid)))
            except (OSError, RuntimeError):
                continue
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
    report = (f"soak {MINUTES:g} min, {len(history)} steps: trainer RSS {warm.trainer_rss / mib:.0f} -> "
              f"{last.trainer_rss / mib:.0f} MiB (max {max(s.trainer_rss for s in samples) / mib:.0f}), fds "
              f"{warm.trainer_fds} -> {last.trainer_fds}; worker RSS {warm.worker_rss / mib:.0f} -> "
              f"{last.worker_rss / mib:.0f} MiB (max {max(s.worker_rss for s in samples) / mib:.0f}), fds "
              f"{warm.worker_fds} -> {last.worker_fds}")
    print(report)
    (tmp_path / "soak.tsv").write_text("\n".join(
        f"{s.t:.0f}\t{s.step}\t{s.trainer_rss}\t{s.trainer_fds}\t{s.worker_rss}\t{s.worker_fds}" for s in samples))
    assert last.trainer_rss <= (1 + RSS_GROWTH) * warm.trainer_rss, report
    assert last.worker_rss <= (1 + RSS_GROWTH) * warm.worker_rss, report
    assert max(s.trainer_fds for s in samples if s.t >= warm.t) <= warm.trainer_fds + FD_SLACK, report
    assert max(s.worker_fds for s in samples if s.t >= warm.t) <= warm.worker_fds + FD_SLACK, report

"""The rollout process ends when its trainer is killed (no ``stop()`` ever comes)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

# A "trainer" that starts a child running the worker's parent watch, prints the child's pid, and waits.
PARENT = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c",
    "import os; from grpo_core.rollout.worker import exit_with_parent; exit_with_parent(os.getppid(), period_s=0.2)"])
print(child.pid, flush=True)
time.sleep(120)
"""


def gone(pid: int) -> bool:
    try:
        state = next(line for line in Path(f"/proc/{pid}/status").read_text().splitlines() if line.startswith("State:"))
    except (FileNotFoundError, StopIteration):
        return True
    return " Z" in state  # exited, waiting for its new parent to reap it


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_the_worker_exits_when_its_trainer_is_killed():
    trainer = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True)
    worker = int(trainer.stdout.readline())
    try:
        time.sleep(1.0)
        assert not gone(worker), "the watch must not end a worker whose trainer lives"
        os.kill(trainer.pid, signal.SIGKILL)
        trainer.wait()
        deadline = time.monotonic() + 10
        while not gone(worker) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert gone(worker), "the worker outlived its killed trainer by 10 s"
    finally:
        if not gone(worker):
            os.kill(worker, signal.SIGKILL)

"""An external vLLM server killed and restarted on the same port mid-run (``server.managed: false``).

The test runs a trainer against the session's CPU vLLM server; once the run trains samples drawn after
its first push, a thread kills the server's process group with SIGKILL and starts it again with the
same command on the same port, from outside the trainer, while a poller records the server's
``/weight_info`` throughout. The new server comes back on its disk weights under the weight version
``"default"``, and it stays the session's server for the tests after this one (every trainer pushes
its own weights when it starts).

It must show: the run finishes; the restarted server reported ``"default"`` until the trainer pushed
again; no trained sample carries a version the trainer never pushed (the ledger lists each step's
sample versions, so a ``"default"`` sample would appear as -1); the re-push is logged (the trainer's
log, ``sync/server_restarts`` in MLflow and the ledger count the flow's summary reads).

Cost: one vLLM start of the tiny model (the restart: about 1-2 min on an idle 2-core machine, 3-5 min on
a loaded one) and a 60-step run of well under a second per step.

    .venv/bin/python -m pytest -q tests/integration/test_server_restart.py
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from dataclasses import dataclass, field

import httpx
import mlflow
import pytest

from grpo_core.checkpoint import ledger_summary, read_ledger
from grpo_core.config import AsyncGRPOConfig
from grpo_core.rewards import accuracy_reward, format_reward
from grpo_core.rollout.stages import UNKNOWN_VERSION
from grpo_core.tiny import arithmetic_dataset
from grpo_core.training.trainer import AsyncGRPOTrainer
from grpo_core.vllm_server.process import VLLMServer

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MAX_STEPS = 60
# The kill comes once a step trains samples sampled after the first push, and at least this many steps before
# the end. Until then the run trains a backlog of version-0 samples: while the rollout process scores its first
# groups (a cold start of a few seconds) it goes on generating, as far ahead as max_staleness allows, which this
# test sets high. That backlog measured 4 to 32 steps on two cores (the server's log: 37 generate requests
# before the second push), hence 60 steps.
STEPS_AFTER_KILL = 8
START_TIMEOUT_S = 1800  # a vLLM start on two busy cores has taken ten minutes


@dataclass
class VersionPoller:
    """``GET /weight_info`` every ``period_s``: (time, version or None when nothing answered)."""

    url: str
    period_s: float = 0.1
    seen: list[tuple[float, str | None]] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        with httpx.Client(timeout=2.0) as http:
            while not self._stop.is_set():
                try:
                    version = str(http.get(f"{self.url}/weight_info").json()["weight_version"])
                except (httpx.HTTPError, ValueError, KeyError):
                    version = None
                self.seen.append((time.time(), version))
                self._stop.wait(self.period_s)

    def stop(self) -> None:
        self._stop.set()


@dataclass
class Restart:
    fresh_at_step: int = 0
    kill_after_step: int = 0
    killed_at: float = 0.0
    serving_again_at: float = 0.0
    log_offset: int = 0
    error: BaseException | None = None


def fresh_samples_trained(output_dir: str) -> bool:
    """Whether a step trained samples of a weight version after the first push."""
    try:
        _, steps = read_ledger(output_dir)
    except OSError:
        return False
    return any(max(r["versions"], default=0) >= 1 for r in steps)


def kill_and_restart(server: VLLMServer, trainer: AsyncGRPOTrainer, out: Restart) -> None:
    try:
        while not fresh_samples_trained(trainer.args.output_dir):
            time.sleep(0.2)
        out.fresh_at_step = len(trainer.state.log_history)
        # After that step's push and log line, so the kill finds the trainer collecting (a kill during a
        # push is the other way a restart is noticed: the push fails).
        logged = len(trainer.state.log_history)
        while len(trainer.state.log_history) == logged:
            time.sleep(0.01)
        out.kill_after_step = len(trainer.state.log_history)
        pid = server.process.pid
        os.killpg(pid, signal.SIGKILL)  # its own process group: API server, engine core, workers
        server.process.wait()
        out.killed_at = time.time()
        server.process = None
        out.log_offset = server.log_path.stat().st_size  # the restart appends to the same log
        server.start(timeout_s=START_TIMEOUT_S)  # the same command and port: the trainer's URL does not change
        out.serving_again_at = time.time()
    except BaseException as exc:  # noqa: BLE001 - reported by the test
        out.error = exc


def test_trainer_repushes_to_a_restarted_external_server(vllm_server, tiny_model_path, mlflow_server, tmp_path,
                                                         monkeypatch, caplog):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server)
    server = vllm_server
    config = AsyncGRPOConfig(
        output_dir=str(tmp_path / "run"), vllm_server_base_url=server.base_url, report_to="mlflow",
        run_name="server-restart", max_steps=MAX_STEPS, learning_rate=1e-4, num_generations=4,
        per_device_train_batch_size=8, max_completion_length=16, num_sampler_logprobs=4, save_strategy="no",
        # Staleness never drops a sample in this run (at most MAX_STEPS + 1 pushes), so only the rule for
        # versions never pushed can keep the restarted server's samples out: the staleness of such a
        # sample is every push there was.
        max_staleness=MAX_STEPS + 4,
        max_concurrent_rollouts=8, queue_maxsize=8,
        worker_heartbeat_timeout_s=120.0, server_unavailable_timeout_s=START_TIMEOUT_S,
    )
    trainer = AsyncGRPOTrainer(tiny_model_path, [accuracy_reward, format_reward],
                               train_dataset=arithmetic_dataset()["train"], args=config)
    poller = VersionPoller(server.base_url)
    restart = Restart()
    threads = [threading.Thread(target=poller.run, daemon=True),
               threading.Thread(target=kill_and_restart, args=(server, trainer, restart), daemon=True)]
    caplog.set_level(logging.INFO, logger="grpo_core")
    try:
        for thread in threads:
            thread.start()
        started = time.monotonic()
        history = trainer.train()
        train_s = time.monotonic() - started
    finally:
        poller.stop()
        threads[1].join(timeout=START_TIMEOUT_S if server.process is None else 10)
    assert restart.error is None, f"the restart from outside failed: {restart.error}"
    print(f"trained {len(history)} steps in {train_s:.0f} s; killed after step {restart.kill_after_step}; the server "
          f"was down {restart.serving_again_at - restart.killed_at:.0f} s")
    assert restart.kill_after_step <= MAX_STEPS - STEPS_AFTER_KILL, (
        f"the kill came too late to test what follows (samples after the first push were trained by step "
        f"{restart.fresh_at_step})")

    # ---- the run finished, and the trainer counted one restart
    assert len(history) == MAX_STEPS and trainer.global_step == MAX_STEPS
    assert trainer.run.server_restarts == 1
    assert history[-1]["sync/server_restarts"] == 1.0

    # ---- the server's weight-version history: the trainer's versions, nothing while it was down, then
    # "default" (disk weights) from the new process until the re-push, then the trainer's versions again
    after_kill = [(t, v) for t, v in poller.seen if t > restart.killed_at]
    back = [(t, v) for t, v in after_kill if v is not None]
    assert back, "the poller never saw the restarted server"
    assert back[0][1] == "default", f"the restarted server first reported {back[0][1]!r}"
    repushed = next((v for _, v in back if v != "default"), None)
    assert repushed is not None, "the restarted server never got the trainer's weights"
    assert all(v == "default" for _, v in back[: [v for _, v in back].index(repushed)])
    before_kill = [v for t, v in poller.seen if t < restart.killed_at and v is not None]
    assert int(repushed) >= int(before_kill[-1]), (repushed, before_kill[-1])  # this step's weights, not older
    served = {v for _, v in poller.seen if v is not None}

    # ---- no sample the restarted server generated before the re-push was trained: those carry its
    # "default" version (tokens sampled across the re-push carry both, and the oldest counts)
    attempts, steps = read_ledger(config.output_dir)
    trained_versions = {v for record in steps for v in record["versions"]}
    assert UNKNOWN_VERSION not in trained_versions, f"samples of the restarted server's disk weights trained: {steps}"
    assert {str(v) for v in trained_versions} <= served - {"default"}, (trained_versions, served)
    assert trained_versions <= set(trainer.versions.pushed)
    assert max(trained_versions) >= int(repushed), "no sample generated after the restart was trained"
    summary = ledger_summary(config.output_dir)
    assert summary["server_restarts"] == 1  # what the flow's summary reports
    # Generations the restarted server finished before the re-push paused it: wholly on disk weights.
    with open(server.log_path, "rb") as log:
        log.seek(restart.log_offset)
        log_lines = log.read().decode(errors="replace").splitlines()
    first_pause = next(i for i, line in enumerate(log_lines) if "POST /pause" in line)
    on_disk_weights = sum('"POST /inference/v1/generate' in line for line in log_lines[:first_pause])
    print(f"restarted server: {on_disk_weights} generations finished on its disk weights before the re-push; "
          f"samples dropped for a version never pushed: {summary['foreign_dropped']}; "
          f"trained versions {sorted(trained_versions)}; re-pushed version {repushed}")

    # ---- the re-push is logged: in the trainer's log and in MLflow
    messages = [r.getMessage() for r in caplog.records]
    assert any(f"re-pushed weight version {repushed} to the restarted server" in m for m in messages), messages[-20:]
    client = mlflow.MlflowClient(mlflow_server)
    run_id = trainer.tracker.run_id
    restarts = {m.step: m.value for m in client.get_metric_history(run_id, "sync/server_restarts")}
    assert sorted(restarts) == list(range(1, MAX_STEPS + 1))
    killed = restart.kill_after_step
    assert [restarts[s] for s in range(1, killed + 1)] == [0.0] * killed and restarts[MAX_STEPS] == 1.0
    print("restart noticed by " + ("a failed push" if any("the push failed" in m for m in messages)
                                   else "the check before a collection or during one"))
    assert {m.step for m in client.get_metric_history(run_id, "loss")} == set(range(1, MAX_STEPS + 1))

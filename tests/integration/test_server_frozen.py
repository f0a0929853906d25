"""A run of one server that freezes (SIGSTOP) for longer than ``server_drain_after_s``: the fleet's rule makes it
out, and as the only server it is waited for, not drained (``vllm_server.health``). The run finishes, no prompt
position is trained twice or lost (the run ledger), and MLflow has the time the trainer waited on it
(``fleet/<name>/waited_s``: frozen right after a step, the server holds the next push until SIGCONT).

Uses the session's server (tests/conftest.py) and leaves it serving (SIGCONT in any case).

    .venv/bin/python -m pytest -q -s tests/integration/test_server_frozen.py
"""

from __future__ import annotations

import os
import signal
import threading
import time

import mlflow
import pytest

from grpo_core.checkpoint import ledger_summary, read_ledger
from grpo_core.config import AsyncGRPOConfig
from grpo_core.rewards import accuracy_reward, format_reward
from grpo_core.rollout.routing_client import server_name
from grpo_core.tiny import arithmetic_dataset
from grpo_core.training.trainer import AsyncGRPOTrainer

pytestmark = pytest.mark.integration

DRAIN_AFTER_S = 4.0
STOP_S = 12.0  # three windows: out by the rule, waited for as the only server
STEPS = 20
FREEZE_AFTER_STEP = 3


def test_a_lone_server_frozen_past_the_window_is_waited_for_and_the_wait_is_in_mlflow(
        vllm_server, mlflow_server, tiny_model_path, tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server)
    name = server_name(vllm_server.base_url)
    config = AsyncGRPOConfig(
        output_dir=str(tmp_path / "run"), vllm_server_base_url=vllm_server.base_url, report_to="mlflow",
        run_name="lone-frozen", max_steps=STEPS, learning_rate=1e-4, num_generations=4, per_device_train_batch_size=8,
        max_completion_length=16, save_strategy="no", num_sampler_logprobs=4, server_drain_after_s=DRAIN_AFTER_S,
        server_unavailable_timeout_s=300.0, max_staleness=1_000_000, worker_heartbeat_timeout_s=120.0,
        max_concurrent_rollouts=8, queue_maxsize=16)
    trainer = AsyncGRPOTrainer(tiny_model_path, [accuracy_reward, format_reward],
                               train_dataset=arithmetic_dataset()["train"], args=config)
    failure: list[BaseException] = []

    def freeze_once() -> None:
        try:
            while len(trainer.state.log_history) < FREEZE_AFTER_STEP:
                time.sleep(0.05)
            # At once, not waiting for it to generate: the tiny run finishes its steps from the queue in seconds,
            # and the next push (one per step) must meet the frozen server.
            os.killpg(vllm_server.process.pid, signal.SIGSTOP)
            try:
                time.sleep(STOP_S)
            finally:
                os.killpg(vllm_server.process.pid, signal.SIGCONT)
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            failure.append(exc)

    thread = threading.Thread(target=freeze_once, daemon=True)
    thread.start()
    try:
        history = trainer.train()
    finally:
        thread.join(timeout=STOP_S + 70)
        os.killpg(vllm_server.process.pid, signal.SIGCONT)  # whatever happened, the session's server serves on
    assert not failure, failure
    assert len(history) == STEPS
    last = history[-1]
    assert last["fleet/drains"] == 0.0 and last[f"rollout/server/{name}/serving"] == 1.0  # never drained
    assert sum(h.get("rollout/resent_requests", 0.0) for h in history) == 0.0
    # Frozen right after a step, it holds the next push until SIGCONT: the trainer waited most of the freeze on it.
    waited = last[f"fleet/{name}/waited_s"]
    assert STOP_S / 2 <= waited <= STOP_S + 60, waited

    _, records = read_ledger(config.output_dir)
    consumed = [p for r in records for p in r["trained"] + r["dropped_groups"]]
    assert ledger_summary(config.output_dir)["prompts_trained_twice"] == 0
    assert not set(range(records[-1]["frontier"])) - set(consumed)

    client = mlflow.MlflowClient(mlflow_server)
    logged = client.get_metric_history(trainer.tracker.run_id, f"fleet/{name}/waited_s")
    assert max(m.value for m in logged) == waited

"""What a logged step costs the artifact store does not grow with the run: bytes read and written at step 10 and at
step 1,000 are equal within 10%, and so are the means over ten blocks of steps early and late, with every step's
completions in a table MLflow's UI shows as one (a file per block of 9 steps, each named in the run's tag
``mlflow.loggedArtifacts``; ``grpo_core/tracking/tables.py``).

A real MLflow tracker (SQLite for runs, a moto S3 server behind a byte-counting proxy as the artifact store, the way
a cluster's runs keep artifacts in S3) is driven by the trainer's own metric log (``StepLog.record`` and
``StepLog.completions``, what ``AsyncGRPOTrainer`` calls each step) for 1,000 steps with 16 completions each, and a
checkpoint reference (``log_artifact_uri``, what the checkpointer writes) every 7 steps. Nothing is trained: the
per-step logging path is the thing measured, with every earlier step's artifacts in the store.

    .venv/bin/python -m pytest -q tests/test_tracking_step_cost.py
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import httpx
import numpy as np
import pytest

from grpo_core.config import AsyncGRPOConfig
from grpo_core.packing.planner import StepPlan
from grpo_core.rollout.types import GroupReport
from grpo_core.tracking.tables import LOGGED_ARTIFACTS_TAG, block_path, read_table, table_block
from grpo_core.training.collector import StepBatch
from grpo_core.training.step_log import StepLog
from grpo_core.vllm_server.process import free_port
from tests.fault_proxy import FaultProxy

# A real S3 server (moto) is started: the fast tier leaves this test out, as it does those of other servers.
pytestmark = pytest.mark.startup

STEPS = 1000
SAVE_EVERY = 7  # neither step 10 nor step 1,000 saves: the two compare like with like
BUCKET = "grpo-artifacts"


@pytest.fixture(scope="module")
def s3_store(tmp_path_factory):
    """A moto S3 server with a bucket, behind a proxy that counts bytes; yields the proxy."""
    root = tmp_path_factory.mktemp("moto-cost")
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=open(root / "moto.log", "wb"), stderr=subprocess.STDOUT, start_new_session=True)
    proxy = None
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                httpx.get(f"http://127.0.0.1:{port}", timeout=2)
                break
            except httpx.HTTPError:
                assert time.monotonic() < deadline, (root / "moto.log").read_text()
                time.sleep(0.5)
        httpx.put(f"http://127.0.0.1:{port}/{BUCKET}").raise_for_status()
        proxy = FaultProxy(f"http://127.0.0.1:{port}").start()
        yield proxy
    finally:
        if proxy is not None:
            proxy.stop()
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


def step_batch(step: int) -> StepBatch:
    """Two groups of eight completions, each with a prompt, a completion, the reward and two functions' scores."""
    rng = np.random.default_rng(step)
    reports = []
    for g in range(2):
        accuracy = rng.integers(0, 2, 8).astype(float)
        fmt = np.full(8, 0.5)
        reports.append(GroupReport(
            position=2 * step + g, row_index=g, epoch=0, rewards=accuracy + fmt,
            rewards_per_func={"accuracy_reward": accuracy, "format_reward": fmt}, num_samples=8, dropped=False,
            # Numbers of four digits: the text is as long at every step, so only the logging's own cost can differ.
            completions=[f"<think>{step:04d} + {g} = {step + g:04d}</think><answer>{step + g + i:04d}</answer>"
                         for i in range(8)],
            prompt_text=f"What is {step:04d} + {g}? Answer inside <answer></answer>."))
    plan = StepPlan(microbatches=[], token_budget=4096, world_size=1, gradient_accumulation_steps=1)
    return StepBatch(plan=plan, samples=[], reports=reports, stale_dropped=0, staleness=[], wait_s=0.0)


def test_a_logged_step_costs_the_artifact_store_the_same_at_step_10_and_step_1000(s3_store, tmp_path, monkeypatch):
    import mlflow

    from grpo_core.tracking.tracker import MLflowTracker

    monkeypatch.setenv("MLFLOW_S3_ENDPOINT_URL", s3_store.url)
    for key, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                       "AWS_DEFAULT_REGION": "us-east-1"}.items():
        monkeypatch.setenv(key, value)
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    mlflow.MlflowClient(store).create_experiment("cost", artifact_location=f"s3://{BUCKET}/mlflow")
    tracker = MLflowTracker(store, "cost", "cost")
    args = AsyncGRPOConfig(log_completions=True, num_completions_to_log=16, num_completions_to_print=0, max_steps=STEPS)
    step_log = StepLog(args, tracker, True, [], frozenset())

    def traffic() -> tuple[int, int, int]:
        """Requests, bytes sent and bytes received through the proxy so far."""
        rows = list(s3_store.traffic)
        return len(rows), sum(r[2] for r in rows), sum(r[3] for r in rows)

    cost: dict[int, tuple[int, int, int]] = {}
    for step in range(1, STEPS + 1):
        before = traffic()
        step_log.record(step, {"reward": 1.0, "loss": 0.1, "rollout/generated_tok_s": 100.0})
        step_log.completions(step, step_batch(step))
        if step % SAVE_EVERY == 0:
            tracker.log_artifact_uri("checkpoint", f"s3://{BUCKET}/run/checkpoint-{step}", step=step)
        assert not tracker.flush(), f"writes of step {step} were not delivered"
        after = traffic()
        cost[step] = tuple(a - b for a, b in zip(after, before, strict=True))  # type: ignore[assignment]
    tracker.close()

    client = mlflow.MlflowClient(store)
    # Every step's rows are in a table MLflow's UI shows as one: a file per block, each named in the run's tag.
    blocks = sorted({table_block("completions", step, STEPS, 1) for step in range(1, STEPS + 1)})
    files = [a.path for a in client.list_artifacts(tracker.run_id, "completions")]
    assert files == [block_path("completions", b) for b in blocks] and blocks[1] == (10, 18) and blocks[-1] == (1000, 1008)
    listed = json.loads(client.get_run(tracker.run_id).data.tags[LOGGED_ARTIFACTS_TAG])
    assert [e["path"] for e in listed if e["type"] == "table"] == files
    assert read_table(client, tracker.run_id, "completions")["step"].tolist() == [s for s in range(1, STEPS + 1)
                                                                                   for _ in range(16)]
    requests_10, sent_10, received_10 = cost[10]
    requests_1000, sent_1000, received_1000 = cost[STEPS]
    print(f"artifact store per logged step: step 10 {requests_10} requests, {sent_10} B written, {received_10} B read;"
          f" step {STEPS} {requests_1000} requests, {sent_1000} B written, {received_1000} B read")
    assert sent_10 > 1000  # the step's table did go to the store
    assert requests_1000 == requests_10
    assert abs(sent_1000 - sent_10) <= 0.1 * sent_10
    assert abs(received_1000 - received_10) <= 0.1 * received_10  # nothing is read back to add a step
    # A block's file is written again at each of its steps: over whole blocks (ten of 9 steps), late costs as early.
    early, late = range(10, 100), range(901, 991)
    assert blocks.index((10, 18)) + 10 == blocks.index((100, 108)) and (901, 909) in blocks and (991, 999) in blocks
    for i, what in ((0, "requests"), (1, "bytes written"), (2, "bytes read")):
        mean_early, mean_late = (sum(cost[s][i] for s in steps) / len(steps) for steps in (early, late))
        print(f"{what} per step, mean over steps 10-99: {mean_early:.0f}, over steps 901-990: {mean_late:.0f}")
        assert abs(mean_late - mean_early) <= 0.1 * max(mean_early, 1), what
    # A checkpoint reference costs the same late in the run as early.
    # A late saving step at the same place in its block as step 7 (the block's file then holds as many steps).
    span = blocks[0][1]
    late_save = max(s for s in range(SAVE_EVERY, STEPS + 1, SAVE_EVERY) if (s - 1) % span == (SAVE_EVERY - 1) % span)
    assert late_save > 900
    save_first, save_last = cost[SAVE_EVERY], cost[late_save]
    assert save_last[0] == save_first[0] and abs(save_last[1] - save_first[1]) <= 0.1 * save_first[1]

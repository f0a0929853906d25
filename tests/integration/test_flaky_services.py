"""Object storage and tracking that fail for a while: the run goes on, loses nothing, doubles nothing.

One 12-step run checkpoints every 2 steps to a moto S3 server and logs to the session's MLflow
server, each reached through a fault-injecting proxy (``tests/fault_proxy.py``):

1. S3 answers every request with 503 ``SlowDown`` for 20 s, starting as the first checkpoint's files
   arrive in the bucket (the write is under way);
2. later S3 is stopped (connections refused, open ones cut) for 30 s;
3. later MLflow loses its replies for 5 s (requests reach it, answers do not) and is then stopped
   for 55 s more.

It must show: the run finishes; training went on while MLflow was down; every checkpoint in the
bucket loads (each one the run saved, with its step); the ledger has every step; MLflow holds each
step's metrics exactly once, with the values the trainer logged.

Cost: about 3 minutes of training on the shared session servers (vLLM, MLflow) plus a moto start.

    .venv/bin/python -m pytest -q tests/integration/test_flaky_services.py
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field

import httpx
import mlflow
import pytest

from grpo_core.checkpoint import MANIFEST, read_ledger, surviving_steps
from grpo_core.config import AsyncGRPOConfig
from grpo_core.rewards import accuracy_reward, format_reward
from grpo_core.tiny import arithmetic_dataset
from grpo_core.training.trainer import AsyncGRPOTrainer
from grpo_core.vllm_server.process import free_port
from tests.fault_proxy import FaultProxy

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MAX_STEPS = 12
SAVE_STEPS = 2
# Each window spans several of the retried calls it hits (a step takes 1-3 s here, and the storage and
# tracking retries back off from 1 s), so every fault meets calls in flight and calls started inside it.
S3_ERRORS_S = 10.0
S3_DOWN_S = 15.0
MLFLOW_DROPS_S = 5.0
MLFLOW_DOWN_S = 25.0  # with the drops: 30 s without an answer


@pytest.fixture(scope="module")
def moto_s3(tmp_path_factory):
    """A moto S3 server with a bucket; yields its URL (the test's view, behind no proxy)."""
    root = tmp_path_factory.mktemp("moto-flaky")
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=open(root / "moto.log", "wb"), stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                httpx.get(url, timeout=2)
                break
            except httpx.HTTPError:
                assert time.monotonic() < deadline, (root / "moto.log").read_text()
                time.sleep(0.5)
        yield url
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


@dataclass
class Faults:
    """What the fault thread did, and when (for the assertions)."""

    s3_errors_at_step: int = -1
    s3_down_at_step: int = -1
    mlflow_down: tuple[float, float] = (0.0, 0.0)
    steps_during_mlflow_outage: int = 0
    log: list[str] = field(default_factory=list)
    error: BaseException | None = None


def bucket_keys(s3, prefix: str) -> list[str]:
    listing = s3.list_objects_v2(Bucket="grpo", Prefix=prefix)
    return [o["Key"] for o in listing.get("Contents", [])]


def inject(trainer: AsyncGRPOTrainer, s3, prefix: str, s3_proxy: FaultProxy, mlflow_proxy: FaultProxy, faults: Faults) -> None:
    def wait_until(predicate, what: str, timeout_s: float = 1800) -> None:
        deadline = time.monotonic() + timeout_s
        while not predicate():
            if time.monotonic() > deadline:
                raise TimeoutError(what)
            time.sleep(0.01)

    try:
        # 1: 503s from the moment the first checkpoint's first file lands (its write is under way)
        wait_until(lambda: bucket_keys(s3, f"{prefix}/checkpoint-{SAVE_STEPS}/"), "first checkpoint write")
        faults.s3_errors_at_step = trainer.global_step
        s3_proxy.set_mode("error")
        time.sleep(S3_ERRORS_S)
        s3_proxy.set_mode("pass")
        faults.log.append(f"S3 503s for {S3_ERRORS_S:.0f} s from step {faults.s3_errors_at_step}")
        # 2: a stopped S3 two steps later (ledger writes, and a checkpoint when it falls on one)
        target = trainer.global_step + 2
        wait_until(lambda: trainer.global_step >= target, f"step {target}")
        faults.s3_down_at_step = trainer.global_step
        s3_proxy.set_mode("down")
        time.sleep(S3_DOWN_S)
        s3_proxy.set_mode("pass")
        faults.log.append(f"S3 down for {S3_DOWN_S:.0f} s from step {faults.s3_down_at_step}")
        # 3: MLflow: replies lost, then stopped, with training still to do
        target = trainer.global_step + 1
        wait_until(lambda: trainer.global_step >= target, f"step {target}")
        first = trainer.global_step
        start = time.time()
        mlflow_proxy.set_mode("drop")
        time.sleep(MLFLOW_DROPS_S)
        mlflow_proxy.set_mode("down")
        time.sleep(MLFLOW_DOWN_S)
        mlflow_proxy.set_mode("pass")
        faults.mlflow_down = (start, time.time())
        faults.steps_during_mlflow_outage = trainer.global_step - first
        faults.log.append(f"MLflow without answers for {MLFLOW_DROPS_S + MLFLOW_DOWN_S:.0f} s from step {first}; "
                          f"{faults.steps_during_mlflow_outage} steps trained meanwhile")
    except BaseException as exc:  # noqa: BLE001 - reported by the test
        faults.error = exc
        s3_proxy.set_mode("pass")
        mlflow_proxy.set_mode("pass")


@pytest.fixture(scope="module")
def flaky_run(vllm_server, mlflow_server, tiny_model_path, moto_s3, tmp_path_factory):
    import boto3

    s3_proxy = FaultProxy(moto_s3).start()
    mlflow_proxy = FaultProxy(mlflow_server).start()
    env = {"AWS_ACCESS_KEY_ID": "grpo-test-key", "AWS_SECRET_ACCESS_KEY": "grpo-test-secret",
           "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL": s3_proxy.url, "MLFLOW_TRACKING_URI": mlflow_proxy.url}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    s3 = boto3.client("s3", endpoint_url=moto_s3, region_name="us-east-1")  # the test's own view: no proxy
    s3.create_bucket(Bucket="grpo")
    prefix = f"flaky-{uuid.uuid4().hex[:8]}"
    config = AsyncGRPOConfig(
        output_dir=f"s3://grpo/{prefix}", vllm_server_base_url=vllm_server.base_url, report_to="mlflow",
        run_name=prefix, max_steps=MAX_STEPS, save_steps=SAVE_STEPS, save_total_limit=None, logging_steps=1,
        learning_rate=1e-4, num_generations=4, per_device_train_batch_size=8, max_completion_length=16,
        num_sampler_logprobs=4, max_staleness=1000, max_concurrent_rollouts=8, queue_maxsize=8,
        worker_heartbeat_timeout_s=120.0, storage_retry_timeout_s=300.0, tracking_flush_timeout_s=600.0,
    )
    faults = Faults()
    try:
        trainer = AsyncGRPOTrainer(tiny_model_path, [accuracy_reward, format_reward],
                                   train_dataset=arithmetic_dataset()["train"], args=config)
        thread = threading.Thread(target=inject, args=(trainer, s3, prefix, s3_proxy, mlflow_proxy, faults), daemon=True)
        thread.start()
        started = time.monotonic()
        history = trainer.train()
        seconds = time.monotonic() - started
        thread.join(timeout=MLFLOW_DROPS_S + MLFLOW_DOWN_S + 60)
        trainer.tracker.close()  # waits for what the outage held back (a no-op when train() closed it)
        print(f"flaky run: {seconds:.0f} s; {'; '.join(faults.log)}; S3 proxy {dict(s3_proxy.counts)}, "
              f"MLflow proxy {dict(mlflow_proxy.counts)}")
        assert faults.error is None, f"the fault thread failed: {faults.error!r}"
        counts = (Counter(s3_proxy.counts), Counter(mlflow_proxy.counts))
        # The proxies stay (passing everything) while the tests read: s3fs keeps its client per endpoint.
        yield trainer, history, config, faults, counts[0], counts[1], s3, prefix
    finally:
        s3_proxy.stop()
        mlflow_proxy.stop()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def test_s3_errors_and_outage_during_checkpoints(flaky_run, tiny_model_path):
    trainer, history, config, faults, s3_counts, _, s3, prefix = flaky_run
    # The faults reached the trainer's storage traffic.
    assert s3_counts["error"] > 0 and s3_counts["down"] + s3_counts["pass"] > 0, s3_counts
    assert len(history) == MAX_STEPS
    assert not any("checkpoint/failed" in h for h in history), "a checkpoint was skipped"

    # The ledger holds every step once.
    attempts, steps = read_ledger(config.output_dir)
    assert [r["step"] for r in surviving_steps(attempts, steps)] == list(range(1, MAX_STEPS + 1))

    # Every checkpoint the run wrote is in the bucket, complete, and loads with its step.
    saved = sorted({int(k.split("/")[1].split("-")[1]) for k in bucket_keys(s3, f"{prefix}/checkpoint-")})
    assert saved == list(range(SAVE_STEPS, MAX_STEPS + 1, SAVE_STEPS))
    for step in saved:
        url = f"{config.output_dir}/checkpoint-{step}"
        assert f"{prefix}/checkpoint-{step}/{MANIFEST}" in bucket_keys(s3, f"{prefix}/checkpoint-{step}/")
        reader = AsyncGRPOTrainer(tiny_model_path, [accuracy_reward], train_dataset=arithmetic_dataset()["train"],
                                  args=config.replace(report_to="none", resume_from_checkpoint=url))
        reader.checkpointer.restore(reader.checkpointer.find_resume_point(url))
        assert reader.global_step == step


def test_mlflow_outage_loses_and_doubles_nothing(flaky_run, mlflow_server):
    trainer, history, _, faults, _, mlflow_counts, _, _ = flaky_run
    assert mlflow_counts["drop"] > 0 and mlflow_counts["down"] + mlflow_counts["drop"] > 0, mlflow_counts
    assert faults.steps_during_mlflow_outage >= 1, "training stopped while MLflow was down"
    client = mlflow.MlflowClient(mlflow_server)
    run_id = trainer.tracker.run_id
    # Metrics the run's settings fix go to the run as params or tags, not as step metrics (tracking/run_view.py).
    keys = sorted({k for record in history for k in record if k != "step"} - trainer.step_log.constant_metrics)
    missing, doubled, wrong = [], [], []
    for key in keys:
        logged = Counter((m.step, m.value) for m in client.get_metric_history(run_id, key))
        per_step = Counter(step for step, _ in logged.elements())
        for record in history:
            if key not in record:
                continue
            step = int(record["step"])
            if per_step[step] == 0:
                missing.append((key, step))
            elif per_step[step] > 1:
                doubled.append((key, step, per_step[step]))
            elif logged[(step, record[key])] != 1:
                wrong.append((key, step))
    assert not missing and not doubled and not wrong, (missing[:10], doubled[:10], wrong[:10])
    assert {m.step for m in client.get_metric_history(run_id, "loss")} == set(range(1, MAX_STEPS + 1))
    assert client.get_run(run_id).info.status == "FINISHED"

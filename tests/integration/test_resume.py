"""Preemption: the flow resumes a SIGKILLed trainer from its newest good checkpoint, locally and on S3.

Each run starts ``grpo train JOB.yaml`` (the real CLI, Prefect flow and trainer processes) and kills
the trainer's process group with SIGKILL. The local run kills it three times: at a random step, while
a checkpoint is being written, and at another random step (with the vLLM server, so the flow must
restart the server too). The S3 run kills it once, while a checkpoint after the first good one is
being written to the bucket, so that it resumes from a checkpoint in the bucket past a torn one there
(the local run covers the kills at random moments and a third attempt). Afterwards each run's ledger,
checkpoints, logs and its MLflow run must show: ``max_steps`` reached; every prompt position below
the final frontier consumed by the steps that survived; re-trained prompts only past the checkpoint
each attempt resumed from, and as many as the flow reports; the torn checkpoint skipped with a
warning; one MLflow run with every step logged and re-run steps marked. The S3 run uses a moto S3
server on loopback and the session's Prefect server, and checks that the secret key reaches no log,
job file or MLflow run. Finally a vLLM server starts on a checkpoint folder as it is and generates.

    .venv/bin/python -m pytest -q tests/integration/test_resume.py
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import httpx
import mlflow
import pytest
import yaml

from flows.train_flow import local_run_dir
from grpo_core.checkpoint import MANIFEST, Storage, list_checkpoints, read_ledger, surviving_steps
from grpo_core.launch.job import JobConfig
from grpo_core.vllm_server.process import VLLMServer, VLLMServerSpec, free_port

pytestmark = [pytest.mark.integration, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
MAX_STEPS = 30
SAVE_STEPS = 5
# Generous: on two cores shared with other work one vLLM start has taken ten minutes.
FLOW_TIMEOUT_S = 3000
START_TIMEOUT_S = 1800
TRAINER = {
    "max_steps": MAX_STEPS,
    "save_steps": SAVE_STEPS,
    "save_total_limit": 3,
    "logging_steps": 1,
    "learning_rate": 2e-4,
    "num_generations": 4,
    "per_device_train_batch_size": 16,
    "max_completion_length": 16,
    "num_sampler_logprobs": 4,
    # No sample may go stale, so that a prompt the ledger does not list as trained can only be one
    # the resume skipped. The rollout worker is not held back by a full queue (groups keep being
    # generated while finished ones wait to be queued, in no order), so the queue is made large
    # enough never to fill and staleness is not limited within these 30 steps.
    "max_staleness": 1000,
    "max_concurrent_rollouts": 32,
    "queue_maxsize": 8192,
    "token_budget": 2048,
    "worker_heartbeat_timeout_s": 120.0,
}


# ------------------------------------------------------------------------------------------ helpers
def alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie waiting for its parent to reap it counts as dead)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return False
    return state not in ("Z", "X")


def modified(entry: dict[str, Any]) -> float:
    """Modification time of an fsspec listing entry (local: ``mtime``; S3: ``LastModified``)."""
    return float(entry["mtime"]) if "mtime" in entry else entry["LastModified"].timestamp()


def kill_group(pid: int) -> None:
    """SIGKILL the process group led by ``pid``, a process this test started (directly or via the flow)."""
    try:
        if os.getpgid(pid) == pid:
            os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def writers_into(folder: Path) -> set[int]:
    """Process-group leaders whose stdout is a file in ``folder`` (servers this run started)."""
    leaders = set()
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and os.readlink(proc / "fd" / "1").startswith(f"{folder}/"):
                leaders.add(os.getpgid(int(proc.name)))
        except OSError:
            continue
    return leaders - {os.getpgid(0)}


@dataclass
class Kill:
    attempt: int
    pid: int
    moment: str
    at_step: int
    torn_checkpoint: str | None = None


@dataclass
class FlowRun:
    """One ``grpo train`` subprocess and the processes it starts."""

    job: JobConfig
    workdir: Path
    env: dict[str, str]
    proc: subprocess.Popen[bytes] | None = None
    kills: list[Kill] = field(default_factory=list)
    seen_pids: list[int] = field(default_factory=list)

    @property
    def local(self) -> Path:
        return local_run_dir(self.job)

    @cached_property
    def storage(self) -> Storage:
        # One client for the whole run: a new S3 client per poll cost the poller so much time on two
        # busy cores that it missed checkpoint writes and killed a trainer that had already finished
        # (Storage.ls drops the listing cache itself, so the one client still sees new files).
        return Storage(self.job.trainer.output_dir)

    def start(self) -> None:
        job_yaml = self.workdir / "job.yaml"
        job_yaml.write_text(yaml.safe_dump(json.loads(self.job.model_dump_json())))
        for stale in ("trainer.pid", "train.log", "summary.json", "vllm_server.log"):
            (self.local / stale).unlink(missing_ok=True)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "flows.cli", "train", str(job_yaml)],
            cwd=REPO, env=self.env, start_new_session=True,
            stdout=open(self.workdir / "flow.log", "wb"), stderr=subprocess.STDOUT,
        )

    def check_flow(self) -> None:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise AssertionError(f"flow exited early ({self.proc.returncode}):\n{self.flow_log()[-4000:]}")

    def flow_log(self) -> str:
        return (self.workdir / "flow.log").read_text(errors="replace")

    def wait_new_trainer(self, timeout_s: float = START_TIMEOUT_S) -> int:
        deadline = time.monotonic() + timeout_s
        pid_file = self.local / "trainer.pid"
        while time.monotonic() < deadline:
            self.check_flow()
            if pid_file.is_file() and pid_file.read_text().strip():
                pid = int(pid_file.read_text())
                if pid not in self.seen_pids and alive(pid):
                    self.seen_pids.append(pid)
                    return pid
            time.sleep(0.2)
        raise AssertionError(f"no new trainer within {timeout_s} s:\n{self.flow_log()[-4000:]}")

    def steps_of(self, attempt: int) -> list[int]:
        steps = self.storage.ls(self.storage.path("ledger", "steps"))
        names = [e["name"].rsplit("/", 1)[-1] for e in steps]
        return [int(n[5:13]) for n in names if n.startswith(f"{attempt:04d}-")]

    def wait_step(self, attempt: int, pid: int, step: int, timeout_s: float = 900) -> int:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.check_flow()
            assert alive(pid), f"trainer {pid} died on its own:\n{self.train_log()[-4000:]}"
            done = self.steps_of(attempt)
            if done and max(done) >= step:
                return max(done)
            time.sleep(0.3)
        raise AssertionError(f"attempt {attempt} did not reach step {step}:\n{self.train_log()[-4000:]}")

    def kill_during_checkpoint_write(self, attempt: int, pid: int, after_step: int, timeout_s: float = 900) -> Kill:
        """Kill as soon as a checkpoint folder newer than ``after_step`` holds files written by this
        attempt but no manifest yet (debris of an earlier attempt has older files)."""
        since = time.time() - 1.0  # S3 reports modification times in whole seconds
        deadline = time.monotonic() + timeout_s
        storage = self.storage
        while time.monotonic() < deadline:
            assert alive(pid), f"trainer {pid} died on its own:\n{self.train_log()[-4000:]}"
            for step, path in list_checkpoints(storage):
                if step <= after_step:
                    break
                entries = storage.ls(path)
                names = {e["name"].rsplit("/", 1)[-1] for e in entries}
                if MANIFEST not in names and any(modified(e) >= since for e in entries):
                    kill_group(pid)
                    return Kill(attempt, pid, "checkpoint write", step, torn_checkpoint=path)
            time.sleep(0.002 if storage.is_local else 0.01)
        raise AssertionError(f"no checkpoint write after step {after_step} seen:\n{self.train_log()[-4000:]}")

    def server_pid(self) -> int:
        starts = re.findall(r"Started server process \[(\d+)\]", (self.local / "vllm_server.log").read_text(errors="replace"))
        assert starts, "the managed vLLM server logged no process id"
        return int(starts[-1])

    def train_log(self) -> str:
        path = self.local / "train.log"
        return path.read_text(errors="replace") if path.is_file() else ""

    def wait_done(self, timeout_s: float) -> dict[str, Any]:
        assert self.proc is not None
        try:
            code = self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"flow did not finish in {timeout_s} s:\n{self.train_log()[-4000:]}") from None
        assert code == 0, f"flow failed ({code}):\n{self.flow_log()[-6000:]}"
        return json.loads((self.local / "summary.json").read_text())

    def stop(self) -> None:
        """Interrupt the flow (it stops its server and trainer), then kill whatever it left."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                kill_group(self.proc.pid)
        for pid in self.seen_pids:
            kill_group(pid)
        # A server interrupted while starting is not yet known to the flow, so it survives the
        # flow's cleanup; it is found by the log file in this run's folder that it writes to.
        for pid in writers_into(self.local):
            kill_group(pid)


def kill_live_trainer(run: FlowRun, pid: int, target: int) -> None:
    """SIGKILL the trainer, which must still be running: a kill that lands after it finished proves nothing."""
    assert alive(pid), f"trainer {pid} ended before the kill planned after step {target}:\n{run.train_log()[-3000:]}"
    kill_group(pid)


def run_with_kills(run: FlowRun, rng: random.Random, kill_server: bool) -> tuple[dict[str, Any], float]:
    start = time.monotonic()
    run.start()
    # 1: a random moment some steps into the first attempt.
    pid = run.wait_new_trainer()
    target = rng.randint(3, 2 * SAVE_STEPS - 2)
    run.wait_step(1, pid, target)
    time.sleep(rng.uniform(0.0, 1.5))
    kill_live_trainer(run, pid, target)
    run.kills.append(Kill(1, pid, "random", target))
    # 2: during the write of the first checkpoint the second attempt makes.
    pid = run.wait_new_trainer()
    run.wait_step(2, pid, 1)
    resumed = min(run.steps_of(2)) - 1
    run.kills.append(run.kill_during_checkpoint_write(2, pid, after_step=resumed))
    # 3: a random moment of the third attempt; in the managed run the server dies with it.
    pid = run.wait_new_trainer()
    run.wait_step(3, pid, 1)
    resumed = min(run.steps_of(3)) - 1
    target = rng.randint(resumed + 2, MAX_STEPS - 3)
    run.wait_step(3, pid, target)
    time.sleep(rng.uniform(0.0, 1.5))
    if kill_server:
        server = run.server_pid()
        assert alive(server) and os.getpgid(server) == server, f"server {server} is not a live group leader"
        kill_group(server)
        while alive(server):
            time.sleep(0.05)
        print(f"killed the vLLM server's group {server}")
    kill_live_trainer(run, pid, target)
    run.kills.append(Kill(3, pid, "random" + (" + server" if kill_server else ""), target))
    run.wait_new_trainer()
    summary = run.wait_done(FLOW_TIMEOUT_S)
    return summary, time.monotonic() - start


def run_with_one_torn_write(run: FlowRun) -> tuple[dict[str, Any], float]:
    """One kill: while the first attempt writes a checkpoint after its first good one (so that the resume
    starts from a good checkpoint, past the torn one)."""
    start = time.monotonic()
    run.start()
    pid = run.wait_new_trainer()
    run.wait_step(1, pid, SAVE_STEPS + 1)  # checkpoint-SAVE_STEPS is written before step SAVE_STEPS + 1 is logged
    good = [step for step, path in list_checkpoints(run.storage)
            if MANIFEST in {e["name"].rsplit("/", 1)[-1] for e in run.storage.ls(path)}]
    assert good, f"no good checkpoint after step {SAVE_STEPS + 1}: {list_checkpoints(run.storage)}"
    run.kills.append(run.kill_during_checkpoint_write(1, pid, after_step=max(good)))
    run.wait_new_trainer()
    summary = run.wait_done(FLOW_TIMEOUT_S)
    return summary, time.monotonic() - start


def check_run(run: FlowRun, summary: dict[str, Any], tracking_uri: str, experiment: str, kills: int) -> None:
    """The checks of a run that was killed ``kills`` times (one of them while a checkpoint was written)."""
    assert len(run.kills) == kills, run.kills
    # ---- the flow's own account
    assert summary["resumes"] == kills
    assert summary["steps"] == MAX_STEPS

    # ---- the ledger: which positions each step consumed, per attempt
    attempts, steps = read_ledger(run.job.trainer.output_dir)
    assert [a["attempt"] for a in attempts] == list(range(1, kills + 2))
    assert attempts[0]["checkpoint"] is None
    assert sum(r["stale_dropped"] for r in steps) == 0, "stale drops would hide skipped prompts"
    kept = surviving_steps(attempts, steps)
    assert [r["step"] for r in kept] == list(range(1, MAX_STEPS + 1))
    consumed = {p for r in kept for p in r["trained"] + r["dropped_groups"]}
    final_frontier = kept[-1]["frontier"]
    assert final_frontier >= MAX_STEPS  # a step trains at least one prompt's group
    missing = sorted(set(range(final_frontier)) - consumed)
    assert not missing, f"prompt positions below the final frontier {final_frontier} never trained: {missing}"

    def positions(records: list[dict[str, Any]]) -> dict[int, list[int]]:
        steps_of: dict[int, list[int]] = {}
        for r in records:
            for p in r["trained"] + r["dropped_groups"]:
                steps_of.setdefault(p, []).append(r["step"])
        return steps_of

    by_attempt = {a["attempt"]: positions([r for r in steps if r["attempt"] == a["attempt"]]) for a in attempts}
    for attempt in attempts:
        number = attempt["attempt"]
        # Within one attempt a group is trained once (its samples may spread over two adjacent steps).
        assert all(max(s) - min(s) <= 1 for s in by_attempt[number].values()), number
        before = {p for a, seen in by_attempt.items() if a < number for p in seen}
        again = set(by_attempt[number]) & before
        # Re-trained prompts lie past the frontier saved in the checkpoint this attempt resumed from.
        assert all(p >= attempt["position"] for p in again), (attempt, sorted(again)[:10])
    twice = sum(1 for p in consumed | {p for seen in by_attempt.values() for p in seen}
                if sum(p in seen for seen in by_attempt.values()) > 1)
    assert summary["prompts_trained_twice"] == twice

    # ---- the kill during a checkpoint write left a torn folder that the next attempt skipped
    torn = next(k for k in run.kills if k.moment == "checkpoint write")
    assert torn.torn_checkpoint is not None
    assert f"skipping torn checkpoint {run.storage.url(torn.torn_checkpoint)}" in run.train_log()
    # The torn one was the first checkpoint written after the newest good one: the attempt after the kill resumed
    # from that good one (attempts[i] is attempt i + 1; step 0 where there was none), not from an older one.
    assert attempts[torn.attempt]["step"] == torn.at_step - SAVE_STEPS, (attempts[torn.attempt], torn)

    # ---- checkpoints: the last one is good and holds the final step
    newest_step, newest = list_checkpoints(run.storage)[0]
    assert newest_step == MAX_STEPS
    assert MANIFEST in {e["name"].rsplit("/", 1)[-1] for e in run.storage.ls(newest)}

    # ---- MLflow: one run, every step, re-runs marked
    client = mlflow.MlflowClient(tracking_uri)
    experiment_id = client.get_experiment_by_name(experiment).experiment_id
    runs = client.search_runs([experiment_id])
    assert [r.info.run_id for r in runs] == [summary["mlflow_run_id"]]
    assert runs[0].info.status == "FINISHED"
    run_id = summary["mlflow_run_id"]
    losses = client.get_metric_history(run_id, "loss")
    assert {m.step for m in losses} == set(range(1, MAX_STEPS + 1))
    # Every step of a resumed attempt says whether an earlier attempt logged it already: 1 exactly where the
    # step's loss was logged before (a step's metrics share one timestamp; an attempt logs a step once).
    first_logged = {}
    for m in sorted(losses, key=lambda m: m.timestamp):
        first_logged.setdefault(m.step, m.timestamp)
    rerun = [(m.step, m.timestamp, m.value) for m in client.get_metric_history(run_id, "train/rerun_step")]
    loss_rows = {(m.step, m.timestamp) for m in losses}
    assert {(step, stamp) for step, stamp, _ in rerun} <= loss_rows
    for step, stamp, value in rerun:
        assert value == float(stamp > first_logged[step]), (step, stamp, value, first_logged[step])
    marked = sum(int(value) for _, _, value in rerun)
    assert marked > 0, "no step was re-run, so the kills did not land after a checkpoint"
    assert marked == len(loss_rows) - len(first_logged)  # every re-logged step is marked, and only those
    tags = client.get_run(run_id).data.tags
    assert tags["prompts_trained_twice"] == str(twice) and tags["resumes"] == str(kills)
    assert tags["attempt"] == str(kills + 1)
    assert not [k for k in client.get_run(run_id).data.metrics if k.startswith(("job/", "train/attempt"))]


PREFECT_RECORD = """
import json
from prefect.client.orchestration import get_client
with get_client(sync_client=True) as client:
    runs = [str(r.id) for r in client.read_flow_runs()]
    artifacts = [{"flow_run_id": str(a.flow_run_id), "key": a.key, "type": a.type, "data": a.data}
                 for a in client.read_artifacts()]
print("PREFECT " + json.dumps({"flow_runs": runs, "artifacts": artifacts}))
"""


def prefect_record(run: FlowRun) -> dict[str, Any]:
    """The flow runs and artifacts in the Prefect API the run's flow used (its own, in the run's PREFECT_HOME)."""
    done = subprocess.run([sys.executable, "-c", PREFECT_RECORD], env=run.env, cwd=REPO, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.split("PREFECT ", 1)[1].splitlines()[0])


def job_for(output_dir: str, tracking_uri: str, experiment: str, server_url: str | None) -> JobConfig:
    server = {"managed": True, "startup_timeout_s": START_TIMEOUT_S} if server_url is None else {
        "managed": False, "base_url": server_url}
    return JobConfig.model_validate({
        "dataset": "grpo_core.tiny:arithmetic_dataset",
        "max_resumes": 3,
        "server": server,
        "tracking": {"tracking_uri": tracking_uri, "experiment": experiment, "system_metrics": False},
        "trainer": {**TRAINER, "do_eval": False, "output_dir": output_dir},
    })


def flow_env(tmp_path: Path, extra: dict[str, str] | None = None) -> dict[str, str]:
    """The flow's environment with an ephemeral Prefect API of its own (in the run's PREFECT_HOME)."""
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "prefect"), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
           # The ephemeral API starts in seconds on an idle machine, far slower on two busy cores.
           "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "300"}
    env.pop("PREFECT_API_URL", None)  # an ephemeral Prefect API of its own
    env.update(extra or {})
    return env


# ------------------------------------------------------------------------------------------ tests
@pytest.fixture(scope="module")
def local_run(mlflow_server, tiny_model_path, tmp_path_factory):
    """The managed-server job on a local folder, killed three times (the server with the third)."""
    tmp = tmp_path_factory.mktemp("resume-local")
    experiment = f"resume-local-{uuid.uuid4().hex[:8]}"
    run = FlowRun(job_for(str(tmp / "out"), mlflow_server, experiment, None), tmp, flow_env(tmp))
    seed = random.randrange(1 << 30)
    print(f"kill moments seeded with {seed}")
    try:
        summary, seconds = run_with_kills(run, random.Random(seed), kill_server=True)
    finally:
        run.stop()
    print(f"local resume run: {seconds:.0f} s, kills {run.kills}, summary {summary}")
    return run, summary, experiment


def test_flow_resumes_after_three_kills_local(local_run, mlflow_server):
    run, summary, experiment = local_run
    check_run(run, summary, mlflow_server, experiment, kills=3)
    # The flow restarted the server it lost with the third kill.
    starts = re.findall(r"Started server process \[(\d+)\]", (run.local / "vllm_server.log").read_text(errors="replace"))
    assert len(starts) == 2
    # Prefect: the flow run has one progress artifact that all four attempts moved, at 100% now.
    record = prefect_record(run)
    assert len(record["flow_runs"]) == 1, record["flow_runs"]
    by_key: dict[str, list[dict[str, Any]]] = {}
    for artifact in record["artifacts"]:
        assert artifact["flow_run_id"] == record["flow_runs"][0]
        by_key.setdefault(artifact["key"], []).append(artifact)
    progress = by_key["training-progress"]
    assert len(progress) == 1 and float(progress[0]["data"]) == 100.0, progress
    assert [a["type"] for a in by_key["training-summary"]] == ["markdown"]
    assert f"[{summary['mlflow_run_id']}](" in by_key["training-summary"][0]["data"]


def test_vllm_serves_a_checkpoint_folder_as_it_is(local_run, tmp_path):
    run, _summary, _ = local_run
    folder = list_checkpoints(run.storage)[0][1]
    # Started by hand for the generous timeout: a start on two busy cores has taken over ten minutes.
    server = VLLMServer(VLLMServerSpec(model=folder, max_model_len=256), tmp_path)
    try:
        server.start(timeout_s=START_TIMEOUT_S)
        reply = httpx.post(
            f"{server.base_url}/v1/completions",
            json={"model": folder, "prompt": "<|im_start|>user\nWhat is 2+3?<|im_end|>\n<|im_start|>assistant\n",
                  "max_tokens": 12, "temperature": 0.0},
            timeout=120,
        )
        reply.raise_for_status()
        choice = reply.json()["choices"][0]
        assert choice["text"].strip(), reply.json()
        assert reply.json()["usage"]["completion_tokens"] > 0
    finally:
        server.stop()


@pytest.fixture(scope="module")
def s3_server(tmp_path_factory):
    """A moto S3 server on loopback with one bucket; yields the env s3fs/boto3 need (a fresh secret)."""
    root = tmp_path_factory.mktemp("moto")
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=open(root / "moto.log", "wb"), stderr=subprocess.STDOUT, start_new_session=True)
    env = {
        "AWS_ACCESS_KEY_ID": "grpo-test-key",
        "AWS_SECRET_ACCESS_KEY": f"secret-{uuid.uuid4().hex}",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
    }
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                httpx.get(env["AWS_ENDPOINT_URL"], timeout=2)
                break
            except httpx.HTTPError:
                assert time.monotonic() < deadline, (root / "moto.log").read_text()
                time.sleep(0.5)
        import boto3

        boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"], region_name="us-east-1",
                     aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
                     aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"]).create_bucket(Bucket="grpo")
        yield env
    finally:
        kill_group(proc.pid)
        proc.wait(10)


def test_flow_resumes_past_a_torn_checkpoint_s3(s3_server, vllm_server, mlflow_server, prefect, tmp_path,
                                                monkeypatch):
    for key, value in s3_server.items():
        monkeypatch.setenv(key, value)  # this process reads the bucket too
    experiment = f"resume-s3-{uuid.uuid4().hex[:8]}"
    output_dir = f"s3://grpo/{experiment}"
    _, prefect_env, _ = prefect  # the session's Prefect server: no ephemeral API to start
    run = FlowRun(job_for(output_dir, mlflow_server, experiment, vllm_server.base_url), tmp_path,
                  {**prefect_env, **s3_server})
    try:
        summary, seconds = run_with_one_torn_write(run)
    finally:
        run.stop()
    print(f"s3 resume run: {seconds:.0f} s, kills {run.kills}, summary {summary}")
    check_run(run, summary, mlflow_server, experiment, kills=1)
    assert not list(run.local.glob("checkpoint-*")), "checkpoints belong in the bucket, not the local run folder"

    # The secret went to the processes' environment only.
    secret = s3_server["AWS_SECRET_ACCESS_KEY"]
    texts = {p.name: p.read_text(errors="replace") for p in run.local.iterdir() if p.is_file() and p.suffix in (".json", ".log")}
    texts["flow.log"] = run.flow_log()
    assert {"job.json", "job_resume.json", "train.log", "summary.json"} <= set(texts)
    assert not [name for name, text in texts.items() if secret in text]
    client = mlflow.MlflowClient(mlflow_server)
    data = client.get_run(summary["mlflow_run_id"]).data
    assert secret not in json.dumps({"params": data.params, "tags": data.tags})

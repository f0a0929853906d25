"""A whole job stopped (flow, trainer and all, as when its machine is lost), then the same ``grpo train`` command
run again: it continues the unfinished run, and a different job is refused that folder.

The first run is SIGKILLed, flow and trainer together, once a checkpoint past the first is complete. Then:

1. another job (one setting changed) in the same ``output_dir`` must stop before anything starts, naming
   ``trainer.output_dir`` and ``resume_from_checkpoint``, and leave every checkpoint as it was;
2. the first job's command again must finish ``max_steps`` from that checkpoint, in the same MLflow run (one run in
   the experiment, every step logged), with the ledger's second attempt resumed from the checkpoint and no prompt
   trained twice in the final model.

    .venv/bin/python -m pytest -q tests/integration/test_rerun_continues.py
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import mlflow
import pytest
import yaml

from grpo_core.checkpoint import (MANIFEST, Storage, list_checkpoints, read_ledger, surviving_steps,
                                  unfinished_run)
from grpo_core.checkpoint.ledger import attempts_per_position

pytestmark = [pytest.mark.integration, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
MAX_STEPS = 6
SAVE_STEPS = 2


def job(url: str, output_dir: Path, **trainer: Any) -> dict[str, Any]:
    return {
        "model": "tiny:arithmetic", "dataset": "tiny:arithmetic",
        "server": {"managed": False, "base_url": url},
        "trainer": {"output_dir": str(output_dir), "bf16": False, "max_steps": MAX_STEPS, "save_steps": SAVE_STEPS,
                    "logging_steps": 1, "per_device_train_batch_size": 16, "num_generations": 4,
                    "max_completion_length": 16, "do_eval": False, **trainer},
    }


def start(spec: dict[str, Any], workdir: Path, name: str, env: dict[str, str]) -> subprocess.Popen[bytes]:
    path = workdir / f"{name}.yaml"
    path.write_text(yaml.safe_dump(spec))
    return subprocess.Popen([sys.executable, "-m", "flows.cli", "train", str(path)], cwd=REPO, env=env,
                            start_new_session=True, stdout=open(workdir / f"{name}.log", "wb"),
                            stderr=subprocess.STDOUT)


def log_of(workdir: Path, name: str) -> str:
    return (workdir / f"{name}.log").read_text(errors="replace")


def good_checkpoints(output_dir: Path) -> list[int]:
    return sorted(int(p.name.split("-")[1]) for p in output_dir.glob("checkpoint-*") if (p / MANIFEST).is_file())


def kill_whole_job(flow: subprocess.Popen[bytes], output_dir: Path) -> None:
    """SIGKILL the flow's process group and the trainer's (the flow starts it in a session of its own)."""
    pid_file = output_dir / "trainer.pid"
    trainer = int(pid_file.read_text().split()[0]) if pid_file.is_file() else None
    for group in (flow.pid, trainer):
        if group is not None:
            try:
                os.killpg(group, signal.SIGKILL)
            except ProcessLookupError:
                pass
    flow.wait(timeout=60)


def test_the_same_command_again_continues_an_unfinished_run(vllm_server, prefect, tmp_path):
    _, env, _ = prefect
    out = tmp_path / "run"
    first = job(vllm_server.base_url, out)

    flow = start(first, tmp_path, "first", env)
    deadline = time.monotonic() + 1200
    while not [s for s in good_checkpoints(out) if s > SAVE_STEPS]:
        assert flow.poll() is None, f"the first run ended before it was killed:\n{log_of(tmp_path, 'first')[-4000:]}"
        assert time.monotonic() < deadline, f"no second checkpoint in 1200 s:\n{log_of(tmp_path, 'first')[-4000:]}"
        time.sleep(0.5)
    kill_whole_job(flow, out)
    stopped = unfinished_run(str(out), MAX_STEPS)
    assert stopped is not None and SAVE_STEPS < stopped.step < MAX_STEPS, stopped
    before = {p.name: sorted(f.name for f in p.iterdir()) for p in out.glob("checkpoint-*")}

    # Another job in that folder: refused before anything starts, nothing of the stopped run touched.
    other = start(job(vllm_server.base_url, out, learning_rate=1e-4), tmp_path, "other", env)
    assert other.wait(timeout=600) != 0, log_of(tmp_path, "other")[-4000:]
    refusal = log_of(tmp_path, "other")
    assert "trainer.output_dir" in refusal and "resume_from_checkpoint" in refusal, refusal[-4000:]
    assert {p.name: sorted(f.name for f in p.iterdir()) for p in out.glob("checkpoint-*")} == before

    # The same command again: the run goes on from its checkpoint, in its MLflow run.
    again = start(first, tmp_path, "again", env)
    assert again.wait(timeout=1500) == 0, log_of(tmp_path, "again")[-6000:]

    attempts, steps = read_ledger(str(out))
    assert len(attempts) == 2, attempts
    assert attempts[1]["checkpoint"] is not None and attempts[1]["step"] == stopped.step, attempts[1]
    kept = surviving_steps(attempts, steps)
    assert [r["step"] for r in kept] == list(range(1, MAX_STEPS + 1)), [r["step"] for r in kept]
    twice = [p for p, a in attempts_per_position([{**r, "dropped_groups": []} for r in kept]).items() if len(a) > 1]
    assert twice == [], f"prompt positions trained by both attempts: {twice}"

    summary = json.loads((out / "summary.json").read_text())  # the store the flow used (the suite may set one)
    assert summary["mlflow_run_id"] == stopped.mlflow_run_id, (summary["mlflow_run_id"], stopped.mlflow_run_id)
    client = mlflow.MlflowClient(summary["mlflow_tracking_uri"])
    experiment = client.get_run(stopped.mlflow_run_id).info.experiment_id
    runs = [r for r in client.search_runs([experiment]) if r.data.tags.get("resolved.output_dir") == str(out)]
    assert [r.info.run_id for r in runs] == [stopped.mlflow_run_id], [r.info.run_id for r in runs]
    logged = {m.step for m in client.get_metric_history(stopped.mlflow_run_id, "perf/step_s")}
    assert set(range(1, MAX_STEPS + 1)) <= logged, sorted(logged)
    assert runs[0].info.status == "FINISHED", runs[0].info.status
    assert unfinished_run(str(out), MAX_STEPS) is None  # finished: a next run in the folder starts a new one
    assert [s for s, _ in list_checkpoints(Storage(str(out)))][0] == MAX_STEPS

"""A run whose groups stop carrying learning signal ends with the reason, and the flow does not resume it.

``grpo train`` (as a user runs it, against the session's server) trains the tiny model with a reward function that
scores every rollout the same: every group is dropped, the trainer has nothing to train, and after
``no_signal_patience_steps`` steps' worth of such groups the training process stops with ``NoLearningSignalError``.
The flow reads why from the result file and fails at once, without the resumes it gives a preempted trainer, and
marks the MLflow run FAILED with the reason.
"""

from __future__ import annotations

import subprocess
import sys

import mlflow
import pytest
import yaml

from grpo_core.checkpoint import read_ledger
from tests.integration.grpo_cli import REPO

pytestmark = [pytest.mark.integration]


def same_reward(prompts, completions, **kwargs) -> list[float]:
    """Every rollout scores 0.5: no group ever has a reward to learn from."""
    return [0.5] * len(completions)


def test_a_run_without_learning_signal_stops_with_the_reason_and_is_not_resumed(vllm_server, prefect, tmp_path):
    _, env, _ = prefect
    job = {
        "model": "tiny:arithmetic", "dataset": "tiny:arithmetic",
        "reward_funcs": ["tests.integration.test_no_learning_signal:same_reward"],
        "max_resumes": 2,
        "trainer": {"do_eval": False, "max_steps": 5, "num_generations": 4, "per_device_train_batch_size": 8,
                    "max_completion_length": 8, "no_signal_patience_steps": 2, "save_steps": 1},
    }
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    out = tmp_path / "run"
    tracking_uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    done = subprocess.run(
        [sys.executable, "-m", "flows.cli", "train", str(path), "--output-dir", str(out), "--server-url",
         vllm_server.base_url], cwd=REPO, env={**env, "OMP_NUM_THREADS": "1", "MLFLOW_TRACKING_URI": tracking_uri},
        capture_output=True, text=True, timeout=900,
    )
    output = done.stdout + done.stderr
    assert done.returncode != 0, output[-4000:]
    # 2 steps of 8 samples in groups of 4: the fourth group without signal in a row stops the run, at step 0
    assert "training stopped at step 0: NoLearningSignalError: the last 4 groups" in output, output[-4000:]
    assert "reward 0.5 in 4" in output and "not resumed" in output
    assert "resume 1/2" not in output  # the flow's message before a resumed attempt
    attempts, steps = read_ledger(str(out))
    assert len(attempts) == 1 and steps == []
    client = mlflow.MlflowClient(tracking_uri)
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert len(runs) == 1 and runs[0].info.status == "FAILED"
    assert runs[0].data.tags["failure"].startswith("training stopped at step 0: NoLearningSignalError")

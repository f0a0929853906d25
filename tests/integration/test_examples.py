"""The example jobs in examples/ (LoRA, tools, environment, curriculum loop) run through ``grpo train``.

Each runs as a user would (``grpo train examples/<name>.yaml --server-url URL``), against the session's
CPU vLLM server and Prefect server, with its own MLflow store; the run must finish, train its steps
and show, in the metrics, the feature it exists for.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from grpo_core.launch.job import JobConfig
from tests.integration.grpo_cli import grpo_train

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))


def test_every_example_job_parses():
    assert {p.stem for p in EXAMPLES} >= {"lora", "tools", "environment", "curriculum"}
    for path in EXAMPLES:
        JobConfig.model_validate(yaml.safe_load(path.read_text()))


# What each example must show in its MLflow run (each metric at its largest over the steps), besides training its steps.
# (The session's server loads adapters at run time, so LoRA picks adapter sync; the curriculum logs how
# many groups its filter skipped, zero or more, which only a custom loop's filter_prompt produces.)
SHOWS = {
    "lora": lambda tags, metrics: tags.get("sync/mode") == "adapter",
    "tools": lambda tags, metrics: metrics.get("tools/calculator/calls", 0) > 0,
    "environment": lambda tags, metrics: "rewards/rollout_reward/mean" in metrics,
    "curriculum": lambda tags, metrics: "rollout/groups_filtered" in metrics,
}


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_example_runs_through_grpo_train(path, vllm_server, prefect, tmp_path):
    import mlflow

    api, env, _ = prefect
    out = tmp_path / "run"
    # The jobs name no tracking store: the flow takes MLFLOW_TRACKING_URI, as MLflow's own clients do.
    tracking_uri = f"sqlite:///{tmp_path / 'tracking' / 'mlflow.db'}"
    (tmp_path / "tracking").mkdir()
    grpo_train(path, out, vllm_server.base_url, env, tracking_uri)
    summary = json.loads((out / "summary.json").read_text())
    job = JobConfig.model_validate(yaml.safe_load(path.read_text()))
    assert job.tracking.tracking_uri is None and summary["mlflow_tracking_uri"] == tracking_uri
    assert summary["steps"] == job.trainer.max_steps
    client = mlflow.MlflowClient(summary["mlflow_tracking_uri"])
    run = client.get_run(summary["mlflow_run_id"])
    # Each metric's largest value over the run's steps: a tool called in one step was called in the run, whatever the
    # last step sampled.
    largest = {k: max(m.value for m in client.get_metric_history(run.info.run_id, k)) for k in run.data.metrics}
    assert SHOWS[path.stem](run.data.tags, largest), (run.data.tags, sorted(largest.items()))

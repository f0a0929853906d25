"""What the trackers write into an MLflow store (a SQLite file here; the integration tests use a real server):
the experiment's kind, headline copies, param texts, and the final model with its metrics.

    .venv/bin/python -m pytest -q tests/test_mlflow_run.py
"""

from __future__ import annotations

import json
import time

import mlflow
import pandas
import pytest

from grpo_core.tracking.run_view import (
    EXPERIMENT_KIND_TAG,
    HEADLINE_METRICS,
    HEADLINE_SECTION,
    RUNS_VIEW,
    RUNS_VIEW_NAME,
    TRAINING_EXPERIMENT_KIND,
    experiment_url,
    read_saved_view,
    runs_view_state,
)
from grpo_core.tracking.tracker import (
    MLflowTracker,
    complete_headline,
    log_transformers_model,
    system_metrics,
    training_experiment,
)
from grpo_core.tracking.tables import LOGGED_ARTIFACTS_TAG, read_table, table_block
from tests.test_checkpoint import model_path  # noqa: F401 - fixture


@pytest.fixture
def store(tmp_path) -> str:
    return f"sqlite:///{tmp_path / 'mlflow.db'}"


VIEW_TAG = f"mlflow.sharedViewState.{RUNS_VIEW}"


def test_experiments_are_of_the_training_kind_and_open_on_their_saved_headline_view(store):
    client = mlflow.MlflowClient(store)
    made = training_experiment(client, "made")
    tags = client.get_experiment(made).tags
    assert tags[EXPERIMENT_KIND_TAG] == TRAINING_EXPERIMENT_KIND
    assert read_saved_view(tags[VIEW_TAG]) == (RUNS_VIEW_NAME, runs_view_state())
    assert f"viewStateShareKey={RUNS_VIEW}" in experiment_url("http://127.0.0.1:1", made)
    # Opened again, the same view is left as it is (its times too).
    training_experiment(client, "made")
    assert client.get_experiment(made).tags[VIEW_TAG] == tags[VIEW_TAG]
    # One made elsewhere without a kind gets it; a kind someone chose stays; a view in the form the UI does not
    # list (a bare state) is replaced by a saved view.
    bare = client.create_experiment("bare")
    chosen = client.create_experiment("chosen", tags={EXPERIMENT_KIND_TAG: "finetuning",
                                                      VIEW_TAG: json.dumps(runs_view_state())})
    assert training_experiment(client, "bare") == bare
    assert client.get_experiment(bare).tags[EXPERIMENT_KIND_TAG] == TRAINING_EXPERIMENT_KIND
    training_experiment(client, "chosen")
    chosen_tags = client.get_experiment(chosen).tags
    assert chosen_tags[EXPERIMENT_KIND_TAG] == "finetuning"
    assert read_saved_view(chosen_tags[VIEW_TAG]) == (RUNS_VIEW_NAME, runs_view_state())


def test_the_tracker_writes_headline_copies_and_param_texts(store):
    tracker = MLflowTracker(store, "grpo", "run")
    tracker.log_params({"learning_rate": 2e-4, "bf16": None, "max_staleness": 2, "tools": []})
    tracker.log_metrics({"reward": 1.25, "perf/step_s": 3.0}, step=1)
    tracker.log_metrics({"reward": 1.5, "perf/step_s": 2.0}, step=2)
    tracker.close()
    client = mlflow.MlflowClient(store)
    run = client.get_run(tracker.run_id)
    assert run.info.experiment_id == tracker.experiment_id
    assert run.data.params == {"learning_rate": "0.0002", "max_staleness": "2"}
    copy = [(m.step, m.value) for m in client.get_metric_history(tracker.run_id, f"{HEADLINE_SECTION}/reward")]
    assert sorted(copy) == [(1, 1.25), (2, 1.5)]
    assert not [k for k in run.data.metrics if k.startswith(HEADLINE_SECTION) and k != f"{HEADLINE_SECTION}/reward"]
    mlflow.set_tracking_uri(store)
    found = mlflow.search_runs(experiment_ids=[tracker.experiment_id], filter_string="params.learning_rate = '0.0002'",
                               output_format="list")
    assert [r.info.run_id for r in found] == [tracker.run_id]


def test_metrics_the_flow_logs_itself_reach_the_headline_once(store):
    client = mlflow.MlflowClient(store)
    run_id = client.create_run(training_experiment(client, "grpo")).info.run_id
    client.log_metric(run_id, "heldout_accuracy", 0.25, step=0)
    client.log_metric(run_id, "heldout_accuracy", 0.5, step=3)
    assert complete_headline(client, run_id) == 2
    assert complete_headline(client, run_id) == 0
    copies = client.get_metric_history(run_id, f"{HEADLINE_SECTION}/{HEADLINE_METRICS['heldout_accuracy']}")
    assert sorted((m.step, m.value) for m in copies) == [(0, 0.25), (3, 0.5)]


def test_the_final_model_is_registered_at_its_step_with_the_runs_metrics(store, model_path):  # noqa: F811
    from grpo_core.tracking.tracker import link_model_metrics

    client = mlflow.MlflowClient(store)
    run_id = client.create_run(training_experiment(client, "grpo")).info.run_id
    for step in (1, 2, 3):
        client.log_metric(run_id, "reward", 0.5 * step, step=step)
        client.log_metric(run_id, "loss", 1.0 / step, step=step)
    client.log_metric(run_id, "perf/step_s", 2.0, step=3)
    # The flow samples system metrics (numbered 0, 1, ...) while it logs the model: none may land on it.
    with system_metrics(run_id, store, interval_s=0.5):
        uri = log_transformers_model(store, run_id, model_path, "tiny-test", step=3)
        time.sleep(1.5)
    model_id = uri.removeprefix("models:/")
    final_step = {("reward", 3, 1.5), ("loss", 3, 1.0 / 3), ("perf/step_s", 3, 2.0)}
    assert {(m.key, m.step, m.value) for m in mlflow.get_logged_model(model_id).metrics} == final_step
    assert [o.step for o in client.get_run(run_id).outputs.model_outputs] == [3]
    versions = client.search_model_versions("name = 'tiny-test'")
    assert [(v.run_id, v.source) for v in versions] == [(run_id, uri)]  # the version is this logged model
    tags = client.get_run(run_id).data.tags
    assert tags["final_model"] == "models:/tiny-test/1" and tags["final_model_id"] == model_id
    # The held-out accuracy after the final sync comes later, from the flow: linked to the model once.
    client.log_metric(run_id, "heldout_accuracy", 0.4, step=3)
    assert link_model_metrics(client, run_id, model_id) == 1
    assert link_model_metrics(client, run_id, model_id) == 0
    metrics = {(m.key, m.step, m.value) for m in mlflow.get_logged_model(model_id).metrics}
    assert metrics == final_step | {("heldout_accuracy", 3, 0.4)}
    assert len(client.get_metric_history(run_id, "heldout_accuracy")) == 1  # the run's history gained nothing


def test_a_block_shorter_than_the_sampling_interval_still_logs_system_metrics(store):
    from grpo_core.tracking.tracker import system_metrics

    client = mlflow.MlflowClient(store)
    run_id = client.create_run(training_experiment(client, "grpo")).info.run_id
    with system_metrics(run_id, store, interval_s=60.0):
        pass  # over long before the first interval ends, as a short run is
    metrics = client.get_run(run_id).data.metrics
    assert any(k.startswith("system/cpu") for k in metrics), sorted(metrics)


def test_each_logged_step_is_a_table_file_of_its_own_that_mlflow_reads(store, tmp_path):
    tracker = MLflowTracker(store, "grpo", "run")
    for step in (1, 2, 10):
        tracker.log_table("completions", {"step": [step, step], "prompt": ["p", "q"], "completion": ["a", "b"],
                                          "reward": [1.0, None], "accuracy_reward": [1.0, 0.0]}, step=step)
    tracker.close()
    client = mlflow.MlflowClient(store)
    files = [a.path for a in client.list_artifacts(tracker.run_id, "completions")]
    assert files == ["completions/step-00000001.json", "completions/step-00000002.json", "completions/step-00000010.json"]
    # The layout of MLflow's tables, as pandas reads it; read_table joins a run's steps.
    table = pandas.read_json(client.download_artifacts(tracker.run_id, "completions/step-00000010.json", str(tmp_path)),
                             orient="split")
    assert list(table.columns) == ["step", "prompt", "completion", "reward", "accuracy_reward"]
    assert table["step"].tolist() == [10, 10] and table["accuracy_reward"].tolist() == [1.0, 0.0]
    joined = read_table(client, tracker.run_id, "completions")
    assert joined["step"].tolist() == [1, 1, 2, 2, 10, 10] and joined["reward"].isna().tolist() == [False, True] * 3
    # MLflow's UI shows a file as a table (View as table, Artifact evaluation) when the run's tag names it so.
    assert ui_tables(client.get_run(tracker.run_id).data.tags) == files


def ui_tables(tags: dict[str, str]) -> list[str]:
    """The artifacts MLflow's UI offers as tables, by its own rule (3.17): the entries of ``mlflow.loggedArtifacts``
    (a JSON list) whose type is ``table``."""
    return [e["path"] for e in json.loads(tags.get(LOGGED_ARTIFACTS_TAG, "[]")) if e.get("type") == "table"]


def test_a_long_run_logs_a_file_per_block_of_steps_each_named_a_table_and_resumes_in_its_block(store, tmp_path):
    # 400 steps cannot each be named in a tag of 8,000 characters: blocks of 4 steps (100 files) can.
    blocks = [table_block("completions", step, 400, 1) for step in range(1, 401)]
    assert blocks[0] == (1, 4) and blocks[3] == (1, 4) and blocks[4] == (5, 8) and len(set(blocks)) == 100
    assert table_block("completions", 7, 120, 1) == (7, 7)  # the demo's 120 steps: a file each

    def rows(step: int) -> dict[str, list]:
        return {"step": [step, step], "prompt": ["p", "q"], "completion": [f"{step}", "b"], "reward": [1.0, 0.0]}

    tracker = MLflowTracker(store, "grpo", "run")
    for step in range(1, 7):  # the run stops after step 6, in the middle of block 5-8
        tracker.log_table("completions", rows(step), step=step, block=blocks[step - 1])
    tracker.close()
    client = mlflow.MlflowClient(store)
    files = ["completions/steps-00000001-00000004.json", "completions/steps-00000005-00000008.json"]
    assert [a.path for a in client.list_artifacts(tracker.run_id, "completions")] == files
    assert ui_tables(client.get_run(tracker.run_id).data.tags) == files
    assert read_table(client, tracker.run_id, "completions")["step"].tolist() == [s for s in range(1, 7) for _ in "pq"]

    # Resumed from a checkpoint of step 5: step 6 is trained again, and the block keeps steps 5 and 6 once each.
    resumed = MLflowTracker(store, "grpo", "run", run_id=tracker.run_id)
    for step in range(6, 10):
        resumed.log_table("completions", rows(step), step=step, block=blocks[step - 1])
    resumed.close()
    table = read_table(client, tracker.run_id, "completions")
    assert table["step"].tolist() == [s for s in range(1, 10) for _ in "pq"]
    assert ui_tables(client.get_run(tracker.run_id).data.tags) == [*files, "completions/steps-00000009-00000012.json"]
    assert len(client.get_run(tracker.run_id).data.tags[LOGGED_ARTIFACTS_TAG]) < 8000

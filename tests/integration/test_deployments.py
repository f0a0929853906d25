"""prefect.yaml against a real Prefect server and process worker, as an operator and the UI use them.

A Prefect server (own PREFECT_HOME, loopback port) is started for this module; ``grpo deploy``
registers every deployment of ``prefect.yaml`` and creates the work pools from ``infra/``; a
process worker serves the ``grpo-process`` pool. Then: the deployments and pools are as declared, each
job registered whole (the form shows every value the run uses); bad parameters are refused naming the
field; the nightly schedule produces scheduled runs; and a run of ``embedded-default`` created through
the REST API with edited parameters (as the UI's form does) completes, and the session's MLflow server
holds it as its users look for it: a training experiment, headline charts, params under TRL's names that
the README's searches find, the summary, a completions table and the registered model with its metrics;
Prefect holds one progress artifact and a summary that links to the run.
"""

from __future__ import annotations

import copy
import datetime as dt
import json
import re
import os
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import torch
import yaml

from flows.heldout import heldout_line, prompts_digest
from grpo_core.launch.job import resolve_dataset
from grpo_core.tracking.tables import read_table
from tests.conftest import HTTP, Service

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
TERMINAL = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}


@pytest.fixture(scope="module")
def deployments(prefect) -> dict[str, dict]:
    """``grpo deploy`` of the repository's prefect.yaml; the registered deployments by name."""
    api, env, _ = prefect
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "flows.cli", "deploy", "--file", str(ROOT / "prefect.yaml")],
                          env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"grpo deploy failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    print(f"grpo deploy: {time.monotonic() - started:.0f} s")
    return {d["name"]: d for d in HTTP.post(f"{api}/deployments/filter", json={}).json()}


@pytest.fixture(scope="module")
def worker(prefect, deployments, tmp_path_factory):
    """A process worker on the default queue of grpo-process (started after the pool exists)."""
    api, env, _ = prefect
    log = tmp_path_factory.mktemp("prefect-worker") / "worker.log"
    name = f"test-worker-{uuid.uuid4().hex[:6]}"
    service = Service([sys.executable, "-m", "prefect", "worker", "start", "--pool", "grpo-process", "--type", "process",
                       "--work-queue", "default", "--limit", "1", "--name", name], env, log)
    deadline = time.monotonic() + 120
    while not any(w["name"] == name for w in HTTP.post(f"{api}/work_pools/grpo-process/workers/filter", json={}).json()):
        assert service.proc.poll() is None, f"worker exited:\n{service.tail()}"
        assert time.monotonic() < deadline, f"worker did not register in 120 s:\n{service.tail()}"
        time.sleep(1)
    yield service
    service.stop()


def create_run(api: str, deployment: dict, job: dict) -> httpx.Response:
    """What the UI's "Custom run" form sends: the full parameter values, validated by the server."""
    return HTTP.post(f"{api}/deployments/{deployment['id']}/create_flow_run",
                      json={"parameters": {"job": job, "provisioner": "local"}})


def wait_terminal(api: str, run_id: str, timeout_s: float, worker) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            run = HTTP.get(f"{api}/flow_runs/{run_id}").json()
        except httpx.TimeoutException:
            run = {"state_type": "(no answer)"}  # a slow moment of the server; ask again
        if run["state_type"] in TERMINAL:
            return run
        assert time.monotonic() < deadline, f"flow run still {run['state_type']} after {timeout_s:.0f} s:\n{worker.tail()}"
        time.sleep(3)


def run_logs(api: str, run_id: str) -> str:
    logs = HTTP.post(f"{api}/logs/filter", json={"logs": {"flow_run_id": {"any_": [run_id]}}, "limit": 200,
                                                  "sort": "TIMESTAMP_DESC"}).json()
    return "\n".join(entry["message"] for entry in reversed(logs))[-6000:]


# ------------------------------------------------------------------------------------------ the file itself
def test_prefect_yaml_jobs_validate_and_match_the_demo():
    from flows.cli import DEMO_TRAINER
    from grpo_core.launch.job import JobConfig

    project = yaml.safe_load((ROOT / "prefect.yaml").read_text())
    assert project["definitions"]["trainer"]["demo"] == DEMO_TRAINER  # the deployment is `grpo demo`
    for deployment in project["deployments"]:
        JobConfig.model_validate(deployment["parameters"]["job"])  # every shipped job is a valid JobConfig
    by_name = {d["name"]: d for d in project["deployments"]}
    # The override example differs from the embedded default in exactly what it says it overrides.
    base, long = by_name["embedded-default"]["parameters"]["job"], by_name["embedded-long"]["parameters"]["job"]
    changed = {k for k in {**base["trainer"], **long["trainer"]} if base["trainer"].get(k) != long["trainer"].get(k)}
    assert changed == {"max_steps", "learning_rate", "output_dir"}


# ------------------------------------------------------------------------------------------ registration
def test_deployments_and_pools_are_registered(prefect, deployments):
    api, _, _ = prefect
    project = yaml.safe_load((ROOT / "prefect.yaml").read_text())
    assert set(deployments) == {d["name"] for d in project["deployments"]}
    pools = {p["name"]: p for p in HTTP.post(f"{api}/work_pools/filter", json={}).json()}
    assert pools["grpo-process"]["type"] == "process" and pools["grpo-kubernetes"]["type"] == "kubernetes"
    assert "job_manifest" in pools["grpo-kubernetes"]["base_job_template"]["job_configuration"]
    commit = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    for name, deployment in deployments.items():
        assert deployment["version"] == commit
        assert deployment["enforce_parameter_schema"] is True
        # Typed parameters: the UI renders the JobConfig form from this schema.
        schema = deployment["parameter_openapi_schema"]
        assert schema["properties"]["job"]["$ref"].endswith("/JobConfig")
        assert "learning_rate" in schema["definitions"]["AsyncGRPOConfig"]["properties"]
    # Each job whole, as it validates: the custom-run form shows the values the run will use.
    from grpo_core.launch.job import JobConfig

    for written in project["deployments"]:
        registered = deployments[written["name"]]["parameters"]["job"]
        assert registered == JobConfig.model_validate(written["parameters"]["job"]).model_dump(mode="json")
        assert len(registered["reward_funcs"]) == 2 and registered["trainer"]["report_to"] == "mlflow"
    local_pull = deployments["embedded-default"]["pull_steps"][0]["prefect.deployments.steps.set_working_directory"]
    assert Path(local_pull["directory"]) == ROOT
    assert deployments["gpu-cluster"]["work_pool_name"] == "grpo-kubernetes"
    assert deployments["gpu-cluster"]["parameters"]["provisioner"] == "kubernetes"


def test_bad_parameters_are_refused_naming_the_field(prefect, deployments, worker):
    api, _, _ = prefect
    deployment = deployments["embedded-default"]
    job = deployment["parameters"]["job"]
    # Only this deployment's runs: the scheduler adds nightly runs in the meantime.
    of_this_deployment = {"flow_runs": {"deployment_id": {"any_": [deployment["id"]]}}}
    runs_before = len(HTTP.post(f"{api}/flow_runs/filter", json=of_this_deployment).json())

    # Refused by the API before a run exists: the schema says why and names the field.
    for path, value, field in [(("max_resumes",), -1, "max_resumes"),
                               (("trainer", "learning_rate"), "fast", "learning_rate"),
                               (("server", "max_model_len"), 8, "max_model_len")]:
        bad = copy.deepcopy(job)
        target = bad
        for key in path[:-1]:
            target = target.setdefault(key, {})
        target[path[-1]] = value
        reply = create_run(api, deployment, bad)
        assert reply.status_code == 409, reply.text
        assert field in reply.json()["detail"], reply.text
    assert len(HTTP.post(f"{api}/flow_runs/filter", json=of_this_deployment).json()) == runs_before

    # A negative learning rate: AsyncGRPOConfig.validate() refuses it. Where the parameter schema
    # carries the bound, the API refuses it like the cases above; otherwise the flow's typed
    # parameter refuses it when the worker picks the run up: the run fails before it ever runs
    # (never RUNNING, no task started), naming the field.
    bad = copy.deepcopy(job)
    bad["trainer"]["learning_rate"] = -1e-4
    reply = create_run(api, deployment, bad)
    if reply.status_code == 409:
        assert "learning_rate" in reply.json()["detail"], reply.text
        return
    assert reply.status_code == 201, reply.text
    run = wait_terminal(api, reply.json()["id"], 300, worker)
    states = [s["type"] for s in HTTP.get(f"{api}/flow_run_states/", params={"flow_run_id": run["id"]}).json()]
    assert run["state_type"] == "FAILED", states
    assert "RUNNING" not in states, states
    assert "learning_rate" in run["state"]["message"], run["state"]["message"]
    tasks = HTTP.post(f"{api}/task_runs/filter", json={"flow_runs": {"id": {"any_": [run["id"]]}}}).json()
    assert tasks == []


def test_nightly_schedule_produces_scheduled_runs(prefect, deployments):
    api, _, server = prefect
    deployment = deployments["embedded-nightly"]
    assert [s["schedule"]["cron"] for s in deployment["schedules"]] == ["0 2 * * *"]
    deadline = time.monotonic() + 120
    while True:
        runs = HTTP.post(f"{api}/flow_runs/filter", json={"flow_runs": {
            "deployment_id": {"any_": [deployment["id"]]}, "state": {"type": {"any_": ["SCHEDULED"]}}}}).json()
        if runs:
            break
        assert time.monotonic() < deadline, f"no scheduled run within 120 s; server log:\n{server.tail()}"
        time.sleep(2)
    now = dt.datetime.now(dt.timezone.utc)
    for run in runs:
        start = dt.datetime.fromisoformat(run["expected_start_time"].replace("Z", "+00:00"))
        assert start > now and (start.hour, start.minute) == (2, 0), run["expected_start_time"]
        assert run["work_queue_name"] == "nightly"  # not picked up by a worker serving only "default"
        assert run["parameters"]["job"]["tracking"]["experiment"] == "grpo-nightly"


# ------------------------------------------------------------------------------------------ a real run
@dataclass
class EmbeddedRun:
    """A run of ``embedded-default`` created as the UI's form creates one, and what it left."""

    flow_run: dict
    job: dict
    summary: dict
    elapsed_s: float
    output_dir: Path


@pytest.fixture(scope="module")
def embedded_run(prefect, deployments, worker, mlflow_server, vllm_server, tiny_model_path, tmp_path_factory):
    api, _, _ = prefect
    deployment = deployments["embedded-default"]
    out = tmp_path_factory.mktemp("embedded") / "run"
    # The deployment's job with a few fields edited, as a person would in the form: a short run on the
    # session's vLLM server (same tiny model), tracked in the session's MLflow server. Everything else,
    # the learning rate and the completions table among it, is the deployment's (the demo's) own.
    job = copy.deepcopy(deployment["parameters"]["job"])
    job["model"] = tiny_model_path
    job["server"] = {"managed": False, "base_url": vllm_server.base_url}
    job["tracking"] = {"tracking_uri": mlflow_server, "experiment": f"deployment-test-{uuid.uuid4().hex[:6]}"}
    job["trainer"].update(do_eval=True, num_generations_eval=1, max_steps=3, per_device_train_batch_size=16,
                          output_dir=str(out))
    started = time.monotonic()
    reply = create_run(api, deployment, job)
    assert reply.status_code == 201, reply.text
    run = wait_terminal(api, reply.json()["id"], 1200, worker)
    elapsed = time.monotonic() - started
    assert run["state_type"] == "COMPLETED", f"{run['state']['message']}\n{run_logs(api, run['id'])}\n{worker.tail()}"
    print(f"embedded-default flow run: {elapsed:.0f} s")
    return EmbeddedRun(run, job, json.loads((out / "summary.json").read_text()), elapsed, out)


def tags_after_flow(client, run_id: str) -> dict[str, str]:  # noqa: ANN001
    return client.get_run(run_id).data.tags


def readme_search_examples() -> list[str]:
    """The filter strings the README lists as finding the demo's run (the block after its marker)."""
    text = (ROOT / "README.md").read_text()
    block = text.split("<!-- search examples -->", 1)[1].split("```text\n", 1)[1].split("```", 1)[0]
    return [line.strip() for line in block.splitlines() if line.strip()]


@pytest.mark.slow
def test_embedded_default_run_completes_with_metrics_in_mlflow(prefect, embedded_run, mlflow_server, tiny_model_path,
                                                               tmp_path):
    import mlflow

    from flows.train_flow import registered_model_name
    from grpo_core.launch.job import JobConfig
    from grpo_core.tracking.run_view import (
        EXPERIMENT_KIND_TAG,
        HEADLINE_METRICS,
        HEADLINE_SECTION,
        HELDOUT_ACCURACY,
        RUNS_VIEW,
        RUNS_VIEW_NAME,
        run_url,
    )
    from tests.test_mlflow_ui import experiment_tags_as_the_ui_reads_them, listed_views

    api, _, _ = prefect
    job, summary = embedded_run.job, embedded_run.summary
    experiment = job["tracking"]["experiment"]
    client = mlflow.MlflowClient(mlflow_server)
    assert summary["mlflow_tracking_uri"] == mlflow_server
    mlflow_run = client.get_run(summary["mlflow_run_id"])
    run_id = mlflow_run.info.run_id
    mlflow_experiment = client.get_experiment_by_name(experiment)
    assert mlflow_run.info.experiment_id == mlflow_experiment.experiment_id
    # A model-training experiment, so MLflow's UI shows it as one (not as a GenAI app), with its runs view.
    assert mlflow_experiment.tags[EXPERIMENT_KIND_TAG] == "custom_model_development"
    # Its headline view is a saved view, listed under "Views" each time the page loads (a reload, a bookmark).
    ui_tags = experiment_tags_as_the_ui_reads_them(mlflow_server, mlflow_experiment.experiment_id)
    assert listed_views(ui_tags) == {RUNS_VIEW: RUNS_VIEW_NAME}
    assert mlflow_run.info.status == "FINISHED"
    rewards = client.get_metric_history(run_id, "reward")
    assert sorted({m.step for m in rewards}) == [1, 2, 3]
    metrics = mlflow_run.data.metrics
    for key in ("batch/packing_ratio", "sample/staleness_mean", "rollout/generated_tok_s", "loss"):
        assert key in metrics, sorted(metrics)
    assert any(k.startswith("system/") for k in metrics), sorted(metrics)  # system metrics on
    # Headline charts first: each headline metric the trainer logs is repeated at every step in the first section.
    for source in set(HEADLINE_METRICS) - {HELDOUT_ACCURACY}:  # the held-out one: test_..._heldout_accuracy
        copy_steps = [m.step for m in client.get_metric_history(run_id, f"{HEADLINE_SECTION}/{HEADLINE_METRICS[source]}")]
        assert sorted(copy_steps) == [1, 2, 3], source
    # Settings-fixed values are params or tags, not charts; counts of the job are tags.
    for flat in ("learning_rate", "sync/mode", "sync/bytes", "rollout/fork_turns", "train/attempt", "train/rerun_step",
                 "job/resumes"):
        assert flat not in metrics, flat
    tags = mlflow_run.data.tags
    assert tags["sync/mode"] == "full" and int(tags["sync/bytes"]) > 0 and tags["attempt"] == "1"
    assert (tags["resumes"], tags["prompts_trained_twice"], tags["server_restarts"]) == ("0", "0", "0")
    assert tags["resolved.attention_backend"] == "reference" and tags["resolved.bf16"] == "False"
    assert tags["task"] == "arithmetic" and tags["model"] == tiny_model_path
    assert len(tags["config_hash"]) == 12 and mlflow_run.info.run_name.endswith(tags["config_hash"][:8])
    assert tags["git_commit"] == subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                                                text=True).stdout.strip()

    # Params: one per setting under TRL's names, as Python prints the value; none under job.*, none unset.
    params = mlflow_run.data.params
    assert params["learning_rate"] == "0.0002" and params["max_staleness"] == str(job["trainer"]["max_staleness"])
    assert params["model_name_or_path"] == tiny_model_path and json.loads(params["reward_funcs"]) == job["reward_funcs"]
    assert not [k for k in params if k.startswith(("job.", "perf/"))] and "None" not in params.values()
    assert "grpo.attention_backend" in params and "resolved.attention_backend" not in params
    # What the run used, contradicting nothing: the server it trained against, no do_eval beside eval_strategy=no,
    # no path of this machine (that is the tag resolved.output_dir).
    assert params["vllm_server_base_url"] == job["server"]["base_url"]
    assert not [v for v in params.values() if "localhost:8000" in v]
    assert "do_eval" not in params and params["grpo.heldout_before_after"] == "True"
    assert params["output_dir"] == "run" and tags["resolved.output_dir"] == str(embedded_run.output_dir)
    # The answer is on the run: the description starts with the held-out result the summary holds.
    assert tags["mlflow.note.content"].startswith(heldout_line(summary))
    # Every search the README shows finds the run.
    mlflow.set_tracking_uri(mlflow_server)
    examples = readme_search_examples()
    assert len(examples) >= 4, examples
    for example in examples:
        found = mlflow.search_runs(experiment_names=[experiment], filter_string=example, output_format="list")
        assert [r.info.run_id for r in found] == [run_id], example

    # Artifacts: the summary, a table of completions per logged step (the job's default: the first 16 of each step).
    artifacts = {a.path for a in client.list_artifacts(run_id)}
    assert {"summary.json", "completions", "checkpoints"} <= artifacts, artifacts
    logged_summary = json.loads(Path(mlflow.artifacts.download_artifacts(
        artifact_uri=f"runs:/{run_id}/summary.json", tracking_uri=mlflow_server, dst_path=str(tmp_path))).read_text())
    assert logged_summary == summary
    assert [a.path for a in client.list_artifacts(run_id, "completions")] == [
        f"completions/step-{s:08d}.json" for s in (1, 2, 3)]
    table = read_table(client, run_id, "completions")
    assert {"step", "prompt", "completion", "reward", "accuracy_reward", "format_reward"} <= set(table.columns)
    assert sorted(set(table["step"])) == [1, 2, 3] and table.groupby("step").size().max() <= 16

    # The held-out accuracy before and after, each with its 95% interval over the 20 held-out problems, and the
    # paired gain; the same numbers as heldout_accuracy at step 0 and at the last step.
    assert (summary["eval_problems"], summary["eval_prompts"], summary["eval_samples"]) == (20, 100, 100)
    for label in ("before", "after"):
        low, high = summary[f"eval_accuracy_{label}_ci95"]
        assert 0.0 <= summary[f"eval_accuracy_{label}"] <= 1.0 and low <= summary[f"eval_accuracy_{label}"] <= high
    gain_low, gain_high = summary["eval_gain_ci95"]
    assert gain_low <= summary["eval_gain"] <= gain_high
    assert summary["eval_gain"] == pytest.approx(summary["eval_accuracy_after"] - summary["eval_accuracy_before"])
    seed = job["trainer"].get("seed", 0)
    held_out = resolve_dataset(job.get("dataset", "tiny:arithmetic"), seed)["eval"]["prompt"]
    assert summary["seed"] == seed and summary["eval_prompts_digest"] == prompts_digest(held_out)
    accuracy = {m.step: m.value for m in client.get_metric_history(mlflow_run.info.run_id, HELDOUT_ACCURACY)}
    assert accuracy == {0: summary["eval_accuracy_before"], 3: summary["eval_accuracy_after"]}
    lows = {m.step: m.value for m in client.get_metric_history(mlflow_run.info.run_id, "heldout_accuracy_ci95_low")}
    assert lows[3] == pytest.approx(summary["eval_accuracy_after_ci95"][0])
    # The run's picture beside summary.json, and in the MLflow run.
    picture = embedded_run.output_dir / "run.png"
    assert summary["picture"] == str(picture) and picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "run.png" in [a.path for a in client.list_artifacts(mlflow_run.info.run_id)]

    # The checkpoint the trainer wrote after its last step is referenced by URI, not copied...
    refs = mlflow.artifacts.download_artifacts(artifact_uri=f"runs:/{run_id}/checkpoints", tracking_uri=mlflow_server,
                                               dst_path=str(tmp_path / "refs"))
    reference = json.loads((Path(refs) / "checkpoint-step-000003.json").read_text())
    assert Path(reference["uri"]) == embedded_run.output_dir / "checkpoint-3" and reference["step"] == 3
    # ...and the final model is an MLflow transformers model, registered under the job's default name at
    # the last step with the run's metrics, that loads back.
    registered = registered_model_name(JobConfig.model_validate(job))
    versions = client.search_model_versions(f"name = '{registered}' and run_id = '{run_id}'")
    assert len(versions) == 1 and versions[0].source == summary["final_model_uri"]
    # The version says what it is: the run's description, its score, base model, data set and commit.
    assert versions[0].description == tags_after_flow(client, run_id)["mlflow.note.content"]
    assert versions[0].tags["heldout_accuracy"] == f"{summary['eval_accuracy_after']:.3f}"
    assert (versions[0].tags["base_model"], versions[0].tags["dataset"]) == (tiny_model_path, job["dataset"])
    assert versions[0].tags["git_commit"] == tags["git_commit"]
    assert tags_after_flow(client, run_id)["final_model"] == f"models:/{registered}/{versions[0].version}"
    model = client.get_logged_model(summary["final_model_uri"].removeprefix("models:/"))
    assert [o.step for o in mlflow_run.outputs.model_outputs] == [3]
    linked = {m.key: m.step for m in model.metrics}
    assert {"reward", "loss", "sample/staleness_mean"} <= set(linked) and linked["reward"] == 3
    components = mlflow.transformers.load_model(f"models:/{registered}/{versions[0].version}", return_type="components")
    weights = dict(components["model"].named_parameters())
    assert "model" in components and "tokenizer" in components
    from safetensors.torch import load_file

    saved = load_file(str(embedded_run.output_dir / "checkpoint-3" / "model.safetensors"))
    name = next(iter(saved))
    assert torch.equal(weights[name].detach().to(saved[name].dtype), saved[name])

    # Prefect: one summary artifact whose links open the run in its experiment, one progress artifact at 100%,
    # and the flow run's logs hold the training steps.
    flow_run = embedded_run.flow_run
    artifacts = HTTP.post(f"{api}/artifacts/filter", json={"artifacts": {"flow_run_id": {"any_": [flow_run["id"]]}}}).json()
    by_key: dict[str, list[dict]] = {}
    for artifact in artifacts:
        by_key.setdefault(artifact["key"], []).append(artifact)
    [summary_md] = by_key["training-summary"]
    assert summary_md["type"] == "markdown"
    assert f"[{run_id}]({run_url(mlflow_server, mlflow_run.info.experiment_id, run_id)})" in summary_md["data"]
    assert "| summary | value |" in summary_md["data"]
    [progress] = by_key["training-progress"]
    assert progress["type"] == "progress" and float(progress["data"]) == 100.0
    logs = run_logs(api, flow_run["id"])
    assert "[train]" in logs and "step 3" in logs, logs[-3000:]


# The held-out accuracy as a metric before training and after the final sync (also in the headline section and on
# the registered model), and the run's picture as an artifact.
@pytest.mark.slow
def test_embedded_default_run_holds_the_heldout_accuracy_and_the_picture(embedded_run, mlflow_server):
    import mlflow

    from grpo_core.tracking.run_view import HEADLINE_SECTION, HELDOUT_ACCURACY

    client = mlflow.MlflowClient(mlflow_server)
    run_id = embedded_run.summary["mlflow_run_id"]
    accuracy = client.get_metric_history(run_id, HELDOUT_ACCURACY)
    assert sorted(m.step for m in accuracy) == [0, 3]  # before training, and after the final weight sync
    assert sorted(m.step for m in client.get_metric_history(run_id, f"{HEADLINE_SECTION}/heldout_accuracy")) == [0, 3]
    assert "run.png" in {a.path for a in client.list_artifacts(run_id)}
    model = client.get_logged_model(embedded_run.summary["final_model_uri"].removeprefix("models:/"))
    assert (HELDOUT_ACCURACY, 3) in {(m.key, m.step) for m in model.metrics}


PROGRESS_FLOW = '''
# A flow whose "trainer" logs rewards to MLflow step by step; after each step it waits for the progress
# artifact to move and prints the value the Prefect API holds while the flow still runs.
import sys, time
import httpx, mlflow
from prefect import flow
from prefect.runtime import flow_run
from flows.progress import TrainingProgress
from flows.train_flow import progress_artifact


@flow
def watched(tracking_uri: str, api: str) -> None:
    client = mlflow.MlflowClient(tracking_uri)
    run_id = client.create_run(client.create_experiment("progress")).info.run_id
    seen = []
    with TrainingProgress(tracking_uri, run_id, total_steps=4, interval_s=0.2, on_step=progress_artifact()):
        for step in range(1, 5):
            client.log_metric(run_id, "reward", 0.1 * step, step=step)
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                found = httpx.post(f"{api}/artifacts/filter", json={"artifacts": {"key": {"any_": ["training-progress"]},
                                                                      "flow_run_id": {"any_": [flow_run.id]}}}).json()
                value = float(found[0]["data"]) if found else None
                if value is not None and value != (seen[-1] if seen else 0.0):
                    break
                time.sleep(0.2)
            seen.append(value)
    print("SEEN", seen)


watched(sys.argv[1], sys.argv[2])
'''


def test_the_progress_artifact_moves_while_training_runs(prefect, tmp_path):
    api, env, _ = prefect
    script = tmp_path / "watched.py"
    script.write_text(PROGRESS_FLOW)
    done = subprocess.run([sys.executable, str(script), f"sqlite:///{tmp_path / 'mlflow.db'}", api], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    seen = json.loads(done.stdout.split("SEEN ")[1].splitlines()[0])
    assert seen == [25.0, 50.0, 75.0, 100.0], seen


def test_deploy_selects_by_name_and_names_unknown_ones():
    from flows.deploy import load_pool_specs, load_project, selected_deployments

    project = load_project(ROOT / "prefect.yaml")
    assert [d["name"] for d in selected_deployments(project, ["grpo-train/embedded-long"])] == ["embedded-long"]
    with pytest.raises(ValueError, match="embedded-default"):
        selected_deployments(project, ["embeded-default"])
    # Every pool a deployment names has a template, of the type the worker expects.
    specs = load_pool_specs(ROOT)
    assert {d["work_pool"]["name"] for d in project["deployments"]} <= specs.keys()
    assert {s.type for s in specs.values()} == {"process", "kubernetes"}


def test_storage_credentials_come_from_an_aws_credentials_block(prefect):
    # The flow's storage_credentials parameter names a prefect-aws AwsCredentials block; its values
    # reach the environment the training processes inherit, and only the names are logged.
    api, env, _ = prefect
    script = (
        "import os\n"
        "from prefect_aws import AwsCredentials\n"
        "from flows.train_flow import load_storage_credentials\n"
        "AwsCredentials(aws_access_key_id='AKIAEXAMPLE', aws_secret_access_key='s3cr3t-value', region_name='eu-west-1',\n"
        "               aws_client_parameters={'endpoint_url': 'http://127.0.0.1:9000'}).save('grpo-s3-test', overwrite=True)\n"
        "load_storage_credentials('grpo-s3-test')\n"
        "print(os.environ['AWS_ACCESS_KEY_ID'], os.environ['AWS_SECRET_ACCESS_KEY'], os.environ['AWS_DEFAULT_REGION'],\n"
        "      os.environ['AWS_ENDPOINT_URL'])\n"
    )
    done = subprocess.run([sys.executable, "-c", script], env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["AKIAEXAMPLE", "s3cr3t-value", "eu-west-1", "http://127.0.0.1:9000"]
    assert "s3cr3t-value" not in done.stderr


DOC_NAME = re.compile(r"(?<![\w/.\[(])(params|metrics)\.(`[^`]+`|[A-Za-z_][\w/]*)")
"""A param or metric as a search names it (``params.learning_rate``, ``metrics.`0_headline/reward` ``)."""
OWN_PARAM = re.compile(r"`(grpo\.[a-z_][\w.]*)`")
"""A param of this project's own, named in backticks (``grpo.attention_backend``)."""


def doc_names() -> dict[str, set[str]]:
    """Every param and metric the pages of docs/ and the README name: searches, and this project's own params."""
    out: dict[str, set[str]] = {"params": set(), "metrics": set()}
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = page.read_text()
        for kind, name in DOC_NAME.findall(text):
            out[kind].add(name.strip("`"))
        out["params"] |= {n for n in OWN_PARAM.findall(text) if "<" not in n}
    return out


def test_every_param_and_metric_the_docs_name_is_in_a_demo_shaped_run(embedded_run, mlflow_server):
    import mlflow

    run = mlflow.MlflowClient(mlflow_server).get_run(embedded_run.summary["mlflow_run_id"])
    names = doc_names()
    assert {"learning_rate", "grpo.attention_backend"} <= names["params"] and "heldout_accuracy" in names["metrics"]
    assert not names["params"] - set(run.data.params), sorted(names["params"] - set(run.data.params))
    assert not names["metrics"] - set(run.data.metrics), sorted(names["metrics"] - set(run.data.metrics))

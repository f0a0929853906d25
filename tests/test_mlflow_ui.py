"""What a person finds of a run in MLflow, against real MLflow servers: the saved view the experiment opens on, the
answer on the run and on its registered version, params that say what the run used, and the demo's printed command
(``grpo ui``), run as printed in a new shell.

    .venv/bin/python -m pytest -q tests/test_mlflow_ui.py
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from contextlib import redirect_stdout
from io import StringIO
from pathlib import Path

import httpx
import mlflow
import pytest

from grpo_core.config import AsyncGRPOConfig
from grpo_core.launch.job import JobConfig
from grpo_core.tracking.run_view import RUNS_VIEW, RUNS_VIEW_NAME, job_params, machine_tags, runs_view_state
from grpo_core.tracking.tracker import MLflowTracker, log_transformers_model, trainer_params
from tests.test_checkpoint import model_path  # noqa: F401 - fixture

pytestmark = pytest.mark.startup  # real MLflow servers (and a UI that takes tens of seconds to answer)

SAVED_VIEW_PREFIX = "mlflow.sharedViewState."


def listed_views(tags: list[dict[str, str]]) -> dict[str, str]:
    """The views MLflow's UI lists under "Views" for an experiment's tags, by the rules of its own code (3.17: a tag
    ``mlflow.sharedViewState.<id>`` whose value is an object with a string ``name``, a number ``createdAt`` and a
    string ``state``); id -> name."""
    out = {}
    for tag in tags:
        key, value = tag["key"], tag["value"]
        if not key.startswith(SAVED_VIEW_PREFIX) or key == SAVED_VIEW_PREFIX:
            continue
        try:
            view = json.loads(value)
        except ValueError:
            continue
        if isinstance(view, dict) and isinstance(view.get("name"), str) and isinstance(view.get("state"), str) \
                and isinstance(view.get("createdAt"), (int, float)) and not isinstance(view["createdAt"], bool):
            out[key.removeprefix(SAVED_VIEW_PREFIX)] = view["name"]
    return out


def experiment_tags_as_the_ui_reads_them(ui: str, experiment_id: str) -> list[dict[str, str]]:
    """The experiment's tags from the request the UI makes when a page (re)loads."""
    reply = httpx.get(f"{ui}/ajax-api/2.0/mlflow/experiments/get", params={"experiment_id": experiment_id}, timeout=30)
    reply.raise_for_status()
    return reply.json()["experiment"].get("tags", [])


def log_a_finished_run(store: str, model_dir: str | None, server_urls: list[str], output_dir: str) -> tuple[str, dict]:
    """A run as the flow leaves it (the same functions, in the same order), without training: params, tags, a few
    steps, a completions table, the final model (when ``model_dir``), the held-out accuracy and the answer."""
    from flows.heldout import heldout_line, heldout_summary, log_heldout
    from grpo_core.tracking.run_answer import record_answer
    from grpo_core.tracking.tracker import complete_headline, git_commit, run_identity

    job = JobConfig.model_validate({"trainer": {"output_dir": output_dir, "do_eval": True}})
    job_dict = json.loads(job.model_dump_json())
    name, identity = run_identity(job_dict)
    tracker = MLflowTracker(store, "grpo-ui-test", name)
    tracker.log_params({**trainer_params(job.trainer, server_urls), **job_params(job_dict)})
    tracker.set_tags({**identity, **machine_tags(output_dir)})
    for step in (1, 2, 3):
        tracker.log_metrics({"reward": 0.5 * step, "loss": 1.0 / step}, step=step)
        answers = [str(2 + i) for i in range(4)]  # a group of four rollouts, one right
        tracker.log_table("completions", {"step": [step] * 4, "prompt": ["1+1?"] * 4, "completion": answers,
                                          "reward": [float(a == "2") for a in answers],
                                          "accuracy_reward": [float(a == "2") for a in answers]}, step=step)
    tracker.close()
    run_id = tracker.run_id
    client = mlflow.MlflowClient(store)
    if model_dir:
        log_transformers_model(store, run_id, model_dir, "tiny-arithmetic", artifact_path="tiny-arithmetic", step=3)
    problems = {str(i): float(i % 2) for i in range(10)}
    before = {"accuracy": 0.5, "num_prompts": 10, "num_samples": 20, "problems": problems}
    after = {"accuracy": 0.7, "num_prompts": 10, "num_samples": 20,
             "problems": {k: min(1.0, v + 0.4) for k, v in problems.items()}}
    log_heldout(store, run_id, before, after, last_step=3)
    complete_headline(client, run_id)
    summary = {"steps": 3, "reward_first": 0.5, "reward_last": 1.5, **heldout_summary(before, after),
               "mlflow_tracking_uri": store, "mlflow_run_id": run_id}
    record_answer(client, run_id, summary, job_dict, "tiny-arithmetic" if model_dir else None, heldout_line(summary),
                  git_commit())
    return run_id, summary


def test_a_run_on_a_tracking_server_answers_and_keeps_its_view(mlflow_server, model_path, tmp_path):  # noqa: F811
    used = ["http://127.0.0.1:41001", "http://127.0.0.1:41002"]
    run_id, summary = log_a_finished_run(mlflow_server, model_path, used, str(tmp_path / "demo"))
    client = mlflow.MlflowClient(mlflow_server)
    run = client.get_run(run_id)

    # The experiment's view is a saved view: listed under "Views" whenever the page loads (a reload, a bookmark).
    for _ in range(2):
        tags = experiment_tags_as_the_ui_reads_them(mlflow_server, run.info.experiment_id)
        assert listed_views(tags) == {RUNS_VIEW: RUNS_VIEW_NAME}
    view = next(t["value"] for t in tags if t["key"] == SAVED_VIEW_PREFIX + RUNS_VIEW)
    assert json.loads(json.loads(view)["state"]) == runs_view_state()

    # The answer is on the run: its description starts with the held-out result, which is also a metric a search
    # finds without quoting, with its interval.
    description = run.data.tags["mlflow.note.content"]
    assert description.startswith("held-out accuracy 0.500") and "-> 0.700" in description and "95% CI" in description
    low, high = summary["eval_accuracy_after_ci95"]
    assert run.data.metrics["heldout_accuracy"] == 0.7
    assert (run.data.metrics["heldout_accuracy_ci95_low"], run.data.metrics["heldout_accuracy_ci95_high"]) == (low, high)
    mlflow.set_tracking_uri(mlflow_server)
    found = mlflow.search_runs(experiment_ids=[run.info.experiment_id], filter_string="metrics.heldout_accuracy > 0.6",
                               output_format="list")
    assert [r.info.run_id for r in found] == [run_id]

    # The registered version says what it is: the same description, its score, base model, data set and commit.
    version = client.get_model_version("tiny-arithmetic", "1")
    assert version.run_id == run_id and version.description == description
    assert version.tags["heldout_accuracy"] == "0.700" and version.tags["heldout_accuracy_ci95"] == (
        f"[{low:.3f}, {high:.3f}]")
    assert version.tags["base_model"] == "tiny:arithmetic" and version.tags["dataset"] == "tiny:arithmetic"
    assert re.fullmatch(r"[0-9a-f]{40}", version.tags["git_commit"])
    # The logged model is named after what it is, and the run points at the version by name.
    assert run.data.tags["final_model"] == "models:/tiny-arithmetic/1"
    assert client.get_logged_model(run.data.tags["final_model_id"]).name == "tiny-arithmetic"

    # Params say what the run used and contradict nothing.
    params = run.data.params
    assert json.loads(params["vllm_server_base_url"]) == used
    assert not [v for v in params.values() if "localhost:8000" in v]
    assert "do_eval" not in params or params.get("eval_strategy") != "no"
    assert not Path(params["output_dir"]).is_absolute() and run.data.tags["resolved.output_dir"] == str(tmp_path / "demo")
    trl = {f.name for f in __import__("dataclasses").fields(AsyncGRPOConfig)}
    assert all(k.startswith("grpo.") or k in trl or k in {"model_name_or_path", "dataset_name", "reward_funcs",
                                                          "use_peft"} for k in params), sorted(params)


def test_the_demos_printed_command_works_as_printed_in_a_new_shell(tmp_path):
    from flows.cli import print_mlflow_links

    out = tmp_path / "demo"
    out.mkdir()
    store = f"sqlite:///{out / 'mlflow.db'}"
    run_id, summary = log_a_finished_run(store, None, ["http://127.0.0.1:41001"], str(out))
    (out / "summary.json").write_text(json.dumps(summary))
    printed = StringIO()
    with redirect_stdout(printed):
        print_mlflow_links(summary, str(out))
    commands = [line.strip() for line in printed.getvalue().splitlines() if " ui " in line]
    assert len(commands) == 1, printed.getvalue()
    assert "5000" not in printed.getvalue()

    # A new shell: no virtual environment on PATH, another working directory, nothing of this process's environment.
    shell = subprocess.Popen(["bash", "-c", commands[0]], cwd="/", env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)},
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines: list[str] = []
    try:
        deadline = time.monotonic() + 300
        while not any("Ctrl-C stops it" in line for line in lines):
            line = shell.stdout.readline()  # type: ignore[union-attr]
            assert line or shell.poll() is None, "".join(lines)
            lines.append(line)
            assert time.monotonic() < deadline, "".join(lines)
        links = dict(re.findall(r"^\s+([a-z ]+):\s+(http://\S+)$", "".join(lines), re.M))
        assert {"the run", "its charts", "its completions", "the experiment"} <= set(links), lines
        ui = re.match(r"http://127\.0\.0\.1:\d+", links["the experiment"]).group(0)  # type: ignore[union-attr]
        assert not ui.endswith(":5000")
        # Printed only once the UI answers: each link's page and the experiment's saved view, at once.
        for url in links.values():
            assert "workflowType=machine_learning" in url and httpx.get(url, timeout=30).status_code == 200
        experiment_id = re.search(r"/experiments/(\d+)/", links["the experiment"]).group(1)  # type: ignore[union-attr]
        assert listed_views(experiment_tags_as_the_ui_reads_them(ui, experiment_id)) == {RUNS_VIEW: RUNS_VIEW_NAME}
        assert f"/runs/{run_id}" in links["the run"] and links["its completions"].endswith(
            f"/runs/{run_id}/artifacts?workflowType=machine_learning")
    finally:
        if shell.poll() is None:
            os.killpg(shell.pid, signal.SIGTERM)  # the command stops its UI server on SIGTERM, as on Ctrl-C
        shell.wait(60)
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"{ui}/health", timeout=5)  # the UI it started is gone with it

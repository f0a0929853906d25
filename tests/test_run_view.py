"""How a run reads in MLflow's UI (``grpo_core.tracking.run_view``) and in Prefect's (the flow's summary, the
deployment form's jobs): pure functions, no server.

    .venv/bin/python -m pytest -q tests/test_run_view.py
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from grpo_core.config import AsyncGRPOConfig
from grpo_core.launch.job import JobConfig
from grpo_core.tracking.run_view import (
    HEADLINE_METRICS,
    HEADLINE_SECTION,
    HELDOUT_CI95,
    MULTI_TURN_METRICS,
    OWN_PREFIX,
    RUNS_VIEW,
    RUNS_VIEW_NAME,
    TRAINING_WORKFLOW,
    TRL_TRAINER_FIELDS,
    as_params,
    constant_metrics,
    constant_tags,
    experiment_tags,
    experiment_url,
    job_params,
    machine_tags,
    param_text,
    read_saved_view,
    resolved_tags,
    run_url,
    runs_view_state,
    saved_view,
    trainer_param_values,
    ui_command,
    with_headline,
)
from grpo_core.tracking.tracker import redact

ROOT = Path(__file__).resolve().parents[1]


def chart_section(metric: str) -> str:
    """MLflow's UI's section of a metric's chart: the name up to its last '/', "" for none."""
    return metric.rpartition("/")[0]


def ui_section_order(metrics: list[str]) -> list[str]:
    """The sections in the order MLflow's UI lays them out: named ones as JavaScript sorts strings (code points;
    Python sorts ASCII the same), then the unprefixed metrics ("Model metrics"), then ``system``."""
    named = sorted({chart_section(m) for m in metrics} - {"", "system"})
    return named + [s for s in ("", "system") if s in {chart_section(m) for m in metrics}]


# Every section the trainer and the flow log into, with names a user's own reward function or tool may add.
LOGGED = ["reward", "loss", "grad_norm", "batch/packing_ratio", "checkpoint/seconds", "clip_ratio/low_mean",
          "completions/mean_length", "heldout_accuracy", "eval/rewards/accuracy_reward", "perf/step_s",
          "rewards/Accuracy/mean", "rewards/_private/mean", "rollout/generated_tok_s", "sample/staleness_mean",
          "sampling/ratio_mean", "sync/seconds", "system/cpu_utilization_percentage", "tools/Calc/calls",
          "train/rerun_step", "env/reward", "moe/aux_loss"]


def test_the_headline_section_is_laid_out_first_and_holds_a_copy_of_each_headline_metric():
    metrics = {name: float(i) for i, name in enumerate(LOGGED)}
    charted = with_headline(metrics)
    assert ui_section_order(list(charted))[0] == HEADLINE_SECTION
    # Originals keep their (TRL) names and values; each headline metric present has its copy, the rest none.
    assert {k: v for k, v in charted.items() if k in metrics} == metrics
    copies = {k: v for k, v in charted.items() if k not in metrics}
    present = [k for k in HEADLINE_METRICS if k in metrics]
    assert copies == {f"{HEADLINE_SECTION}/{HEADLINE_METRICS[k]}": metrics[k] for k in present}
    # At most nine charts: three rows on the metrics page; the UI sorts them by name, three to a row at 1366 pixels,
    # and the held-out accuracy and the reward are in the first row.
    assert len(set(HEADLINE_METRICS.values())) == len(HEADLINE_METRICS) <= 9
    assert {HEADLINE_METRICS["reward"], HEADLINE_METRICS["heldout_accuracy"]} <= set(sorted(HEADLINE_METRICS.values())[:3])


def test_constant_metrics_follow_the_settings():
    single = constant_metrics(multi_turn=False, world_size=1, lr_scheduler_type="constant", weight_sync_encoding="dense",
                              weight_sync_transport="group")
    assert {"learning_rate", "sync/mode", "sync/bytes", "sync/dense_bytes", "batch/row_cost_imbalance"} <= single
    assert MULTI_TURN_METRICS <= single
    varied = constant_metrics(multi_turn=True, world_size=2, lr_scheduler_type="cosine", weight_sync_encoding="delta",
                              weight_sync_transport="group")
    assert varied == {"sync/mode", "sync/dense_bytes"}  # a decaying rate, delta pushes, turns and ranks are charted
    # Nothing a person reads to judge a run is ever dropped.
    assert not (single | varied) & set(HEADLINE_METRICS)
    assert constant_tags({"sync/bytes": 5200896.0, "sync/dense_bytes": 1.5, "learning_rate": 2e-4}) == {
        "sync/bytes": "5200896", "sync/dense_bytes": "1.5"}  # the learning rate is a param already


def test_params_are_spelled_as_python_prints_them_and_unset_ones_are_left_out():
    assert param_text(2e-4) == "0.0002" and param_text(1e-6) == "1e-06" and param_text(8) == "8"
    assert param_text(True) == "True" and param_text("auto") == "auto"
    assert param_text([1.0, 0.5]) == "[1.0, 0.5]" and param_text({"a": 1}) == '{"a": 1}'
    assert param_text(None) is None and param_text([]) is None and param_text({}) is None
    assert as_params({"learning_rate": 2e-4, "bf16": None, "reward_weights": None, "tools": []}) == {
        "learning_rate": "0.0002"}
    assert resolved_tags({"bf16": False, "experts_implementation": None}) == {"resolved.bf16": "False"}


def test_job_params_use_trl_names_once_each():
    job = json.loads(JobConfig.model_validate({
        "model": "Qwen/Qwen3-0.6B", "peft_config": {"r": 16, "lora_alpha": 32, "target_modules": "all-linear"},
        "server": {"max_model_len": 2048, "dtype": "bfloat16", "managed": False, "base_url": "http://gpu:8000",
                   "env": {"VLLM_LOGGING_LEVEL": "INFO", "AWS_SECRET_ACCESS_KEY": "s3cr3t"}},
        "tracking": {"experiment": "x"}, "rendezvous_address": "10.0.0.1",
    }).model_dump_json())
    params = as_params(redact(job_params(job)))  # as MLflowTracker.log_params writes them
    assert params["grpo.server.env.VLLM_LOGGING_LEVEL"] == "INFO" and "s3cr3t" not in json.dumps(params)
    assert params["model_name_or_path"] == "Qwen/Qwen3-0.6B" and params["dataset_name"] == "tiny:arithmetic"
    assert json.loads(params["reward_funcs"]) == job["reward_funcs"]
    assert (params["use_peft"], params["lora_r"], params["lora_alpha"], params["lora_target_modules"]) == (
        "True", "16", "32", "all-linear")
    assert params["grpo.server.max_model_len"] == "2048" and params["grpo.server.dtype"] == "bfloat16"
    assert params["grpo.max_resumes"] == "3"  # the project's own settings under its prefix
    # Where the run happens, and what is unset, is no param; nothing is logged under a job.* prefix.
    for absent in ("grpo.server.base_url", "grpo.server.managed", "experiment", "rendezvous_address", "grpo.tools",
                   "grpo.environment_factory", "grpo.server.max_loras", "model", "dataset"):
        assert absent not in params, absent
    assert not [k for k in params if k.startswith(("job.", "trainer", "server", "tracking"))]
    # One name per setting: none of the job's is also a trainer setting's.
    assert not set(params) & {f.name for f in dataclasses.fields(AsyncGRPOConfig)}


def test_trainer_params_keep_trls_names_record_the_servers_used_and_contradict_nothing(tmp_path):
    config = dataclasses.asdict(AsyncGRPOConfig(output_dir=str(tmp_path / "demo"), do_eval=True))
    used = ["http://127.0.0.1:41234", "http://127.0.0.1:41235"]
    params = as_params(trainer_param_values(config, used))
    # TRL's settings under TRL's names, the project's own as grpo.<name>: every field once, nothing else.
    assert params["learning_rate"] == "1e-06" and params["max_staleness"] == "4"
    assert params[f"{OWN_PREFIX}packing"] == "tree" and "packing" not in params
    own = {k.removeprefix(OWN_PREFIX) for k in params if k.startswith(OWN_PREFIX)}
    assert not own & TRL_TRAINER_FIELDS and not {k for k in params if not k.startswith(OWN_PREFIX)} - TRL_TRAINER_FIELDS
    # The servers the run used, not the default URL; one server as its URL.
    assert json.loads(params["vllm_server_base_url"]) == used
    assert as_params(trainer_param_values(config, used[:1]))["vllm_server_base_url"] == used[0]
    assert "localhost:8000" not in json.dumps(params)
    # No do_eval=True beside eval_strategy=no: the before/after evaluation has a name of its own.
    assert "do_eval" not in params and params[f"{OWN_PREFIX}heldout_before_after"] == "True"
    assert params["eval_strategy"] == "no"
    # No path of this machine in a param: the folder's name, the path as a tag.
    assert params["output_dir"] == "demo" and str(tmp_path) not in json.dumps(params)
    assert machine_tags(config["output_dir"]) == {"resolved.output_dir": str(tmp_path / "demo")}
    remote = dataclasses.asdict(AsyncGRPOConfig(output_dir="s3://bucket/runs/a"))
    assert trainer_param_values(remote)["output_dir"] == "s3://bucket/runs/a"


def test_the_experiments_view_is_a_saved_view_the_ui_lists():
    tags = experiment_tags(now_ms=1_700_000_000_000)
    value = tags[f"mlflow.sharedViewState.{RUNS_VIEW}"]
    envelope = json.loads(value)
    # The fields and types MLflow's UI checks before it lists a view (a string state, a number createdAt).
    assert isinstance(envelope["name"], str) and isinstance(envelope["state"], str)
    assert envelope["createdAt"] == envelope["updatedAt"] == 1_700_000_000_000
    assert read_saved_view(value) == (RUNS_VIEW_NAME, runs_view_state())
    columns = runs_view_state()["selectedColumns"]
    assert "metrics.`reward`" in columns and "metrics.`heldout_accuracy`" in columns
    # Metric columns sort by name: the held-out accuracy and the reward come among the first three.
    metric_columns = sorted(c for c in columns if c.startswith("metrics."))
    assert {"metrics.`heldout_accuracy`", "metrics.`reward`"} <= set(metric_columns[:3])
    assert not {f"metrics.`{n}`" for n in HELDOUT_CI95} & set(columns)  # the interval is on the run's page
    # The form the UI loads through a link but does not list is told apart.
    assert read_saved_view(json.dumps(runs_view_state())) is None and read_saved_view("not json") is None
    assert read_saved_view(saved_view("v", {}, True)) is None  # a bool is no time


def test_links_open_the_training_view_of_the_right_experiment():
    server = "http://mlflow.example:5000/"
    assert experiment_url(server, "7") == (f"http://mlflow.example:5000/#/experiments/7/runs?{TRAINING_WORKFLOW}"
                                           f"&viewStateShareKey={RUNS_VIEW}")
    assert run_url(server, "7", "abc") == f"http://mlflow.example:5000/#/experiments/7/runs/abc?{TRAINING_WORKFLOW}"
    assert run_url(server, "7", "abc", "model-metrics").endswith("/#/experiments/7/runs/abc/model-metrics?"
                                                                 "workflowType=machine_learning")
    assert ui_command(server, "outputs/demo") is None
    # A store has no address until something serves it: no link, but the command (full path) that serves it.
    store = "sqlite:////tmp/run/mlflow.db"
    with pytest.raises(ValueError, match="grpo ui"):
        run_url(store, "1", "abc")
    command = ui_command(store, "/tmp/run")
    assert command.endswith(" ui /tmp/run") and command.startswith("/")


# ---------------------------------------------------------------------------------------------- Prefect
def test_the_summary_artifact_has_a_header_and_links_to_the_run_in_its_experiment():
    from flows.train_flow import summary_markdown

    job = JobConfig()
    summary = {"steps": 120, "reward_last": 1.5321, "mlflow_tracking_uri": "http://127.0.0.1:5000",
               "mlflow_run_id": "abc123", "resumes": 0}
    markdown = summary_markdown(job, summary, "4")
    lines = markdown.splitlines()
    header = lines.index("|---|---|") - 1
    assert all(cell.strip() for cell in lines[header].strip("|").split("|")), lines[header]  # no empty header
    assert f"| mlflow_run_id | [abc123]({run_url('http://127.0.0.1:5000', '4', 'abc123')}) |" in lines
    assert "/#/experiments/0/" not in markdown and "| reward_last | 1.532 |" in lines
    assert experiment_url("http://127.0.0.1:5000", "4") in markdown
    local = summary_markdown(job, {**summary, "mlflow_tracking_uri": "sqlite:////tmp/x/mlflow.db"}, "1")
    assert " ui " in local and "http://127.0.0.1:5000" not in local  # the command that serves the store and links


def test_deployments_are_registered_with_their_whole_job():
    from flows.deploy import full_jobs, load_project

    project = load_project(ROOT / "prefect.yaml")
    full = full_jobs(project)
    for written, deployment in zip(project["deployments"], full["deployments"], strict=True):
        job = deployment["parameters"]["job"]
        assert job == JobConfig.model_validate(written["parameters"]["job"]).model_dump(mode="json")
        # What the form shows is what the run uses: the defaults the job file leaves out are written out.
        assert job["reward_funcs"] == JobConfig().reward_funcs and len(job["reward_funcs"]) == 2
        assert job["trainer"]["report_to"] == "mlflow" and job["trainer"]["log_completions"] is True
    assert "reward_funcs" not in project["deployments"][0]["parameters"]["job"]  # the file itself stays short
    bad = {"deployments": [{"name": "broken", "parameters": {"job": {"max_resumes": -1}}}]}
    with pytest.raises(ValueError, match=r"(?s)deployment .broken.*max_resumes"):
        full_jobs(bad)


def test_the_registered_model_is_named_after_the_job_unless_it_names_one():
    from flows.train_flow import registered_model_name

    assert registered_model_name(JobConfig()) == "tiny-arithmetic-arithmetic"
    assert registered_model_name(JobConfig(model="Qwen/Qwen3-0.6B")) == "qwen3-0.6b-arithmetic"
    assert registered_model_name(JobConfig(tracking={"registered_model_name": "mine"})) == "mine"

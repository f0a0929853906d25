"""scripts/staleness_table.py reads the stale-sample policy table from an MLflow store as staleness_runs.py leaves it.

Runs are logged to a SQLite MLflow store (a real store, no server) with the tags and metrics the trainer and the
flow write; the table's numbers are checked against values computed by hand.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

mlflow = pytest.importorskip("mlflow")


def load_script(name: str):
    path = Path(__file__).parents[1] / "scripts" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def log_run(client, experiment_id: str, policy: str, setting: str, discarded: list[float], status: str = "FINISHED"):
    run = client.create_run(experiment_id, run_name=f"{setting}-{policy}-seed0",
                            tags={"staleness.policy": policy, "staleness.setting": setting})
    rid = run.info.run_id
    client.log_param(rid, "seed", "0")
    client.log_param(rid, "max_steps", "60")
    for step, dropped in enumerate(discarded, start=1):
        for name, value in {"waste/generated_tokens": 100.0, "waste/generated_completions": 10.0,
                            "waste/discarded_tokens": dropped, "waste/trained_tokens": 100.0 - dropped,
                            "waste/trained_completions": 10.0 - dropped / 20, "perf/step_s": float(step),
                            "sample/staleness_mean": 0.5, "sample/late_kept": 1.0 if policy == "keep" else 0.0}.items():
            client.log_metric(rid, name, value, step=step)
    client.log_metric(rid, "heldout_accuracy", 0.3, step=0)
    client.log_metric(rid, "heldout_accuracy_ci95_low", 0.2, step=0)
    client.log_metric(rid, "heldout_accuracy_ci95_high", 0.4, step=0)
    client.log_metric(rid, "heldout_accuracy", 0.6, step=len(discarded))
    client.set_terminated(rid, status)


def test_the_table_is_read_from_the_experiment(tmp_path, capsys):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = mlflow.MlflowClient(uri)
    experiment_id = client.create_experiment("stale-sample-policies", artifact_location=str(tmp_path / "artifacts"))
    log_run(client, experiment_id, "keep", "long_tail", [0.0, 0.0, 0.0])
    log_run(client, experiment_id, "drop", "long_tail", [20.0, 0.0, 10.0])
    log_run(client, experiment_id, "drop", "demo", [0.0, 0.0, 0.0, 0.0])
    log_run(client, experiment_id, "keep", "demo", [0.0], status="FAILED")  # not a row
    table = load_script("staleness_table")
    assert table.main(["--tracking-uri", uri, "--json", str(tmp_path / "rows.json")]) == 0
    rows = __import__("json").loads((tmp_path / "rows.json").read_text())
    assert [(r["setting"], r["policy"]) for r in rows] == [("demo", "drop"), ("long_tail", "drop"), ("long_tail", "keep")]
    drop = rows[1]
    assert drop["discarded_share"] == pytest.approx(30 / 300) and drop["discarded_tokens"] == 30
    # trained: 270 tokens over 28.5 samples; generated: 300 over 30
    assert drop["length_ratio"] == pytest.approx((270 / 28.5) / 10.0)
    assert drop["step_s_median"] == 2.0 and drop["steps"] == 3 and rows[2]["late_kept"] == 3
    assert drop["heldout_before"] == {"mean": 0.3, "low": 0.2, "high": 0.4}
    assert drop["heldout_after"]["mean"] == 0.6 and drop["heldout_after"]["low"] is None
    assert drop["command"] == "python scripts/staleness_runs.py --policy drop --setting long_tail --max-steps 60"
    out = capsys.readouterr().out
    assert "| long_tail | drop | 3 | 10.0% (30 of 300) |" in out and "0.300 [0.20, 0.40]" in out


def test_each_rows_job_is_a_valid_job_with_its_policy_and_setting():
    from grpo_core.launch.job import JobConfig

    runs = load_script("staleness_runs")
    for policy in runs.POLICIES:
        for setting in runs.SETTINGS:
            job = JobConfig.model_validate(runs.job_data(policy, setting, 3, 60, "/tmp/out", "name", True, "e", None))
            assert job.trainer.stale_samples == policy and job.trainer.max_steps == 60 and job.trainer.seed == 3
            assert job.tracking.tags == {"staleness.policy": policy, "staleness.setting": setting}
            long_tail = setting == "long_tail"
            assert (job.trainer.max_completion_length == 64) is long_tail
            assert job.reward_funcs[0] == "grpo_core.rewards:accuracy_reward"  # the held-out accuracy's function
            assert ("benchmarks.staleness.long_tail:long_answer_reward" in job.reward_funcs) is long_tail
            assert job.loop_cls == ("benchmarks.staleness.long_tail:LongTailLoop" if long_tail else None)

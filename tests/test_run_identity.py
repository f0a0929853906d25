"""MLflow run identity: the config hash groups runs of one recipe; the name and tags say what ran."""

from __future__ import annotations

import json

from grpo_core.launch.job import JobConfig
from grpo_core.tracking.tracker import config_hash, run_identity


def job(**values) -> dict:
    return json.loads(JobConfig.model_validate(values).model_dump_json())


def test_hash_ignores_where_a_run_happens_but_not_what_it_trains():
    base = config_hash(job())
    # Same recipe, other place or name: same hash.
    assert config_hash(job(trainer={"output_dir": "/elsewhere", "run_name": "x"},
                           tracking={"tracking_uri": "http://mlflow:5000", "experiment": "other"},
                           server={"managed": False, "base_url": "http://gpu:8000"})) == base
    # Anything that changes training: another hash.
    assert config_hash(job(trainer={"learning_rate": 1e-3})) != base
    assert config_hash(job(dataset="tiny:tools")) != base
    assert config_hash(job(server={"max_model_len": 1024})) != base


def test_name_and_tags():
    name, tags = run_identity(job(model="Qwen/Qwen3-4B", dataset="my_project.data:load"))
    assert name == f"qwen3-4b-load-{tags['config_hash'][:8]}"
    assert tags["model"] == "Qwen/Qwen3-4B" and tags["task"] == "load" and len(tags["config_hash"]) == 12
    name, tags = run_identity(job())
    assert name.startswith("tiny-arithmetic-arithmetic-") and tags["task"] == "arithmetic"


def test_git_commit_from_the_environment_wins(monkeypatch):
    monkeypatch.setenv("GRPO_GIT_COMMIT", "0123abcd")  # images carry no .git; the build sets this
    _, tags = run_identity(job())
    assert tags["git_commit"] == tags["mlflow.source.git.commit"] == "0123abcd"

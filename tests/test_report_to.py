"""Tracking set-up with the base install: a default config needs no MLflow; asking for it without it is named.

The base install (``pip install grpo-core``) leaves mlflow out (it is in the ``flows`` extra); here it is made
unimportable by a ``None`` entry in ``sys.modules``, as Python does for a package that is not installed.

    .venv/bin/python -m pytest -q tests/test_report_to.py
"""

from __future__ import annotations

import sys

import pytest

from grpo_core.config import AsyncGRPOConfig
from grpo_core.launch.job import JobConfig
from grpo_core.rewards import accuracy_reward
from grpo_core.tracking.tracker import NullTracker, make_tracker
from grpo_core.training.trainer import AsyncGRPOTrainer
from tests.test_checkpoint import model_path, train_rows  # noqa: F401 - fixtures


@pytest.fixture
def without_mlflow(monkeypatch):
    monkeypatch.setitem(sys.modules, "mlflow", None)
    with pytest.raises(ImportError):
        import mlflow  # noqa: F401


def test_a_default_config_trains_without_mlflow(without_mlflow, model_path, train_rows, tmp_path):
    trainer = AsyncGRPOTrainer(model=model_path, reward_funcs=accuracy_reward, train_dataset=train_rows,
                               args=AsyncGRPOConfig(output_dir=str(tmp_path)))
    assert isinstance(trainer.tracker, NullTracker)
    trainer.tracker.log_metrics({"loss": 1.0}, step=1)


def test_report_to_mlflow_without_mlflow_names_the_field_and_the_fix(without_mlflow, tmp_path):
    with pytest.raises(ImportError, match=r"AsyncGRPOConfig\.report_to='mlflow' needs the mlflow package.*"
                                          r"pip install 'grpo-core\[flows\]'.*report_to='none'"):
        make_tracker(AsyncGRPOConfig(output_dir=str(tmp_path), report_to="mlflow"))


def test_the_library_reports_nowhere_by_default_and_a_job_to_mlflow():
    assert AsyncGRPOConfig().report_to == "none"  # as transformers' TrainingArguments (and so TRL)
    assert JobConfig().trainer.report_to == "mlflow"  # the flow follows and summarises the job from its run
    assert JobConfig(trainer={"max_steps": 3}).trainer.report_to == "mlflow"
    assert JobConfig(trainer={"report_to": "none"}).trainer.report_to == "none"
    assert JobConfig.model_validate_json(JobConfig().model_dump_json()).trainer.report_to == "mlflow"

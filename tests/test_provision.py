"""LocalProvisioner's training environment: CPU trainers beside a local vLLM server take half the cores."""

from __future__ import annotations

import os

import pytest

from flows.provision import LocalProvisioner, TrainingLaunch


def launch(url: str, nproc: int = 1) -> TrainingLaunch:
    return TrainingLaunch(job_file="job.json", server_url=url, model_path="m", mlflow_run_id=None,
                          tracking_uri=None, result_file="r.json", nproc_per_node=nproc)


@pytest.fixture
def no_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("flows.provision._has_cuda", lambda: False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 8)


@pytest.mark.usefixtures("no_gpu")
@pytest.mark.parametrize("url,nproc,threads", [
    ("http://127.0.0.1:8000", 1, "4"), ("http://localhost:8000", 2, "2"), ("http://[::1]:8000", 8, "1"),
])
def test_a_loopback_server_halves_the_trainer_threads(url: str, nproc: int, threads: str) -> None:
    assert LocalProvisioner().training_env(launch(url, nproc))["OMP_NUM_THREADS"] == threads


@pytest.mark.usefixtures("no_gpu")
def test_a_remote_server_leaves_threads_alone() -> None:
    assert "OMP_NUM_THREADS" not in LocalProvisioner().training_env(launch("http://vllm.cluster.local:8000"))


@pytest.mark.usefixtures("no_gpu")
def test_a_user_setting_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert LocalProvisioner().training_env(launch("http://127.0.0.1:8000"))["OMP_NUM_THREADS"] == "3"


def test_gpus_leave_threads_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("flows.provision._has_cuda", lambda: True)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert "OMP_NUM_THREADS" not in LocalProvisioner().training_env(launch("http://127.0.0.1:8000"))

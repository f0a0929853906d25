"""Shared fixtures: the offline tiny model and real servers (vLLM, MLflow) started once per session.

Every integration test that can share the vLLM server does: it is started with LoRA serving on
(so LoRA tests need no second server), and every trainer pushes its own weights at start-up, so
tests do not depend on what an earlier test left on the server. Servers are stopped by the
process group they were started in, never by name.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch

from grpo_core.server import VLLMServer, VLLMServerSpec, free_port

SHARED_MAX_LORAS = 6
SHARED_MAX_LORA_RANK = 16


@pytest.fixture(scope="session")
def tiny_model_path() -> str:
    from grpo_core.tiny import build_tiny_model

    return str(build_tiny_model())


@pytest.fixture(scope="session")
def server_logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("server-logs")


@pytest.fixture(scope="session")
def vllm_server(tiny_model_path: str, server_logs: Path):
    """One CPU vLLM server for the session: gloo weight transfer, scale-out, LoRA serving."""
    spec = VLLMServerSpec(
        model=tiny_model_path,
        max_model_len=512,
        enable_lora=True,
        max_loras=SHARED_MAX_LORAS,
        max_lora_rank=SHARED_MAX_LORA_RANK,
        max_logprobs=20,
    )
    server = VLLMServer(spec, server_logs / "shared")
    server.start(timeout_s=900)
    # From here on the server's CPU worker shares the cores with trainers in this process; OpenMP
    # threads on the same cores stall each other (see LocalProvisioner.training_env), so the
    # trainers take half of them, as the flow's do.
    threads = torch.get_num_threads()
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    yield server
    torch.set_num_threads(threads)
    server.stop()


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory: pytest.TempPathFactory):
    """A real ``mlflow server`` on loopback with a SQLite store; yields its URL."""
    root = tmp_path_factory.mktemp("mlflow")
    port = free_port()
    log = open(root / "server.log", "wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port),
         "--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}", "--artifacts-destination", str(root / "artifacts"),
         "--workers", "1"],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"mlflow server exited: {(root / 'server.log').read_text()[-2000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(1)
    else:
        os.killpg(proc.pid, signal.SIGKILL)
        raise RuntimeError("mlflow server did not start within 180 s")
    yield url
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(20)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)

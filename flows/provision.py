"""Where the flow's processes run, behind one small interface.

``LocalProvisioner`` starts the vLLM server and the training processes as children of the flow (the
embedded default, a process work pool). A cluster implementation renders the same two things as
Kubernetes jobs (see ``flows/kubernetes.py``). The flow only calls ``start_server``,
``server_alive``, ``stop_server`` and ``run_training``, so its code is the same for both.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from grpo_core.server import VLLMServer, VLLMServerSpec


@dataclass
class TrainingLaunch:
    """One training attempt: the entry point's arguments and the topology."""

    job_file: str
    server_url: str
    model_path: str
    mlflow_run_id: str | None
    tracking_uri: str | None
    result_file: str
    nproc_per_node: int = 1
    nnodes: int = 1
    log_file: str | None = None

    def command(self) -> list[str]:
        entry = ["-m", "grpo_core.launch", self.job_file, "--server-url", self.server_url,
                 "--model-path", self.model_path, "--result", self.result_file]
        if self.mlflow_run_id:
            entry += ["--mlflow-run-id", self.mlflow_run_id]
        if self.tracking_uri:
            entry += ["--tracking-uri", self.tracking_uri]
        if self.nproc_per_node * self.nnodes == 1:
            return [sys.executable, *entry]
        # One node: a rendezvous on a free local port, so two runs on one machine never share 29500.
        standalone = ["--standalone"] if self.nnodes == 1 else []
        return [sys.executable, "-m", "torch.distributed.run", *standalone, "--nproc-per-node",
                str(self.nproc_per_node), "--nnodes", str(self.nnodes), *entry]


class Provisioner(ABC):
    @abstractmethod
    def start_server(self, spec: VLLMServerSpec, log_dir: str, timeout_s: float) -> str:
        """Start a server and return its base URL once it serves."""

    @abstractmethod
    def server_alive(self, base_url: str) -> bool: ...

    @abstractmethod
    def stop_server(self, base_url: str) -> None: ...

    @abstractmethod
    def run_training(self, launch: TrainingLaunch, on_start: Callable[[int], None] | None = None) -> int:
        """Run one training attempt to completion; return its exit code (negative: killed by signal)."""

    @abstractmethod
    def trains_on_gpu(self) -> bool:
        """Whether the trainers run on CUDA devices (their weight-transfer backend is then NCCL)."""


class LocalProvisioner(Provisioner):
    """Child processes on this machine; the server and trainers are stopped with the flow."""

    def __init__(self) -> None:
        self.servers: dict[str, VLLMServer] = {}

    def start_server(self, spec: VLLMServerSpec, log_dir: str, timeout_s: float) -> str:
        server = VLLMServer(spec, log_dir).start(timeout_s)
        self.servers[server.base_url] = server
        return server.base_url

    def server_alive(self, base_url: str) -> bool:
        server = self.servers.get(base_url)
        return server is not None and server.is_alive()

    def trains_on_gpu(self) -> bool:
        return _has_cuda()

    def stop_server(self, base_url: str) -> None:
        server = self.servers.pop(base_url, None)
        if server is not None:
            server.stop()

    def training_env(self, launch: TrainingLaunch) -> dict[str, str]:
        """The trainers' environment. With no GPU and the server on this machine (one this
        provisioner started, or any on a loopback address), both share the CPU cores: the vLLM CPU
        worker binds its OpenMP threads to them, and trainers that also spin one OpenMP thread per
        core stall each other's barriers (a forward+backward of about 1 s alone took 13-22 s beside a
        busy server). The trainers then get half the cores between them, unless ``OMP_NUM_THREADS``
        is set already."""
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        local_server = launch.server_url in self.servers or _is_loopback(launch.server_url)
        if local_server and "OMP_NUM_THREADS" not in env and not _has_cuda():
            env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 2) // 2 // launch.nproc_per_node))
        return env

    def run_training(self, launch: TrainingLaunch, on_start: Callable[[int], None] | None = None) -> int:
        log_path = Path(launch.log_file) if launch.log_file else None
        log = open(log_path, "ab") if log_path else None
        proc = subprocess.Popen(
            launch.command(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own group: a kill reaches torchrun's ranks too
            env=self.training_env(launch),
        )
        if on_start is not None:
            on_start(proc.pid)
        pump = threading.Thread(target=_pump, args=(proc.stdout, log), daemon=True)
        pump.start()
        try:
            code = proc.wait()
        except BaseException:
            _kill_group(proc.pid)
            proc.wait()
            raise
        finally:
            pump.join(timeout=5)
            if log is not None:
                log.close()
        return code


def _is_loopback(url: str) -> bool:
    import ipaddress
    from urllib.parse import urlparse

    host = urlparse(url).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _pump(stream: Any, log: Any) -> None:
    """Copy the child's output to our stdout (live progress) and to its log file."""
    for line in iter(stream.readline, b""):
        sys.stdout.buffer.write(line)
        sys.stdout.flush()
        if log is not None:
            log.write(line)
            log.flush()


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass

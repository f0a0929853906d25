"""Start and stop a vLLM OpenAI-compatible server as a child process, with the flags the trainer needs.

Shared by the Prefect flows, the CLI and the tests. The server runs in its own session (process
group) so that ``stop()`` ends exactly the processes it started (API server, engine core, workers)
and nothing else. Its output goes to a log file in the run's output folder; when the server dies,
``VLLMServerError`` carries the end of that log.

    with VLLMServer(VLLMServerSpec(model="path/to/model"), log_dir="out") as server:
        print(server.base_url)
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx


class VLLMServerError(RuntimeError):
    """The vLLM server failed to start or died; the message ends with the tail of its log."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass
class VLLMServerSpec:
    """How to launch the server. Defaults suit the CPU build and the offline tiny model."""

    model: str | os.PathLike[str]
    """Model folder (a path object is fine) or hub id to serve."""
    host: str = "127.0.0.1"
    """Interface to bind; loopback by default."""
    port: int = 0
    """TCP port; 0 picks a free one."""
    max_model_len: int = 512
    """Longest prompt + completion the server accepts (sizes its KV cache per request)."""
    dtype: str = "float32"
    """Weight dtype on the server; float32 keeps CPU log-probs comparable to the trainer's."""
    weight_transfer_backend: str = "gloo"
    """Weight-transfer backend: ``gloo`` on CPU (this package's plugin), ``nccl`` on GPUs."""
    max_logprobs: int = 20
    """Server cap on requested top log-probs per token; must cover ``num_sampler_logprobs + 1``."""
    enable_lora: bool = False
    """Serve LoRA adapters (runtime loading is enabled along with it)."""
    max_lora_rank: int = 16
    """Largest adapter rank the server accepts (one of 1, 8, 16, 32, 64, 128, 256, 320, 512)."""
    max_loras: int = 4
    """Adapters resident at once; the trainer needs at least ``max_staleness + 2``."""
    kv_cache_gib: int = 1
    """CPU KV-cache size in GiB (VLLM_CPU_KVCACHE_SPACE); ignored on GPUs."""
    seed: int = 0
    """Server sampling seed."""
    extra_args: list[str] = field(default_factory=list)
    """Further command-line flags, appended as given."""
    env: dict[str, str] = field(default_factory=dict)
    """Extra environment variables for the server process."""

    def command(self, port: int) -> list[str]:
        """The full command line (the CPU build has no ``vllm serve``; the module entry point works everywhere)."""
        cmd = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", os.fspath(self.model),
            "--host", self.host,
            "--port", str(port),
            "--max-model-len", str(self.max_model_len),
            "--dtype", self.dtype,
            "--seed", str(self.seed),
            "--logprobs-mode", "processed_logprobs",
            "--max-logprobs", str(self.max_logprobs),
            "--weight-transfer-config", json.dumps({"backend": self.weight_transfer_backend}),
            "--enable-scale-out",
        ]
        if self.enable_lora:
            cmd += ["--enable-lora", "--max-lora-rank", str(self.max_lora_rank), "--max-loras", str(self.max_loras)]
        return cmd + list(self.extra_args)

    def environment(self) -> dict[str, str]:
        env = dict(os.environ)
        env["VLLM_SERVER_DEV_MODE"] = "1"
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(self.kv_cache_gib))
        if self.enable_lora:
            env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "1"
        env.update(self.env)
        return env


class VLLMServer:
    """A vLLM server child process: ``start()`` waits until it serves, ``stop()`` ends its process group."""

    def __init__(self, spec: VLLMServerSpec, log_dir: str | Path):
        self.spec = spec
        self.log_path = Path(log_dir) / "vllm_server.log"
        self.port = spec.port or free_port(spec.host)
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def base_url(self) -> str:
        return f"http://{self.spec.host}:{self.port}"

    def start(self, timeout_s: float = 600.0) -> "VLLMServer":
        if self.process is not None:
            raise RuntimeError("server already started")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")
        log.write(f"$ {' '.join(self.spec.command(self.port))}\n".encode())
        log.flush()
        self.process = subprocess.Popen(
            self.spec.command(self.port),
            stdout=log,
            stderr=subprocess.STDOUT,
            env=self.spec.environment(),
            start_new_session=True,  # its own process group: stop() ends exactly what we started
        )
        log.close()
        self._wait_ready(timeout_s)
        return self

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.check_alive()
            try:
                if httpx.get(f"{self.base_url}/v1/models", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1.0)
        self.stop()
        raise VLLMServerError(f"vLLM server did not serve within {timeout_s:.0f} s\n{self.log_tail()}")

    def is_alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def check_alive(self) -> None:
        """Raise ``VLLMServerError`` with the end of the log if the server process has exited."""
        if self.process is not None and self.process.poll() is not None:
            raise VLLMServerError(
                f"vLLM server exited with code {self.process.returncode}; "
                f"log {self.log_path}:\n{self.log_tail()}"
            )

    def log_tail(self, lines: int = 40) -> str:
        try:
            text = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        return "\n".join(text[-lines:])

    def stop(self, timeout_s: float = 20.0) -> None:
        """SIGTERM the server's process group, then SIGKILL what is left after ``timeout_s``."""
        proc, self.process = self.process, None
        if proc is None or proc.poll() is not None:
            return
        for sig, wait in ((signal.SIGTERM, timeout_s), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                proc.wait(wait)
                break
            except subprocess.TimeoutExpired:
                continue
        # The engine core and workers share the group; reap any that outlived the API server.
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def __enter__(self) -> "VLLMServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

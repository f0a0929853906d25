"""Start and stop a vLLM OpenAI-compatible server as a child process, with the flags the trainer needs.

Shared by the Prefect flows, the CLI and the tests. The server runs in its own session (process
group) so that ``stop()`` ends exactly the processes it started (API server, engine core, workers)
and nothing else. Its output goes to a log file in the run's output folder; when the server dies,
``VLLMServerError`` carries the end of that log.

    with VLLMServer(VLLMServerSpec(model="path/to/model"), log_dir="out") as server:
        print(server.base_url)
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field

from grpo_core.config import LoraRank
from grpo_core.config_checks import check_fields
from grpo_core.staleness import resident_adapters
from grpo_core.vllm_lines import LINES, LineFeatures, installed_line
from grpo_core.vllm_server.control import VLLMControlClient
from grpo_core.vllm_server.cpu_placement import CpuPlacement, forked_on, format_cpus
from grpo_core.waiting import announced_wait


class VLLMServerError(RuntimeError):
    """The vLLM server failed to start or died; the message ends with the tail of its log."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


# The vLLM command-line flags and environment variables this project uses, spelled here only: the
# launch command, the Kubernetes manifests and every "restart the server with" message derive from
# them (tests/test_config.py::test_each_vllm_flag_is_spelled_in_one_module checks that no other module
# spells one).
DEV_MODE_ENV = "VLLM_SERVER_DEV_MODE"
RUNTIME_LORA_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"
CPU_KV_CACHE_ENV = "VLLM_CPU_KVCACHE_SPACE"
CPU_OMP_BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"
ENGINE_MULTIPROCESSING_ENV = "VLLM_ENABLE_V1_MULTIPROCESSING"
OMP_THREADS_ENV = "OMP_NUM_THREADS"
INSECURE_SERIALIZATION_ENV = "VLLM_ALLOW_INSECURE_SERIALIZATION"
CUDA_DEVICES_ENV = "CUDA_VISIBLE_DEVICES"
FLASHINFER_SAMPLER_ENV = "VLLM_USE_FLASHINFER_SAMPLER"
ENTRY_POINT = "vllm.entrypoints.openai.api_server"
MODEL = "--model"
HOST = "--host"
PORT = "--port"
MAX_MODEL_LEN = "--max-model-len"
DTYPE = "--dtype"
SEED = "--seed"
LOGPROBS_MODE = "--logprobs-mode"
MAX_LOGPROBS = "--max-logprobs"
WEIGHT_TRANSFER_CONFIG = "--weight-transfer-config"
ENABLE_SCALE_OUT = "--enable-scale-out"
RETURN_SAMPLING_MASK = "--return-sampling-mask"
ENABLE_LORA = "--enable-lora"
MAX_LORA_RANK = "--max-lora-rank"
MAX_LORAS = "--max-loras"
API_SERVER_COUNT = "--api-server-count"
LANGUAGE_MODEL_ONLY = "--language-model-only"
RETURN_ROUTED_EXPERTS = "--enable-return-routed-experts"
ENFORCE_EAGER = "--enforce-eager"
GPU_MEMORY_UTILIZATION = "--gpu-memory-utilization"


ServedDtype = Literal["auto", "float32", "bfloat16", "float16"]

SHARED_GPU_MEMORY_SHARE = 0.3
"""A GPU server's default memory share on the trainer's own GPU: the weights, activations and a KV cache of a
few GiB for a model up to a few billion parameters, leaving 70% to the trainer's fp32 master weights, gradients,
Adam's moments and activations (a 1.7B model's take about 28 GiB of them at 16k-token rows)."""


def training_dtype(config: Any, cuda: bool) -> ServedDtype:
    """The dtype a run with ``config`` (an ``AsyncGRPOConfig``) computes in, as vLLM's ``--dtype`` names it.

    On CUDA ``bf16=None`` counts as bf16 (the trainer turns it on where the GPU supports it; on one that does
    not, the start-up checks name the difference)."""
    if config.fp16:
        return "float16"
    return "bfloat16" if config.resolved_bf16(cuda) else "float32"


@dataclass(kw_only=True)
class ServerOptions:
    """What a user chooses about a vLLM server: the flow's managed one, or the command a start-up error prints."""

    __pydantic_config__ = ConfigDict(use_attribute_docstrings=True, extra="forbid")

    max_model_len: Annotated[int, Field(ge=16)] = 512
    """Longest prompt + completion the server accepts (sizes its KV cache per request)."""
    dtype: ServedDtype | None = None
    """Weight dtype on the server. None: the trainer's compute dtype (``training_dtype``): bfloat16 where the
    trainer trains in bf16 (the default on CUDA), float16 with ``fp16``, else float32 (the default on CPU), so
    that sampler and trainer log-probs come from the same precision; the start-up checks compare the two."""
    kv_cache_gib: Annotated[int, Field(ge=1)] = 1
    """CPU KV-cache size in GiB (``VLLM_CPU_KVCACHE_SPACE``); ignored on GPUs."""
    enable_lora: bool = False
    """Serve LoRA adapters loaded at run time (adapter-only weight sync)."""
    max_lora_rank: LoraRank = 16
    """Largest adapter rank the server accepts (one of 1, 8, 16, 32, 64, 128, 256, 320, 512)."""
    max_loras: Annotated[int, Field(ge=1)] | None = None
    """Adapters resident at once; None: the trainer's window (``grpo_core.staleness.resident_adapters``)."""
    api_server_count: Annotated[int, Field(ge=1)] = 1
    """API server processes (vLLM serialises top log-probs there). docs/gpus.md's GPU command runs 8; the managed
    server keeps 1 until the two are measured side by side on a GPU."""
    language_model_only: bool = False
    """Skip building a vision-language model's vision tower (text-only training)."""
    return_routed_experts: bool = False
    """Return the experts each token was routed to (a mixture-of-experts model; routing replay and the
    ``sampling/routing_mismatch`` metric need them; set by the model's needs, ``grpo_core.vllm_server.model_needs``)."""
    cpu_worker_in_engine: bool = True
    """A CPU server runs its one model worker inside vLLM's engine process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``)
    instead of a process of its own: one process fewer that starts and imports vLLM, so the server starts in about
    half the time and spends less CPU per generated token (benchmarks/README.md, "CPU server start-up"). The worker
    then runs ``OMP_NUM_THREADS`` threads, as many as vLLM's own binding would have given it, unless the environment
    sets it. False: vLLM's default (a worker process with its OpenMP threads bound). GPU servers are never changed:
    vLLM already runs a one-GPU server's worker in its engine process."""
    enforce_eager: bool = False
    """Run the model without vLLM's compilation (``--enforce-eager``): a faster start but slower generation for the
    Gated DeltaNet hybrid on CPU (benchmarks/README.md, "CPU server start-up"), so eager pays for a server that
    generates little (checks, short runs), compiled for one that generates for long. A server with LoRA enabled runs
    eagerly on CPU either way (vLLM's choice)."""
    cpu_placement: Literal["auto", "off"] = "auto"
    """No GPU and the server started on the trainer's machine (the flow's local provisioner): ``auto`` splits the
    cores, the trainer alone on the top half, the server and the rollout worker on the rest
    (``grpo_core.vllm_server.cpu_placement``); ``off`` leaves them all to the OS scheduler. Ignored on GPUs and clusters."""
    gpu_memory_utilization: Annotated[float, Field(gt=0, le=1)] | None = None
    """Share of its GPU's memory a GPU server may take (weights, activations, KV cache). None: vLLM's own default
    (0.9) for a server on GPUs of its own; ``SHARED_GPU_MEMORY_SHARE`` when the flow starts it on the GPU the
    trainer uses (one GPU on the machine), so that the trainer fits beside it. Ignored on CPU servers."""
    extra_args: list[str] = field(default_factory=list)
    """Further command-line flags, appended as given."""
    env: dict[str, str] = field(default_factory=dict)
    """Extra environment variables for the server process."""

    def __post_init__(self) -> None:
        check_fields(self)


@dataclass(kw_only=True)
class VLLMServerSpec(ServerOptions):
    """One server launch: the user's options plus what the run decides (model, backend, log-probs)."""

    model: str | os.PathLike[str]
    """Model folder (a path object is fine) or hub id to serve."""
    host: str = "127.0.0.1"
    """Interface to bind; loopback by default."""
    port: Annotated[int, Field(ge=0, le=65535)] = 0
    """TCP port; 0 picks a free one."""
    weight_transfer_backend: Literal["gloo", "nccl", "ipc"] = "gloo"
    """Weight-transfer backend: ``gloo`` on CPU (this package's plugin), ``nccl`` on GPUs of its own, ``ipc`` on the
    trainer's GPU (``AsyncGRPOConfig.weight_transfer_backend``)."""
    max_logprobs: Annotated[int, Field(ge=0)] = 20
    """Server cap on requested top log-probs per token; must cover ``num_sampler_logprobs + 1``."""
    return_sampling_mask: bool = False
    """Return each token's top-k/top-p candidate set (needs vLLM's V2 model runner)."""
    seed: int = 0
    """Server sampling seed."""
    dtype: ServedDtype = "float32"
    """Weight dtype of this launch; ``for_run`` sets it from ``ServerOptions.dtype``, else from the training dtype."""
    cuda: bool = False
    """The server runs on GPUs (vLLM's CUDA build); False: vLLM's CPU build."""
    gpus: str | None = None
    """The server's ``CUDA_VISIBLE_DEVICES`` (``grpo_core.vllm_server.gpu_placement``); None: the caller's."""
    vllm_line: Literal["0.32", "0.25"] | None = None
    """The vLLM line the server runs (``grpo_core.vllm_lines``: the flags differ); None: the installed vLLM's."""

    @classmethod
    def for_run(cls, model: str | os.PathLike[str], config: Any, options: ServerOptions | None = None,
                cuda: bool = False, shared_gpu: bool = False, **launch: Any) -> VLLMServerSpec:
        """The server a run with ``config`` (an ``AsyncGRPOConfig``) needs, with the user's ``options``;
        ``shared_gpu``: it runs on the trainer's own GPU (its memory share and weight-transfer backend follow)."""
        options = options or ServerOptions()
        own = {f.name: getattr(options, f.name) for f in dataclasses.fields(ServerOptions)}
        if own["enable_lora"] and own["max_loras"] is None:
            own["max_loras"] = resident_adapters(config.max_staleness)
        if own["dtype"] is None:
            own["dtype"] = training_dtype(config, cuda)
        if cuda and shared_gpu and own["gpu_memory_utilization"] is None:
            own["gpu_memory_utilization"] = SHARED_GPU_MEMORY_SHARE
        return cls(
            **own,
            model=model,
            weight_transfer_backend=config.resolved_weight_transfer_backend(cuda, shared_gpu),
            max_logprobs=max(20, config.num_sampler_logprobs + 1),
            return_sampling_mask=config.needs_candidate_sets(),
            seed=config.seed,
            cuda=cuda,
            **launch,
        )

    def for_replica(self, replica: int) -> VLLMServerSpec:
        """Server ``replica`` of a fleet started from this spec: the same flags, its own sampling seed (servers with
        one seed would draw alike from alike batches)."""
        return dataclasses.replace(self, seed=self.seed + replica)

    def command(self, port: int) -> list[str]:
        """The full command line (the CPU build has no ``vllm serve``; the module entry point works everywhere)."""
        cmd = [
            sys.executable, "-m", ENTRY_POINT,
            MODEL, os.fspath(self.model),
            HOST, self.host,
            PORT, str(port),
            *self.flags(),
        ]
        return cmd

    def flags(self) -> list[str]:
        """Every flag but the model and the address: what the trainer needs, then the user's options."""
        flags = [
            MAX_MODEL_LEN, str(self.max_model_len),
            DTYPE, self.dtype,
            SEED, str(self.seed),
            LOGPROBS_MODE, "processed_logprobs",
            MAX_LOGPROBS, str(self.max_logprobs),
            WEIGHT_TRANSFER_CONFIG, json.dumps({"backend": self.weight_transfer_backend}),
        ]
        if self.line().scale_out_flag:
            flags.append(ENABLE_SCALE_OUT)  # a 0.25 server serves the tokens route without it (vllm_lines)
        if self.cuda and self.gpu_memory_utilization is not None:
            flags += [GPU_MEMORY_UTILIZATION, str(self.gpu_memory_utilization)]
        if self.return_sampling_mask:
            flags.append(RETURN_SAMPLING_MASK)
        if self.api_server_count > 1:
            flags += [API_SERVER_COUNT, str(self.api_server_count)]
        if self.language_model_only:
            flags.append(LANGUAGE_MODEL_ONLY)
        if self.return_routed_experts:
            flags.append(RETURN_ROUTED_EXPERTS)
        if self.enforce_eager:
            flags.append(ENFORCE_EAGER)
        if self.enable_lora:
            flags += [ENABLE_LORA, MAX_LORA_RANK, str(self.max_lora_rank)]
            if self.max_loras is not None:
                flags += [MAX_LORAS, str(self.max_loras)]
        return flags + list(self.extra_args)

    def server_environment(self) -> dict[str, str]:
        """The variables the server needs beyond the caller's environment."""
        env = {DEV_MODE_ENV: "1", CPU_KV_CACHE_ENV: os.environ.get(CPU_KV_CACHE_ENV, str(self.kv_cache_gib))}
        if self.enable_lora:
            env[RUNTIME_LORA_ENV] = "1"
        if self.runs_worker_in_engine:
            env[ENGINE_MULTIPROCESSING_ENV] = "0"
        if self.weight_transfer_backend == "ipc":
            env[INSECURE_SERIALIZATION_ENV] = "1"  # the IPC engine unpickles the handles it is posted (ipc_trainer)
        if self.gpus is not None:
            env[CUDA_DEVICES_ENV] = self.gpus
        if self.cuda and FLASHINFER_SAMPLER_ENV not in os.environ and importlib.util.find_spec("flashinfer") is None:
            # vLLM's GPU sampler imports FlashInfer unless told not to, and its engine fails to start without it
            # (the 0.25 line on an H100); FlashInfer is an optional kernel package, so sample with vLLM's own.
            env[FLASHINFER_SAMPLER_ENV] = "0"
        return {**env, **self.env}

    def line(self) -> LineFeatures:
        """The features of the vLLM line this server runs (``vllm_line``, else the installed one's)."""
        return LINES[self.vllm_line] if self.vllm_line is not None else installed_line()

    @property
    def runs_worker_in_engine(self) -> bool:
        """Whether vLLM's one model worker runs inside the engine process (``cpu_worker_in_engine`` on a CPU server)."""
        return self.cpu_worker_in_engine and not self.cuda

    def environment(self) -> dict[str, str]:
        return {**os.environ, **self.server_environment()}

    def shell_command(self) -> str:
        """The launch as a shell command for a person to run (in "restart the server with" messages)."""
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in self.server_environment().items() if k != CPU_KV_CACHE_ENV)
        words = ["python", "-m", ENTRY_POINT, MODEL, os.fspath(self.model), *self.flags()]
        lines, line = [], f"{env} {words[0]} {words[1]} {words[2]}"
        rest = words[3:]
        i = 0
        while i < len(rest):
            # One flag per line, with its value when it has one.
            word = shlex.quote(rest[i])
            if i + 1 < len(rest) and not rest[i + 1].startswith("--"):
                word += " " + shlex.quote(rest[i + 1])
                i += 1
            lines.append(line)
            line = "    " + word
            i += 1
        lines.append(line)
        return " \\\n".join(lines)


class VLLMServer:
    """A vLLM server child process: ``start()`` waits until it serves, ``stop()`` ends its process group.

    ``placement`` (a ``CpuPlacement``, CPU servers only): the server's processes start on its generation cores
    and its engine binds its OpenMP threads to the placement's engine cores."""

    def __init__(self, spec: VLLMServerSpec, log_dir: str | Path, placement: CpuPlacement | None = None):
        self.spec = spec
        self.placement = placement
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
        env = self.spec.environment()
        if self.placement is not None:
            env[CPU_OMP_BIND_ENV] = format_cpus(self.placement.engine)
            log.write(f"# cpu placement: {self.placement.describe()}\n".encode())
            log.flush()
        if self.spec.runs_worker_in_engine and OMP_THREADS_ENV not in env:
            env[OMP_THREADS_ENV] = str(self.engine_threads())
        with forked_on(self.placement.generation if self.placement is not None else None):
            self.process = subprocess.Popen(
                self.spec.command(self.port),
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,  # its own process group: stop() ends exactly what we started
            )
        log.close()
        self._wait_ready(timeout_s)
        return self

    def engine_threads(self) -> int:
        """OpenMP threads of a worker that runs in the engine process: the placement's engine cores, else what
        vLLM's own binding gives a worker process (every core this process may use but one, kept for the API
        server and the engine's scheduling)."""
        if self.placement is not None:
            return len(self.placement.engine)
        return max(1, len(os.sched_getaffinity(0)) - 1)

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        client = VLLMControlClient(self.base_url)
        hint = (f"its log is {self.log_path}; a CPU server takes 1-3 min to start on two cores, so if the log stops "
                "moving for longer, read it and stop the run")
        try:
            with announced_wait(f"the vLLM server to start at {self.base_url}", timeout_s, hint,
                                detail=lambda: f"its log: {self.last_log_line()}"):
                while time.monotonic() < deadline:
                    self.check_alive()
                    if client.answers("/v1/models", timeout=2.0):
                        return
                    time.sleep(1.0)
        finally:
            client.close()
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

    def last_log_line(self, width: int = 120) -> str:
        """The log's last non-empty line, cut to ``width`` characters (what the server is doing now)."""
        tail = [line for line in self.log_tail(5).splitlines() if line.strip()]
        return tail[-1].strip()[:width] if tail else "(empty)"

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

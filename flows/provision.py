"""Where the flow's processes run, behind one small interface.

``LocalProvisioner`` starts the vLLM servers and the training processes as children of the flow (the
embedded default, a process work pool). A cluster implementation renders the same two things as
Kubernetes jobs (see ``flows/kubernetes.py``). The flow only calls ``start_server`` (once per replica of a
fleet), ``server_alive``, ``restart_server``, ``stop_server`` and ``run_training``, so its code is the same for
both. A restarted server keeps its URL, so the trainers find it where it was.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shlex
import signal
import subprocess
import sys
import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from grpo_core.vllm_server.cpu_placement import CpuPlacement, forked_on, joined, resolve_placement
from grpo_core.vllm_server.gpu_placement import GpuPlacement, place_on_gpus, visible_gpus
from grpo_core.vllm_server.process import VLLMServer, VLLMServerSpec

log = logging.getLogger(__name__)


@dataclass
class TrainingLaunch:
    """One training attempt on one node: the entry point's arguments and the topology.

    With ``nnodes > 1`` every node runs the same launch but for ``node_rank``, under torchrun's static
    rendezvous: node 0 hosts it at ``rendezvous_address:rendezvous_port`` and holds trainer rank 0 (the
    rank that talks to vLLM and writes ``result_file``); the other nodes dial it there.
    """

    job_file: str
    """The ``JobConfig`` as a JSON file every node reads."""
    server_url: str
    """The vLLM server's base URL; a fleet's servers' URLs joined by commas."""
    model_path: str
    """The resolved model folder (so no node resolves ``job.model`` again)."""
    mlflow_run_id: str | None
    """The MLflow run rank 0 logs into; None: the job's own tracking settings."""
    tracking_uri: str | None
    """The MLflow tracking URI; None: MLflow's default."""
    result_file: str
    """Where rank 0 writes the result JSON (metric history, final step)."""
    nproc_per_node: int = 1
    """Training processes on each node (torchrun ``--nproc-per-node``)."""
    nnodes: int = 1
    """Training nodes (torchrun ``--nnodes``)."""
    node_rank: int = 0
    """This node's rank, ``0 <= node_rank < nnodes`` (torchrun ``--node-rank``); node 0 hosts the rendezvous."""
    rendezvous_address: str | None = None
    """With ``nnodes > 1``: node 0's address as every node reaches it (torchrun ``--master-addr``); required there."""
    rendezvous_port: int = 29500
    """With ``nnodes > 1``: the port node 0 listens on for the rendezvous (torchrun ``--master-port``)."""
    log_file: str | None = None
    """This node's log (appended to); None: the output goes to the flow's stdout only."""

    def __post_init__(self) -> None:
        if self.nproc_per_node < 1 or self.nnodes < 1:
            raise ValueError(f"nproc_per_node={self.nproc_per_node}, nnodes={self.nnodes}: both must be >= 1")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank={self.node_rank} is outside 0..{self.nnodes - 1} (nnodes={self.nnodes})")
        if not 1 <= self.rendezvous_port <= 65535:
            raise ValueError(f"rendezvous_port={self.rendezvous_port}: need 1 <= port <= 65535")

    @property
    def world_size(self) -> int:
        return self.nproc_per_node * self.nnodes

    def for_node(self, node_rank: int) -> "TrainingLaunch":
        """The same launch as node ``node_rank`` runs it."""
        return dataclasses.replace(self, node_rank=node_rank)

    def entry_args(self) -> list[str]:
        """``-m grpo_core.launch JOB --server-url ...``: the training entry point, the same on every node."""
        entry = ["-m", "grpo_core.launch", self.job_file, "--server-url", self.server_url,
                 "--model-path", self.model_path, "--result", self.result_file]
        if self.mlflow_run_id:
            entry += ["--mlflow-run-id", self.mlflow_run_id]
        if self.tracking_uri:
            entry += ["--tracking-uri", self.tracking_uri]
        return entry

    def torchrun_args(self, node_rank: str | None = None) -> list[str]:
        """torchrun's options for this topology (the program's arguments follow them).

        ``node_rank`` stands in for ``self.node_rank`` where the cluster fills it in per node (a
        Kubernetes Indexed Job passes ``$(NODE_RANK)``).
        """
        topology = [f"--nnodes={self.nnodes}", f"--nproc-per-node={self.nproc_per_node}"]
        if self.nnodes == 1:
            # A rendezvous on a free local port, so two runs on one machine never share 29500.
            return ["--standalone", *topology]
        if not self.rendezvous_address:
            raise ValueError(
                f"nnodes={self.nnodes} needs rendezvous_address: node 0's address as the other nodes reach it "
                "(the job's rendezvous_address)"
            )
        rank = str(self.node_rank) if node_rank is None else node_rank
        return [*topology, f"--node-rank={rank}", f"--master-addr={self.rendezvous_address}",
                f"--master-port={self.rendezvous_port}"]

    def command(self) -> list[str]:
        """This node's command line: the entry point alone for one process, else under torchrun."""
        if self.world_size == 1:
            return [sys.executable, *self.entry_args()]
        return [sys.executable, "-m", "torch.distributed.run", *self.torchrun_args(), *self.entry_args()]


class Provisioner(ABC):
    @abstractmethod
    def start_server(self, spec: VLLMServerSpec, log_dir: str, timeout_s: float, replica: int = 0,
                     replicas: int = 1) -> str:
        """Start server ``replica`` of ``replicas`` and return its base URL once it serves."""

    @abstractmethod
    def server_alive(self, base_url: str) -> bool: ...

    @abstractmethod
    def restart_server(self, base_url: str, timeout_s: float) -> None:
        """Start the server at ``base_url`` again, from its spec, at the same URL (after it died); returns once it serves."""

    @abstractmethod
    def stop_server(self, base_url: str) -> None: ...

    @abstractmethod
    def run_training(self, launch: TrainingLaunch, on_start: Callable[[int], None] | None = None) -> int:
        """Run one training attempt to completion; return its exit code (negative: killed by signal)."""

    @abstractmethod
    def trains_on_gpu(self) -> bool:
        """Whether the trainers run on CUDA devices (their weight-transfer backend is then NCCL or CUDA IPC)."""

    def gpu_placement(self, trainer_processes: int) -> GpuPlacement | None:
        """The GPUs of a managed server and of the trainers, where this provisioner places both on one machine
        (None: the cluster's scheduler places them, or there is no GPU)."""
        return None


class LocalProvisioner(Provisioner):
    """Child processes on this machine; the server and trainers are stopped with the flow.

    Without a GPU, the server it starts and the trainers that use it split the cores
    (``ServerOptions.cpu_placement="auto"``, ``grpo_core.vllm_server.cpu_placement.embedded_placement``): the trainers alone on
    the top half, the server's processes and the rollout worker on the rest. Left to the scheduler, a one-thread
    trainer's forward/backward beside a generating server took 4x its time alone (``benchmarks/trainer/cpu_share.py``)."""

    def __init__(self) -> None:
        self.servers: dict[str, VLLMServer] = {}

    def start_server(self, spec: VLLMServerSpec, log_dir: str, timeout_s: float, replica: int = 0,
                     replicas: int = 1) -> str:
        placement = resolve_placement(spec.cpu_placement, cuda=_has_cuda(), server_started_here=True,
                                      replica=replica, replicas=replicas)
        if placement is not None:
            log.info("cpu placement%s: %s", f" of server {replica}" if replicas > 1 else "", placement.describe())
        # A fleet's servers log side by side; a single server where it always has.
        folder = Path(log_dir) / f"server-{replica}" if replicas > 1 else Path(log_dir)
        server = VLLMServer(spec, folder, placement=placement).start(timeout_s)
        self.servers[server.base_url] = server
        return server.base_url

    def restart_server(self, base_url: str, timeout_s: float) -> None:
        server = self.servers[base_url]
        server.stop()  # whatever is left of its process group
        server.start(timeout_s)  # the same spec, placement, log and port

    def placement_for(self, server_url: str) -> CpuPlacement | None:
        """The core split of the server(s) at ``server_url`` (a fleet: URLs joined by commas) when this provisioner
        started them placed, else None."""
        placements = [getattr(self.servers.get(url), "placement", None) for url in server_url.split(",")]
        if not placements or any(p is None for p in placements):
            return None
        return joined(placements)

    def server_alive(self, base_url: str) -> bool:
        server = self.servers.get(base_url)
        return server is not None and server.is_alive()

    def trains_on_gpu(self) -> bool:
        return _has_cuda()

    def gpu_placement(self, trainer_processes: int) -> GpuPlacement | None:
        gpus = visible_gpus()
        return place_on_gpus(gpus, trainer_processes) if gpus else None

    def stop_server(self, base_url: str) -> None:
        server = self.servers.pop(base_url, None)
        if server is not None:
            server.stop()

    def training_env(self, launch: TrainingLaunch) -> dict[str, str]:
        """The trainers' environment. With no GPU and the server on this machine (one this
        provisioner started, or any on a loopback address), both share the CPU cores: the vLLM CPU
        worker binds its OpenMP threads to them, and trainers that also spin one OpenMP thread per
        core stall each other's barriers (a forward+backward took many times as long beside a busy server:
        benchmarks/README.md, "Where the CPU goes beside a local CPU server, and the core split"). The trainers
        then get half the cores between them, unless ``OMP_NUM_THREADS``
        is set already. A server this provisioner started placed also names the rollout worker's cores
        (``GRPO_ROLLOUT_CPUS``); ``run_training`` starts the trainers on the others."""
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        gpus = self.gpu_placement(launch.nproc_per_node)
        if gpus is not None and launch.nnodes == 1:
            env["CUDA_VISIBLE_DEVICES"] = gpus.trainer_devices()
        placement = self.placement_for(launch.server_url)
        if placement is not None:
            placed = placement.trainer_environment(launch.nproc_per_node)
            if "OMP_NUM_THREADS" in env:
                placed.pop("OMP_NUM_THREADS")
            return {**env, **placed}
        urls = launch.server_url.split(",")
        local_server = any(url in self.servers or _is_loopback(url) for url in urls)
        if local_server and "OMP_NUM_THREADS" not in env and not _has_cuda():
            env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 2) // 2 // launch.nproc_per_node))
        return env

    def run_training(self, launch: TrainingLaunch, on_start: Callable[[int], None] | None = None) -> int:
        """Run ``launch``'s node here. Of a multi-node launch that is one node (the flow's is node 0):
        the other nodes' commands are logged, for whoever starts them on their machines."""
        if launch.nnodes > 1 and launch.node_rank == 0:
            for rank in range(1, launch.nnodes):
                command = shlex.join(launch.for_node(rank).command())
                log.info("training node_rank %d of %d runs: %s", rank, launch.nnodes, command)
        log_path = Path(launch.log_file) if launch.log_file else None
        log_out = open(log_path, "ab") if log_path else None
        placement = self.placement_for(launch.server_url)
        # On a placed machine the trainers (torchrun's ranks too) start on the trainer cores; their rollout
        # worker moves to the generation cores when it starts (GRPO_ROLLOUT_CPUS).
        with forked_on(placement.trainer if placement is not None else None):
            proc = subprocess.Popen(
                launch.command(),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own group: a kill reaches torchrun's ranks too
                env=self.training_env(launch),
            )
        if on_start is not None:
            on_start(proc.pid)
        pump = threading.Thread(target=_pump, args=(proc.stdout, log_out), daemon=True)
        pump.start()
        try:
            code = proc.wait()
        except BaseException:
            _kill_group(proc.pid)
            proc.wait()
            raise
        finally:
            pump.join(timeout=5)
            if log_out is not None:
                log_out.close()
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

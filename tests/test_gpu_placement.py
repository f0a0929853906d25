"""A run's GPUs: the server and the trainer on one GPU (CUDA IPC pushes) or on GPUs of their own (NCCL), the vLLM
lines' launch differences, and the flow's one resolution of the backend they must agree on. CPU only: the
placement and the launch are pure; the GPU run itself is benchmarks/device/e2e_gpu.py."""

from __future__ import annotations

import pytest

from flows.placement import place_on_machine, server_spec
from grpo_core.config import AsyncGRPOConfig
from grpo_core.config_checks import ConfigError
from grpo_core.launch.job import JobConfig
from grpo_core.vllm_lines import LINES, installed_line, line_of
from grpo_core.vllm_server.gpu_placement import GpuPlacement, place_on_gpus
from grpo_core.vllm_server.process import SHARED_GPU_MEMORY_SHARE, VLLMServerSpec


def test_one_gpu_is_shared_and_more_give_the_server_its_own():
    one = place_on_gpus([0], 1)
    assert one.shared and one.server_devices() == "0" and one.trainer_devices() == "0"
    four = place_on_gpus([4, 5, 6, 7], 2)
    assert not four.shared and four.server_devices() == "4" and four.trainer_devices() == "5,6"
    with pytest.raises(ValueError, match="nproc_per_node=2 trainers on one GPU"):
        place_on_gpus([0], 2)
    with pytest.raises(ValueError, match="at most 1"):
        place_on_gpus([0, 1], 2)


def test_backend_follows_the_placement_unless_set():
    config = AsyncGRPOConfig(output_dir="/tmp/x")
    assert config.resolved_weight_transfer_backend(False) == "gloo"
    assert config.resolved_weight_transfer_backend(True) == "nccl"
    assert config.resolved_weight_transfer_backend(True, shared_gpu=True) == "ipc"
    assert AsyncGRPOConfig(output_dir="/tmp/x", weight_transfer_backend="gloo").resolved_weight_transfer_backend(
        True, shared_gpu=True) == "gloo"
    with pytest.raises(ConfigError, match="weight_transfer_backend"):
        AsyncGRPOConfig(output_dir="/tmp/x", weight_transfer_backend="nccl").resolved_weight_transfer_backend(
            True, shared_gpu=True)
    with pytest.raises(ConfigError, match="weight_sync_encoding"):
        AsyncGRPOConfig(output_dir="/tmp/x", weight_transfer_backend="ipc", weight_sync_encoding="delta")


class OneGpuMachine:
    """The provisioner's view of a machine with one GPU (nothing is started)."""

    def __init__(self, gpus: list[int]):
        self.gpus = gpus

    def trains_on_gpu(self) -> bool:
        return True

    def gpu_placement(self, trainer_processes: int) -> GpuPlacement:
        return place_on_gpus(self.gpus, trainer_processes)


def test_the_flow_places_the_server_on_the_trainers_gpu(tmp_path):
    job = JobConfig.model_validate({"trainer": {"output_dir": str(tmp_path)}})
    placed = place_on_machine(job, OneGpuMachine([0]))
    assert job.trainer.weight_transfer_backend is None  # the user's job is not changed in place
    assert placed.trainer.weight_transfer_backend == "ipc"
    spec = server_spec(placed, str(tmp_path), OneGpuMachine([0]))
    assert spec.cuda and spec.gpus == "0" and spec.weight_transfer_backend == "ipc"
    assert spec.gpu_memory_utilization == SHARED_GPU_MEMORY_SHARE
    assert spec.server_environment()["VLLM_ALLOW_INSECURE_SERIALIZATION"] == "1"
    assert spec.server_environment()["CUDA_VISIBLE_DEVICES"] == "0"
    flags = spec.flags()
    assert flags[flags.index("--gpu-memory-utilization") + 1] == str(SHARED_GPU_MEMORY_SHARE)
    assert '{"backend": "ipc"}' in flags


def test_two_gpus_keep_nccl_and_the_servers_own_memory(tmp_path):
    job = JobConfig.model_validate({"trainer": {"output_dir": str(tmp_path)}})
    placed = place_on_machine(job, OneGpuMachine([0, 1]))
    assert placed.trainer.weight_transfer_backend == "nccl"
    spec = server_spec(placed, str(tmp_path), OneGpuMachine([0, 1]))
    assert spec.gpus == "0" and spec.gpu_memory_utilization is None and "--gpu-memory-utilization" not in spec.flags()


def test_the_lines_differ_in_the_launch():
    assert line_of("0.25.0") == LINES["0.25"] and line_of("0.32.0+cpu") == LINES["0.32"]
    assert line_of("0.33.1") == LINES["0.32"]
    with pytest.raises(ValueError, match="older than the oldest supported line"):
        line_of("0.22.0")
    with pytest.raises(ValueError, match="not a version number"):
        line_of("main")
    assert installed_line() == LINES["0.32"]  # the lock's CPU build
    old = VLLMServerSpec(model="m", cuda=True, vllm_line="0.25")
    new = VLLMServerSpec(model="m", cuda=True, vllm_line="0.32")
    assert "--enable-scale-out" not in old.flags() and "--enable-scale-out" in new.flags()

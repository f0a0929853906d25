"""How a vLLM server is launched (grpo_core.vllm_server.process and model_needs): a CPU server runs its worker in the
engine process with a bounded thread count, eager where the model's compile warm-up is long, and GPU servers are
left to vLLM's own defaults."""

from __future__ import annotations

import os

import pytest

from grpo_core.vllm_server.cpu_placement import CpuPlacement
from grpo_core.vllm_server.process import (
    ENFORCE_EAGER,
    ENGINE_MULTIPROCESSING_ENV,
    ServerOptions,
    VLLMServer,
    VLLMServerSpec,
)

def test_a_cpu_server_runs_its_worker_in_the_engine_process() -> None:
    spec = VLLMServerSpec(model="m")
    assert spec.server_environment()[ENGINE_MULTIPROCESSING_ENV] == "0"
    assert f"{ENGINE_MULTIPROCESSING_ENV}=0" in spec.shell_command()  # the printed command starts it the same way


@pytest.mark.parametrize("spec", [VLLMServerSpec(model="m", cuda=True), VLLMServerSpec(model="m", cpu_worker_in_engine=False)],
                         ids=["gpu", "opted-out"])
def test_a_gpu_server_or_an_opt_out_keeps_vllms_worker_process(spec: VLLMServerSpec) -> None:
    assert ENGINE_MULTIPROCESSING_ENV not in spec.server_environment()


def test_the_in_engine_worker_takes_the_placements_engine_cores_or_all_but_one() -> None:
    placed = VLLMServer(VLLMServerSpec(model="m"), "/tmp/unused",
                        placement=CpuPlacement(trainer=(3,), generation=(0, 1, 2), engine=(0, 1)))
    assert placed.engine_threads() == 2
    unplaced = VLLMServer(VLLMServerSpec(model="m"), "/tmp/unused")
    assert unplaced.engine_threads() == max(1, len(os.sched_getaffinity(0)) - 1)


@pytest.mark.parametrize("eager", [False, True])
def test_enforce_eager_reaches_the_command_only_when_chosen(eager: bool) -> None:
    assert (ENFORCE_EAGER in VLLMServerSpec(model="m", enforce_eager=eager).flags()) is eager


def test_for_run_passes_the_device_on() -> None:
    from grpo_core.config import AsyncGRPOConfig

    config = AsyncGRPOConfig(output_dir="/tmp/unused")
    assert VLLMServerSpec.for_run("m", config, ServerOptions(), cuda=True).cuda is True
    assert VLLMServerSpec.for_run("m", config, ServerOptions(), cuda=False).cuda is False

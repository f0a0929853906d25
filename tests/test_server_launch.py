"""How a vLLM server is launched (grpo_core.vllm_server.process and model_needs): a CPU server runs its worker in the
engine process with a bounded thread count, eager where the model's compile warm-up is long, and GPU servers are
left to vLLM's own defaults."""

from __future__ import annotations

import os

import pytest
from transformers import Qwen3Config, Qwen3MoeConfig

from grpo_core.vllm_server.cpu_placement import CpuPlacement
from grpo_core.vllm_server.model_needs import server_preferences
from grpo_core.vllm_server.process import (
    ENFORCE_EAGER,
    ENGINE_MULTIPROCESSING_ENV,
    ServerOptions,
    VLLMServer,
    VLLMServerSpec,
)

SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
             num_key_value_heads=1, head_dim=16)


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


@pytest.mark.parametrize("eager,flagged", [(None, False), (False, False), (True, True)])
def test_enforce_eager_reaches_the_command_only_when_chosen(eager: bool | None, flagged: bool) -> None:
    assert (ENFORCE_EAGER in VLLMServerSpec(model="m", enforce_eager=eager).flags()) is flagged


def test_only_a_cpu_server_for_moe_or_gated_delta_layers_prefers_eager() -> None:
    moe = Qwen3MoeConfig(**SMALL, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
    dense = Qwen3Config(**SMALL)
    assert {k: v for k, (v, _) in server_preferences(moe, cuda=False).items()} == {"enforce_eager": True}
    assert server_preferences(moe, cuda=True) == {}
    assert server_preferences(dense, cuda=False) == {}


def test_for_run_passes_the_device_on() -> None:
    from grpo_core.config import AsyncGRPOConfig

    config = AsyncGRPOConfig(output_dir="/tmp/unused")
    assert VLLMServerSpec.for_run("m", config, ServerOptions(), cuda=True).cuda is True
    assert VLLMServerSpec.for_run("m", config, ServerOptions(), cuda=False).cuda is False

"""The configuration: every field is read somewhere, every bound is enforced at construction, every
vLLM flag is spelled in one module, and the job file, the Prefect form and the library agree."""

from __future__ import annotations

import ast
import dataclasses
import re
import typing
from pathlib import Path

import pytest
from pydantic import TypeAdapter

from grpo_core.config import TRL_COMPATIBILITY_ONLY, AsyncGRPOConfig, ConfigError, field_names
from grpo_core.launch.job import JobConfig, ServerParams, TrackingParams
from grpo_core.vllm_server.process import ServerOptions, VLLMServerSpec

REPO = Path(__file__).resolve().parents[1]
SOURCES = [p for p in (REPO / "grpo_core").rglob("*.py")] + [p for p in (REPO / "flows").rglob("*.py")]


CHECKS = {"__post_init__", "_check_relations", "check_fields", "fail_field"}


def attributes_read() -> set[str]:
    """Names read as ``x.<name>`` anywhere in the package, except inside the config's own checks
    (which read every field); a ``resolved_*`` method of the config counts when something calls it."""
    names: set[str] = set()
    for path in SOURCES:
        tree = ast.parse(path.read_text())
        skipped = {id(n) for f in ast.walk(tree) if isinstance(f, ast.FunctionDef) and f.name in CHECKS for n in ast.walk(f)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load) and id(node) not in skipped:
                names.add(node.attr)
    return names


@pytest.mark.parametrize("owner", [AsyncGRPOConfig, ServerParams, TrackingParams, JobConfig])
def test_every_field_is_read_somewhere(owner):
    # A field that nothing reads is a setting that does nothing. TRL-compatibility fields are listed
    # and documented.
    read = attributes_read()
    fields = [f.name for f in dataclasses.fields(owner)] if dataclasses.is_dataclass(owner) else list(owner.model_fields)
    unread = [name for name in fields if name not in read and name not in TRL_COMPATIBILITY_ONLY]
    assert not unread, f"{owner.__name__} fields nothing reads: {unread}"


def test_trl_compatibility_fields_are_documented():
    readme = (REPO / "README.md").read_text()
    for name in TRL_COMPATIBILITY_ONLY:
        assert f"`{name}`" in readme, f"{name} is accepted for TRL compatibility only; the README must say so"


def bounded_fields() -> list[tuple[str, object]]:
    """(field, a value its declared bounds or choices refuse), derived from the annotations."""
    hints = typing.get_type_hints(AsyncGRPOConfig, include_extras=True)
    cases = []
    for name in field_names():
        schema = TypeAdapter(hints[name]).json_schema()
        options = schema.get("anyOf", [schema])
        for option in options:
            if "minimum" in option:
                cases.append((name, option["minimum"] - 1))
            elif "exclusiveMinimum" in option:
                cases.append((name, option["exclusiveMinimum"]))
            elif "maximum" in option:
                cases.append((name, option["maximum"] + 1))
            elif "exclusiveMaximum" in option:
                cases.append((name, option["exclusiveMaximum"]))
            elif "enum" in option and option.get("type") == "string":
                cases.append((name, "no-such-choice"))
            elif "pattern" in option:
                cases.append((name, "not matching"))
            else:
                continue
            break
    return cases


BOUNDED = bounded_fields()


def test_the_bounded_fields_are_found():
    names = {name for name, _ in BOUNDED}
    assert {"learning_rate", "epsilon", "num_generations", "packing", "lr_scheduler_type", "top_p",
            "vllm_importance_sampling_clip_max", "weight_transfer_port_range"} <= names
    assert len(BOUNDED) >= 40


@pytest.mark.parametrize("name,value", BOUNDED, ids=[name for name, _ in BOUNDED])
def test_each_bounded_field_is_refused_at_construction_naming_it(name, value):
    with pytest.raises(ConfigError, match=rf"AsyncGRPOConfig\.{name}="):
        AsyncGRPOConfig(**{name: value})


def test_types_are_checked_strictly_and_nothing_is_rewritten():
    with pytest.raises(ConfigError, match="fsdp_cpu_offload"):
        AsyncGRPOConfig(fsdp_cpu_offload="yes")
    with pytest.raises(ConfigError, match="max_steps"):
        AsyncGRPOConfig(max_steps=True)
    config = AsyncGRPOConfig(learning_rate=3e-6, bf16=None, weight_transfer_backend=None)
    assert config.bf16 is None and config.weight_transfer_backend is None  # resolved, never overwritten
    assert config.resolved_weight_transfer_backend(cuda=True) == "nccl"
    assert config.resolved_weight_transfer_backend(cuda=False) == "gloo"


def test_unknown_keys_are_refused_with_the_closest_name():
    with pytest.raises(ConfigError, match="did you mean 'learning_rate'"):
        AsyncGRPOConfig.from_dict({"learnig_rate": 1e-6})
    with pytest.raises(ValueError, match="did you mean 'max_loras'"):
        JobConfig.model_validate({"server": {"maxloras": 4}})
    with pytest.raises(ValueError, match="did you mean 'max_staleness'"):
        JobConfig.model_validate({"trainer": {"max_stalenes": 1}})


def test_a_subclass_in_a_script_is_checked_the_same_way():
    @dataclasses.dataclass
    class CurriculumConfig(AsyncGRPOConfig):
        pass_rate_cap: float = 0.9

    assert CurriculumConfig(pass_rate_cap=0.5).pass_rate_cap == 0.5
    with pytest.raises(ConfigError, match="pass_rate_cap"):
        CurriculumConfig(pass_rate_cap="high")
    with pytest.raises(ConfigError, match="learning_rate"):
        CurriculumConfig(learning_rate=0)


def test_the_job_form_carries_the_trainer_fields_with_their_docs_and_bounds():
    schema = JobConfig.model_json_schema()
    trainer = schema["$defs"]["AsyncGRPOConfig"]["properties"]
    assert set(trainer) == set(field_names())
    assert trainer["learning_rate"]["exclusiveMinimum"] == 0
    assert "Peak AdamW learning rate" in trainer["learning_rate"]["description"]
    assert trainer["packing"]["enum"] == ["tree", "flat"]
    assert all(prop.get("description") for prop in trainer.values()), "every field has a docstring"
    server = schema["$defs"]["ServerParams"]["properties"]
    assert {f.name for f in dataclasses.fields(ServerOptions)} <= set(server)


def test_the_loss_takes_its_settings_from_the_config():
    from grpo_core.training.loss import LossConfig

    loss = LossConfig.from_config(AsyncGRPOConfig())
    assert loss.score_centering_weights == AsyncGRPOConfig().score_centering_weights
    assert LossConfig.from_config(AsyncGRPOConfig(num_sampler_logprobs=0)).score_centering is False
    with pytest.raises(TypeError):
        LossConfig()  # no defaults of its own to drift from the config's


# vLLM's flags and variables, spelled only in grpo_core/vllm_server/process.py (one source for launches and messages).
VLLM_SPELLINGS = ["--enable-scale-out", "--logprobs-mode", "--max-logprobs", "--weight-transfer-config",
                  "--return-sampling-mask", "--enable-lora", "--max-lora-rank", "--max-loras", "--max-model-len",
                  "--api-server-count", "--language-model-only", "--enable-return-routed-experts", "VLLM_SERVER_DEV_MODE", "VLLM_ALLOW_RUNTIME_LORA_UPDATING",
                  "vllm.entrypoints.openai.api_server"]


@pytest.mark.parametrize("spelling", VLLM_SPELLINGS)
def test_each_vllm_flag_is_spelled_in_one_module(spelling):
    modules = sorted(str(p.relative_to(REPO)) for p in SOURCES if spelling in p.read_text())
    assert modules == ["grpo_core/vllm_server/process.py"], modules


# HTTP requests outside the vLLM client: the Kubernetes API client (not a vLLM server).
HTTP_CALL = re.compile(r"\bhttpx\.(get|post|put|delete|request|stream|Client|AsyncClient)\(")
# The vLLM clients, the Kubernetes API client, and grpo ui's check that the MLflow UI it started answers.
HTTP_CLIENT_MODULES = ["flows/kubernetes.py", "grpo_core/rollout/generation.py", "grpo_core/tracking/ui.py",
                       "grpo_core/vllm_server/control.py"]


def test_every_vllm_server_request_goes_through_the_client_modules():
    modules = sorted(str(p.relative_to(REPO)) for p in SOURCES if HTTP_CALL.search(p.read_text()))
    assert modules == HTTP_CLIENT_MODULES, modules


def test_a_server_that_is_not_there_does_not_answer_and_raises_nothing():
    from grpo_core.vllm_server.control import VLLMControlClient

    client = VLLMControlClient("http://127.0.0.1:9")
    assert client.answers("/v1/models") is False and client.answers("/health", timeout=0.5) is False
    client.close()


def test_launch_and_restart_message_are_the_same_command():
    spec = VLLMServerSpec.for_run("Qwen/Qwen3-4B", AsyncGRPOConfig(top_k=20), ServerOptions(enable_lora=True), cuda=True)
    launched = spec.command(8000)
    shown = spec.shell_command()
    for flag in spec.flags():
        assert flag in shown or flag.replace('"', '\\"') in shown or re.escape(flag) in shown, flag
    assert "--return-sampling-mask" in launched and '{"backend": "nccl"}' in launched
    assert launched[launched.index("--max-loras") + 1] == str(AsyncGRPOConfig().max_staleness + 2)

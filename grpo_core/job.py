"""``JobConfig``: one training job (model, data, rewards, server, tracking, trainer), typed for the UI.

It is the parameter model of the Prefect flow and the schema of ``grpo train CONFIG.yaml``. The
trainer part is an ``AsyncGRPOConfig`` whose own checks run during validation, so a bad value is
rejected before anything starts, naming the field. Names of functions and datasets are import
strings (``package.module:function``) so a job pickles and serialises as plain text.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic.dataclasses import dataclass as pydantic_dataclass

from grpo_core.config import AsyncGRPOConfig

TrainerConfig = pydantic_dataclass(AsyncGRPOConfig, config=ConfigDict(extra="forbid"))
"""``AsyncGRPOConfig`` validated by pydantic: field types checked, then its own ``validate()``."""


class ServerParams(BaseModel):
    """The vLLM server: started by the flow (``managed``) or an existing one at ``base_url``."""

    model_config = ConfigDict(extra="forbid")

    managed: bool = Field(True, description="Start the server as a child process and stop it at the end.")
    base_url: str | None = Field(None, description="URL of an existing server (when managed is false).")
    max_model_len: int = Field(512, ge=16, description="Longest prompt + completion the server accepts.")
    dtype: str = Field("float32", description="Server weight dtype (float32 on CPU; bfloat16 on GPUs).")
    kv_cache_gib: int = Field(1, ge=1, description="CPU KV-cache size in GiB.")
    enable_lora: bool = Field(False, description="Serve LoRA adapters (adapter-only weight sync).")
    max_lora_rank: int = Field(16, description="Largest adapter rank the server accepts.")
    max_loras: int = Field(6, ge=1, description="Adapters resident at once (>= max_staleness + 2).")
    startup_timeout_s: float = Field(600.0, gt=0, description="Seconds to wait for the server to serve.")
    extra_args: list[str] = Field(default_factory=list, description="Further vLLM command-line flags.")


class TrackingParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    tracking_uri: str | None = Field(None, description="MLflow tracking URI; default: a SQLite store in output_dir.")
    experiment: str = Field("grpo", description="MLflow experiment name.")
    system_metrics: bool = Field(True, description="Log CPU/GPU/memory system metrics with the run.")


class JobConfig(BaseModel):
    """Everything one run needs. Defaults are the embedded tiny-model demo."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field("tiny:arithmetic", description="Model path/id, or tiny:<variant> for the offline tiny model.")
    dataset: str = Field("tiny:arithmetic", description="tiny:<task> or an import string returning a DatasetDict.")
    reward_funcs: list[str] = Field(
        default_factory=lambda: ["grpo_core.rewards:accuracy_reward", "grpo_core.rewards:format_reward"],
        description="Import strings of the reward functions.",
    )
    tools: list[str] = Field(default_factory=list, description="Import strings of tool functions.")
    eval_reward: str = Field("grpo_core.rewards:accuracy_reward", description="Reward used as held-out accuracy.")
    eval_prompts: int = Field(100, ge=0, description="Held-out prompts sampled before and after training (0 skips).")
    eval_samples_per_prompt: int = Field(4, ge=1, description="Completions per held-out prompt.")
    nproc_per_node: int = Field(1, ge=1, description="Training processes per node (torchrun).")
    nnodes: int = Field(1, ge=1, description="Training nodes.")
    max_resumes: int = Field(3, ge=0, description="Times the flow restarts a training process that died.")
    server: ServerParams = Field(default_factory=ServerParams)
    tracking: TrackingParams = Field(default_factory=TrackingParams)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)  # type: ignore[valid-type]

    @field_validator("reward_funcs", "tools")
    @classmethod
    def _import_strings(cls, values: list[str]) -> list[str]:
        for value in values:
            if ":" not in value:
                raise ValueError(f"{value!r} is not an import string; write it as package.module:function")
        return values

    def trainer_config(self, **overrides: Any) -> AsyncGRPOConfig:
        """The trainer part as a plain ``AsyncGRPOConfig`` (with ``overrides`` applied)."""
        return AsyncGRPOConfig.from_dict({**dataclasses.asdict(self.trainer), **overrides})


def import_string(path: str) -> Any:
    """``package.module:attr`` → the object."""
    module_name, _, attr = path.partition(":")
    module = importlib.import_module(module_name)
    try:
        return getattr(module, attr)
    except AttributeError as exc:
        raise ImportError(f"{module_name} has no attribute {attr!r} (from {path!r})") from exc


def resolve_model(spec: str) -> str:
    """A model folder for ``spec``: ``tiny:<variant>`` builds (or reuses) the offline tiny model."""
    if spec.startswith("tiny:"):
        from grpo_core.tiny import build_tiny_model

        return str(build_tiny_model(variant=spec.removeprefix("tiny:")))
    return spec


def resolve_dataset(spec: str) -> Any:
    """A ``DatasetDict`` with ``train`` (and optionally ``eval``) for ``spec``."""
    if spec.startswith("tiny:"):
        from grpo_core.tiny import arithmetic_dataset

        # The tools variant uses the same arithmetic prompts; only the model knows the calculator.
        builders = {"arithmetic": arithmetic_dataset, "tools": arithmetic_dataset}
        task = spec.removeprefix("tiny:")
        if task not in builders:
            raise ValueError(f"dataset {spec!r}: unknown tiny task; use one of {sorted(builders)}")
        return builders[task]()
    return import_string(spec)()

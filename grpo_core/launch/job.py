"""``JobConfig``: one training job (model, data, rewards, tools, server, tracking, trainer) as plain data.

It is the parameter model of the Prefect flow (the deployment form is its JSON schema) and the
schema of ``grpo train JOB.yaml``. Nothing is declared twice: ``trainer`` is the library's own
``AsyncGRPOConfig``, ``server`` extends ``grpo_core.vllm_server.process.ServerOptions``, and ``peft_config`` is
checked against peft's ``LoraConfig``. Everything the Python API takes as an object is named here by
import string (``package.module:attr``), so a job pickles and serialises as text: reward functions,
tools, an environment factory, a custom ``AsyncRolloutLoop`` and the dataset loader. Unknown keys
are refused at every level with the closest valid name.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from grpo_core.config import AsyncGRPOConfig, ConfigError
from grpo_core.config_checks import check_known_keys
from grpo_core.environments import load_environment
from grpo_core.tiny import arithmetic_dataset, build_tiny_model
from grpo_core.vllm_server.process import ServerOptions

ImportString = Annotated[str, Field(pattern=r"^[\w.]+:[\w.]+$", description="package.module:attribute")]

JOB_TRAINER_DEFAULTS: dict[str, Any] = {"report_to": "mlflow", "do_eval": True, "log_completions": True,
                                        "num_completions_to_log": 16}
"""Where a job's trainer differs from ``AsyncGRPOConfig``'s defaults, for keys the job does not set: the flow
tracks every job in MLflow (the library itself reports nowhere by default, as transformers does), reports
the held-out accuracy before and after training, and keeps a sample of completions in the run (the first 16 of
each logged step: two groups of the default ``num_generations``)."""

REPLACED_JOB_KEYS = {
    "eval_reward": "reward_funcs (the held-out accuracy is the first reward function's mean)",
    "eval_prompts": "trainer.do_eval (false skips the held-out evaluation, which covers the data set's eval split)",
    "eval_samples_per_prompt": "trainer.num_generations_eval",
}
"""Job keys of an earlier version, and the field that holds each setting now."""


class _Strict(BaseModel):
    """Refuses unknown keys with a suggestion (pydantic's own message names no alternative)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    @model_validator(mode="before")
    @classmethod
    def _known_keys(cls, values: Any) -> Any:
        if isinstance(values, dict):
            check_known_keys(cls.__name__, values, [*cls.model_fields, *_aliases(cls)])
        return values


def _aliases(cls: type[BaseModel]) -> list[str]:
    return [f.alias for f in cls.model_fields.values() if f.alias]


@dataclasses.dataclass(kw_only=True)
class ServerParams(ServerOptions):
    """The vLLM server(s): started by the flow (``managed``), or existing ones at ``base_url``."""

    managed: bool = True
    """Start the server(s) as child processes (or Kubernetes jobs) and stop them at the end."""
    replicas: Annotated[int, Field(ge=1)] = 1
    """Servers the flow starts (``managed``): a fleet of this many, the same model and flags each (its own sampling
    seed, ``seed + replica``), its own cores and port on one machine (``cpu_placement``), its own stable name on
    Kubernetes. The rollout worker routes each group to one of them, every push reaches all of them, and a server
    that dies is restarted by the flow and catches up before it serves again. A server's own data parallelism (vLLM's
    ``--data-parallel-size`` in ``extra_args``) is the other way to more generation: docs/fleet.md
    says when to use which."""
    base_url: str | list[str] | None = None
    """URL of an existing server, or the URLs of an existing fleet (when ``managed`` is false)."""
    startup_timeout_s: Annotated[float, Field(gt=0)] = 600.0
    """Seconds to wait for a managed server to serve."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.managed and not self.base_url:
            raise ConfigError("ServerParams.base_url is required when managed is false: give the URL of the running server")
        if not self.managed and self.replicas > 1:
            raise ConfigError("ServerParams.replicas counts the servers the flow starts (managed: true); list the URLs "
                              "of an existing fleet in base_url instead")

    def urls(self) -> list[str]:
        """The existing servers' URLs (``managed: false``)."""
        return [self.base_url] if isinstance(self.base_url, str) else list(self.base_url or [])

    def options(self) -> ServerOptions:
        """The launch options alone (what ``VLLMServerSpec.for_run`` takes)."""
        return ServerOptions(**{f.name: getattr(self, f.name) for f in dataclasses.fields(ServerOptions)})


class TrackingParams(_Strict):
    """Where the run is tracked."""

    tracking_uri: str | None = None
    """MLflow tracking URI; default: ``MLFLOW_TRACKING_URI`` when set, else a SQLite store in the run folder."""
    experiment: str = "grpo"
    """MLflow experiment name."""
    system_metrics: bool = True
    """Log CPU/GPU/memory system metrics with the run."""
    registered_model_name: str | None = None
    """The name the final model is registered under in the MLflow model registry (a new version per run); None:
    ``<model>-<task>`` (``tiny-arithmetic-arithmetic`` for the demo), the run's name without its config hash."""
    tags: dict[str, str] = Field(default_factory=dict)
    """Tags the MLflow run gets when the flow creates it, before training, so that a run that fails carries them
    too (for example the settings a comparison varies, to search the experiment on)."""


class JobConfig(_Strict):
    """Everything one run needs. Defaults are the embedded tiny-model demo."""

    @model_validator(mode="before")
    @classmethod
    def _replaced_keys(cls, values: Any) -> Any:
        old = [k for k in REPLACED_JOB_KEYS if isinstance(values, dict) and k in values]
        if old:
            raise ConfigError("; ".join(f"JobConfig.{k} is gone: set {REPLACED_JOB_KEYS[k]}" for k in old))
        return values

    model: str = "tiny:arithmetic"
    """Model folder or hub id, or ``tiny:<variant>`` for an offline tiny model."""
    dataset: str = "tiny:arithmetic"
    """``tiny:<task>``, or an import string of a function returning a ``DatasetDict`` with ``train`` (and ``eval``)."""
    reward_funcs: list[ImportString] = Field(
        default_factory=lambda: ["grpo_core.rewards:accuracy_reward", "grpo_core.rewards:format_reward"]
    )
    """Import strings of the reward functions (``AsyncGRPOTrainer(reward_funcs=...)``)."""
    tools: list[ImportString] = Field(default_factory=list)
    """Import strings of tool functions (``tools=...``)."""
    environment_factory: ImportString | None = None
    """Import string of the environment factory (``environment_factory=...``)."""
    loop_cls: ImportString | None = None
    """Import string of an ``AsyncRolloutLoop`` subclass to run the rollout stages with (a trainer's ``loop_cls``)."""
    peft_config: dict[str, Any] | None = None
    """LoRA: keyword arguments of peft's ``LoraConfig`` (e.g. ``{r: 16, lora_alpha: 32, target_modules: all-linear}``)."""
    nproc_per_node: Annotated[int, Field(ge=1)] = 1
    """Training processes per node (torchrun)."""
    nnodes: Annotated[int, Field(ge=1)] = 1
    """Training nodes."""
    rendezvous_address: str | None = None
    """With ``nnodes > 1``: node 0's address as the other training nodes reach it (torchrun ``--master-addr``).
    Required by the local provisioner, which runs node 0 where the flow runs and logs the command of every other
    node; the Kubernetes provisioner ignores it (node 0 is its pod 0)."""
    rendezvous_port: Annotated[int, Field(ge=1, le=65535)] = 29500
    """With ``nnodes > 1``: the port node 0 listens on for the other nodes (torchrun ``--master-port``)."""
    max_resumes: Annotated[int, Field(ge=0)] = 3
    """Times the flow restarts a training process that died."""
    server: ServerParams = Field(default_factory=ServerParams)
    """The vLLM server."""
    tracking: TrackingParams = Field(default_factory=TrackingParams)
    """MLflow."""
    trainer: AsyncGRPOConfig = Field(default_factory=lambda: AsyncGRPOConfig(**JOB_TRAINER_DEFAULTS))
    """The trainer's settings (``AsyncGRPOConfig``), held-out evaluation included (``do_eval``,
    ``num_generations_eval``, ``eval_strategy``, ``eval_steps``). A job's trainer reports to MLflow and evaluates
    before and after training unless it says otherwise (``report_to: none``, ``do_eval: false``): the flow opens
    the run, follows progress and reads the summary from it."""

    @field_validator("server", "trainer", mode="before")
    @classmethod
    def _dataclass_keys(cls, value: Any, info: Any) -> Any:
        owner = {"server": ServerParams, "trainer": AsyncGRPOConfig}[info.field_name]
        if isinstance(value, dict):
            check_known_keys(owner.__name__, value, [f.name for f in dataclasses.fields(owner)])
            if owner is AsyncGRPOConfig:
                value = {**JOB_TRAINER_DEFAULTS, **value}
        return value

    @field_validator("peft_config")
    @classmethod
    def _lora_config(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is not None:
            lora_config(value)  # peft's own checks, with our message for unknown keys
        return value

    @model_validator(mode="after")
    def _environment_gives_data_and_rewards(self) -> "JobConfig":
        # Compared with the defaults, not the keys given: the flow writes a job back whole (resume_job.json).
        taken = [k for k in ("dataset", "reward_funcs") if getattr(self, k) != JobConfig.model_fields[k].get_default(
            call_default_factory=True)]
        if self.trainer.environment is not None and taken:
            raise ConfigError(f"JobConfig.{taken[0]} is set, but trainer.environment={self.trainer.environment!r} gives "
                              "the data set and the reward functions; drop JobConfig.dataset and JobConfig.reward_funcs")
        return self

    def trainer_config(self, **overrides: Any) -> AsyncGRPOConfig:
        """The trainer part (with ``overrides`` applied and checked)."""
        return self.trainer.replace(**overrides) if overrides else self.trainer


def lora_config(values: dict[str, Any]) -> Any:
    """peft's ``LoraConfig`` from job data; unknown keys are refused with the closest name."""
    from peft import LoraConfig

    check_known_keys("peft LoraConfig", values, [f.name for f in dataclasses.fields(LoraConfig)])
    return LoraConfig(**values)


def import_string(path: str) -> Any:
    """``package.module:attr`` → the object."""
    module_name, _, attr = path.partition(":")
    module = importlib.import_module(module_name)
    target: Any = module
    for part in attr.split("."):
        try:
            target = getattr(target, part)
        except AttributeError as exc:
            raise ImportError(f"{module_name} has no attribute {attr!r} (from {path!r})") from exc
    return target


def resolve_model(spec: str) -> str:
    """A model folder for ``spec``: ``tiny:<variant>`` builds (or reuses) the offline tiny model."""
    if spec.startswith("tiny:"):
        return str(build_tiny_model(variant=spec.removeprefix("tiny:")))
    return spec


def resolve_dataset(spec: str, seed: int = 0) -> Any:
    """A ``DatasetDict`` with ``train`` (and optionally ``eval``) for ``spec``; ``seed`` (the trainer's) orders a
    tiny task's rows, so one seed always gives the same training and held-out prompts. A tiny task's held-out
    problems are the tiny model's, whatever the seed (see ``tiny.tasks.arithmetic_dataset``)."""
    if spec.startswith("tiny:"):
        # The tools variant uses the same arithmetic prompts; only the model knows the calculator.
        builders = {"arithmetic": arithmetic_dataset, "tools": arithmetic_dataset}
        task = spec.removeprefix("tiny:")
        if task not in builders:
            raise ValueError(f"dataset {spec!r}: unknown tiny task; use one of {sorted(builders)}")
        return builders[task](seed=seed)
    return import_string(spec)()


def resolve_job_inputs(job: JobConfig) -> tuple[Any, list[Any], list[float] | None]:
    """The job's data (a ``DatasetDict`` with ``train``, maybe ``eval``), reward functions and their weights: the
    trainer's ``environment`` when it names one (``grpo_core.environments``), else ``dataset`` and ``reward_funcs``."""
    trainer = job.trainer
    if trainer.environment is None:
        return resolve_dataset(job.dataset, trainer.seed), [import_string(n) for n in job.reward_funcs], trainer.reward_weights
    from datasets import DatasetDict

    inputs = load_environment(trainer.environment, trainer.environment_args, seed=trainer.seed)
    splits = {"train": inputs.train_dataset, **({"eval": inputs.eval_dataset} if inputs.eval_dataset is not None else {})}
    return DatasetDict(splits), inputs.reward_funcs, trainer.reward_weights or inputs.reward_weights

"""``AsyncGRPOConfig``: every knob of a run, typed, one docstring per field, validated, never rewritten.

Field names follow TRL's ``AsyncGRPOConfig`` / ``TrainingArguments`` wherever the concept exists,
so a config written for that trainer reads the same here. Values that depend on others (such as
``max_concurrent_rollouts``) are resolved by ``resolved_*`` methods, not by overwriting the field
the user set. ``from_dict`` rejects unknown keys with the list of valid ones.
"""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass, field
from typing import Annotated, Any

from annotated_types import Gt


class ConfigError(ValueError):
    """A config value is invalid; the message names the field and how to fix it."""


_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


@dataclass
class AsyncGRPOConfig:
    """Configuration of an asynchronous GRPO run (trainer, rollout worker and weight sync)."""

    # ---- output, steps and logging --------------------------------------------------------------
    output_dir: str = "outputs/grpo"
    """Where checkpoints, the server log and the LoRA serving cache go; any fsspec URL (``s3://...``)."""
    max_steps: int = 200
    """Optimizer steps to train. A step is always a full optimizer step (all micro-batches, all ranks)."""
    num_train_epochs: float = 1.0
    """Passes over the prompts, used only when ``max_steps`` <= 0."""
    logging_steps: int = 1
    """Log metrics every N optimizer steps."""
    seed: int = 0
    """Seed for model init (when built), data order, sampling and dropout."""
    run_name: str | None = None
    """Name of the tracking run; defaults to the output folder's name."""
    report_to: str = "mlflow"
    """Where metrics go: ``mlflow`` or ``none`` (console only)."""

    # ---- optimisation ----------------------------------------------------------------------------
    learning_rate: Annotated[float, Gt(0)] = 1e-6
    """Peak AdamW learning rate."""
    lr_scheduler_type: str = "constant"
    """``constant``, ``linear`` or ``cosine`` decay after warm-up."""
    warmup_steps: int = 0
    """Linear warm-up steps."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    adam_beta1: float = 0.9
    """AdamW beta1."""
    adam_beta2: float = 0.999
    """AdamW beta2."""
    max_grad_norm: float = 1.0
    """Clip the global gradient norm to this value (0 disables)."""
    per_device_train_batch_size: int = 8
    """Samples each rank trains per micro-batch at most (a row also stops at ``token_budget``)."""
    gradient_accumulation_steps: int = 1
    """Micro-batches per optimizer step."""
    bf16: bool = False
    """Train in bfloat16 mixed precision (fp32 master weights); checkpoints are written in bf16."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass to save memory."""
    fsdp_reshard_after_forward: bool = True
    """FSDP2: free each decoder layer's gathered weights after its forward and gather them again for
    backward (less memory); False keeps them from forward to backward (one gather fewer per layer)."""
    fsdp_cpu_offload: bool = False
    """FSDP2: keep the sharded weights, gradients and optimizer state in host memory (CUDA only);
    the optimizer step then runs on the CPU."""
    compile_mode: str = "none"
    """``torch.compile`` per decoder layer: ``none``; ``pointwise`` (the MLP and the norms: element-wise
    ops fuse, attention stays eager); ``layers`` (whole layers, tree attention traced too; fastest
    in benchmarks/README.md). Compiling costs start-up time and changes bf16 rounding."""

    # ---- generation --------------------------------------------------------------------------------
    num_generations: int = 8
    """Rollouts per prompt (one group); the advantage baseline is the group's mean reward."""
    max_completion_length: int = 256
    """Most tokens generated per rollout, summed over its turns."""
    temperature: float = 1.0
    """Sampling temperature; the trainer's log-probs use the same temperature."""
    top_p: float = 1.0
    """Nucleus sampling; < 1 makes the trainer renormalise over each token's candidate set."""
    top_k: int = 0
    """Top-k sampling (0 = off); > 0 makes the trainer renormalise over each token's candidate set."""
    chat_template_kwargs: dict[str, Any] | None = None
    """Extra keyword arguments for ``apply_chat_template`` when building prompts."""
    max_tool_calling_iterations: int | None = None
    """Most tool-calling turns per rollout (None: until the model stops calling or the budget ends)."""
    tool_timeout_s: float = 30.0
    """Per-call timeout of a tool; a timed-out call returns its error to the model."""
    fork_threshold_tokens: int = 1024
    """Multi-turn re-tokenisation drift (tokens) above which a turn forks a new sequence instead of realigning."""

    # ---- rewards and advantages ------------------------------------------------------------------------
    reward_weights: list[float] | None = None
    """Weight of each reward function in the summed reward (default: all 1)."""
    scale_rewards: bool = True
    """Divide group advantages by the group's reward std."""

    # ---- objective ----------------------------------------------------------------------------------
    epsilon: float = 0.2
    """Lower clip of the importance ratio: ratio >= 1 - epsilon."""
    epsilon_high: float = 0.28
    """Upper clip of the importance ratio: ratio <= 1 + epsilon_high."""
    score_centering: bool = True
    """Subtract the expected score over the sampler's top tokens at each trained position."""
    score_centering_weights: str = "importance"
    """Weights of the centering baseline over the top-N: ``importance`` (the sampler's probabilities times each
    candidate's clipped ratio, zero-mean for any ratio) or ``sampler`` (the sampler's probabilities alone, exact
    only when every candidate has the same ratio, e.g. pure top-k truncation)."""
    num_sampler_logprobs: int = 8
    """Top-N sampler log-probs requested per generated token (for score centering); 0 turns centering off."""
    vllm_importance_sampling_clip_min: float = 0.5
    """Tokens whose trainer/sampler ratio falls below this are dropped from the loss."""
    vllm_importance_sampling_clip_max: float = 2.0
    """Tokens whose trainer/sampler ratio rises above this are dropped from the loss."""

    # ---- asynchrony ---------------------------------------------------------------------------------
    max_staleness: int = 4
    """Weight versions a sample may lag behind the trainer before it is dropped."""
    max_concurrent_rollouts: int | None = None
    """Ceiling on rollouts in flight (None: max(max_staleness, 1) x batch x accumulation x processes)."""
    queue_maxsize: int = 1024
    """Samples buffered between the rollout process and the trainer."""
    weight_sync_steps: int = 1
    """Push weights to the server every N optimizer steps."""
    worker_heartbeat_timeout_s: float = 60.0
    """The run fails if the rollout worker sends no heartbeat for this long."""

    # ---- packing ----------------------------------------------------------------------------------------
    token_budget: int = 8192
    """Unique tokens per packed row (one row per rank per micro-batch)."""
    packing: str = "tree"
    """``tree`` (prefix-trie rows, shared tokens forwarded once) or ``flat`` (padding-free, no sharing)."""

    # ---- vLLM server ------------------------------------------------------------------------------------
    vllm_server_base_url: str = "http://localhost:8000"
    """Base URL of the vLLM server used for generation and weight sync."""
    vllm_server_timeout: float = 240.0
    """Seconds to wait for the server to answer before the run fails."""
    request_timeout: float = 600.0
    """Timeout of one HTTP request to the server."""
    weight_transfer_backend: str = "gloo"
    """``gloo`` (CPU servers, this package's vLLM plugin) or ``nccl`` (GPU servers)."""
    lora_sync_mode: str = "auto"
    """With ``peft_config`` only. ``merged``: every sync merges the adapter into the base weights and pushes
    them all over ``weight_transfer_backend``. ``adapter``: only the adapter is written under
    ``<output_dir>/.vllm_lora/`` and loaded by name (needs ``--enable-lora`` and
    ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1`` on the server). ``auto``: ``adapter`` when the server offers both
    at start-up, else ``merged``; picked once, never switched during the run."""

    # ---- checkpoints --------------------------------------------------------------------------------------
    save_strategy: str = "steps"
    """``steps`` (every ``save_steps``) or ``no``."""
    save_steps: int = 50
    """Write a checkpoint every N optimizer steps."""
    save_total_limit: int | None = 3
    """Keep the newest N checkpoints (None keeps all)."""
    resume_from_checkpoint: bool | str | None = None
    """True: the newest good checkpoint under ``output_dir``; a path: that one; None/False: start fresh."""
    ignore_data_skip: bool = True
    """Always True: the worker jumps to the saved prompt index instead of replaying the data."""

    # ---- logging of samples ---------------------------------------------------------------------------------
    log_completions: bool = False
    """Print a few completions every ``logging_steps``."""
    num_completions_to_print: int = 3
    """How many completions ``log_completions`` prints."""

    def __post_init__(self) -> None:
        self.validate()

    # ------------------------------------------------------------------------------------------------
    def validate(self) -> None:
        """Raise ``ConfigError`` naming the first invalid field and how to fix it."""

        def need(ok: bool, name: str, fix: str) -> None:
            if not ok:
                raise ConfigError(f"AsyncGRPOConfig.{name}={getattr(self, name)!r} is invalid: {fix}")

        need(self.learning_rate > 0, "learning_rate", "use a positive learning rate such as 1e-6")
        need(self.max_steps > 0 or self.num_train_epochs > 0, "max_steps", "set max_steps > 0 or num_train_epochs > 0")
        need(self.logging_steps >= 1, "logging_steps", "log at least every step count >= 1")
        need(self.per_device_train_batch_size >= 1, "per_device_train_batch_size", "use >= 1")
        need(self.gradient_accumulation_steps >= 1, "gradient_accumulation_steps", "use >= 1")
        need(self.num_generations >= 2, "num_generations", "GRPO needs >= 2 rollouts per prompt for a baseline")
        need(self.max_completion_length >= 1, "max_completion_length", "use >= 1")
        need(self.temperature > 0, "temperature", "sample with temperature > 0")
        need(0 < self.top_p <= 1, "top_p", "use a value in (0, 1]")
        need(self.top_k >= 0, "top_k", "use 0 (off) or a positive integer")
        need(0 <= self.epsilon < 1, "epsilon", "use a value in [0, 1), e.g. 0.2")
        need(self.epsilon_high >= 0, "epsilon_high", "use a non-negative value, e.g. 0.28")
        need(self.num_sampler_logprobs >= 0, "num_sampler_logprobs", "use 0 (off) or a positive integer <= the server's --max-logprobs")
        need(
            0 <= self.vllm_importance_sampling_clip_min < 1 < self.vllm_importance_sampling_clip_max,
            "vllm_importance_sampling_clip_min",
            "need clip_min < 1 < vllm_importance_sampling_clip_max",
        )
        need(
            self.score_centering_weights in ("importance", "sampler"),
            "score_centering_weights",
            "use 'importance' or 'sampler'",
        )
        need(self.max_staleness >= 0, "max_staleness", "use >= 0 (0 = only on-policy samples)")
        need(
            self.max_concurrent_rollouts is None or self.max_concurrent_rollouts >= 1,
            "max_concurrent_rollouts",
            "use None (auto) or >= 1",
        )
        need(self.queue_maxsize >= 1, "queue_maxsize", "use >= 1")
        need(self.weight_sync_steps >= 1, "weight_sync_steps", "use >= 1")
        need(self.token_budget >= 16, "token_budget", "use at least the longest prompt + completion")
        need(isinstance(self.fsdp_reshard_after_forward, bool), "fsdp_reshard_after_forward", "use True or False")
        need(isinstance(self.fsdp_cpu_offload, bool), "fsdp_cpu_offload", "use True or False")
        need(self.compile_mode in ("none", "pointwise", "layers"), "compile_mode", "use 'none', 'pointwise' or 'layers'")
        need(self.packing in ("tree", "flat"), "packing", "use 'tree' or 'flat'")
        need(self.weight_transfer_backend in ("gloo", "nccl"), "weight_transfer_backend", "use 'gloo' (CPU) or 'nccl' (GPU)")
        need(self.lora_sync_mode in ("auto", "merged", "adapter"), "lora_sync_mode", "use 'auto', 'merged' or 'adapter'")
        need(self.save_strategy in ("steps", "no"), "save_strategy", "use 'steps' or 'no'")
        need(self.save_steps >= 1, "save_steps", "use >= 1")
        need(self.save_total_limit is None or self.save_total_limit >= 1, "save_total_limit", "use None or >= 1")
        need(self.lr_scheduler_type in ("constant", "linear", "cosine"), "lr_scheduler_type", "use constant, linear or cosine")
        need(self.ignore_data_skip is True, "ignore_data_skip", "replaying data is not supported; leave it True")
        need(self.report_to in ("mlflow", "none"), "report_to", "use 'mlflow' or 'none'")
        need(self.fork_threshold_tokens >= 1, "fork_threshold_tokens", "use >= 1 (a drift of that many tokens forks)")
        need(self.tool_timeout_s > 0, "tool_timeout_s", "use a positive timeout")
        need(self.worker_heartbeat_timeout_s > 0, "worker_heartbeat_timeout_s", "use a positive timeout")

    # ------------------------------------------------------------------------------------------------
    def resolved_max_concurrent_rollouts(self, num_processes: int) -> int:
        """The ceiling on rollouts in flight: what the trainer can consume before samples go stale."""
        if self.max_concurrent_rollouts is not None:
            return self.max_concurrent_rollouts
        return (
            max(self.max_staleness, 1)
            * self.per_device_train_batch_size
            * self.gradient_accumulation_steps
            * num_processes
        )

    def needs_candidate_sets(self) -> bool:
        """Truncated sampling: the trainer must renormalise over each token's candidate set."""
        return self.top_p < 1.0 or self.top_k > 0

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "AsyncGRPOConfig":
        """Build from a mapping (e.g. YAML), rejecting unknown keys with a suggestion."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = [k for k in values if k not in names]
        if unknown:
            hints = []
            for key in unknown:
                close = difflib.get_close_matches(key, names, n=1)
                hints.append(f"{key!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
            raise ConfigError(f"AsyncGRPOConfig has no field {', '.join(hints)}")
        return cls(**values)


def lora_rank_ok(rank: int) -> bool:
    """vLLM accepts only these ``--max-lora-rank`` values."""
    return rank in _LORA_RANKS


__all__ = ["AsyncGRPOConfig", "ConfigError", "lora_rank_ok", "field"]

"""Typed sections of ``AsyncGRPOConfig``: which of the flat config's fields each subsystem reads.

The flat, TRL-named config stays the one declaration of every field (type, bounds, default, docstring). A
section is a view of it, ``config.fleet``, ``config.checkpoint`` and so on: it hands on the fields it names,
unchanged and with the config's types, and refuses any other with an error that names the section. A subsystem
that takes its section instead of the whole config shows at its signature what it depends on, and cannot come to
depend on a setting of another part unnoticed. ``tests/test_config_sections.py`` checks that every field of the
config is in a section and that every name a section lists is a field or a method of the config.
"""

from __future__ import annotations

from typing import Any

SECTIONS: dict[str, frozenset[str]] = {
    "rollout": frozenset({
        "num_generations", "max_completion_length", "temperature", "top_p", "top_k", "chat_template_kwargs",
        "max_tool_calling_iterations", "tool_timeout_s", "fork_threshold_tokens", "reward_weights", "scale_rewards",
        "num_sampler_logprobs", "max_staleness", "max_concurrent_rollouts", "queue_maxsize", "weight_sync_steps",
        "worker_heartbeat_timeout_s", "num_train_epochs", "seed", "vllm_server_base_url", "request_timeout",
        "server_drain_after_s", "server_unavailable_timeout_s", "per_device_train_batch_size",
        "gradient_accumulation_steps", "resolved_max_concurrent_rollouts", "server_urls", "needs_candidate_sets",
        "multi_turn_prompts", "environment", "environment_args"}),
    "training": frozenset({
        "max_steps", "seed", "learning_rate", "lr_scheduler_type", "warmup_steps", "weight_decay", "adam_beta1",
        "adam_beta2", "adam_epsilon", "max_grad_norm", "per_device_train_batch_size", "gradient_accumulation_steps",
        "bf16", "fp16", "gradient_checkpointing", "fsdp_reshard_after_forward", "fsdp_keep_weights_between_micro_batches",
        "fsdp_cpu_offload", "compile_mode",
        "compile_graph_breaks",
        "attention_backend", "tree_attention_plan", "tree_kv_regather", "attention_kernel", "logprob_chunk_size",
        "epsilon", "epsilon_high", "score_centering", "score_centering_weights", "vllm_importance_sampling_clip_min",
        "vllm_importance_sampling_clip_max", "vllm_importance_sampling_correction", "vllm_importance_sampling_mode",
        "vllm_importance_sampling_cap", "max_staleness", "stale_samples", "token_budget", "packing", "gdn_backend", "routing_replay",
        "no_signal_patience_steps", "num_generations",
        "moe_aux_loss_coef", "num_sampler_logprobs", "temperature", "resolved_bf16", "resolved_logprob_chunk_size", "needs_candidate_sets"}),
    "sync": frozenset({
        "output_dir", "max_staleness", "request_timeout", "weight_transfer_backend", "weight_transfer_address",
        "weight_transfer_port_range", "weight_sync_bucket_mb", "weight_sync_transport", "weight_sync_encoding",
        "weight_patch_url", "weight_patch_keyframe_every", "weight_sync_deadline_floor_s", "weight_sync_deadline_slack",
        "weight_sync_assumed_mb_s", "lora_sync_mode", "server_urls", "resolved_weight_transfer_backend"}),
    "fleet": frozenset({
        "vllm_server_base_url", "vllm_server_fleet_file", "server_drain_after_s", "vllm_server_timeout",
        "request_timeout", "server_unavailable_timeout_s", "weight_sync_deadline_floor_s", "weight_sync_attempts",
        "weight_sync_verify_every", "weight_sync_verify_atol", "weight_sync_transport", "server_urls"}),
    "checkpoint": frozenset({
        "output_dir", "max_steps", "seed", "save_strategy", "save_steps", "storage_retry_timeout_s", "save_total_limit",
        "resume_from_checkpoint", "ignore_data_skip"}),
    "tracking": frozenset({
        "output_dir", "max_steps", "logging_steps", "run_name", "report_to", "tracking_flush_timeout_s",
        "log_completions", "num_completions_to_log", "num_completions_to_print", "print_completions_steps"}),
    "evaluation": frozenset({
        "do_eval", "eval_strategy", "eval_steps", "num_generations_eval", "eval_beside_training", "num_generations", "max_completion_length",
        "temperature", "reward_weights", "num_eval_generations", "runs_evaluation"}),
}
"""Per section, the config's fields (and the methods that derive values from them) its subsystem reads."""


class ConfigSection:
    """One section of a config (``SECTIONS[name]``): its fields read through, anything else refused."""

    __slots__ = ("_name", "_config")

    def __init__(self, name: str, config: Any):
        object.__setattr__(self, "_name", name)
        object.__setattr__(self, "_config", config)

    def __getattr__(self, field: str) -> Any:
        if field in SECTIONS[self._name]:
            return getattr(self._config, field)
        raise AttributeError(f"the config's {self._name!r} section has no {field!r}: add it to "
                             f"grpo_core.config_sections.SECTIONS[{self._name!r}] if this part really reads it")

    def __setattr__(self, field: str, value: Any) -> None:
        raise AttributeError(f"the config's {self._name!r} section is read-only; set {field!r} on the config")

    def __repr__(self) -> str:
        return f"<{self._name} section of {type(self._config).__name__}>"


class Section:
    """A section as an attribute of the config class (``config.fleet``), made afresh from the config it is read on."""

    def __set_name__(self, owner: type, name: str) -> None:
        if name not in SECTIONS:
            raise TypeError(f"no section {name!r}; the sections are {sorted(SECTIONS)}")
        self.name = name

    def __get__(self, config: Any, owner: type | None = None) -> Any:
        return self if config is None else ConfigSection(self.name, config)

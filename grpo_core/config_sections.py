"""Each part's own typed settings, made from the one ``AsyncGRPOConfig`` users write.

The flat, TRL-named config stays the one declaration of every field (type, bounds, default, docstring). Each part
of a run (rollout, training, sync, fleet, checkpoint, tracking, evaluation) receives a frozen dataclass of its own,
``config.fleet``, ``config.checkpoint`` and so on: its fields are the config's, with the config's types, copied
when it is made (``settings_type`` generates the class from the config's declarations, so no field is written
twice), and nothing else. A part that takes its settings shows at its signature what it depends on, cannot change
the run's settings, and cannot come to read a setting of another part unnoticed: the attribute is not there, and
the error names the part and this module. The methods that derive values (``server_urls``,
``resolved_max_concurrent_rollouts``) come along where a part lists them. ``tests/test_config_sections.py`` checks
that every field is in a part, that every listed name is a field or method of the config, and that no method a
part carries reads a name outside the part.

Two consumers keep the whole config, by design: the rollout loop (``AsyncRolloutLoop.config``) and the held-out
evaluation, which runs the same loop. The loop is the extension point of a user's script: a subclass of it reads the
fields of the user's own config subclass (``tests/integration/test_drop_in.py``), which no part of this package
declares. What a part needs that is made from other parts' fields comes to it as a value: the weight sync's set-up
(``sync.factory.SyncSetup``) takes ``config.sync`` and refuses the whole config, and the server command its LoRA
start-up check shows, which spells fields of every part, is written by the orchestrator.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap
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
        "moe_aux_loss_coef", "num_sampler_logprobs", "temperature", "top_p", "top_k", "resolved_bf16", "resolved_logprob_chunk_size", "needs_candidate_sets"}),
    "sync": frozenset({
        "output_dir", "max_staleness", "request_timeout", "weight_transfer_backend", "weight_transfer_address",
        "weight_transfer_port_range", "weight_sync_bucket_mb", "weight_sync_transport", "weight_sync_encoding",
        "weight_patch_url", "weight_patch_keyframe_every", "weight_sync_deadline_floor_s", "weight_sync_deadline_slack",
        "weight_sync_assumed_mb_s", "lora_sync_mode", "vllm_server_base_url", "server_urls", "resolved_weight_transfer_backend"}),
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
        "do_eval", "eval_strategy", "eval_steps", "num_generations_eval", "eval_beside_training", "eval_beside_prompts_in_flight",
        "num_generations", "max_completion_length",
        "temperature", "reward_weights", "num_eval_generations", "runs_evaluation"}),
}
"""Per part, the config's fields (and the methods that derive values from them) it reads."""


def _method_reads(function: Any) -> set[str]:
    """The names ``function`` reads on ``self`` (its source's ``self.<name>``)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    return {node.attr for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self"}


def method_reads_outside(config_cls: type, part: str) -> dict[str, set[str]]:
    """Per method the part carries, the names it reads on ``self`` that the part does not hold (should be none)."""
    names = SECTIONS[part]
    return {name: reads - names for name in sorted(names) if callable(getattr(config_cls, name, None))
            if (reads := _method_reads(getattr(config_cls, name))) - names}


def _refuse(self: Any, name: str) -> Any:
    # Only reached when ``name`` is none of the part's fields or methods (slots: no instance dict to look in).
    raise AttributeError(f"the {self.PART!r} settings have no {name!r}: add it to "
                         f"grpo_core.config_sections.SECTIONS[{self.PART!r}] if this part really reads it")


def settings_type(config_cls: type, part: str, class_name: str, module: str) -> type:
    """The frozen dataclass of ``part``: the fields it lists, declared as ``config_cls`` declares them, and the
    methods it lists, the config's own functions (they read only the part's names: the test says so)."""
    declared = {f.name: f for f in dataclasses.fields(config_cls)}
    names = SECTIONS[part]
    fields = [(name, declared[name].type) for name in declared if name in names]
    methods = {name: getattr(config_cls, name) for name in sorted(names) if name not in declared}
    namespace = {**methods, "PART": part, "__getattr__": _refuse,
                 "__doc__": f"The settings the {part} part of a run reads (made by ``{config_cls.__name__}.{part}``)."}
    cls = dataclasses.make_dataclass(class_name, fields, namespace=namespace, frozen=True, slots=True)
    cls.__module__ = module  # where the class is bound to its name, so that it pickles (the rollout process)
    return cls


def settings_of(config: Any, cls: type) -> Any:
    """``cls``'s settings, the values ``config`` holds now."""
    return cls(**{f.name: getattr(config, f.name) for f in dataclasses.fields(cls)})


class Section:
    """A part's settings as an attribute of the config class (``config.fleet``): made afresh from the config each
    time it is read, so a part holds the values of when it was built. The class is looked up on the config
    (``settings_types``, filled where the config class is defined)."""

    def __set_name__(self, owner: type, name: str) -> None:
        if name not in SECTIONS:
            raise TypeError(f"no section {name!r}; the sections are {sorted(SECTIONS)}")
        self.name = name

    def __get__(self, config: Any, owner: type | None = None) -> Any:
        if config is None:
            return self
        return settings_of(config, type(config).settings_types[self.name])

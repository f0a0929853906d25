"""The policy a trainer trains, built once before training: loaded, adapted, wired for tree attention, sharded,
with its optimizer and learning-rate schedule.

``build_policy`` decides everything the device and the settings leave open (the precision, the attention
kernels, grouped experts, FSDP) and returns it as a ``Policy``; the trainer holds its parts under TRL's names
(``model``, ``processing_class``, ``optimizer``, ``lr_scheduler``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from grpo_core.config import AsyncGRPOConfig
from grpo_core.data.inputs import model_load_error
from grpo_core.models.attention.tree import enable_tree_attention
from grpo_core.models.fsdp import FSDPSettings, needs_fsdp, shard_policy
from grpo_core.models.head.lm_head import output_head, vocab_size
from grpo_core.models.loading import load_policy, load_tokenizer
from grpo_core.models.lora import apply_lora, warn_if_not_saved
from grpo_core.models.moe.experts import use_grouped_experts
from grpo_core.models.moe.policy import MoEPolicy
from grpo_core.ranks import DistInfo, init_distributed
from grpo_core.training.perf import PerfMeter

log = logging.getLogger(__name__)


@dataclass
class Policy:
    """What ``build_policy`` made, under the names the trainer keeps them by."""

    model: Any
    model_path: str | None
    processing_class: Any
    optimizer: torch.optim.Optimizer
    lr_scheduler: Any
    grad_scaler: Any  # torch.amp.GradScaler for fp16, else None
    bf16: bool
    compute_dtype: torch.dtype  # what forward/backward run in; weights are served and saved in it too
    wire_dtype: torch.dtype | None  # what weights travel to the servers in (``wire_dtype``)
    compile_mode: str
    compile_graph_breaks: str | None  # nested or outer where layers are compiled whole, else None
    keep_weights_between_micro_batches: bool  # one rank keeps gathered weights through a step (FSDPSettings)
    attention_backend: str
    experts_implementation: Any
    moe: MoEPolicy | None
    vocab_size: int
    perf: PerfMeter
    owns_process_group: bool  # this trainer started the process group, and shuts it down at the end


def build_policy(model: Any, processing_class: Any, peft_config: Any, args: AsyncGRPOConfig, dist: DistInfo,
                 device: torch.device) -> Policy:
    """Load ``model`` (a path, a hub name or a module) on ``device`` and make it trainable as ``args`` say."""
    bf16 = resolve_precision(args, device, dist.is_main)
    compute_dtype = torch.bfloat16 if bf16 else (torch.float16 if args.fp16 else torch.float32)
    fsdp_settings = FSDPSettings.from_config(args, bf16=bf16, device_type=device.type, world_size=dist.world_size)
    # Ranks (and 1-rank bf16 through FSDP2) join the process group before anything is sharded.
    owns_process_group = needs_fsdp(fsdp_settings, dist.world_size) and init_distributed(
        dist, device, timeout_s=max(3600.0, 2 * args.request_timeout))
    torch.manual_seed(args.seed)
    try:
        module, model_path = load_policy(model, device)
    except (OSError, ValueError) as exc:
        raise model_load_error(model, exc) from exc
    tokenizer = load_tokenizer(processing_class, model_path)
    if peft_config is not None:
        module = apply_lora(module, peft_config)
        warn_if_not_saved(args)
    attention_backend = enable_tree_attention(
        module, backend=args.attention_backend, linear_backend=args.gdn_backend, kernel=args.attention_kernel,
        compute_dtype=compute_dtype, kv_regather=args.tree_kv_regather, plan=args.tree_attention_plan)
    # Mixture-of-experts policies: experts as grouped GEMMs, routers that can replay the sampler's routes
    # (switched on once the server is known to return them).
    experts_implementation = use_grouped_experts(module)
    moe = MoEPolicy.for_model(module, replay=False, aux_loss_coef=args.moe_aux_loss_coef)
    if args.logprob_chunk_size is not None:
        output_head(module)  # a model the chunked head cannot run is refused before anything starts
    vocab = vocab_size(module)
    perf = PerfMeter(module, device, bf16, dist.world_size)
    module = shard_policy(module, fsdp_settings, device)  # before the optimizer sees the weights
    optimizer = torch.optim.AdamW(
        [p for p in module.parameters() if p.requires_grad], lr=args.learning_rate,
        betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_epsilon, weight_decay=args.weight_decay)
    return Policy(model=module, model_path=model_path, processing_class=tokenizer, optimizer=optimizer,
                  lr_scheduler=lr_scheduler(args, optimizer), bf16=bf16, compute_dtype=compute_dtype,
                  wire_dtype=wire_dtype(bf16),
                  grad_scaler=torch.amp.GradScaler("cuda") if args.fp16 else None,
                  compile_mode=fsdp_settings.compile,
                  compile_graph_breaks=(("nested" if fsdp_settings.nested_graph_breaks else "outer")
                                        if fsdp_settings.compile == "layers" else None),
                  keep_weights_between_micro_batches=fsdp_settings.keeps_weights(dist.world_size),
                  attention_backend=attention_backend,
                  experts_implementation=experts_implementation, moe=moe, vocab_size=vocab, perf=perf,
                  owns_process_group=owns_process_group)


def resolve_precision(args: AsyncGRPOConfig, device: torch.device, is_main: bool) -> bool:
    """Whether the trainer computes in bf16 on ``device`` (fp16 only on CUDA)."""
    cuda = device.type == "cuda"
    if args.fp16 and not cuda:
        raise ValueError("AsyncGRPOConfig.fp16=True needs a CUDA device; on CPU leave fp16 off (training runs fp32)")
    bf16 = args.resolved_bf16(cuda and torch.cuda.is_bf16_supported())
    if args.bf16 is None and not bf16 and is_main:
        log.info("bf16=None: training in fp32 on %s (bf16 is the default on CUDA devices that support it)", device)
    return bf16


def wire_dtype(bf16: bool) -> torch.dtype | None:
    """The dtype weights travel in: bf16 when training in bf16 (the policy the trainer computes with,
    half the bytes of the fp32 master weights), else the weights' own dtype (None)."""
    return torch.bfloat16 if bf16 else None


def lr_scheduler(args: AsyncGRPOConfig, optimizer: torch.optim.Optimizer) -> Any:
    """transformers' schedule of that name; decaying ones reach 0 at ``max_steps``."""
    from transformers import get_scheduler

    extra = {} if args.lr_scheduler_type == "constant" else {"num_warmup_steps": args.warmup_steps}
    if args.lr_scheduler_type in ("linear", "cosine"):
        if args.max_steps <= 0:
            raise ValueError(f"lr_scheduler_type={args.lr_scheduler_type!r} decays to 0 at max_steps; set max_steps > 0")
        extra["num_training_steps"] = args.max_steps
    return get_scheduler(args.lr_scheduler_type, optimizer, **extra)

"""The tiny models: config, seeded initialisation and the supervised warm-up.

The architecture follows ``ModelSpec``: a Qwen3 (attention only), a Qwen3.5 Gated DeltaNet hybrid
(``linear_attention``), or a Qwen3.5 vision-language model (``vision``: the same hybrid as its
language model, with a tiny random vision tower that no step ever trains).

The warm-up is plain next-token cross-entropy on assistant tokens only (the template's generation
mask), over a pool of chat examples from the train problems. Its answers are deliberately noisy
(``WarmupSpec.correct_prob``): the policy should follow the answer format but be right only part of
the time, so that RL has reward to gain. ``evaluate.sampled_eval`` measures where it landed.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerFast, Qwen3Config

from grpo_core.tiny import tasks
from grpo_core.tiny.spec import ModelSpec, WarmupSpec
from grpo_core.tiny.tokenizer import IM_END, PAD_TOKEN


@contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """Run with ``n`` intra-op threads and restore the caller's setting afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def make_config(spec: ModelSpec, tokenizer: PreTrainedTokenizerFast) -> PretrainedConfig:
    """The transformers config ``spec`` describes, with ``architectures`` naming the class to build."""
    text = dict(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=spec.max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": spec.rope_theta},
        tie_word_embeddings=spec.tie_word_embeddings,
        bos_token_id=None,
        eos_token_id=tokenizer.convert_tokens_to_ids(IM_END),
        pad_token_id=tokenizer.convert_tokens_to_ids(PAD_TOKEN),
        dtype="float32",
    )
    if spec.moe is not None:
        # Every expert as wide as the dense MLP it is upcycled from; top-k weights renormalised.
        text.update(num_experts=spec.moe.num_experts, num_experts_per_tok=spec.moe.experts_per_token,
                    moe_intermediate_size=spec.intermediate_size)
    if spec.linear_attention is None:
        if spec.moe is not None:
            from transformers import Qwen3MoeConfig

            return Qwen3MoeConfig(**text, norm_topk_prob=True, architectures=["Qwen3MoeForCausalLM"])
        return Qwen3Config(**text, architectures=["Qwen3ForCausalLM"])
    from transformers import Qwen3_5Config, Qwen3_5TextConfig

    linear = spec.linear_attention
    text.update(
        layer_types=list(linear.layer_types),
        linear_num_key_heads=linear.num_key_heads,
        linear_num_value_heads=linear.num_value_heads,
        linear_key_head_dim=linear.key_head_dim,
        linear_value_head_dim=linear.value_head_dim,
        linear_conv_kernel_dim=linear.conv_kernel_dim,
    )
    if spec.moe is not None:
        from transformers import Qwen3_5MoeTextConfig

        # Qwen3.5-MoE always renormalises its top-k and adds a sigmoid-gated shared expert.
        return Qwen3_5MoeTextConfig(**text, shared_expert_intermediate_size=spec.intermediate_size,
                                    architectures=["Qwen3_5MoeForCausalLM"])
    if spec.vision is None:
        return Qwen3_5TextConfig(**text, architectures=["Qwen3_5ForCausalLM"])
    # Qwen3.5 checkpoints rotate a quarter of each head with M-RoPE over (time, height, width); the
    # sections split those rotary frequencies as Qwen3.5's own 11/11/10 of 32 do.
    rotary = spec.head_dim // 4 // 2
    text["rope_parameters"] = {"rope_type": "default", "rope_theta": spec.rope_theta, "partial_rotary_factor": 0.25,
                               "mrope_interleaved": True, "mrope_section": _sections(rotary)}
    v = spec.vision
    vision = dict(depth=v.depth, hidden_size=v.hidden_size, intermediate_size=v.intermediate_size,
                  num_heads=v.num_heads, out_hidden_size=spec.hidden_size, patch_size=v.patch_size,
                  temporal_patch_size=v.temporal_patch_size, spatial_merge_size=v.spatial_merge_size,
                  num_position_embeddings=v.num_position_embeddings)
    return Qwen3_5Config(text_config=text, vision_config=vision, tie_word_embeddings=spec.tie_word_embeddings,
                         architectures=["Qwen3_5ForConditionalGeneration"])


def _sections(n: int) -> list[int]:
    """``n`` rotary frequencies split over three axes, the first ones taking the remainder."""
    return [n // 3 + (1 if i < n % 3 else 0) for i in range(3)]


def init_model(spec: ModelSpec, tokenizer: PreTrainedTokenizerFast, seed: int) -> PreTrainedModel:
    import transformers

    config = make_config(spec, tokenizer)
    cls = getattr(transformers, config.architectures[0])
    # The global RNG is the only seed HF's init reads; fork it so the caller's stream is untouched.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = cls(config)
    return model.float()


def add_vision_tower(spec: ModelSpec, tokenizer: PreTrainedTokenizerFast, language_model: PreTrainedModel,
                     seed: int) -> PreTrainedModel:
    """The vision-language model of ``spec`` around a built text model: its weights, a seeded random tower.

    ``language_model`` is the matching text-only hybrid (``Qwen3_5ForCausalLM``); on text the result
    computes what it computes (M-RoPE with one position on all three axes is its plain RoPE).
    """
    model = init_model(spec, tokenizer, seed)
    model.model.language_model.load_state_dict(language_model.model.state_dict())
    if not spec.tie_word_embeddings:
        model.lm_head.load_state_dict(language_model.lm_head.state_dict())
    return model


def upcycle(spec: ModelSpec, tokenizer: PreTrainedTokenizerFast, dense: PreTrainedModel, seed: int) -> PreTrainedModel:
    """The MoE model of ``spec`` from its dense counterpart ``dense`` (same sizes, ``moe=None``).

    Everything but the MLPs is copied. Each expert is the dense MLP plus ``expert_noise`` times each
    matrix's RMS of seeded noise; the router starts random (``router_std``). With the top-k weights
    summing to 1, noiseless experts would compute the dense MLP exactly whatever the router picks.
    Qwen3.5-MoE's shared expert starts as the dense MLP with its output projection at zero, so it
    adds nothing until trained.
    """
    moe = spec.moe
    if moe is None:
        raise ValueError("upcycle needs spec.moe")
    model = init_model(spec, tokenizer, seed)
    missing, unexpected = model.load_state_dict(dense.state_dict(), strict=False)
    if any(".mlp." not in name for name in [*missing, *unexpected]):
        raise ValueError(f"upcycle: the dense model does not match outside the MLPs ({[*missing, *unexpected][:4]})")
    gen = torch.Generator().manual_seed(seed)

    def noisy(weight: torch.Tensor) -> torch.Tensor:
        return weight + moe.expert_noise * weight.pow(2).mean().sqrt() * torch.randn(weight.shape, generator=gen)

    with torch.no_grad():
        for layer, dense_layer in zip(model.model.layers, dense.model.layers, strict=True):
            mlp, block = dense_layer.mlp, layer.mlp
            gate_up = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])
            for e in range(moe.num_experts):
                block.experts.gate_up_proj[e].copy_(noisy(gate_up))
                block.experts.down_proj[e].copy_(noisy(mlp.down_proj.weight))
            block.gate.weight.normal_(0.0, moe.router_std, generator=gen)
            shared = getattr(block, "shared_expert", None)
            if shared is not None:
                shared.load_state_dict(mlp.state_dict())
                shared.down_proj.weight.zero_()
                block.shared_expert_gate.weight.zero_()
    return model.float()


def warmup_conversations(
    w: WarmupSpec, problems: Sequence[tasks.Problem], *, with_tools: bool, seed: int
) -> Iterator[list[dict[str, Any]]]:
    """Endless seeded stream of warm-up chats drawn from the train problems.

    With ``with_tools`` the prompt lists the calculator (the caller renders it) and a ``tool_prob``
    share of the chats call it; the others answer directly, right with probability ``correct_prob``.
    """
    rng = random.Random(f"warmup-{seed}-{with_tools}")
    while True:
        problem = rng.choice(problems)
        template = rng.randrange(len(tasks.QUESTION_TEMPLATES))
        system = tasks.SYSTEM_PROMPT if rng.random() < w.system_prob else None
        if with_tools and rng.random() < w.tool_prob:
            yield tasks.tool_conversation(problem, template, system, reasoning=rng.random() < w.reasoning_prob)
            continue
        value = problem.value
        if rng.random() >= w.correct_prob:
            # Near misses, as a weak model makes them; never negative, so the wrong answer stays wrong.
            value += rng.choice([d for d in (-2, -1, 1, 2) if value + d >= 0])
        answer = tasks.answer_text(problem, value, rng.randrange(len(tasks.ANSWER_TEMPLATES)))
        yield [*tasks.make_prompt(problem, template, system), {"role": "assistant", "content": answer}]


@dataclass
class Example:
    input_ids: list[int]
    labels: list[int]  # -100 outside assistant tokens


def encode_pool(
    w: WarmupSpec, tokenizer: PreTrainedTokenizerFast, problems: Sequence[tasks.Problem], *, with_tools: bool, seed: int
) -> list[Example]:
    """Tokenise ``w.num_examples`` warm-up chats, labels masked to the assistant tokens."""
    pool: list[Example] = []
    stream = warmup_conversations(w, problems, with_tools=with_tools, seed=seed)
    tools = [tasks.CALCULATOR_SCHEMA] if with_tools else None
    for _ in range(w.num_examples):
        enc = tokenizer.apply_chat_template(
            next(stream), tools=tools, tokenize=True, return_dict=True, return_assistant_tokens_mask=True,
        )
        ids, mask = enc["input_ids"], enc["assistant_masks"]
        pool.append(Example(ids, [t if m else -100 for t, m in zip(ids, mask, strict=True)]))
    return pool


def _collate(batch: Sequence[Example], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    width = max(len(e.input_ids) for e in batch)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    labels = torch.full((len(batch), width), -100, dtype=torch.long)
    attn = torch.zeros((len(batch), width), dtype=torch.long)
    for row, ex in enumerate(batch):
        n = len(ex.input_ids)
        ids[row, :n] = torch.tensor(ex.input_ids)
        labels[row, :n] = torch.tensor(ex.labels)
        attn[row, :n] = 1
    return ids, labels, attn


def _lr_at(step: int, w: WarmupSpec) -> float:
    # Linear warm-up then cosine decay to 10% of the peak.
    if step < w.warmup_steps:
        return w.lr * (step + 1) / w.warmup_steps
    progress = (step - w.warmup_steps) / max(1, w.steps - w.warmup_steps)
    return w.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def warmup_train(
    model: PreTrainedModel, pool: Sequence[Example], w: WarmupSpec, *, pad_id: int, seed: int, log_every: int = 0,
    clean_pool: Sequence[Example] | None = None,
) -> list[float]:
    """Run the warm-up in place and return the per-step losses: the first ``w.clean_steps`` steps draw their
    batches from ``clean_pool`` (every answer right), the others from ``pool``."""
    if w.clean_steps and clean_pool is None:
        raise ValueError("a warm-up with clean_steps needs clean_pool")
    rng = random.Random(f"batches-{seed}")
    opt = torch.optim.AdamW(model.parameters(), lr=w.lr, weight_decay=w.weight_decay, betas=(0.9, 0.98))
    model.train()
    losses: list[float] = []
    start = time.perf_counter()
    for step in range(w.steps):
        for group in opt.param_groups:
            group["lr"] = _lr_at(step, w)
        source = clean_pool if step < w.clean_steps else pool
        ids, labels, attn = _collate([source[rng.randrange(len(source))] for _ in range(w.batch_size)], pad_id)
        loss = model(input_ids=ids, attention_mask=attn, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        if log_every and (step + 1) % log_every == 0:
            print(f"warmup step {step + 1}/{w.steps} loss {loss.item():.4f} ({time.perf_counter() - start:.1f}s)")
    model.eval()
    return losses

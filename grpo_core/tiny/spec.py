"""Hyper-parameters of the offline tiny model: task, tokenizer, architecture and warm-up.

``TinySpec`` is hashed (with ``CODE_VERSION``) into the cache folder name, so any change to a
field, or a bump of ``CODE_VERSION`` after a change to the build code, gives a fresh build.

How the defaults were chosen (1 torch thread, temperature-1 sampling, 128-256 prompts per split):
- Single-digit addition, 80 train / 20 held-out problems. With clean labels the warm-up is still
  mid-way through learning the table when it has to stop (about 0.3 accuracy at 200 steps, 0.7 at
  300), so where it lands depends on the seed. Instead, 65% of warm-up answers are near misses
  (``correct_prob=0.35``), which caps how sure the policy can get: after 400 steps accuracy is
  0.26-0.30 on both splits and the format rate 0.98-1.0, with the right answer the most frequent
  sample on about half of the problems. A plain group-baseline policy gradient (8 prompts x 8
  samples, lr 2e-4, transformers sampling) took a 500-step build of this recipe from 0.33 to
  0.55-0.6 mean accuracy in 100 steps, which is the room RL needs.
- The tools variant fine-tunes that model for 300 steps on chats with the calculator listed, 20% of
  which call it: about 10% of sampled answers then make a well-formed call, accuracy is ~0.27 and
  format ~0.9; calling the tool more is how RL can gain. Every call first thinks in a short
  ``<think>`` block (``reasoning_prob=1``), so a chat template that drops earlier reasoning, as
  Qwen3's does, rewrites the calling turn and the multi-turn reconcile must fork.
- The Qwen3.5 variants (``arithmetic-hybrid``: 3 Gated DeltaNet + 1 attention layer, same width;
  ``arithmetic-vlm``: that language model with a random vision tower) take the arithmetic warm-up
  unchanged: accuracy 0.28 (train) / 0.20 (held out), format 0.96-0.99 (128 samples each). Linear
  heads are 64 wide because vLLM's CPU kernels refuse 32, and the short convolution 4 wide because
  that is the width its CPU build prepacks. The warm-up costs more than the Qwen3 one per step (the
  transformers fallback of the gated delta rule); the VLM reuses the hybrid build and trains nothing.
- The mixture-of-experts variants (``arithmetic-moe``: Qwen3-MoE, ``arithmetic-hybrid-moe``: Qwen3.5-MoE)
  are upcycled from the cached dense builds (``MoESpec``: 8 experts as wide as the dense MLP, top-2) and
  warmed up for 40 more steps at lr 1e-3 (65 s and 151 s of CPU time for the whole builds on two
  cores), accuracy (train / held out, 128 samples) 0.29 / 0.27 and 0.17 / 0.28, format 0.98-0.99.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field, replace

# Bump when the build code changes what it produces for the same spec (corpus text, template, loop).
CODE_VERSION = 1

VARIANTS = ("arithmetic", "tools", "arithmetic-hybrid", "arithmetic-vlm", "arithmetic-moe", "arithmetic-hybrid-moe")
MOE_BASES = {"arithmetic-moe": "arithmetic", "arithmetic-hybrid-moe": "arithmetic-hybrid"}
"""Each mixture-of-experts variant and the dense variant whose build it is upcycled from."""


@dataclass(frozen=True)
class TaskSpec:
    """The arithmetic problem space and its fixed train / eval split."""

    max_operand: int = 9
    """Operands are drawn from 0..max_operand."""
    ops: tuple[str, ...] = ("+",)
    """Operators in the problem space ('+' and/or '-'; subtraction keeps results >= 0)."""
    eval_fraction: float = 0.2
    """Share of the problems held out for evaluation."""
    split_seed: int = 1234
    """Seed of the held-out split. Separate from the model seed so that every model build and every
    data set agree on which problems are held out."""

    def __post_init__(self) -> None:
        if not 1 <= self.max_operand <= 99:
            raise ValueError(f"max_operand must be in 1..99, got {self.max_operand}")
        if not self.ops or any(op not in ("+", "-") for op in self.ops):
            raise ValueError(f"ops must be a non-empty subset of ('+', '-'), got {self.ops}")
        if not 0.0 < self.eval_fraction < 0.5:
            raise ValueError(f"eval_fraction must be in (0, 0.5), got {self.eval_fraction}")


@dataclass(frozen=True)
class LinearAttentionSpec:
    """Gated DeltaNet layers, making the model a Qwen3.5-style hybrid (``Qwen3_5ForCausalLM``)."""

    layer_types: tuple[str, ...] = ("linear_attention", "linear_attention", "linear_attention", "full_attention")
    """One entry per decoder layer; replaces ``num_hidden_layers``."""
    num_key_heads: int = 2
    num_value_heads: int = 4
    key_head_dim: int = 64
    """vLLM's CPU kernels refuse 32 ("Unexpected head dim size")."""
    value_head_dim: int = 64
    conv_kernel_dim: int = 4
    """Width of the short convolution; vLLM's CPU build prepacks and runs width 4 only."""

    def __post_init__(self) -> None:
        if set(self.layer_types) - {"linear_attention", "full_attention"} or "linear_attention" not in self.layer_types:
            raise ValueError(f"layer_types must mix 'linear_attention' and 'full_attention', got {self.layer_types}")
        if self.num_value_heads % self.num_key_heads:
            raise ValueError("num_value_heads must be a multiple of num_key_heads")
        if self.conv_kernel_dim != 4:
            raise ValueError("vLLM's CPU Gated DeltaNet convolution handles conv_kernel_dim 4 only")


@dataclass(frozen=True)
class VisionSpec:
    """A tiny vision tower and projector, making the model a vision-language model
    (``Qwen3_5ForConditionalGeneration``). Random and never trained: the trainer freezes it and a
    server started with ``ServerOptions.language_model_only`` does not build it."""

    depth: int = 1
    hidden_size: int = 32
    intermediate_size: int = 64
    num_heads: int = 2
    patch_size: int = 4
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    num_position_embeddings: int = 64
    """Learned patch positions (an 8 x 8 grid); Qwen3.5's default of 2304 would make the tower the
    largest part of the tiny model."""


@dataclass(frozen=True)
class MoESpec:
    """Sparse mixture-of-experts MLPs (``Qwen3MoeForCausalLM``, or ``Qwen3_5MoeForCausalLM`` with
    ``linear_attention``), upcycled from the dense build: every expert starts as that model's MLP
    plus seeded noise, so the MoE model starts where the dense one ended and a short warm-up
    makes its experts and router differ."""

    num_experts: int = 8
    experts_per_token: int = 2
    """Top-k of the router; the top-k weights are renormalised to sum to 1 (so identical experts
    compute the dense MLP exactly)."""
    expert_noise: float = 0.5
    """Seeded noise added to each expert's copy of the dense weights, times each matrix's RMS: what
    makes the experts, and so the router's choice, differ from the first step. Measured on the
    Qwen3 build: at 0.5 the upcycled model's warm-up loss is the dense one's (0.200 vs 0.198), and
    swapping each token's k-th expert for its (k+1)-th moves answer log-probs by 0.004 on average
    (0.34 at most); at 0.2, 0.002 (0.12)."""
    router_std: float = 0.5
    """Standard deviation of the router's initial weights."""

    def __post_init__(self) -> None:
        if not 1 <= self.experts_per_token < self.num_experts <= 256:
            raise ValueError("need 1 <= experts_per_token < num_experts <= 256 (vLLM returns routes as uint8 up to 256)")


@dataclass(frozen=True)
class ModelSpec:
    """Qwen3 architecture sizes (head_dim 64 because vLLM's CPU attention rejects smaller heads);
    ``linear_attention`` makes it a Qwen3.5 Gated DeltaNet hybrid and ``vision`` a vision-language model."""

    hidden_size: int = 256
    intermediate_size: int = 512
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 64
    max_position_embeddings: int = 512
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = True
    """Tied input/output embeddings: fewer parameters to train and to sync to vLLM."""
    linear_attention: LinearAttentionSpec | None = None
    """Gated DeltaNet layers (None: attention only, ``Qwen3ForCausalLM``)."""
    vision: VisionSpec | None = None
    """Vision tower (needs ``linear_attention``: the vision-language model is a Qwen3.5)."""
    moe: MoESpec | None = None
    """Sparse MoE MLPs in every decoder layer, each expert as wide as ``intermediate_size``."""

    def __post_init__(self) -> None:
        if self.moe is not None and self.vision is not None:
            raise ValueError("moe and vision: the tiny MoE variants are text models")
        if self.vision is not None and self.linear_attention is None:
            raise ValueError("vision needs linear_attention: the tiny vision-language model is a Qwen3.5")
        if self.linear_attention is not None and len(self.linear_attention.layer_types) != self.num_hidden_layers:
            raise ValueError("num_hidden_layers must equal len(linear_attention.layer_types)")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.head_dim < 32:
            raise ValueError("vLLM's CPU attention needs head_dim >= 32 (64 is what was tested)")


@dataclass(frozen=True)
class WarmupSpec:
    """Supervised warm-up that teaches the answer format and leaves accuracy partial."""

    steps: int = 400
    batch_size: int = 32
    lr: float = 5e-3
    weight_decay: float = 0.01
    warmup_steps: int = 10
    correct_prob: float = 0.35
    """Probability that a warm-up answer states the right result; the rest are off by 1 or 2. Below 1
    this caps how sure the policy becomes, leaving reward for RL to gain."""
    clean_steps: int = 0
    """The first ``clean_steps`` of ``steps`` train on answers that are all right, the rest on answers right with
    ``correct_prob``: the model first learns the sums, then to miss them by 1 or 2 most of the time."""
    tool_prob: float = 0.0
    """(tools variant) Share of warm-up examples that call the calculator instead of answering."""
    reasoning_prob: float = 0.0
    """(tools variant) Share of those calls that first think in a short ``<think>`` block, as
    reasoning models do; templates that drop earlier reasoning then rewrite the call's turn."""
    system_prob: float = 0.5
    """Share of warm-up examples with the system prompt (the rest have only the user turn)."""
    num_examples: int = 4096
    """Size of the pre-tokenised warm-up pool the batches are drawn from."""

    def __post_init__(self) -> None:
        for name in ("correct_prob", "tool_prob", "reasoning_prob", "system_prob"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {value}")
        if self.steps < 0 or self.batch_size < 1 or self.warmup_steps < 0:
            raise ValueError("steps and warmup_steps must be >= 0 and batch_size >= 1")
        if not 0 <= self.clean_steps <= self.steps:
            raise ValueError(f"clean_steps must be in [0, steps={self.steps}], got {self.clean_steps}")


@dataclass(frozen=True)
class TokenizerSpec:
    vocab_size: int = 512
    """Target BPE vocabulary including the 256 byte symbols and the special / added tokens."""
    corpus_size: int = 3000
    """Number of synthetic conversations the BPE merges are learned from."""


@dataclass(frozen=True)
class TinySpec:
    """Everything that determines the bytes of a built tiny model folder."""

    variant: str = "arithmetic"
    seed: int = 0
    task: TaskSpec = field(default_factory=TaskSpec)
    tokenizer: TokenizerSpec = field(default_factory=TokenizerSpec)
    model: ModelSpec = field(default_factory=ModelSpec)
    warmup: WarmupSpec = field(default_factory=WarmupSpec)
    """Warm-up from the seeded initialisation on plain arithmetic chats."""
    tools_warmup: WarmupSpec | None = None
    """(tools variant only) Second warm-up, started from the built arithmetic model, on chats whose
    prompt lists the calculator tool."""
    moe_warmup: WarmupSpec | None = None
    """(MoE variants only) Warm-up of the model upcycled from the dense build (``MoESpec``), on the
    same chats as ``warmup``."""
    eval_samples: int = 128
    """Sampled completions per split scored at the end of the build and recorded in build_info.json
    (0 skips it)."""
    num_threads: int = 1
    """Torch threads during the build; CPU reductions depend on it, so it is part of the spec. One
    thread: on a shared 2-core box two OpenMP threads ran the warm-up several times slower than one."""

    def __post_init__(self) -> None:
        if self.variant not in VARIANTS:
            raise ValueError(f"variant must be one of {VARIANTS}, got {self.variant!r}")
        if (self.variant == "tools") != (self.tools_warmup is not None):
            raise ValueError("tools_warmup must be set for the tools variant and only for it")
        if (self.variant in MOE_BASES) != (self.moe_warmup is not None):
            raise ValueError("moe_warmup must be set for the MoE variants and only for them")
        if self.warmup.tool_prob:
            raise ValueError("warmup.tool_prob must be 0: tool use is taught by tools_warmup")
        hybrid, vision, moe = (self.model.linear_attention is not None, self.model.vision is not None,
                               self.model.moe is not None)
        expected = {"arithmetic-hybrid": (True, False, False), "arithmetic-vlm": (True, True, False),
                    "arithmetic-moe": (False, False, True), "arithmetic-hybrid-moe": (True, False, True)}
        if (hybrid, vision, moe) != expected.get(self.variant, (False, False, False)):
            raise ValueError(f"variant {self.variant!r}: model.linear_attention is for the hybrid, VLM and hybrid-MoE "
                             "variants, model.vision for the VLM variant only, model.moe for the MoE variants only")

    def base(self) -> TinySpec | None:
        """The spec whose built model this variant starts from (None: built from scratch).

        The tools variant fine-tunes the arithmetic model; the VLM variant is the hybrid's warmed-up
        language model with a random vision tower added, so both Qwen3.5 variants start from the same
        policy and only one of them pays for a warm-up.
        """
        if self.variant == "tools":
            return replace(self, variant="arithmetic", tools_warmup=None)
        if self.variant == "arithmetic-vlm":
            return replace(self, variant="arithmetic-hybrid", model=replace(self.model, vision=None))
        if self.variant in MOE_BASES:
            return replace(self, variant=MOE_BASES[self.variant], model=replace(self.model, moe=None), moe_warmup=None)
        return None

    def to_json(self) -> str:
        return json.dumps({"code_version": CODE_VERSION, **_without_late_defaults(asdict(self))}, sort_keys=True)

    def digest(self) -> str:
        return hashlib.sha256(self.to_json().encode()).hexdigest()[:12]


# Fields added after models were first cached, with the default that reproduces the older build.
# Left out of the digest at that default, so adding them does not invalidate existing caches.
_LATE_FIELD_DEFAULTS = {"reasoning_prob": 0.0, "clean_steps": 0, "linear_attention": None, "vision": None, "moe": None, "moe_warmup": None}


def _without_late_defaults(value: object) -> object:
    if isinstance(value, dict):
        return {k: _without_late_defaults(v) for k, v in value.items()
                if not (k in _LATE_FIELD_DEFAULTS and v == _LATE_FIELD_DEFAULTS[k])}
    return value


# The Qwen3 arithmetic model's warm-up (and so the tools and MoE variants' base): the sums first, then the near
# misses (see the module docstring).
ARITHMETIC_WARMUP = WarmupSpec(clean_steps=300)

# The upcycled MoE models' warm-up: the dense recipe (same noisy answers), shorter and slower, since it
# starts from the dense model's policy and only has to make the experts and the router differ.
MOE_WARMUP = WarmupSpec(steps=40, lr=1e-3, warmup_steps=5)


def default_spec(variant: str = "arithmetic", seed: int = 0) -> TinySpec:
    """The tuned spec for each variant (see the module docstring for the measurements behind it)."""
    if variant in MOE_BASES:
        dense = default_spec(MOE_BASES[variant], seed)
        return replace(dense, variant=variant, model=replace(dense.model, moe=MoESpec()), moe_warmup=MOE_WARMUP)
    if variant in ("arithmetic-hybrid", "arithmetic-vlm"):
        model = ModelSpec(num_hidden_layers=4, linear_attention=LinearAttentionSpec(),
                          vision=VisionSpec() if variant == "arithmetic-vlm" else None)
        return TinySpec(variant=variant, seed=seed, model=model)
    if variant != "tools":
        return TinySpec(variant=variant, seed=seed, warmup=ARITHMETIC_WARMUP)
    # Tool calls always give the right answer, direct answers rarely do: accuracy starts near
    # tool_prob + (1 - tool_prob) * correct_prob and RL can raise it by calling the tool more.
    tools = WarmupSpec(steps=300, batch_size=16, lr=3e-3, warmup_steps=10, correct_prob=0.2, tool_prob=0.2,
                       reasoning_prob=1.0, num_examples=2048)
    return TinySpec(variant=variant, seed=seed, warmup=ARITHMETIC_WARMUP, tools_warmup=tools)

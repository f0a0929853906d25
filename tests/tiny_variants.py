"""The Qwen3.5 tiny variants as the CI checks of weight sync and serving build them: a short warm-up.

The checks in ``tests/integration/test_hybrid_models.py`` compare the server's log-probs with the
trainer's on sampled tokens before and after pushes; they hold for any weights, so they need a model that
is past its initialisation (every tensor moved by training, norms and decays included), not one that has
learned arithmetic. The default specs warm the hybrid up for 400 steps of about a second each on one core
(its Gated DeltaNet layers run PyTorch's reference code on a CPU); 40 steps move every tensor. The
learning test, which needs the tuned model, builds the default spec (``grpo_core.tiny.default_spec``).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from grpo_core.tiny import TinySpec, build_from_spec, default_spec

CHECK_WARMUP_STEPS = 40
MOE_CHECK_WARMUP_STEPS = 10
"""The mixture-of-experts variants' own warm-up in the checks: the upcycled model starts from the dense
build's trained weights (every tensor already moved), so a few steps are enough to move the routers."""


def check_spec(variant: str) -> TinySpec:
    """``variant``'s default spec with a short warm-up and no build-time evaluation.

    A mixture-of-experts variant is upcycled from its dense variant's check build, except ``arithmetic-moe``,
    which starts from the default ``arithmetic`` build that the session's server already needs."""
    spec = default_spec(variant)
    if spec.moe_warmup is not None:
        warmup = spec.warmup if variant == "arithmetic-moe" else replace(spec.warmup, steps=CHECK_WARMUP_STEPS)
        return replace(spec, warmup=warmup, moe_warmup=replace(spec.moe_warmup, steps=MOE_CHECK_WARMUP_STEPS),
                       eval_samples=0 if variant != "arithmetic-moe" else spec.eval_samples)
    return replace(spec, warmup=replace(spec.warmup, steps=CHECK_WARMUP_STEPS), eval_samples=0)


def build_check_variant(variant: str) -> Path:
    return build_from_spec(check_spec(variant))


def build_moe_variants() -> None:
    """Both mixture-of-experts variants for the checks."""
    for variant in ("arithmetic-moe", "arithmetic-hybrid-moe"):
        build_check_variant(variant)


def build_hybrid_variants() -> None:
    """Both Qwen3.5 variants for the checks (the VLM reuses the hybrid's build)."""
    for variant in ("arithmetic-hybrid", "arithmetic-vlm"):
        build_check_variant(variant)

"""The Qwen3.5 tiny variants (Gated DeltaNet hybrid, vision-language model) and what their server needs.

Small specs built from code in seconds: the hybrid is a ``Qwen3_5ForCausalLM``, the VLM is the
hybrid's language model inside a ``Qwen3_5ForConditionalGeneration`` with a random tower (same
text log-probs, tower frozen by the trainer), and each model's config decides its server's options
(bf16 on CPU for Gated DeltaNet layers, ``--language-model-only`` for a vision tower), also through
the flow's ``server_spec``. The served variants are tested in tests/integration/test_hybrid_models.py.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from grpo_core.tiny import build_from_spec, default_spec
from grpo_core.tiny.spec import LinearAttentionSpec, ModelSpec, TinySpec, TokenizerSpec, VisionSpec, WarmupSpec
from grpo_core.vllm_server.model_needs import model_server_options, server_needs
from grpo_core.vllm_server.process import ServerOptions

SMALL_MODEL = ModelSpec(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                        num_key_value_heads=1, head_dim=32,
                        linear_attention=LinearAttentionSpec(layer_types=("linear_attention", "full_attention"),
                                                             num_key_heads=1, num_value_heads=2))
SMALL = TinySpec(variant="arithmetic-hybrid", tokenizer=TokenizerSpec(corpus_size=400), model=SMALL_MODEL,
                 warmup=WarmupSpec(steps=3, batch_size=4, num_examples=32, warmup_steps=1), eval_samples=0)
SMALL_VLM = replace(SMALL, variant="arithmetic-vlm", model=replace(SMALL_MODEL, vision=VisionSpec()))


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    cache = tmp_path_factory.mktemp("tiny")
    # Building the VLM builds the hybrid it starts from (into the same cache).
    vlm = build_from_spec(SMALL_VLM, cache)
    return {"hybrid": build_from_spec(SMALL, cache), "vlm": vlm}


# ---- specs ------------------------------------------------------------------------------------------------
def test_new_fields_leave_the_cached_variants_digests_alone() -> None:
    # Fields at their defaults stay out of the digest, so folders built before them remain valid.
    for variant in ("arithmetic", "tools"):
        text = default_spec(variant).to_json()
        assert "linear_attention" not in text and '"vision"' not in text
    hybrid, vlm = default_spec("arithmetic-hybrid"), default_spec("arithmetic-vlm")
    assert len({default_spec(v).digest() for v in ("arithmetic", "tools", "arithmetic-hybrid", "arithmetic-vlm")}) == 4
    assert vlm.base() == hybrid and hybrid.base() is None and default_spec("tools").base() == default_spec("arithmetic")


def test_specs_refuse_what_the_cpu_build_cannot_serve() -> None:
    with pytest.raises(ValueError, match="conv_kernel_dim 4"):
        LinearAttentionSpec(conv_kernel_dim=3)
    with pytest.raises(ValueError, match="num_hidden_layers"):
        ModelSpec(num_hidden_layers=2, linear_attention=LinearAttentionSpec())
    with pytest.raises(ValueError, match="vision needs linear_attention"):
        ModelSpec(vision=VisionSpec())
    with pytest.raises(ValueError, match="variant 'arithmetic'"):
        TinySpec(variant="arithmetic", model=SMALL_MODEL)
    with pytest.raises(ValueError, match="variant 'arithmetic-vlm'"):
        TinySpec(variant="arithmetic-vlm", model=SMALL_MODEL)


# ---- builds -----------------------------------------------------------------------------------------------
def test_hybrid_and_vlm_builds(built: dict[str, Path]) -> None:
    from transformers import AutoConfig, AutoTokenizer

    from grpo_core.models.loading import load_policy
    from grpo_core.models.vision import frozen_tower_prefixes

    hybrid, _ = load_policy(str(built["hybrid"]), torch.device("cpu"))
    vlm, _ = load_policy(str(built["vlm"]), torch.device("cpu"))
    assert type(hybrid).__name__ == "Qwen3_5ForCausalLM" and type(vlm).__name__ == "Qwen3_5ForConditionalGeneration"
    config = AutoConfig.from_pretrained(built["vlm"])
    assert config.get_text_config().layer_types == ["linear_attention", "full_attention"]
    assert json.loads((built["vlm"] / "build_info.json").read_text())["base"] == built["hybrid"].name
    assert AutoTokenizer.from_pretrained(built["vlm"]).get_vocab() == AutoTokenizer.from_pretrained(built["hybrid"]).get_vocab()

    # The VLM's language model is the hybrid's, bit for bit; its tower is there and frozen.
    text = dict(hybrid.model.named_parameters())
    language = dict(vlm.model.language_model.named_parameters())
    assert text.keys() == language.keys() and all(torch.equal(text[n], language[n]) for n in text)
    assert frozen_tower_prefixes(vlm) == ("model.visual.",)
    ids = torch.tensor([list(range(5, 30))])
    with torch.no_grad():
        assert torch.equal(hybrid(input_ids=ids).logits, vlm(input_ids=ids).logits)


# ---- server options ------------------------------------------------------------------------------------------
def test_server_options_follow_the_model(built: dict[str, Path], tmp_path: Path) -> None:
    from transformers import AutoConfig

    hybrid, vlm = AutoConfig.from_pretrained(built["hybrid"]), AutoConfig.from_pretrained(built["vlm"])
    assert set(server_needs(hybrid, cuda=False)) == {"dtype"}
    assert server_needs(hybrid, cuda=True) == {}  # GPU kernels take the user's dtype
    assert {k: v for k, (v, _) in server_needs(vlm, cuda=False).items()} == {"dtype": "bfloat16", "language_model_only": True}

    user = ServerOptions(kv_cache_gib=3, max_model_len=256)
    got = model_server_options(str(built["vlm"]), user, cuda=False)
    assert (got.dtype, got.language_model_only, got.kv_cache_gib, got.max_model_len) == ("bfloat16", True, 3, 256)
    eager = ServerOptions(enforce_eager=True)
    assert model_server_options(str(built["hybrid"]), eager, cuda=False).enforce_eager is True  # the user's choice stays
    assert model_server_options(str(built["hybrid"]), user, cuda=True) is user
    plain = build_from_spec(replace(SMALL, variant="arithmetic", model=replace(SMALL_MODEL, num_hidden_layers=1,
                                                                               linear_attention=None)), tmp_path)
    assert model_server_options(str(plain), user, cuda=False) is user
    assert model_server_options(str(tmp_path / "missing"), user, cuda=False) is user


def test_flow_server_spec_derives_the_options(built: dict[str, Path]) -> None:
    from flows.provision import LocalProvisioner
    from flows.placement import server_spec
    from grpo_core.launch.job import JobConfig

    job = JobConfig.model_validate({"model": "tiny:arithmetic-vlm", "trainer": {"output_dir": "unused"}})
    spec = server_spec(job, str(built["vlm"]), LocalProvisioner())
    flags = spec.flags()
    assert flags[flags.index("--dtype") + 1] == "bfloat16" and "--language-model-only" in flags
    job = JobConfig.model_validate({"model": "tiny:arithmetic-hybrid", "trainer": {"output_dir": "unused"}})
    assert "--language-model-only" not in server_spec(job, str(built["hybrid"]), LocalProvisioner()).flags()


def test_a_printed_server_command_carries_what_the_model_needs(built: dict[str, Path]) -> None:
    """The command a check prints for the user to copy starts a server the model can run on: a Gated DeltaNet model
    on the CPU gets bf16 whatever the trainer computes in, and an option the check asks for stays."""
    from grpo_core.config import AsyncGRPOConfig
    from grpo_core.vllm_server.checks import recommended_command

    fp32_trainer = AsyncGRPOConfig(output_dir="unused", bf16=False)
    assert "--dtype bfloat16" in recommended_command(fp32_trainer, str(built["hybrid"]))
    assert "--language-model-only" in recommended_command(fp32_trainer, str(built["vlm"]))
    asked = recommended_command(fp32_trainer, str(built["hybrid"]), return_routed_experts=True)
    assert "--dtype bfloat16" in asked and "--enable-return-routed-experts" in asked
    assert "--dtype float32" in recommended_command(fp32_trainer, "<model>")  # no folder: the trainer's dtype

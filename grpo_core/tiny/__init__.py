"""Offline tiny model, tokenizer and task data for the embedded default, the examples and the tests.

Nothing is downloaded: a byte-level BPE tokenizer and a small Qwen3 model are built from code and
seeds, warmed up on synthetic arithmetic so that they answer in ``\\boxed{}`` and are right only part
of the time, and cached as an HF folder that transformers and vLLM both load.

    from grpo_core.tiny import arithmetic_dataset, build_tiny_model
    model_path = build_tiny_model()                 # ~/.cache/grpo_core/tiny/arithmetic-<digest>
    dataset = arithmetic_dataset()                  # DatasetDict with "train" and "eval"

Variants (``build_tiny_model(variant=...)``, ``model: tiny:<variant>`` in a job): ``arithmetic``
(Qwen3), ``tools`` (calls a calculator), ``arithmetic-hybrid`` (Qwen3.5 Gated DeltaNet hybrid),
``arithmetic-vlm`` (Qwen3.5 vision-language model, trained on text), and the mixture-of-experts models
upcycled from the dense ones: ``arithmetic-moe`` (Qwen3-MoE) and ``arithmetic-hybrid-moe`` (Qwen3.5-MoE:
Gated DeltaNet and MoE). The Qwen3.5 ones are served in bf16 on CPU, the VLM without its tower
(``grpo_core.vllm_server.model_needs``).

Modules: ``spec`` (hyper-parameters), ``tasks`` (problems, prompts, split, calculator tool),
``tokenizer`` (BPE + chat template), ``warmup`` (model init and supervised warm-up),
``evaluate`` (sampled accuracy / format measurement), ``build`` (cache and atomic build).
"""

from grpo_core.tiny.build import build_from_spec, build_tiny_model, cache_root, model_dir
from grpo_core.tiny.spec import CODE_VERSION, TinySpec, default_spec
from grpo_core.tiny.tasks import CALCULATOR_SCHEMA, SYSTEM_PROMPT, arithmetic_dataset, calculator

__all__ = [
    "CALCULATOR_SCHEMA",
    "CODE_VERSION",
    "SYSTEM_PROMPT",
    "TinySpec",
    "arithmetic_dataset",
    "build_from_spec",
    "build_tiny_model",
    "cache_root",
    "calculator",
    "default_spec",
    "model_dir",
]

"""Vision-language models trained on text only: the right class, a frozen vision tower, no images.

Qwen3.5/3.6 and Qwen3-VL checkpoints are vision-language models (``*ForConditionalGeneration``:
``model.visual`` = vision tower + ``merger`` projector (+ Qwen3-VL's ``deepstack_merger_list``),
``model.language_model``, ``lm_head``). Training them on text:

* they are loaded with the class their config names (``policy_class``), not
  ``AutoModelForCausalLM``, which for Qwen3.5 silently builds the text model alone: a checkpoint
  then keeps the whole model, so a vLLM server can start on it;
* the tower and projector get ``requires_grad=False`` (``freeze_vision_towers``): a text-only row
  never runs them, so they have no gradient, the optimizer (built over trainable parameters) keeps
  no state for them, and weight sync leaves them out (``frozen_tower_prefixes``): the server keeps
  what it loaded;
* a prompt with an image is refused before it becomes tokens (``grpo_core.data.inputs.refuse_images``):
  its image tokens would need the tower and 3-D M-RoPE positions from the image grid, which packed rows
  do not build.

With FSDP2 the frozen tower is its own unit (``grpo_core.models.fsdp.shard_policy``): sharded, and
never gathered since it never runs, rather than riding in the root unit that is gathered every step.
"""

from __future__ import annotations

from typing import Any

import torch

from grpo_core.models.param_names import checkpoint_name

# Submodules that hold a vision tower or its projector in transformers' vision-language models.
VISION_MODULE_NAMES = ("visual", "vision_tower", "vision_model", "multi_modal_projector")
_CLASS_SUFFIXES = ("ForCausalLM", "ForConditionalGeneration")
_PEFT_PREFIX = "base_model.model."


def policy_class(config: Any) -> type | None:
    """The transformers class ``config.architectures[0]`` names, when it is a generative LM class.

    None when the config names none (an in-memory config) or names a head the trainer cannot use
    (a classifier, say): the caller falls back to ``AutoModelForCausalLM``.
    """
    import transformers

    names = getattr(config, "architectures", None) or []
    if not names or not names[0].endswith(_CLASS_SUFFIXES):
        return None
    return getattr(transformers, names[0], None)


def vision_towers(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """``(name, module)`` of the outermost vision towers / projectors of ``model``, in module order."""
    found: list[tuple[str, torch.nn.Module]] = []
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] in VISION_MODULE_NAMES and not any(name.startswith(n + ".") for n, _ in found):
            found.append((name, module))
    return found


def freeze_vision_towers(model: torch.nn.Module) -> list[str]:
    """Set ``requires_grad=False`` on every vision tower and projector; returns their module names."""
    towers = vision_towers(model)
    for _, module in towers:
        module.requires_grad_(False)
    return [name for name, _ in towers]


def _checkpoint_prefix(module_name: str) -> str:
    name = checkpoint_name(module_name + ".")
    return name[len(_PEFT_PREFIX):] if name.startswith(_PEFT_PREFIX) else name


def frozen_tower_prefixes(model: torch.nn.Module) -> tuple[str, ...]:
    """Checkpoint-name prefixes (``"model.visual."``) of the towers whose parameters are all frozen.

    Names are given as the server's checkpoint knows them (wrapper parts and peft's prefix taken
    out), so a weight source can skip every tensor under them. A tower someone chose to train
    (any parameter with ``requires_grad``) is not listed: its weights change and must be sent.
    """
    prefixes = []
    for name, module in vision_towers(model):
        params = list(module.parameters())
        if params and not any(p.requires_grad for p in params):
            prefixes.append(_checkpoint_prefix(name))
    return tuple(prefixes)

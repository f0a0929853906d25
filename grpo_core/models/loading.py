"""Load the policy and its tokenizer, and pick the device and dtype the trainer runs in."""

from __future__ import annotations

import os
from typing import Any

import torch

from grpo_core.models.vision import freeze_vision_towers, policy_class


def load_policy(model: Any, device: torch.device) -> tuple[torch.nn.Module, str | None]:
    """The policy module in fp32 (master weights) on ``device``; also its source path when known.

    A checkpoint is loaded with the class its config names (``grpo_core.models.vision.policy_class``),
    so vision-language models keep their vision tower and checkpoints stay servable; any vision
    tower and projector is frozen (text-only training, see ``grpo_core.models.vision``).
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    if isinstance(model, (str, os.PathLike)):
        path = str(model)
        cls = policy_class(AutoConfig.from_pretrained(path)) or AutoModelForCausalLM
        module = cls.from_pretrained(path, dtype=torch.float32)
    elif isinstance(model, torch.nn.Module):
        path = getattr(getattr(model, "config", None), "_name_or_path", None) or None
        module = model.float()
    else:
        raise TypeError(f"model must be a path or a loaded transformers model, got {type(model).__name__}")
    if not getattr(module.config, "architectures", None):
        # A model built from a config in memory names no class; checkpoints need it to be served.
        module.config.architectures = [type(module).__name__]
    freeze_vision_towers(module)
    module.to(device)
    module.config.use_cache = False
    return module, path


def load_tokenizer(processing_class: Any, model_path: str | None) -> Any:
    from transformers import AutoTokenizer

    if processing_class is not None:
        return processing_class
    if model_path is None:
        raise ValueError("pass processing_class=tokenizer when model is an in-memory module with no path")
    return AutoTokenizer.from_pretrained(model_path)

"""LoRA on the policy: wrap it with peft, read merged weights for full sync, write the adapter vLLM loads.

* ``apply_lora`` wraps the policy with peft so that only the adapter trains, and refuses the peft
  features that neither a merged push nor vLLM can represent;
* ``merged_named_tensors`` yields every weight of the base model under its checkpoint name, with
  ``W + scaling · B @ A`` computed layer by layer for adapted layers: the trained adapter and the
  base weights stay untouched, and at most one merged layer exists at a time;
* ``adapter_state`` / ``adapter_config`` / ``write_adapter`` give the adapter in PEFT's on-disk
  format (``adapter_config.json`` + ``adapter_model.safetensors``), which both ``peft`` and vLLM's
  ``/v1/load_lora_adapter`` read, on any fsspec location.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from typing import Any

import torch

from grpo_core.storage.store import open_url
from grpo_core.vllm_types import materialize_full_tensor

log = logging.getLogger(__name__)

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
_PEFT_PREFIX = "base_model.model."
_ADAPTER = "default"  # peft's name for the one adapter get_peft_model creates


class LoraConfigError(ValueError):
    """The LoRA config asks for something the weight sync cannot serve; the message says what to change."""


def apply_lora(model: torch.nn.Module, peft_config: Any) -> torch.nn.Module:
    """``model`` wrapped by peft with one trainable adapter; the base weights are frozen."""
    from peft import LoraConfig, get_peft_model
    from peft.tuners.lora import Linear as LoraLinear

    if not isinstance(peft_config, LoraConfig):
        raise LoraConfigError(f"peft_config must be a peft.LoraConfig, got {type(peft_config).__name__}")
    # vLLM's adapter loader rejects these, and a merged push has no place for their extra weights.
    unsupported = {
        "use_dora=True": peft_config.use_dora,
        "lora_bias=True": getattr(peft_config, "lora_bias", False),
        f"bias={peft_config.bias!r}": peft_config.bias != "none",
        f"modules_to_save={peft_config.modules_to_save!r}": bool(peft_config.modules_to_save),
    }
    bad = [name for name, present in unsupported.items() if present]
    if bad:
        raise LoraConfigError(f"LoraConfig with {', '.join(bad)} cannot be synced to vLLM; use plain LoRA on linear layers")
    if max_rank(peft_config) > 512:
        raise LoraConfigError(f"LoRA rank {max_rank(peft_config)} exceeds the largest LoRA rank vLLM serves (512)")
    wrapped = get_peft_model(model, peft_config)
    others = sorted(
        f"{name} ({type(module).__name__})"
        for name, module in wrapped.named_modules()
        if _is_lora_layer(module) and not isinstance(module, LoraLinear)
    )
    if others:
        raise LoraConfigError(f"LoRA targets non-linear layers, which the merge does not handle: {others[:5]}")
    return wrapped


def max_rank(peft_config: Any) -> int:
    """The largest adapter rank in the config (``rank_pattern`` may raise it for some layers)."""
    pattern = getattr(peft_config, "rank_pattern", None) or {}
    return max([int(peft_config.r), *(int(r) for r in pattern.values())])


def _is_lora_layer(module: torch.nn.Module) -> bool:
    from peft.tuners.lora import LoraLayer

    return isinstance(module, LoraLayer)


def base_name(peft_name: str) -> str:
    """The base model's checkpoint name of a peft-wrapped parameter or module name."""
    name = peft_name.removeprefix(_PEFT_PREFIX)
    return name.replace(".base_layer.", ".").removesuffix(".base_layer")


def _full(tensor: torch.Tensor) -> torch.Tensor:
    # FSDP2 shards are DTensors; gather one weight at a time (a collective on every rank).
    return materialize_full_tensor(tensor.detach())


def merged_named_tensors(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Every base weight under its checkpoint name, adapted layers merged; nothing is modified.

    Follows ``named_parameters()`` order (tied weights once), so the order matches a plain model's.
    """
    return _checkpoint_tensors(model, merge=True)


def base_named_tensors(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The frozen base weights under checkpoint names, without the adapter (adapter mode's first push)."""
    return _checkpoint_tensors(model, merge=False)


def _checkpoint_tensors(model: torch.nn.Module, merge: bool) -> Iterator[tuple[str, torch.Tensor]]:
    owners = {f"{name}.base_layer.weight": module for name, module in model.named_modules() if _is_lora_layer(module)}
    for name, param in model.named_parameters():
        if ".lora_" in name:
            continue
        owner = owners.get(name) if merge else None
        yield base_name(name), param if owner is None else _merged_weight(owner)


def _merged_weight(layer: Any) -> torch.Tensor:
    """``W + scaling · B @ A`` in the base weight's dtype, computed in fp32 (one new tensor)."""
    weight = _full(layer.base_layer.weight)
    lora_a = _full(layer.lora_A[_ADAPTER].weight).float()
    lora_b = _full(layer.lora_B[_ADAPTER].weight).float()
    delta = (lora_b @ lora_a) * float(layer.scaling[_ADAPTER])
    if getattr(layer, "fan_in_fan_out", False):
        delta = delta.T  # GPT-2 style Conv1D stores the weight transposed
    return (weight.float() + delta).to(weight.dtype)


def adapter_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The adapter's weights under PEFT's file names (full tensors, CPU, contiguous)."""
    from peft import get_peft_model_state_dict

    state = get_peft_model_state_dict(model, adapter_name=_ADAPTER)
    return {name: _full(t).cpu().contiguous() for name, t in state.items()}


def adapter_files_state(model_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The adapter's entries of a full model state dict, renamed to PEFT's file names.

    Checkpoints gather the whole state dict once (a collective under FSDP); taking the adapter from
    it avoids a second gather on the one rank that writes files.
    """
    marker = f".{_ADAPTER}."
    return {
        name.replace(f".lora_A{marker}", ".lora_A.").replace(f".lora_B{marker}", ".lora_B."): tensor.contiguous()
        for name, tensor in model_state.items()
        if ".lora_A." in name or ".lora_B." in name
    }


def adapter_config(model: torch.nn.Module, base_model_name_or_path: str | None = None) -> dict[str, Any]:
    """``adapter_config.json`` content: the live config, with ``all-linear`` already resolved by peft."""
    config = model.peft_config[_ADAPTER].to_dict()
    if base_model_name_or_path is not None:
        config["base_model_name_or_path"] = base_model_name_or_path
    return _jsonable(config)


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (set, frozenset)):
        return sorted(_jsonable(v) for v in value)
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if hasattr(value, "value") and type(value).__module__.startswith("peft"):  # peft enums (task type)
        return value.value
    return value


def write_adapter(
    model: torch.nn.Module, url: str, base_model_name_or_path: str | None = None, state: dict[str, torch.Tensor] | None = None
) -> int:
    """Write the adapter as a PEFT folder at ``url`` (any fsspec URL); returns the weight bytes written."""
    from safetensors.torch import save

    fs, path = open_url(url)
    state = adapter_state(model) if state is None else state
    blob = save(state, metadata={"format": "pt"})
    fs.makedirs(path, exist_ok=True)
    with fs.open(f"{path}/{ADAPTER_WEIGHTS}", "wb") as f:
        f.write(blob)
    # The config goes last: a reader that finds it may assume the weights are complete.
    with fs.open(f"{path}/{ADAPTER_CONFIG}", "w") as f:
        json.dump(adapter_config(model, base_model_name_or_path), f, indent=2)
    return len(blob)


def warn_if_not_saved(args: Any) -> None:
    """With LoRA the only lasting copy of the adapter is a checkpoint; ``.vllm_lora/`` is a serving cache."""
    if getattr(args, "save_strategy", "steps") == "no":
        log.warning(
            "save_strategy='no' with LoRA: no checkpoint will hold the trained adapter, and "
            "%s/.vllm_lora/ is only a serving cache whose versions are deleted as training moves on, "
            "so nothing of this run will survive it; set save_strategy='steps'",
            getattr(args, "output_dir", "<output_dir>"),
        )

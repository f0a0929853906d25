"""What a checkpoint holds, as tensors: full model and optimizer state, RNG states, the servable folder.

The state dict helpers of ``torch.distributed.checkpoint`` gather FSDP2 shards into full tensors on
rank 0 and work on plain modules too, so the single-process and the sharded trainer share one path.
"""

from __future__ import annotations

import copy
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

from grpo_core.checkpoint.folders import MODEL_FILE, CheckpointError
from grpo_core.models.lora import adapter_files_state, write_adapter

def tied_aliases(model: torch.nn.Module) -> dict[str, str]:
    """``alias -> canonical`` for parameters registered under several names (tied embeddings)."""
    canonical: dict[int, str] = {}
    aliases = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in canonical:
            aliases[name] = canonical[id(param)]
        else:
            canonical[id(param)] = name
    return aliases


def full_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Full (unsharded) model and optimizer state dicts on CPU, complete on rank 0.

    A collective under FSDP: every rank must call it. The same helpers work for a plain module, so
    one code path serves the single-process and the sharded trainer.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(model, options=options), get_optimizer_state_dict(model, optimizer, options=options)


def rng_state() -> dict[str, Any]:
    np_state = np.random.get_state()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        # numpy and python states as plain lists so that weights_only loading accepts them.
        "numpy": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]), float(np_state[4])],
        "python": [random.getstate()[0], list(random.getstate()[1]), random.getstate()[2]],
    }


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    name, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, gauss))
    version, internal, gauss_next = state["python"]
    random.setstate((version, tuple(internal), gauss_next))


def gather_objects(value: Any) -> list[Any]:
    """``value`` of every rank, in rank order (a list of one without torch.distributed)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [value]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def barrier() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def write_servable(folder: Path, model: torch.nn.Module, state: dict[str, torch.Tensor], tokenizer: Any, dtype: torch.dtype) -> None:
    """``model.safetensors`` in ``dtype`` with config, generation config and tokenizer: what vLLM loads."""
    from safetensors.torch import save_file

    aliases = tied_aliases(model)
    # Tied weights are stored once, under the name transformers and vLLM expect (the embedding).
    tensors = {
        name: (t.to(dtype) if t.is_floating_point() else t).contiguous()
        for name, t in state.items()
        if name not in aliases
    }
    save_file(tensors, str(folder / MODEL_FILE), metadata={"format": "pt"})
    config = getattr(model, "config", None)
    if config is not None:
        config = copy.deepcopy(config)
        config.dtype = dtype
        config.use_cache = True  # the trainer turns the cache off for itself, not for a server
        config.save_pretrained(folder)
    generation = getattr(model, "generation_config", None)
    if generation is not None:
        generation.save_pretrained(folder)
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)


def load_weights(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Load a full state dict into ``model`` (sharded or not); only tied aliases may be absent."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    params = dict(model.named_parameters())
    tensors = {k: v.to(params[k].dtype) if k in params else v for k, v in tensors.items()}
    result = set_model_state_dict(model, tensors, options=StateDictOptions(full_state_dict=True, strict=False))
    aliases = tied_aliases(model)
    missing = [k for k in result.missing_keys if not (k in aliases and aliases[k] in tensors)]
    if missing or result.unexpected_keys:
        raise CheckpointError(
            f"checkpoint weights do not fit the model: missing {missing[:5]}, unexpected {list(result.unexpected_keys)[:5]}"
        )


def save_policy(folder: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, tokenizer: Any,
                compute_dtype: torch.dtype, is_main: bool, lora: bool, model_path: str | None) -> None:
    """The trainer's ``save_model``: the policy as a servable Hugging Face folder (weights in the compute dtype, fp32
    kept as it is; config, tokenizer; ``lora``: the adapter too, over ``model_path``). Every rank calls it (the
    gather of a sharded model is collective); rank 0 writes."""
    model_state, _ = full_state(model, optimizer)
    if not is_main:
        return
    folder.mkdir(parents=True, exist_ok=True)
    dtype = next(iter(model_state.values())).dtype if compute_dtype == torch.float32 else compute_dtype
    write_servable(folder, model, model_state, tokenizer, dtype)
    if lora:
        write_adapter(model, str(folder), model_path, state=adapter_files_state(model_state))

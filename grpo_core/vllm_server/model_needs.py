"""What a model needs of the vLLM server that samples it, read from the model's config.

Two architectures need server settings that the user's ``ServerOptions`` defaults do not give:

* Gated DeltaNet hybrids (Qwen3.5/3.6, Qwen3-Next, OLMo hybrid: a ``linear_attention`` entry in
  ``layer_types``) on a CPU server: vLLM's CPU Gated DeltaNet kernels run in bfloat16 only (fp32
  stops at the first forward with "not implemented for 'Float'"), so the server runs in bf16 while
  the trainer keeps fp32; sampler and trainer log-probs then differ by bf16 rounding.
* vision-language models (a ``vision_config``): the trainer trains them on text only with a frozen
  tower (``grpo_core.models.vision``), so the server is started language-model-only
  (``ServerOptions.language_model_only``) and builds no tower either.
* mixture-of-experts models (``num_experts`` and ``num_experts_per_tok`` in the config) on a GPU
  server: it returns each token's routed experts (``ServerOptions.return_routed_experts``), which
  routing replay and the routing-mismatch metric need. Not on a CPU server: vLLM returns routes only
  from its V2 model runner, which needs Triton, so the CPU build refuses to start with the flag
  ("AuxOutput Connector requires Model Runner V2"); there the trainer warns once and routes itself.

``model_server_options`` applies these to the user's options and logs each change with its reason;
the flow's managed server goes through it, so ``model: tiny:arithmetic-hybrid`` in a job file or
``grpo demo --model`` gets the right server without a setting of its own.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from typing import Any

from grpo_core.vllm_server.process import ServerOptions

log = logging.getLogger(__name__)

_IMPORT_LOCK = threading.Lock()


def read_model_config(model: str) -> Any:
    """``AutoConfig.from_pretrained(model)``. The first import of a name from transformers' lazy module is not safe
    from two threads at once (seen: "cannot import name 'AutoConfig'" when two servers were set up side by side)."""
    with _IMPORT_LOCK:
        from transformers import AutoConfig
    return AutoConfig.from_pretrained(model)


def _text_config(config: Any) -> Any:
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def has_gated_delta_layers(config: Any) -> bool:
    """Whether the (text) model has Gated DeltaNet layers: ``linear_attention`` in its ``layer_types``."""
    return "linear_attention" in (getattr(_text_config(config), "layer_types", None) or ())


def is_mixture_of_experts(config: Any) -> bool:
    """Whether the (text) model routes tokens to experts: ``num_experts`` (or ``num_local_experts``) and
    ``num_experts_per_tok`` both set in its config."""
    text = _text_config(config)
    experts = getattr(text, "num_experts", None) or getattr(text, "num_local_experts", None)
    return bool(experts) and bool(getattr(text, "num_experts_per_tok", None))


def has_vision_tower(config: Any) -> bool:
    return getattr(config, "vision_config", None) is not None


def server_needs(config: Any, cuda: bool) -> dict[str, tuple[Any, str]]:
    """``{ServerOptions field: (value, why)}`` that a server for a model with ``config`` must have."""
    needs: dict[str, tuple[Any, str]] = {}
    if has_gated_delta_layers(config) and not cuda:
        needs["dtype"] = ("bfloat16", "vLLM's CPU Gated DeltaNet kernels run in bfloat16 only")
    if has_vision_tower(config):
        needs["language_model_only"] = (True, "training is text-only, so the server need not build the vision tower")
    if is_mixture_of_experts(config) and cuda:
        needs["return_routed_experts"] = (True, "routing replay needs the experts the sampler routed each token to")
    return needs


def model_server_options(model: str, options: ServerOptions, cuda: bool) -> ServerOptions:
    """``options`` with what the model at ``model`` (a folder or hub id) needs of its server.

    A model whose config cannot be read (a hub id offline) keeps ``options`` as they are.
    """
    try:
        config = read_model_config(model)
    except (OSError, ValueError) as exc:
        log.warning("could not read the config of %s (%s): server options are used as given", model, exc)
        return options
    changes: dict[str, Any] = {}
    for name, (value, why) in server_needs(config, cuda).items():
        if getattr(options, name) != value:
            log.info("vLLM server %s: %r instead of %r (%s)", name, value, getattr(options, name), why)
            changes[name] = value
    return dataclasses.replace(options, **changes) if changes else options

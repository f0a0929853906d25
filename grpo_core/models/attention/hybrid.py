"""Gated DeltaNet hybrids (Qwen3.5/3.6, Qwen3-Next, OLMo hybrid) in packed rows: the transformers patches.

transformers' Gated DeltaNet layers do not mix tokens themselves: their ``forward`` calls four
functions looked up in the layer's own module at call time (``causal_conv1d_fn``,
``torch_chunk_gated_delta_rule`` and, with a generation cache, ``causal_conv1d_update`` and
``torch_recurrent_gated_delta_rule``), and hands them the model's extra keyword arguments. So
replacing those module attributes reaches every layer, and ``tree_attention=<metadata>`` (what
``PackedRow.model_inputs()`` passes for the attention layers) reaches the replacements too.

The replacements run the trie-aware kernels of ``grpo_core.models.attention.gated_delta`` when a row's
metadata comes with the call, and the original function otherwise (a plain forward, generation),
so a patched model still computes exactly what transformers computes for unpacked inputs. Without
them the stock functions would read the previous *row* position: a flat row of two sequences
already differs from the two forwards by 0.6 in log-prob on a tiny Qwen3.5.

Use (``enable_tree_attention`` does this)::

    install_gated_delta(model)        # patches the modules of the model's GDN layers, idempotent
"""

from __future__ import annotations

import inspect
import sys
from types import ModuleType
from typing import Any, Callable

import torch

from grpo_core.models.attention import gated_delta as gd
from grpo_core.models.attention import short_conv
from grpo_core.models.attention.metadata import TreeAttentionMetadata

# The module-level functions a GDN layer's forward calls; the first two carry packed rows.
CONV_FN, CHUNK_FN = "causal_conv1d_fn", "torch_chunk_gated_delta_rule"
CACHE_FNS = ("causal_conv1d_update", "torch_recurrent_gated_delta_rule")
_PATCHED = "_grpo_tree_originals"  # module attribute: the functions the patches replaced


def is_gated_delta_net(module: torch.nn.Module) -> bool:
    """Whether ``module`` is a transformers Gated DeltaNet layer that the patches reach.

    Checked on structure rather than on a list of names: the layer has the short convolution and
    the decay parameters, and its ``forward`` calls both patched functions from its own module.
    """
    cls = type(module)
    owner = sys.modules.get(cls.__module__)
    if owner is None or not all(hasattr(module, a) for a in ("conv1d", "A_log", "dt_bias")):
        return False
    if not all(callable(getattr(owner, name, None)) for name in (CONV_FN, CHUNK_FN)):
        return False
    try:
        source = inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return False
    return f"{CONV_FN}(" in source and f"{CHUNK_FN}(" in source


def _tree_conv(original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    def causal_conv1d_fn(
        hidden_states: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        activation: str | None = None,
        tree_attention: TreeAttentionMetadata | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        if tree_attention is None:
            return original(hidden_states, weight, bias, activation=activation, **kwargs)
        return short_conv.tree_conv(hidden_states, weight, bias, activation, tree_attention)

    causal_conv1d_fn.__doc__ = "Short causal convolution along each sample's trie path (grpo_core patch)."
    return causal_conv1d_fn


def _tree_chunk(original: Callable[..., Any]) -> Callable[..., Any]:
    def torch_chunk_gated_delta_rule(
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        chunk_size: int = 64,
        initial_state: torch.Tensor | None = None,
        output_final_state: bool = False,
        use_qk_l2norm_in_kernel: bool = False,
        tree_attention: TreeAttentionMetadata | None = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if tree_attention is None:
            return original(query, key, value, g=g, beta=beta, chunk_size=chunk_size, initial_state=initial_state,
                            output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                            **kwargs)
        if initial_state is not None or output_final_state:
            raise ValueError("a packed row cannot continue or fill a generation cache: call the model with use_cache=False")
        if query.shape[0] != 1:
            raise ValueError(f"a packed row is one sequence (batch 1), got batch {query.shape[0]}")
        # squeeze, not ``[0]``: views, where a select's backward would write a zero tensor and copy into it
        out = gd.tree_gated_delta_rule(query.squeeze(0), key.squeeze(0), value.squeeze(0), g.squeeze(0),
                                       beta.squeeze(0), tree_attention, l2norm=use_qk_l2norm_in_kernel)
        return out.unsqueeze(0), None

    torch_chunk_gated_delta_rule.__doc__ = "Gated delta rule, each trie segment from its parent's state (grpo_core patch)."
    return torch_chunk_gated_delta_rule


def _no_rows(original: Callable[..., Any], name: str) -> Callable[..., Any]:
    """Cache-only functions (one decoded token at a time): a packed row never belongs there."""

    def guarded(*args: Any, tree_attention: TreeAttentionMetadata | None = None, **kwargs: Any) -> Any:
        if tree_attention is not None:
            raise ValueError(f"{name}: a packed row cannot continue a generation cache (use_cache=False)")
        return original(*args, **kwargs)

    guarded.__name__ = guarded.__qualname__ = name
    return guarded


def patch_module(module: ModuleType) -> bool:
    """Replace the GDN functions of one modeling module; False if it was patched already."""
    if hasattr(module, _PATCHED):
        return False
    originals = {name: getattr(module, name) for name in (CONV_FN, CHUNK_FN, *CACHE_FNS) if hasattr(module, name)}
    setattr(module, CONV_FN, _tree_conv(originals[CONV_FN]))
    setattr(module, CHUNK_FN, _tree_chunk(originals[CHUNK_FN]))
    for name in CACHE_FNS:
        if name in originals:
            setattr(module, name, _no_rows(originals[name], name))
    setattr(module, _PATCHED, originals)
    return True


def unpatch_module(module: ModuleType) -> None:
    """Put the original functions back (tests)."""
    originals = module.__dict__.pop(_PATCHED, None)
    for name, fn in (originals or {}).items():
        setattr(module, name, fn)


def gated_delta_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules() if is_gated_delta_net(m)]


def install_gated_delta(model: torch.nn.Module, backend: str = "auto") -> str | None:
    """Patch the modules of ``model``'s GDN layers and pick the delta-rule backend (and with it the short
    convolution's, ``gated_delta.register_gdn_backend``).

    Returns the backend's name, or None when the model has no GDN layer (nothing is patched).
    """
    layers = gated_delta_layers(model)
    if not layers:
        return None
    for cls in {type(layer) for layer in layers}:
        patch_module(sys.modules[cls.__module__])
    dk, dv = head_sizes(layers[0])
    channels, kernel = layers[0].conv1d.weight.shape[0], layers[0].conv1d.weight.shape[-1]
    return gd.register_gdn_backend(backend, next(model.parameters()).device, dk, dv, channels, kernel,
                                   heads=value_heads(layers[0]))


def head_sizes(layer: torch.nn.Module) -> tuple[int, int]:
    """A GDN layer's key and value head sizes (transformers' ``head_k_dim``/``head_v_dim``; 64 where a layer
    does not name them), at which the backend's probe runs."""
    return int(getattr(layer, "head_k_dim", 64)), int(getattr(layer, "head_v_dim", 64))


def value_heads(layer: torch.nn.Module) -> int:
    """A GDN layer's value heads (transformers' ``num_v_heads``; 4 where a layer does not name it): the head count
    the delta rule's kernel sees, the key heads being repeated to it, and so the one its probe runs at."""
    return int(getattr(layer, "num_v_heads", 4))

"""The trainer's weights as vLLM's ``WeightSource``: checkpoint (Hugging Face) names, wire dtype.

Wrappers change parameter names (activation checkpointing inserts ``_checkpoint_wrapped_module``,
torch.compile ``_orig_mod``, peft ``base_model.model`` and ``base_layer``); the server's
``load_weights`` expects the names of the saved checkpoint, so they are normalised here
(``grpo_core.models.param_names``). Iteration gathers FSDP2 shards (DTensors) with ``full_tensor()`` one
parameter at a time; the bucketed senders (``send.bucket_stream``) read ``iter_local`` instead and gather a
whole bucket in one collective, so no full copy of the model is ever built either way.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
from grpo_core.vllm_types import ParamMeta, WeightSource, materialize_full_tensor

from grpo_core.models.param_names import checkpoint_name
from grpo_core.models.vision import frozen_tower_prefixes


class ModelWeightSource(WeightSource):
    """Trainable model weights under checkpoint names, cast to ``wire_dtype`` when given; frozen
    vision towers are left out.

    ``named_tensors`` lets LoRA merged sync supply merged weights instead of the raw parameters.
    """

    def __init__(
        self,
        module: torch.nn.Module,
        wire_dtype: torch.dtype | None = None,
        named_tensors: Callable[[], Iterator[tuple[str, torch.Tensor]]] | None = None,
    ):
        self.module = module
        self.wire_dtype = wire_dtype
        named = named_tensors or (lambda: iter(module.named_parameters()))
        # A frozen vision tower never changes: the server keeps the copy it loaded (models/vision.py).
        skip = frozen_tower_prefixes(module)
        self._named = lambda: ((n, t) for n, t in named() if not checkpoint_name(n).startswith(skip))
        self._meta: list[ParamMeta] | None = None

    def metadata(self) -> list[ParamMeta]:
        if self._meta is None:
            # DTensor .shape is the global shape, so this never gathers.
            self._meta = [
                ParamMeta(checkpoint_name(name), self.wire_dtype or t.dtype, tuple(t.shape))
                for name, t in self._named()
            ]
        return self._meta

    def iter_local(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The same tensors under the same names, as this rank holds them: FSDP2 shards stay
        DTensors and nothing is cast or detached, so a bucketed sender gathers and casts whole
        buckets at once (under ``no_grad``: a ``detach()`` per DTensor would be one more dispatched op)."""
        for name, tensor in self._named():
            yield checkpoint_name(name), tensor

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in self._named():
            full = materialize_full_tensor(tensor.detach())
            if self.wire_dtype is not None and full.dtype != self.wire_dtype:
                full = full.to(self.wire_dtype)
            yield checkpoint_name(name), full

"""The trainer's side of a push's log-prob check: the policy's own log-probs of a probe sequence, once per version.

``probe_logprobs`` runs a probe sequence through the packed forward a trained row takes (``pack_row``, the model
with ``logits_to_keep``, the reference log-prob head: ``training.forward.row_logprobs`` with ``fused=False``), so
the check compares the server with what the trainer computes. ``VersionProbe`` computes it once per pushed
version however many servers check it; the fleet builds it from the policy's model, the device and the dtype
of the trainer's own 16-bit rounding, values the trainer hands down at start-up.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import Tensor

from grpo_core.models.fsdp import reshard
from grpo_core.models.head.reference import token_logprobs
from grpo_core.packing.collator import pack_row
from grpo_core.packing.trie import TreeRow
from grpo_core.rollout.types import RolloutSample


@torch.no_grad()
def probe_logprobs(model: torch.nn.Module, token_ids: list[int], device: torch.device,
                   autocast_dtype: torch.dtype | None = None) -> Tensor:
    """The policy's log-prob of each token of ``token_ids`` after the first, at temperature 1 (every rank calls it,
    since a sharded forward is collective). float64 on the host, ``len(token_ids) - 1`` values. ``autocast_dtype``
    runs the forward under autocast to that dtype: the trainer's own rounding in 16 bits, which sets the check's
    tolerance for a 16-bit server (``VersionProbe.rounding_gap``)."""
    n = len(token_ids)
    mask = np.ones(n, dtype=bool)
    mask[0] = False
    sample = RolloutSample(token_ids=np.asarray(token_ids, dtype=np.int32), completion_mask=mask,
                           sampler_logprobs=np.zeros(n, dtype=np.float32), advantage=0.0, reward=0.0, group_id=0,
                           row_index=0, epoch=0, rollout_id="weight-probe", policy_version=0)
    row = TreeRow()
    row.add(sample)
    packed = pack_row(row).to(device)
    was_training = model.training
    model.eval()
    try:
        autocast = (torch.autocast(device.type, dtype=autocast_dtype) if autocast_dtype is not None
                    else contextlib.nullcontext())
        with torch.no_grad(), autocast:
            logits = model(**packed.model_inputs(), logits_to_keep=packed.logit_index).logits[0]
            logprobs, _ = token_logprobs(logits, packed.target_ids, 1.0)
    finally:
        model.train(was_training)
        reshard(model)
    return logprobs.detach().double().cpu()


class VersionProbe:
    """The trainer's probe log-probs, computed once per pushed version however many servers check them (every rank
    pushes to the same servers in the same order, so the forward stays collective). The fleet sets ``version``
    before each push; None computes every time.

    ``low_precision`` is the same probe computed in 16 bits; ``rounding_gap`` compares the two for the version being
    checked: how far the trainer's own rounding moves these weights' probe on average, which a 16-bit server's check
    allows a multiple of (``fleet.verify.PushVerifier``). It is measured at every checked version, since training
    changes it."""

    def __init__(self, probe: Callable[[list[int]], torch.Tensor],
                 low_precision: Callable[[list[int]], torch.Tensor] | None = None):
        self.probe = probe
        self.low_precision = low_precision
        self.version: int | None = None
        self._cached: dict[tuple[str, tuple[int, ...]], Any] = {}  # this version's, per quantity and token ids
        self._cached_version: int | None = None

    @classmethod
    def of_model(cls, model: torch.nn.Module, device: torch.device, train_dtype: str,
                 server_dtype: str) -> VersionProbe:
        """The probe of a trainer's ``model``, which computes in ``train_dtype`` on ``device``, for servers that compute
        in ``server_dtype``. An fp32 trainer whose servers must compute in 16 bits (a model's need, checked at start-up
        on every server) also measures its own bf16 rounding of the probe at each check: those servers' checks
        tolerate a multiple of it (``fleet.verify.ROUNDING_MARGIN``). Every rank decides this alike, from the same
        values."""
        full = functools.partial(probe_logprobs, model, device=device)
        if train_dtype != "float32" or server_dtype == "float32":
            return cls(full)
        return cls(full, functools.partial(probe_logprobs, model, device=device, autocast_dtype=torch.bfloat16))

    def _once_per_version(self, name: str, token_ids: list[int], compute: Callable[[], Any]) -> Any:
        if self.version is None or self.version != self._cached_version:
            self._cached, self._cached_version = {}, self.version
        key = (name, tuple(token_ids))
        if self.version is None or key not in self._cached:
            value = compute()
            if self.version is None:
                return value
            self._cached[key] = value
        return self._cached[key]

    def rounding_gap(self, token_ids: list[int]) -> float | None:
        """Mean |full - 16-bit| probe log-prob of the trainer's current weights, once per version (every rank calls
        it: the forward is collective); None without a 16-bit probe."""
        low_precision = self.low_precision
        if low_precision is None:
            return None
        return self._once_per_version(
            "rounding", token_ids, lambda: float((self(token_ids) - low_precision(token_ids)).abs().mean()))

    def __call__(self, token_ids: list[int]) -> torch.Tensor:
        return self._once_per_version("probe", token_ids, lambda: self.probe(token_ids))

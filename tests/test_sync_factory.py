"""Weights travel in the dtype the trainer computes with: bf16 runs push bf16, fp32 runs push fp32."""

from __future__ import annotations

import torch

from grpo_core.config import AsyncGRPOConfig
from grpo_core.training.policy import wire_dtype
from grpo_core.sync.source import ModelWeightSource


def test_bf16_training_pushes_bf16_and_fp32_pushes_as_is() -> None:
    assert wire_dtype(AsyncGRPOConfig(bf16=True).resolved_bf16(bf16_supported=True)) is torch.bfloat16
    assert wire_dtype(AsyncGRPOConfig(bf16=False).resolved_bf16(bf16_supported=True)) is None
    # bf16=None: on where the device supports it, fp32 (and fp32 on the wire) where it does not.
    assert wire_dtype(AsyncGRPOConfig().resolved_bf16(bf16_supported=True)) is torch.bfloat16
    assert wire_dtype(AsyncGRPOConfig().resolved_bf16(bf16_supported=False)) is None


def test_source_casts_to_the_wire_dtype_and_says_so_in_its_metadata() -> None:
    layer = torch.nn.Linear(4, 3)
    halves = ModelWeightSource(layer, wire_dtype=torch.bfloat16)
    assert {m.dtype for m in halves.metadata()} == {torch.bfloat16}
    sent = dict(halves)
    assert all(t.dtype is torch.bfloat16 for t in sent.values())
    # exact: the same round-to-nearest-even cast to bf16 on both sides, and bf16 -> fp32 is exact
    torch.testing.assert_close(sent["weight"].float(), layer.weight.detach().bfloat16().float(), rtol=0, atol=0)
    assert sum(m.dtype.itemsize * m.shape[0] * (m.shape[1] if len(m.shape) > 1 else 1) for m in halves.metadata()) == 2 * 15
    assert {m.dtype for m in ModelWeightSource(layer).metadata()} == {torch.float32}

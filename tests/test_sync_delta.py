"""Delta encoding of buckets (``grpo_core.sync.wire.delta``) and the tensor digest both ends compute."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from grpo_core.sync.wire.buckets import plan_buckets
from grpo_core.sync.wire.delta import DENSE, apply_bucket, encode_bucket, payload_nbytes, sparse_pays
from grpo_core.sync.wire.digest import tensor_digest


@dataclass(frozen=True)
class Meta:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]


def bucket_bytes(tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.reshape(-1).view(torch.uint8) for t in tensors.values()])


def model_tensors(dtype: torch.dtype, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes = {"embed": (64, 16), "norm": (15,), "proj": (16, 33)}  # odd sizes: misaligned slots
    return {n: torch.randn(s, generator=g).to(dtype) for n, s in shapes.items()}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_delta_applied_to_the_previous_weights_gives_the_new_weights_bit_for_bit(dtype):
    old = model_tensors(dtype)
    new = {n: t.clone() for n, t in old.items()}
    new["embed"][3] += 1.0  # one row: sparse
    new["proj"] += 0.5  # everything: dense
    flat = new["norm"].view(-1)
    flat[[0, 7]] = torch.tensor([float("nan"), -0.0], dtype=dtype)  # bits, not values, are compared
    (bucket,) = plan_buckets([Meta(n, t.dtype, tuple(t.shape)) for n, t in new.items()], 2**30)
    encoded = encode_bucket(bucket, bucket_bytes(new), bucket_bytes(old))
    header = encoded.header.tolist()
    assert header[0] == 16 and header[2] == DENSE, header
    assert header[1] == 2  # -0.0 differs from the old value's bits; NaN travels as its bits
    base = {n: t.reshape(-1).clone() for n, t in old.items()}
    apply_bucket(bucket, encoded.header, encoded.payload, base)
    for name, tensor in new.items():
        assert torch.equal(base[name].view(torch.uint8), tensor.reshape(-1).view(torch.uint8)), name
    assert encoded.changed == 16 + 2 + 16 * 33 and encoded.numel == 64 * 16 + 15 + 16 * 33


def test_without_previous_weights_every_tensor_is_dense_and_creates_the_receivers_copy():
    new = model_tensors(torch.bfloat16)
    (bucket,) = plan_buckets([Meta(n, t.dtype, tuple(t.shape)) for n, t in new.items()], 2**30)
    encoded = encode_bucket(bucket, bucket_bytes(new), None)
    assert encoded.header.tolist() == [DENSE] * 3
    base: dict[str, torch.Tensor] = {}
    apply_bucket(bucket, encoded.header, encoded.payload, base)
    assert all(torch.equal(base[n], t.reshape(-1)) for n, t in new.items())


def test_a_sparse_update_needs_the_previous_tensor_and_a_payload_of_the_announced_size():
    old = model_tensors(torch.float32)
    new = {n: t.clone() for n, t in old.items()}
    new["embed"][0, 0] = 5.0
    (bucket,) = plan_buckets([Meta(n, t.dtype, tuple(t.shape)) for n, t in new.items()], 2**30)
    encoded = encode_bucket(bucket, bucket_bytes(new), bucket_bytes(old))
    with pytest.raises(KeyError, match="embed: a sparse update for a tensor this receiver holds no previous value"):
        apply_bucket(bucket, encoded.header, encoded.payload, {})
    with pytest.raises(ValueError, match="the header announces"):
        apply_bucket(bucket, encoded.header, encoded.payload[:-8], {})
    with pytest.raises(ValueError, match="header says 2000 changed elements of 1024"):
        payload_nbytes(bucket, [2000, 0, 0])


def test_sparse_travels_only_where_it_is_smaller():
    # bf16: 4 + 2 bytes per changed element against 2 per element: sparse below a third.
    assert sparse_pays(300, 1000, 2) and not sparse_pays(340, 1000, 2)
    # fp32: 4 + 4 against 4: below half.
    assert sparse_pays(490, 1000, 4) and not sparse_pays(510, 1000, 4)
    assert sparse_pays(0, 1, 2)


def test_the_digest_sees_any_one_changed_word_and_not_the_layout():
    g = torch.Generator().manual_seed(1)
    t = torch.randn(1001, generator=g).to(torch.bfloat16)
    base = tensor_digest(t)
    assert tensor_digest(t.clone().reshape(7, 143)) == base  # the bytes, not the shape
    words = t.view(torch.int16)
    for position in torch.randint(0, 1001, (200,), generator=g).tolist():
        changed = words.clone()
        changed[position] ^= 1 << int(torch.randint(0, 16, (1,), generator=g))
        assert tensor_digest(changed.view(torch.bfloat16)) != base, position
    swapped = t.clone()
    swapped[[0, 1]] = swapped[[1, 0]]
    assert t[0] == t[1] or tensor_digest(swapped) != base  # positions are weighted: a swap shows

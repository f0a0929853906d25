"""Weight patches on storage (``grpo_core.sync.wire.patch_store``): chains, keyframes, checksums, retention."""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest
import torch

from grpo_core.storage.store import Storage
from grpo_core.sync.wire.buckets import plan_buckets
from grpo_core.sync.wire.delta import encode_bucket
from grpo_core.sync.wire.digest import digests
from grpo_core.sync.wire.patch_store import PatchReader, PatchWriter, apply_patch, manifest_name, patch_name, plan_chain


@dataclass(frozen=True)
class Meta:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]


SHAPES = {"a": (40, 8), "b": (33,), "c": (8, 8)}


def versions(n: int) -> list[dict[str, torch.Tensor]]:
    """n successive weight versions: each changes a few elements of every tensor (bf16)."""
    g = torch.Generator().manual_seed(0)
    current = {k: torch.randn(s, generator=g).to(torch.bfloat16) for k, s in SHAPES.items()}
    out = []
    for _ in range(n):
        out.append({k: t.clone() for k, t in current.items()})
        for t in current.values():
            flat = t.view(-1)
            flat[torch.randint(0, flat.numel(), (3,), generator=g)] += 1.0
    return out


def publish(writer: PatchWriter, history: list[dict[str, torch.Tensor]], bucket_bytes: int = 300):
    plan = plan_buckets([Meta(k, t.dtype, tuple(t.shape)) for k, t in history[0].items()], bucket_bytes)
    previous = None
    for version, weights in enumerate(history):
        flat = torch.cat([t.reshape(-1).view(torch.uint8) for t in weights.values()])
        buffers = [flat[sum(b.nbytes for b in plan[:i]):][: b.nbytes] for i, b in enumerate(plan)]
        old = None if writer.wants_keyframe() else previous
        encoded = [encode_bucket(b, buf, old[i] if old else None) for i, (b, buf) in enumerate(zip(plan, buffers))]
        writer.write(version, plan, encoded, digests({k: t.reshape(-1) for k, t in weights.items()}))
        previous = [buf.clone() for buf in buffers]
    return plan


def test_a_receiver_follows_the_chain_from_what_it_holds_or_from_a_keyframe(tmp_path):
    storage = Storage(str(tmp_path / "patches"))
    history = versions(8)
    publish(PatchWriter(storage, keyframe_every=3), history)
    reader = PatchReader(storage)
    manifests = reader.manifests()
    # Keyframes at 0, 3 and 6; writing 6 deleted what came before keyframe 3.
    assert {v: m.base_version for v, m in manifests.items()} == {3: None, 4: 3, 5: 4, 6: None, 7: 6}
    assert plan_chain(manifests.get, None, 7) == [6, 7]
    assert plan_chain(manifests.get, 3, 5) == [4, 5]
    assert plan_chain(manifests.get, None, 5) == [3, 4, 5]
    assert plan_chain(manifests.get, 4, 7) == [6, 7]  # the chain back from 7 starts at keyframe 6
    assert plan_chain(manifests.get, 5, 5) == []
    for held_version, target in [(None, 7), (3, 5), (None, 5), (4, 7)]:
        base = {} if held_version is None else {k: t.reshape(-1).clone() for k, t in history[held_version].items()}
        for v in plan_chain(manifests.get, held_version, target):
            apply_patch(manifests[v], reader.read(manifests[v]), base)
        for name, tensor in history[target].items():
            assert torch.equal(base[name], tensor.reshape(-1)), (held_version, target, name)
        assert digests(base) == manifests[target].digests
    assert manifests[5].changed < manifests[6].changed == manifests[6].numel  # deltas carry only the changes


def test_a_torn_patch_is_refused_before_any_byte_is_applied(tmp_path):
    storage = Storage(str(tmp_path / "patches"))
    publish(PatchWriter(storage, keyframe_every=10), versions(2))
    reader = PatchReader(storage)
    manifest = reader.manifests()[1]
    path = tmp_path / "patches" / patch_name(1)
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="does not match its manifest"):
        reader.read(manifest)


def test_a_missing_link_is_named(tmp_path):
    storage = Storage(str(tmp_path / "patches"))
    publish(PatchWriter(storage, keyframe_every=10), versions(4))
    (tmp_path / "patches" / manifest_name(2)).unlink()
    manifests = PatchReader(storage).manifests()
    with pytest.raises(LookupError, match="weight patch of version 2 is missing \\(needed to reach 3 from 0\\)"):
        plan_chain(manifests.get, 0, 3)


def test_old_chains_are_deleted_once_a_second_keyframe_is_written(tmp_path):
    storage = Storage(str(tmp_path / "patches"))
    publish(PatchWriter(storage, keyframe_every=2), versions(7))  # keyframes 0, 2, 4, 6
    left = sorted(p.name for p in (tmp_path / "patches").iterdir())
    assert left == [f(v) for v in (4, 5, 6) for f in (manifest_name, patch_name)]
    manifest = json.loads((tmp_path / "patches" / manifest_name(6)).read_text())
    assert manifest["base_version"] is None and len(manifest["digests"]) == 3

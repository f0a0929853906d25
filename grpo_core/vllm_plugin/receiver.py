"""The server side of delta and storage updates: the weights a worker last loaded, and how a patch moves them.

A delta names the elements that changed since a version, so the receiver must hold that version's
weights in checkpoint form. vLLM's in-place sparse loading (its ``sparse_nccl`` engine writes into the
live parameters) does not work here: a CPU server repacks every linear weight for its GEMM kernels
and frees the parameter, and any layer with post-load processing would keep stale derived copies.
So ``HeldWeights`` keeps the checkpoint tensors the worker loaded (host memory, wire dtype, one copy
of the model), a delta is applied to that copy, and the changed model is loaded through the same
layerwise reload as a dense push: a delta saves bytes on the wire and on storage, not load work.

``HeldWeights.version`` is the weight version of that copy; a delta for another base is refused by
name, and a failure half-way through leaves no version (the next update must be whole).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from grpo_core.sync.wire.buckets import Bucket
from grpo_core.sync.wire.digest import tensor_digest

Load = Callable[[list[tuple[str, torch.Tensor]]], Any]
"""The model's ``load_weights`` (inside the layerwise reload the engine's start/finish drive)."""


class BaseVersionMismatch(ValueError):
    """A delta was sent for weights this receiver does not hold; the message names both versions."""


@dataclass
class HeldWeights:
    """The checkpoint tensors a worker last loaded (flat, wire dtype) and their weight version."""

    version: str | None = None
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)

    def require(self, base_version: str | None, what: str) -> None:
        """Refuse a delta whose base is not what this receiver holds."""
        if base_version is None or self.version != base_version or not self.tensors:
            held = self.version if self.tensors else None
            raise BaseVersionMismatch(
                f"{what} applies to weight version {base_version!r}, this server holds {held!r}; "
                "send the weights whole (a dense push or a keyframe)"
            )

    def forget(self) -> None:
        """After a failed update: the copy is no longer any version."""
        self.version = None

    def clear(self) -> None:
        self.version = None
        self.tensors = {}

    def bucket_tensors(self, bucket: Bucket) -> list[tuple[str, torch.Tensor]]:
        """A bucket's tensors as the model loads them: full shapes, copies (the loader may keep them)."""
        return [(s.name, self.tensors[s.name].view(s.shape).clone()) for s in bucket.slots]

    def digests(self, names: list[str]) -> dict[str, str]:
        return {name: tensor_digest(self.tensors[name]) for name in names}

    def check_digests(self, expected: dict[str, str], what: str) -> None:
        """Every tensor of ``expected`` held, with the expected digest; raise naming those that differ."""
        missing = [n for n in expected if n not in self.tensors]
        wrong = [n for n, d in expected.items() if n in self.tensors and tensor_digest(self.tensors[n]) != d]
        if missing or wrong:
            self.forget()
            raise ValueError(
                f"{what}: after applying it, {len(wrong)} tensors differ from the trainer's "
                f"({', '.join(wrong[:3])}{' ...' if len(wrong) > 3 else ''}) and {len(missing)} are missing "
                f"({', '.join(missing[:3])}); the server loaded nothing of it"
            )


def load_plan(held: HeldWeights, plan: list[Bucket], load: Load) -> Iterator[int]:
    """Load every tensor of ``plan`` from ``held``, bucket by bucket; yields the bytes of each bucket."""
    for bucket in plan:
        load(held.bucket_tensors(bucket))
        yield bucket.nbytes


def apply_storage_update(held: HeldWeights, info: dict[str, Any], load: Load, worker: int) -> dict[str, Any]:
    """Bring the worker to ``info['target']`` from the patches under ``info['url']`` and load it.

    ``info``: ``url`` (the patch folder), ``target`` (the version to reach), ``receipt`` (optional: a
    key under which to write what the worker now holds, for the trainer to check). Returns the receipt.
    """
    from grpo_core.storage.store import Storage
    from grpo_core.sync.wire.patch_store import RECEIPTS, PatchReader, apply_patch, plan_chain, receipt_name

    url, target = str(info["url"]), int(info["target"])
    storage = Storage(url)
    reader = PatchReader(storage)
    manifests: dict[int, Any] = {}

    def lookup(version: int) -> Any:
        if version not in manifests:
            manifests[version] = reader.manifest(version)
        return manifests[version]

    held_version = int(held.version) if held.tensors and held.version is not None and held.version.isdigit() else None
    chain = plan_chain(lookup, held_version, target)
    try:
        for version in chain:
            patch = manifests[version]
            if patch.base_version is not None:
                held.require(str(patch.base_version), f"weight patch {version} in {url}")
            apply_patch(patch, reader.read(patch), held.tensors)
            held.version = str(version)
        final = lookup(target)
        if final is None:
            raise LookupError(f"weight patch of version {target} is missing in {url}")
        held.check_digests(final.digests, f"the weight patches {chain} in {url}")
    except BaseException:
        held.forget()
        raise
    for _ in load_plan(held, final.plan(), load):
        pass
    receipt = {"version": target, "worker": worker, "chain": chain, "digests": held.digests(final.names)}
    if info.get("receipt"):
        storage.write_json(storage.path(RECEIPTS, str(info["receipt"]), receipt_name(target, worker)), receipt)
    return receipt

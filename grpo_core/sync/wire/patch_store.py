"""Weight patches on fsspec storage: one file and one manifest per pushed version, a chain a server follows.

For a server that cannot join the trainer's transfer group (another cluster, a server catching up),
each version is written once as a patch and any number of servers apply it:

    <root>/v0000000012.patch   the buckets of the delta encoding (``delta.encode_bucket``), one after
                               another: header (int64 per tensor), then payload
    <root>/v0000000012.json    the manifest, written after the patch (its presence commits the version):
                               version, base_version (None: a keyframe, every tensor whole), the tensors'
                               names, dtypes, shapes and bucket sizes, each bucket's header and payload
                               bytes, the patch's size and SHA-256, and per tensor the ``digest.tensor_digest``
                               of its value at this version
    <root>/receipts/<server>/v0000000012-w0.json
                               written by a server's worker after applying: the chain it applied and the
                               digest of every tensor it now holds (``StoragePatchSync.check_applied``)

A delta is applied to the weights of its ``base_version``, so a server at version b follows the chain
b → … → target; a server with nothing the chain starts from (just restarted, fallen behind the
oldest kept delta) starts at the newest keyframe at or before the target. ``PatchWriter`` writes a
keyframe first (deleting the later versions an earlier attempt of the run left) and then every
``keyframe_every`` versions, and deletes what no chain from the previous keyframe on needs. A reader checks the SHA-256 before it decodes a byte, and the digests
of what it holds after the chain against the manifest, so a server never loads a torn or misapplied
patch.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from grpo_core.sync.wire.buckets import Bucket, plan_from_sizes
from grpo_core.sync.wire.delta import EncodedBucket, apply_bucket, payload_nbytes

PATCH_FORMAT = "grpo-core-weight-patch/1"
RECEIPTS = "receipts"
"""Folder (under the patch root) where each server's workers write what they hold after an update."""


def patch_name(version: int) -> str:
    return f"v{version:010d}.patch"


def manifest_name(version: int) -> str:
    return f"v{version:010d}.json"


@dataclass(frozen=True)
class _Meta:
    """What ``plan_buckets`` reads of a tensor (rebuilt from a manifest)."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]


@dataclass
class PatchManifest:
    """What one patch file holds and how to check it (JSON next to it)."""

    version: int
    base_version: int | None
    """The version the patch applies to; None for a keyframe (every tensor whole)."""
    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    group_sizes: list[int]
    """Tensors per bucket, in order."""
    sections: list[list[int]]
    """Per bucket: [header bytes, payload bytes]."""
    nbytes: int
    sha256: str
    digests: dict[str, str]
    """``tensor_digest`` of every tensor at ``version``."""
    changed: int = 0
    numel: int = 0
    format: str = PATCH_FORMAT
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_json(cls, value: dict[str, Any]) -> PatchManifest:
        if value.get("format") != PATCH_FORMAT:
            raise ValueError(f"weight patch manifest of format {value.get('format')!r}; this reader knows {PATCH_FORMAT!r}")
        return cls(**value)

    def plan(self) -> list[Bucket]:
        """The bucket plan the patch was cut by."""
        meta = [_Meta(n, getattr(torch, d), tuple(s)) for n, d, s in zip(self.names, self.dtype_names, self.shapes)]
        return plan_from_sizes(meta, self.group_sizes)


def plan_chain(manifest: Callable[[int], PatchManifest | None], held: int | None, target: int) -> list[int]:
    """The versions to apply, in order, to bring a receiver holding ``held`` (None: nothing usable) to
    ``target``: the deltas after ``held`` when the chain back from ``target`` passes it, else the
    newest keyframe on that chain and the deltas after it. ``manifest(v)`` reads one manifest (None:
    not there); only the chain's are read. Raises naming a missing link."""
    path: list[int] = []
    version: int | None = target
    while version is not None:
        if held is not None and version == held:
            return list(reversed(path))
        found = manifest(version)
        if found is None:
            raise LookupError(f"weight patch of version {version} is missing (needed to reach {target}"
                              + (f" from {held})" if held is not None else ")"))
        path.append(version)
        version = found.base_version  # None: a keyframe, nothing before it is needed
    return list(reversed(path))


class PatchWriter:
    """Writes each pushed version as a patch (trainer rank 0). ``keyframe_every``: a keyframe after this
    many deltas, so that a server with nothing applies at most that many patches after a keyframe."""

    def __init__(self, storage: Any, keyframe_every: int):
        if keyframe_every < 1:
            raise ValueError(f"keyframe_every={keyframe_every}: must be at least 1")
        self.storage = storage
        if storage.is_local:
            os.makedirs(storage.root, exist_ok=True)  # object stores have no folders to make
        self.keyframe_every = keyframe_every
        self.keyframes: list[int] = []
        self.last: int | None = None
        self.deltas_since_keyframe = 0

    def wants_keyframe(self) -> bool:
        return self.last is None or self.deltas_since_keyframe + 1 >= self.keyframe_every

    def write(self, version: int, plan: Sequence[Bucket], encoded: Sequence[EncodedBucket],
              digests: dict[str, str]) -> PatchManifest:
        """Write ``encoded`` (one per bucket of ``plan``; all dense for a keyframe) as ``version``."""
        keyframe = all(bool((e.header < 0).all()) for e in encoded)
        base = None if keyframe else self.last
        if not keyframe and base is None:
            raise ValueError(f"version {version}: a delta needs a previous version to apply to")
        sha = hashlib.sha256()
        sections = []
        with tempfile.NamedTemporaryFile(prefix="weight-patch-", delete=False) as tmp:
            for e in encoded:
                for part in (e.header.numpy().tobytes(), e.payload.numpy().tobytes()):
                    sha.update(part)
                    tmp.write(part)
                sections.append([e.header.numel() * 8, e.payload.numel()])
            nbytes = tmp.tell()
        if self.last is None:
            self._drop(lambda v: v >= version)  # left by an earlier attempt of the run: other weights
        meta = [s for b in plan for s in b.slots]
        manifest = PatchManifest(
            version=version, base_version=base, names=[s.name for s in meta],
            dtype_names=[str(s.dtype).removeprefix("torch.") for s in meta], shapes=[list(s.shape) for s in meta],
            group_sizes=[len(b.slots) for b in plan], sections=sections, nbytes=nbytes, sha256=sha.hexdigest(),
            digests=digests, changed=sum(e.changed for e in encoded), numel=sum(e.numel for e in encoded),
        )
        try:
            self.storage.put_file(tmp.name, self.storage.path(patch_name(version)))
        finally:
            os.unlink(tmp.name)
        self.storage.write_json(self.storage.path(manifest_name(version)), asdict(manifest))
        self.last = version
        if keyframe:
            self.keyframes.append(version)
            self.deltas_since_keyframe = 0
            self._drop_before_previous_keyframe()
        else:
            self.deltas_since_keyframe += 1
        return manifest

    def _drop_before_previous_keyframe(self) -> None:
        """Keep the chains from the previous keyframe on (a server may be applying one now)."""
        if len(self.keyframes) < 2:
            return
        keep_from = self.keyframes[-2]
        self._drop(lambda v: v < keep_from)
        for folder in self.storage.ls(self.storage.path(RECEIPTS)):
            for entry in self.storage.ls(folder["name"]):
                if (v := _receipt_version(entry["name"])) is not None and v < keep_from:
                    self.storage.rm(entry["name"])
        self.keyframes = self.keyframes[-2:]

    def _drop(self, doomed: Any) -> None:
        """Delete the patches and manifests of the versions ``doomed(version)`` selects."""
        old = [e["name"] for e in self.storage.ls(self.storage.root)
               if (v := _version_of(e["name"])) is not None and doomed(v)]
        # Manifests first: a reader never finds a committed version whose patch is gone.
        for path in sorted(old, key=lambda p: not p.endswith(".json")):
            self.storage.rm(path)


def receipt_name(version: int, worker: int) -> str:
    return f"v{version:010d}-w{worker}.json"


def _receipt_version(path: str) -> int | None:
    stem = os.path.basename(path.rstrip("/"))
    head, sep, _ = stem.partition("-w")
    return int(head[1:]) if sep and head.startswith("v") and head[1:].isdigit() else None


def _version_of(path: str) -> int | None:
    """The version a patch or manifest file is named after, or None for any other file."""
    stem, _, suffix = os.path.basename(path.rstrip("/")).partition(".")
    if suffix in ("patch", "json") and stem.startswith("v") and stem[1:].isdigit():
        return int(stem[1:])
    return None


class PatchReader:
    """Reads manifests and checked patches (server side, or a test)."""

    def __init__(self, storage: Any):
        self.storage = storage

    def manifest(self, version: int) -> PatchManifest | None:
        """The committed manifest of ``version``, or None."""
        try:
            return PatchManifest.from_json(self.storage.read_json(self.storage.path(manifest_name(version))))
        except FileNotFoundError:
            return None

    def manifests(self) -> dict[int, PatchManifest]:
        """Every committed manifest, by version."""
        versions = sorted(v for e in self.storage.ls(self.storage.root)
                          if e["name"].endswith(".json") and (v := _version_of(e["name"])) is not None)
        return {v: m for v in versions if (m := self.manifest(v)) is not None}

    def read(self, manifest: PatchManifest) -> bytes:
        """The patch bytes of ``manifest``, after checking their size and SHA-256."""
        path = self.storage.path(patch_name(manifest.version))
        data = self.storage.cat([path])[path]
        if len(data) != manifest.nbytes or hashlib.sha256(data).hexdigest() != manifest.sha256:
            raise ValueError(f"weight patch {path} does not match its manifest ({len(data)} bytes, "
                             f"{manifest.nbytes} expected, or another SHA-256): torn or altered")
        return data


def apply_patch(manifest: PatchManifest, data: bytes, base: dict[str, torch.Tensor]) -> None:
    """Apply one checked patch to ``base`` (flat tensors by name) in place."""
    raw = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    offset = 0
    for bucket, (header_bytes, body_bytes) in zip(manifest.plan(), manifest.sections):
        header = raw[offset : offset + header_bytes].view(torch.int64)
        offset += header_bytes
        if payload_nbytes(bucket, header) != body_bytes:
            raise ValueError(f"weight patch {manifest.version}: a bucket's header and manifest disagree on its size")
        apply_bucket(bucket, header, raw[offset : offset + body_bytes], base)
        offset += body_bytes

"""Checkpoint folders: their file names, which ones there are, manifests and their checks.

A checkpoint counts only once ``manifest.json`` (name, size and sha256 of every other file) exists;
it is written last. ``read_manifest`` judges a folder by its listing alone (no download);
``verify_local`` checks the hashes of a local copy. Storage itself (fsspec, retries) is
``grpo_core.storage``.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any

from grpo_core.storage.store import Storage

MANIFEST = "manifest.json"
MODEL_FILE = "model.safetensors"
MASTER_FILE = "master_weights.safetensors"
OPTIMIZER_FILE = "optimizer.pt"
SCHEDULER_FILE = "scheduler.json"
RNG_FILE = "rng_state.pt"
TRAINER_STATE = "trainer_state.json"
ROLLOUT_STATE = "rollout_state.json"
FORMAT_VERSION = 1
_CHECKPOINT_DIR = re.compile(r"^checkpoint-(\d+)$")
_CHUNK = 1 << 20


class CheckpointError(RuntimeError):
    """A checkpoint that was asked for by path is missing, torn or unreadable."""


def list_checkpoints(storage: Storage) -> list[tuple[int, str]]:
    """``(step, path)`` of every ``checkpoint-<step>`` folder under ``storage``'s root, newest first (good or not)."""
    found = []
    for entry in storage.ls(storage.root):
        match = _CHECKPOINT_DIR.match(entry["name"].rstrip("/").rsplit("/", 1)[-1])
        if match and entry["type"] == "directory":
            found.append((int(match.group(1)), entry["name"].rstrip("/")))
    return sorted(found, reverse=True)


def remove_checkpoint(storage: Storage, path: str) -> None:
    """Manifest first: a delete cut short leaves a torn folder, never a "good" one missing files."""
    if storage.exists(storage.path_in(path, MANIFEST)):
        storage.rm(storage.path_in(path, MANIFEST))
    if storage.exists(path):
        storage.rm(path, recursive=True)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def build_manifest(folder: Path, step: int, lineage: str) -> dict[str, Any]:
    files = {}
    for path in sorted(p for p in folder.iterdir() if p.is_file() and p.name != MANIFEST):
        files[path.name] = {"size": path.stat().st_size, "sha256": _sha256(path)}
    return {"format_version": FORMAT_VERSION, "step": step, "lineage": lineage, "files": files}


def read_manifest(storage: Storage, folder: str) -> tuple[dict[str, Any] | None, str | None]:
    """``(manifest, None)`` when ``folder`` looks complete by its listing alone (no download), else
    ``(None, why it is torn)``."""
    listing = {e["name"].rstrip("/").rsplit("/", 1)[-1]: e for e in storage.ls(folder)}
    if MANIFEST not in listing:
        return None, "no manifest.json (written last, so the write did not finish)"
    try:
        manifest = storage.read_json(storage.path_in(folder, MANIFEST))
        files = manifest["files"]
    except (ValueError, KeyError, TypeError) as exc:
        return None, f"manifest.json is unreadable ({exc})"
    for name, meta in files.items():
        if name not in listing:
            return None, f"{name} is missing"
        if int(listing[name]["size"]) != meta["size"]:
            return None, f"{name} has {listing[name]['size']} bytes, the manifest says {meta['size']}"
    return manifest, None


def verify_local(folder: Path) -> str | None:
    """Why the local copy ``folder`` differs from its manifest (sizes and sha256), or None."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError) as exc:
        return f"manifest.json is unreadable ({exc})"
    for name, meta in manifest["files"].items():
        path = folder / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != meta["size"]:
            return f"{name} has {path.stat().st_size} bytes, the manifest says {meta['size']}"
        if _sha256(path) != meta["sha256"]:
            return f"{name} does not match its sha256 in the manifest (corrupt)"
    return None

"""Checkpoint folders on fsspec storage: paths, listing, atomic JSON, manifests and their checks.

A checkpoint counts only once ``manifest.json`` (name, size and sha256 of every other file) exists;
it is written last. ``read_manifest`` judges a folder by its listing alone (no download);
``verify_local`` checks the hashes of a local copy. Every call to the store goes through
``retry.retrying``: a transient failure (throttling, 5xx, a timeout, an endpoint that restarts) is
retried with backoff for ``retry_timeout_s``, anything else raises ``StorageError`` naming it.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any

from grpo_core.checkpoint.retry import DEFAULT_TIMEOUT_S, retrying

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


def open_url(url: str) -> tuple[Any, str]:
    """The fsspec filesystem and path for ``url``, made from the environment as it is now.

    fsspec hands back one cached filesystem per set of constructor arguments for the life of the
    process, and an object store's endpoint and credentials (``AWS_ENDPOINT_URL``, keys) are read
    from the environment when that instance is first made. A process that reaches a second store
    or a moved endpoint (a notebook, an agent running several jobs) would keep talking to the first
    one; a fresh instance costs a client set-up, nothing per request.
    """
    from fsspec.core import url_to_fs

    return url_to_fs(url, skip_instance_cache=True)


class CheckpointError(RuntimeError):
    """A checkpoint that was asked for by path is missing, torn or unreadable."""


class Storage:
    """``output_dir`` through fsspec: joins, JSON, listing and deletes that keep checkpoints consistent.

    Use its methods, not ``fs`` directly: they retry transient failures (see the module docstring).
    """

    def __init__(self, url: str, retry_timeout_s: float = DEFAULT_TIMEOUT_S):
        from fsspec.implementations.local import LocalFileSystem

        self.fs, self.root = open_url(url)
        self.is_local = isinstance(self.fs, LocalFileSystem)
        self.retry_timeout_s = retry_timeout_s

    def _retry(self, what: str, path: str, call: Any) -> Any:
        return retrying(what, self.url(path), call, local=self.is_local, timeout_s=self.retry_timeout_s)

    def path(self, *parts: str) -> str:
        return "/".join([self.root.rstrip("/"), *parts])

    def url(self, path: str) -> str:
        return path if self.is_local else self.fs.unstrip_protocol(path)

    def ls(self, path: str) -> list[dict[str, Any]]:
        def listing() -> list[dict[str, Any]]:
            self.fs.invalidate_cache(path)  # s3fs caches listings; another process may have written since
            return self.fs.ls(path, detail=True)

        try:
            return self._retry("listing", path, listing)
        except FileNotFoundError:
            return []

    def read_json(self, path: str) -> Any:
        return json.loads(self._retry("reading", path, lambda: self.fs.cat_file(path)))

    def exists(self, path: str) -> bool:
        return bool(self._retry("checking", path, lambda: self.fs.exists(path)))

    def rm(self, path: str, recursive: bool = False) -> None:
        def remove() -> None:
            try:
                self.fs.rm(path, recursive=recursive)
            except FileNotFoundError:
                pass  # gone already: a repeat of a delete whose reply was lost

        self._retry("deleting", path, remove)

    def put_file(self, local: str, path: str) -> None:
        self._retry("uploading to", path, lambda: self.fs.put_file(local, path))

    def get(self, paths: list[str], local: list[str]) -> None:
        self._retry("downloading", paths[0] if paths else self.root, lambda: self.fs.get(paths, local))

    def cat(self, paths: list[str]) -> dict[str, bytes]:
        return self._retry("reading", paths[0] if paths else self.root, lambda: self.fs.cat(paths))

    def write_json(self, path: str, value: Any) -> None:
        """One object written whole: a single PUT on object stores, a rename on a local disk."""
        self._retry("writing", path, lambda: self._write_json_once(path, value))

    def _write_json_once(self, path: str, value: Any) -> None:
        data = json.dumps(value, indent=1).encode()
        if self.is_local:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            tmp = f"{path}.tmp-{os.getpid()}"
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        else:
            self.fs.pipe_file(path, data)

    def remove_checkpoint(self, path: str) -> None:
        """Manifest first: a delete cut short leaves a torn folder, never a "good" one missing files."""
        if self.exists(self.path_in(path, MANIFEST)):
            self.rm(self.path_in(path, MANIFEST))
        if self.exists(path):
            self.rm(path, recursive=True)

    @staticmethod
    def path_in(folder: str, name: str) -> str:
        return f"{folder.rstrip('/')}/{name}"

    def checkpoints(self) -> list[tuple[int, str]]:
        """``(step, path)`` of every ``checkpoint-<step>`` folder, newest first (good or not)."""
        found = []
        for entry in self.ls(self.root):
            match = _CHECKPOINT_DIR.match(entry["name"].rstrip("/").rsplit("/", 1)[-1])
            if match and entry["type"] == "directory":
                found.append((int(match.group(1)), entry["name"].rstrip("/")))
        return sorted(found, reverse=True)


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


def fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

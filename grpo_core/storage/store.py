"""Any fsspec URL as a folder: a fresh filesystem per URL, and calls that retry what passes.

``open_url`` makes the filesystem for a URL from the environment as it is now; ``Storage`` wraps one
folder (``output_dir``, a run's artifacts) with joins, JSON written whole, listing, deletes and copies.
Every call to the store goes through ``retry.retrying``: a transient failure (throttling, 5xx, a
timeout, an endpoint that restarts) is retried with backoff for ``retry_timeout_s``, anything else
raises ``StorageError`` naming it. Checkpoints, the run ledger, MLflow's final model, LoRA adapters and
the flows all reach storage through here.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from grpo_core.storage.retry import DEFAULT_TIMEOUT_S, retrying


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


class Storage:
    """One folder on fsspec storage: joins, JSON written whole, listing, deletes and copies.

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

    @staticmethod
    def path_in(folder: str, name: str) -> str:
        return f"{folder.rstrip('/')}/{name}"


def fsync_dir(folder: Path) -> None:
    """Make a local folder's new entries (a rename into it) durable."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

"""Weight sync through storage: each version written once as a patch, each server told to apply it.

    PatchPublisher.publish(v)   every rank gathers the model bucket by bucket; rank 0 encodes each
                                bucket against the previous version (``delta``), writes the patch and
                                its manifest (``patch_store``), and keeps the bytes for the next delta
    StoragePatchSync.push(v)    per server: pause → start → update {"transport": "storage", url, v}
                                → finish(v) → resume, each under its deadline; the server reads the
                                chain from what it holds to v, checks every checksum and loads the result
                                (``receiver.apply_storage_update``), then writes a receipt
    StoragePatchSync.check_applied(v)
                                reads the server's receipt and compares every tensor's digest with
                                the trainer's: an exact check of what the server holds

One publisher serves any number of servers (a fleet calls ``push`` per server); a server needs the
package's vLLM plugin (its ``gloo`` engine applies storage updates) but no transfer group, so it may
run on another cluster that reaches the same storage.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from grpo_core.storage.store import Storage
from grpo_core.sync.base import SyncStats, WeightSync
from grpo_core.sync.errors import ServedWeightsMismatch
from grpo_core.sync.send.bucket_stream import local_tensors, send_buckets, source_device
from grpo_core.sync.timing.deadline import DeadlineConfig, Deadlines
from grpo_core.sync.timing.timed_control import TimedControl
from grpo_core.sync.wire.buckets import DEFAULT_BUCKET_BYTES, plan_buckets
from grpo_core.sync.wire.delta import encode_bucket
from grpo_core.sync.wire.digest import tensor_digest
from grpo_core.sync.wire.gloo_messages import STORAGE_TRANSPORT
from grpo_core.sync.wire.patch_store import RECEIPTS, PatchManifest, PatchWriter, receipt_name


class PatchPublisher:
    """Writes every pushed version to ``url`` as a patch (call ``publish`` on every trainer rank)."""

    def __init__(self, source: Any, url: str, rank: int, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 keyframe_every: int = 20):
        self.source = source
        self.url = url
        self.rank = rank
        self.bucket_bytes = bucket_bytes
        self.storage = Storage(url) if rank == 0 else None
        self.writer = PatchWriter(self.storage, keyframe_every) if self.storage is not None else None
        self.previous: list[torch.Tensor] | None = None
        self.manifest: PatchManifest | None = None  # of the last version published (rank 0)
        self.published: int | None = None

    def publish(self, version: int) -> PatchManifest | None:
        """Write ``version`` unless it is the last one written; returns its manifest (None off rank 0)."""
        if self.published == version:
            return self.manifest
        plan = plan_buckets(self.source.metadata(), self.bucket_bytes)
        buffers: list[torch.Tensor] = []
        collect = (lambda buffer: buffers.append(buffer.to("cpu", copy=True))) if self.writer is not None else None
        send_buckets(plan, local_tensors(self.source), collect, source_device(self.source))
        if self.writer is not None:
            old = None if self.writer.wants_keyframe() else self.previous
            encoded = [encode_bucket(b, new, old[k] if old is not None else None) for k, (b, new) in
                       enumerate(zip(plan, buffers))]
            digests = {s.name: tensor_digest(new[s.offset : s.offset + s.nbytes]) for b, new in zip(plan, buffers)
                       for s in b.slots}
            self.manifest = self.writer.write(version, plan, encoded, digests)
            self.previous = buffers
        self.published = version
        return self.manifest


class StoragePatchSync(WeightSync):
    """Brings one server to each pushed version from the patches of ``publisher`` (module docstring).

    ``receipt_key``: the folder name under ``<url>/receipts/`` the server writes what it holds to
    (None: derived from the server's URL).
    """

    def __init__(self, control: Any | None, publisher: PatchPublisher, rank: int = 0,
                 deadline: DeadlineConfig | None = None, receipt_key: str | None = None, mode: str = "full"):
        if rank == 0 and control is None:
            raise ValueError("trainer rank 0 needs a VLLMControlClient to tell the server which patches to apply")
        self.control = control if rank == 0 else None
        self.publisher = publisher
        self.mode = mode
        self.deadlines = Deadlines(deadline or DeadlineConfig(), self.control.base_url if self.control else "")
        url = self.control.base_url if self.control else ""
        self._world_size: int | None = None
        self.receipt_key = receipt_key or "".join(c if c.isalnum() else "_" for c in url.split("://")[-1])

    def push(self, version: int) -> SyncStats:
        start = time.perf_counter()
        manifest = self.publisher.publish(version)
        if self.control is None or manifest is None:
            return SyncStats(mode=self.mode, bytes=0, seconds=time.perf_counter() - start)
        dense = sum(int(torch.Size(s).numel()) * getattr(torch, d).itemsize
                    for s, d in zip(manifest.shapes, manifest.dtype_names))
        calls = TimedControl(self.control, self.deadlines, version, dense)
        calls.pause()
        # From here on a failure leaves the server paused: it may hold half-loaded weights.
        applied = time.monotonic()
        calls.start_weight_update()
        calls.update_weights({"transport": STORAGE_TRANSPORT, "url": self.publisher.url, "target": version,
                              "receipt": self.receipt_key})
        calls.finish_weight_update(str(version))
        self.deadlines.record(dense, time.monotonic() - applied)
        calls.resume()
        return SyncStats(mode=self.mode, bytes=manifest.nbytes, seconds=time.perf_counter() - start, dense_bytes=dense,
                         changed_share=manifest.changed / max(1, manifest.numel) if manifest.base_version is not None
                         else None)

    def receipt(self, version: int, worker: int = 0) -> dict[str, Any]:
        """What the server's worker wrote after applying ``version``."""
        storage = self.publisher.storage
        return storage.read_json(storage.path(RECEIPTS, self.receipt_key, receipt_name(version, worker)))

    def check_applied(self, version: int) -> None:
        """Compare the server's receipt of ``version`` with the trainer's digests; raise naming what differs."""
        if self.control is None:
            return
        manifest = self.publisher.manifest
        if manifest is None or manifest.version != version:
            raise ValueError(f"check_applied({version}): the last version published is "
                             f"{manifest.version if manifest else None}")
        for worker in range(self._workers()):
            try:
                held = self.receipt(version, worker)["digests"]
            except (OSError, KeyError, ValueError) as err:
                raise ServedWeightsMismatch(
                    f"the vLLM server at {self.control.base_url} left no receipt of weight version {version} "
                    f"(worker {worker}; {type(err).__name__}: {err})", server=self.control.base_url, version=version,
                    phase="verify",
                ) from err
            wrong = sorted(n for n, d in manifest.digests.items() if held.get(n) != d)
            if wrong:
                raise ServedWeightsMismatch(
                    f"the vLLM server at {self.control.base_url} holds other weights than the trainer's version {version}: "
                    f"{len(wrong)} of {len(manifest.digests)} tensors differ ({', '.join(wrong[:3])})"
                    + (f" on worker {worker}" if worker else ""),
                    server=self.control.base_url, version=version, phase="verify",
                )

    def _workers(self) -> int:
        if self._world_size is None:
            self._world_size = self.control.world_size()
        return self._world_size

"""The trainer side of the gloo weight transfer: buckets, dense or delta, each wait under a deadline.

Every trainer rank walks the bucket plan (FSDP gathers are collectives); rank 0 broadcasts and talks
to the server. Per push: start → ``/update_weights`` on a thread (it returns once the server loaded
the last bucket) ∥ the broadcasts → finish. Each of those waits has its phase's deadline
(``timing.deadline.Deadlines``); a transfer that passes it stops sending but keeps walking the plan, so the
other ranks' gathers still meet rank 0's, and the push then raises ``WeightSyncTimeout``.

``encoding="delta"`` keeps each bucket's bytes as pushed (host memory, one copy of the model in the
wire dtype) and sends the next push as the changes against them (``delta.encode_bucket``); the first
push of a session is dense, and the receiver keeps what it loads for the deltas that follow.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Any, ClassVar, Self

import torch

from grpo_core.sync.errors import WeightSyncError
from grpo_core.sync.send.bucket_stream import TransferStats, local_tensors, send_buckets, source_device
from grpo_core.sync.timing.deadline import DeadlineConfig, Deadlines, PhaseClock
from grpo_core.sync.timing.timed_control import TimedControl
from grpo_core.sync.wire.buckets import DEFAULT_BUCKET_BYTES, Bucket, plan_buckets, update_info
from grpo_core.sync.wire.delta import encode_bucket
from grpo_core.sync.wire.gated_store import StoreGate, gloo_group, new_secret, trainer_store
from grpo_core.sync.wire.gloo_messages import RENDEZVOUS_TIMEOUT, GlooWeightTransferInitInfo
from grpo_core.vllm_types import TrainerInitInfo, TrainerWeightTransferEngine, VLLMWeightSyncClient, WeightSource

ENCODINGS = ("dense", "delta")
_POLL_S = 0.25


@dataclass
class GlooTrainerInitInfo(TrainerInitInfo):
    """Trainer-side rendezvous parameters; ``world_size`` = 1 + number of vLLM workers."""

    backend: ClassVar[str] = "gloo"
    master_address: str = "127.0.0.1"
    master_port: int = 0
    world_size: int = 2
    weight_version: str | None = None
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    encoding: str = "dense"
    rendezvous_timeout_s: float = RENDEZVOUS_TIMEOUT.total_seconds()


@dataclass(frozen=True)
class DeltaStats:
    """What the last push put on the wire against what a dense push would."""

    encoding: str
    wire_bytes: int
    dense_bytes: int
    changed: int | None
    """Elements that differed from the previous push (None for a dense push)."""
    numel: int


class GlooTrainerWeightTransferEngine(TrainerWeightTransferEngine[GlooTrainerInitInfo]):
    """Sends the trainer's weights bucket by bucket (see the module docstring)."""

    init_info_cls = GlooTrainerInitInfo

    def __init__(self, *, client: VLLMWeightSyncClient, source: WeightSource, is_sender: bool = True,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, encoding: str = "dense"):
        if encoding not in ENCODINGS:
            raise ValueError(f"encoding={encoding!r}: use one of {ENCODINGS}")
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.group: Any = None
        self.gate: Any = None  # the rendezvous listener that checks the secret (rank 0)
        self.next_weight_version: str | None = None
        self.bucket_bytes = bucket_bytes
        self.encoding = encoding
        self.deadlines = Deadlines(DeadlineConfig(), str(getattr(client, "base_url", "the vLLM server")))
        self.previous: list[torch.Tensor] | None = None  # each bucket's bytes at the last push (delta)
        self.previous_version: str | None = None
        self.bytes_sent = 0
        self.last_stats: TransferStats | None = None
        self.last_delta: DeltaStats | None = None

    @classmethod
    def trainer_init(cls, init_info: GlooTrainerInitInfo, *, client: VLLMWeightSyncClient,
                     source: WeightSource | None = None) -> Self:
        if source is None:
            raise ValueError("gloo weight transfer needs a WeightSource")
        engine = cls(client=client, source=source, is_sender=init_info.is_sender, bucket_bytes=init_info.bucket_bytes,
                     encoding=init_info.encoding)
        if not engine.is_sender:
            return engine
        secret = new_secret()
        worker_info = GlooWeightTransferInitInfo(master_address=init_info.master_address,
                                                 master_port=init_info.master_port, rank_offset=1,
                                                 world_size=init_info.world_size, secret=secret)
        # This process hosts the store on sockets it binds itself (a tcp:// rendezvous inside a
        # torchrun rank would only connect as a client and wait forever): the store on loopback, and
        # on the chosen interface a gate that admits only connections presenting the secret.
        engine.gate = StoreGate(init_info.master_address, init_info.master_port, secret)
        timeout = timedelta(seconds=init_info.rendezvous_timeout_s)
        # The workers block in init until the rendezvous completes, so the HTTP call runs on a
        # thread while this process hosts the store as rank 0.
        pool = ThreadPoolExecutor(max_workers=1)
        try:
            pending = pool.submit(client.init_weight_transfer_engine, asdict(worker_info))
            store = trainer_store(engine.gate, init_info.world_size, timeout)
            engine.group = gloo_group(store, 0, init_info.world_size, timeout, bind_address=init_info.master_address)
            pending.result()
        except BaseException:
            engine.shutdown()
            raise
        finally:
            pool.shutdown(wait=False)  # a failed rendezvous must not wait for the server's answer
        return engine

    def send_weights(self) -> None:
        assert self.source is not None
        meta = self.source.metadata()
        plan = plan_buckets(meta, self.bucket_bytes)
        device = source_device(self.source)
        if not self.is_sender:
            self.last_stats = send_buckets(plan, local_tensors(self.source), None, device)
            return
        dense_bytes = sum(b.nbytes for b in plan)
        label = self.next_weight_version
        calls = TimedControl(self.client, self.deadlines, int(label) if label and label.isdigit() else label, dense_bytes)
        delta = self.encoding == "delta" and self.previous is not None
        transfer = calls.clock("transfer")
        info = update_info(meta) | {
            "group_sizes": [len(b.slots) for b in plan], "encoding": "delta" if delta else "dense",
            "version": self.next_weight_version, "base_version": self.previous_version if delta else None,
            "keep": self.encoding == "delta", "deadline_s": transfer.seconds,
        }
        calls.start_weight_update()
        sender = _BucketSender(self.group, transfer, calls, plan, self.previous if delta else None,
                               keep=self.encoding == "delta")
        self.previous = self.previous_version = None  # until this push is done, the server holds neither
        pool = ThreadPoolExecutor(max_workers=1)
        try:
            answered = calls.clock("update")
            # /update_weights blocks on the server until every broadcast below has landed.
            pending = sender.answer = pool.submit(calls.update_weights, info)
            self.last_stats = send_buckets(plan, local_tensors(self.source), sender, device)
            sender.check()
            try:
                pending.result(timeout=answered.remaining() + 1.0)
            except FutureTimeout:
                raise answered.expired("the server did not answer /update_weights") from None
        finally:
            # Never join the request thread on failure: the server may still sit in a receive this
            # rank will not make, and joining would turn the error into a hang.
            pool.shutdown(wait=False)
        calls.finish_weight_update(self.next_weight_version)
        self.deadlines.record(dense_bytes, time.monotonic() - transfer.started)
        self.bytes_sent = sender.wire_bytes
        self.last_delta = DeltaStats(encoding=info["encoding"], wire_bytes=sender.wire_bytes, dense_bytes=dense_bytes,
                                     changed=sender.changed if delta else None, numel=sender.numel)
        if self.encoding == "delta":
            self.previous, self.previous_version = sender.kept, self.next_weight_version

    def shutdown(self) -> None:
        if self.group is not None:
            self.group.shutdown()
            self.group = None
        if self.gate is not None:
            self.gate.close()
            self.gate = None
        self.previous = self.previous_version = None


class _BucketSender:
    """``send`` for ``bucket_stream.send_buckets`` on rank 0: broadcasts bucket k (dense or as a delta
    against ``previous[k]``) within the transfer's deadline; after a failure it sends nothing more
    (the walk goes on for the other ranks' gathers) and ``check`` raises it."""

    def __init__(self, group: Any, clock: PhaseClock, calls: TimedControl, plan: list[Bucket],
                 previous: list[torch.Tensor] | None, keep: bool):
        self.group, self.clock, self.calls, self.plan = group, clock, calls, plan
        self.previous = previous
        self.keep = keep
        self.kept: list[torch.Tensor] = []
        self.answer: Future | None = None  # the request thread's /update_weights, once sent
        self.index = 0
        self.failure: BaseException | None = None
        self.failed_at = -1
        self.wire_bytes = self.changed = self.numel = 0

    def __call__(self, buffer: torch.Tensor) -> None:
        k, self.index = self.index, self.index + 1
        if self.failure is not None:
            return
        # gloo moves host memory; a trainer on CUDA with the gloo backend copies each bucket down.
        host = buffer if buffer.device.type == "cpu" else buffer.cpu()
        try:
            if self.previous is not None:
                encoded = encode_bucket(self.plan[k], host, self.previous[k])
                self._send(encoded.header)
                self._send(encoded.payload)
                self.wire_bytes += encoded.nbytes
                self.changed += encoded.changed
                self.numel += encoded.numel
            else:
                self._send(host)
                self.wire_bytes += host.numel()
                self.numel += sum(s.nbytes // s.dtype.itemsize for s in self.plan[k].slots)
            if self.keep:
                self.kept.append(host.clone())
        except Exception as err:  # noqa: BLE001 - raised by check() once every rank has walked the plan
            self.failure, self.failed_at = err, k

    def _send(self, tensor: torch.Tensor) -> None:
        work = self.group.broadcast(tensor, 0)
        while True:
            # In slices, so that a server that refused the update (it answered /update_weights with an
            # error and will not receive) ends the push now rather than at the deadline.
            try:
                work.wait(timedelta(seconds=min(_POLL_S, max(0.001, self.clock.remaining()))))
                return
            except RuntimeError as err:
                if "timed out" not in str(err).lower() or self.clock.remaining() <= 0:
                    raise
                answer = self.answer
                if answer is not None and answer.done() and answer.exception() is not None:
                    raise answer.exception() from err

    def check(self) -> None:
        if self.failure is None:
            return
        if isinstance(self.failure, WeightSyncError):
            raise self.failure  # the server's own answer, already named
        if self.clock.remaining() <= 0:
            raise self.clock.expired(f"bucket {self.failed_at + 1} of {len(self.plan)}: {self.failure}") from self.failure
        error: WeightSyncError = self.calls.failed("transfer", self.failure)
        raise error from self.failure

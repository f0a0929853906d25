"""Full-weight sync through vLLM's weight-transfer protocol: pause → start → update → finish → resume.

The transport is picked by name: ``gloo`` (this package's backend, CPU servers), ``nccl`` (vLLM's
packed NCCL format, sent by ``send.nccl_trainer.BucketedNCCLTrainerEngine``) or ``ipc`` (vLLM's CUDA IPC engine, for a
server on the trainer's own GPU, sent by ``send.ipc_trainer.IPCTrainerWeightTransferEngine``). Both send the model in
buckets of about ``bucket_bytes``, gathered with one collective per bucket across FSDP2 ranks; gloo
can also send only what changed since the last push (``encoding="delta"``, ``send.gloo_trainer``).

Every call to the server has a deadline (``timing.deadline.Deadlines``; for ``nccl`` the HTTP phases only:
its broadcasts run on the GPU and are not cut off). A push that fails or passes one raises a
``WeightSyncError`` naming the phase, the server and the version, tears its session down (the sync
cannot push again; the caller makes a new one) and leaves the server paused: it may hold half-loaded
weights, which must not be sampled from. The next push, by this trainer or a resumed one, resumes it.

The server dials back to a rendezvous store on trainer rank 0: at ``master_address`` when given,
else at the local address that routes to the server's URL (``address.rendezvous_address``), on a
free port, inside ``port_range`` when the cluster's firewall allows only a range. The server is paused with ``mode=keep`` so in-flight rollouts are frozen rather than aborted,
and with ``clear_cache=true`` so neither their KV nor the prefix cache keeps values computed with
the old weights; tokens generated after the swap carry the new version in ``weight_versions``.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from grpo_core.sync.base import SyncStats, WeightSync
from grpo_core.sync.errors import WeightSyncError
from grpo_core.sync.send.bucket_stream import TransferStats
from grpo_core.sync.send.gloo_trainer import GlooTrainerInitInfo, GlooTrainerWeightTransferEngine
from grpo_core.sync.send.ipc_trainer import IPC_BACKEND, IPCTrainerInitInfo, IPCTrainerWeightTransferEngine
from grpo_core.sync.timing.deadline import DeadlineConfig, Deadlines
from grpo_core.sync.timing.timed_control import TimedControl
from grpo_core.sync.wire.address import PortRange, choose_port, rendezvous_address
from grpo_core.sync.wire.buckets import DEFAULT_BUCKET_BYTES
from grpo_core.sync.wire.gated_store import PortTaken
from grpo_core.sync.wire.gloo_messages import GLOO_BACKEND
from grpo_core.vllm_lines import installed_line
from grpo_core.vllm_types import WeightSource

if TYPE_CHECKING:
    from grpo_core.vllm_server.control import VLLMControlClient


PORT_ATTEMPTS = 3
"""Rendezvous ports tried when one is taken between its choice and its bind (``PortTaken``)."""


def _trainer_engine(backend: str, control: Any, source: WeightSource, rank: int, address: str, port: int,
                    world_size: int, bucket_bytes: int, encoding: str, rendezvous_s: float) -> Any:
    """Rendezvous with the server (rank 0) and return the trainer-side engine for ``backend``."""
    if backend == GLOO_BACKEND:
        info = GlooTrainerInitInfo(rank=rank, master_address=address, master_port=port, world_size=world_size,
                                   bucket_bytes=bucket_bytes, encoding=encoding, rendezvous_timeout_s=rendezvous_s)
        return GlooTrainerWeightTransferEngine.trainer_init(info, client=control, source=source)
    if encoding != "dense":
        raise ValueError(f"weight_sync_encoding={encoding!r} needs the gloo backend; {backend!r} pushes dense weights")
    if backend == IPC_BACKEND:
        if world_size > 2:
            raise ValueError(f"weight_transfer_backend='ipc' reaches a server of one GPU worker; this one has "
                             f"{world_size - 1}: use 'nccl' for a tensor-parallel server")
        return IPCTrainerWeightTransferEngine.trainer_init(IPCTrainerInitInfo(rank=rank, bucket_bytes=bucket_bytes),
                                                           client=control, source=source)
    if backend == "nccl":
        if not installed_line().trainer_engine_api:
            raise ValueError(
                "weight_transfer_backend='nccl' sends through vLLM's trainer-side NCCL API, which the installed vLLM "
                f"line ({installed_line().line}) lacks; a server on the trainer's own GPU takes 'ipc' (or 'gloo')")
        from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

        from grpo_core.sync.send.nccl_trainer import BucketedNCCLTrainerEngine

        info = NCCLTrainerInitInfo(rank=rank, master_address=address, master_port=port, world_size=world_size,
                                   packed=True, packed_buffer_size_bytes=bucket_bytes)
        return BucketedNCCLTrainerEngine.trainer_init(info, client=control, source=source)
    raise ValueError(f"weight_transfer_backend={backend!r} is not supported; use 'gloo' (CPU), 'nccl' (GPUs of its "
                     "own) or 'ipc' (a server on the trainer's GPU)")


class ProtocolWeightSync(WeightSync):
    """Pushes every weight of ``source`` over the named backend; call on every trainer rank.

    ``master_address``: where the server dials back (None: the local address routing to the server's
    URL). ``port_range``: ports the rendezvous may use, both ends included (None: any free port).
    ``bucket_bytes``: the bucket threshold (a bucket closes after the tensor that passes it); the
    sender's extra GPU memory is at most twice the largest bucket, plus the FSDP2 gather scratch.
    ``encoding``: ``dense`` or ``delta`` (gloo only). ``deadline``: the phases' deadlines.
    """

    def __init__(
        self,
        control: VLLMControlClient | None,
        source: WeightSource,
        backend: str,
        rank: int = 0,
        master_address: str | None = None,
        port_range: PortRange | None = None,
        mode: str = "full",
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        encoding: str = "dense",
        deadline: DeadlineConfig | None = None,
    ):
        if rank == 0 and control is None:
            raise ValueError("trainer rank 0 needs a VLLMControlClient to drive the weight transfer")
        self.control = control if rank == 0 else None
        self.backend = backend
        self.mode = mode
        self.source = source
        self.deadlines = Deadlines(deadline or DeadlineConfig(), self.control.base_url if self.control else "")
        self.master_address = ""
        port = world_size = 0
        init_calls = None
        if self.control is not None:
            self.master_address = rendezvous_address(self.control.base_url, master_address)
            port = choose_port(self.master_address, port_range)
            world_size = 1 + self.control.world_size()
            init_calls = TimedControl(self.control, self.deadlines, None, 0)
        for attempt in range(PORT_ATTEMPTS):
            try:
                self.engine = _trainer_engine(backend, init_calls, source, rank, self.master_address, port, world_size,
                                              bucket_bytes, encoding, self.deadlines.seconds("init", 0))
                break
            except PortTaken:
                # Taken between its choice and its bind, before the server was told it: choose again.
                if attempt == PORT_ATTEMPTS - 1:
                    raise
                port = choose_port(self.master_address, port_range)
        self.engine.client = self.control  # each push wraps it in that push's deadlines
        self.engine.deadlines = self.deadlines
        self.bytes_per_push = sum(m.dtype.itemsize * _numel(m.shape) for m in source.metadata())

    @property
    def last_transfer(self) -> TransferStats | None:
        """Buckets, bytes and the extra device memory of the last push (None before the first)."""
        return getattr(self.engine, "last_stats", None)

    def push(self, version: int) -> SyncStats:
        if self.engine is None:
            raise WeightSyncError(f"weight sync to {self.server_url}: its session was torn down by a failed push; "
                                  "make a new sync", server=self.server_url or "", version=version, phase="init")
        start = time.perf_counter()
        calls = TimedControl(self.control, self.deadlines, version, self.bytes_per_push) if self.control else None
        phase = "pause"
        try:
            if calls is not None:
                calls.pause()
            phase = "transfer"
            # Both engines pass the version to /finish_weight_update, before the server resumes.
            self.engine.next_weight_version = str(version)
            if self.backend != GLOO_BACKEND and calls is not None:
                self.engine.client = calls  # vLLM's packed sender drives the HTTP phases itself
            self.engine.send_weights()
            phase = "resume"
            if calls is not None:
                calls.resume()
        except BaseException as err:
            self.close()  # the communicator goes; the server stays paused (see the module docstring)
            if calls is not None and isinstance(err, Exception):
                raise calls.failed(phase, err) from err
            raise
        delta = getattr(self.engine, "last_delta", None)
        return SyncStats(
            mode=self.mode, bytes=delta.wire_bytes if delta else self.bytes_per_push,
            seconds=time.perf_counter() - start, dense_bytes=self.bytes_per_push,
            changed_share=delta.changed / max(1, delta.numel) if delta and delta.changed is not None else None,
        )

    def close(self) -> None:
        if self.engine is not None:
            engine, self.engine = self.engine, None
            engine.shutdown()


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n

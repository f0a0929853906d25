"""What the two sides of a gloo push say to each other: the backend's name, the rendezvous, and the messages.

The trainer builds these (``grpo_core.sync.send.gloo_trainer``, ``grpo_core.sync.storage_sync``); the engine inside
each vLLM worker (``grpo_core.vllm_plugin.gloo_engine``) reads them. ``GlooWeightTransferUpdateInfo.plan``
rebuilds on the receiving side the bucket plan the sender cut (``buckets.plan_from_sizes``).

The messages are plain dataclasses: the receiving engine builds them from the request's dict
(``init_info_cls(**init_info)``), and vLLM's base classes for them carry no behaviour; not deriving from them keeps
vLLM out of the trainer process, which builds these too.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta

import torch

from grpo_core.vllm_types import ParamMeta

from grpo_core.sync.wire.buckets import Bucket, plan_from_sizes

GLOO_BACKEND = "gloo"
"""The name vLLM's ``weight_transfer_config.backend`` gives this transfer (registered by ``grpo_core.vllm_plugin``)."""
RENDEZVOUS_TIMEOUT = timedelta(seconds=300)
STORAGE_TRANSPORT = "storage"
"""``update_info['transport']`` of an update read from weight patches on storage (``grpo_core.vllm_plugin.receiver.apply_storage_update``)."""


@dataclass
class GlooWeightTransferInitInfo:
    """Worker-side rendezvous: the trainer (rank 0) hosts the TCP store."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    secret: str = ""  # presented at the trainer's gate (``gated_store``); fresh per rendezvous


@dataclass
class GlooWeightTransferUpdateInfo:
    """One sync: every parameter's metadata, how many parameters each broadcast carries, and how.

    ``encoding``: ``dense`` (each bucket's flat bytes) or ``delta`` (per bucket a header broadcast, then
    the payload of ``delta.encode_bucket``, applied to the weights of ``base_version``). ``keep``: the
    receiver keeps what it loads, for the deltas that follow. ``deadline_s``: how long the receiver
    waits for the whole transfer before it gives up (None: the group's timeout).
    """

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    group_sizes: list[int] = field(default_factory=list)
    encoding: str = "dense"
    version: str | None = None
    base_version: str | None = None
    keep: bool = False
    deadline_s: float | None = None

    def __post_init__(self) -> None:
        n = len(self.names)
        if len(self.dtype_names) != n or len(self.shapes) != n:
            raise ValueError("update_info names, dtype_names and shapes must have equal lengths")
        if not self.group_sizes:
            self.group_sizes = [n]
        if sum(self.group_sizes) != n:
            raise ValueError(f"group_sizes sum to {sum(self.group_sizes)}, expected {n}")
        if self.encoding not in ("dense", "delta"):
            raise ValueError(f"update_info encoding={self.encoding!r}: use 'dense' or 'delta'")

    def plan(self) -> list[Bucket]:
        meta = [ParamMeta(n, getattr(torch, d), tuple(s)) for n, d, s in zip(self.names, self.dtype_names, self.shapes)]
        return plan_from_sizes(meta, self.group_sizes)

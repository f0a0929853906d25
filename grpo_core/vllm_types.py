"""The trainer side's weight-transfer base types, the same on every supported vLLM line: what a parameter looks like
on the wire (``ParamMeta``), where the weights come from (``WeightSource``), the routes a sender calls
(``VLLMWeightSyncClient``) and what every sender is (``TrainerInitInfo``, ``TrainerWeightTransferEngine``).

They are the project's own, not imported from vLLM, for two reasons: the 0.25 line has no trainer side at all, and
importing vLLM costs a trainer process 8 s of its start on an idle machine with bytecode cached (it brings in
torch's compiler, transformers' image processors and more), which every trainer start and every resume would pay
for types with no behaviour. So the training process imports vLLM only for the NCCL sender, whose rendezvous is
vLLM's own (``grpo_core.sync.send.nccl_trainer``); tests/test_cuda_install.py fails if the training side imports
it otherwise.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar, Generic, Protocol, TypeVar

import torch

TInit = TypeVar("TInit")


def materialize_full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor on this rank: an FSDP2 shard (a DTensor) is gathered, anything else returned as is."""
    full = getattr(tensor, "full_tensor", None)
    return full() if callable(full) else tensor


@dataclass(frozen=True)
class ParamMeta:
    """One parameter as it travels: checkpoint name, wire dtype, full shape."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]


class WeightSource(ABC):
    """The trainer's weights: ``metadata()`` without moving anything, iteration yielding whole tensors in the
    same order (a collective per tensor under FSDP2, so every rank iterates in step)."""

    @abstractmethod
    def metadata(self) -> list[ParamMeta]: ...

    @abstractmethod
    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]: ...


class VLLMWeightSyncClient(Protocol):
    """The server's weight-transfer routes as the senders call them."""

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None: ...

    def start_weight_update(self) -> None: ...

    def update_weights(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None: ...

    def finish_weight_update(self, weight_version: str | None = None) -> None: ...


@dataclass
class TrainerInitInfo:
    """A sender's set-up; rank 0 sends, the other ranks take part in the gathers."""

    backend: ClassVar[str] = ""
    rank: int = field(default=0, kw_only=True)

    @property
    def is_sender(self) -> bool:
        return self.rank == 0


class TrainerWeightTransferEngine(ABC, Generic[TInit]):
    """A sender: set up once by ``trainer_init``, then ``send_weights`` per push, ``shutdown`` at the end."""

    init_info_cls: ClassVar[type] = TrainerInitInfo

    def __init__(self, *, client: Any, source: Any, is_sender: bool = True):
        self.client = client
        self.source = source
        self.is_sender = is_sender

    @abstractmethod
    def send_weights(self) -> None: ...

    def shutdown(self) -> None:
        return None

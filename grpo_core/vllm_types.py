"""The trainer side's weight-transfer base types: vLLM's own on the 0.32 line, the same shapes defined here on the
0.25 line, whose weight-transfer package has the receiving engines only (``grpo_core.vllm_lines`` says what else
differs between the lines). Every sender imports them from here.

Importing this module imports vLLM where it is installed (seconds on a loaded machine), so only what sends weights
or gathers them for a push imports it; the control client, the server's launch and the rollout process do not.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar, Generic, Protocol, TypeVar

import torch

TInit = TypeVar("TInit")

try:  # the 0.32 line
    from vllm.distributed.weight_transfer.base import (  # noqa: F401 - re-exported
        ParamMeta,
        TrainerInitInfo,
        TrainerWeightTransferEngine,
        VLLMWeightSyncClient,
        WeightSource,
        materialize_full_tensor,
    )
except ImportError:  # the 0.25 line: no trainer side in vLLM; the same shapes, defined here

    def materialize_full_tensor(tensor: torch.Tensor) -> torch.Tensor:  # type: ignore[misc]
        """The whole tensor on this rank: an FSDP2 shard (a DTensor) is gathered, anything else returned as is."""
        full = getattr(tensor, "full_tensor", None)
        return full() if callable(full) else tensor

    @dataclass(frozen=True)
    class ParamMeta:  # type: ignore[no-redef]
        """One parameter as it travels: checkpoint name, wire dtype, full shape."""

        name: str
        dtype: torch.dtype
        shape: tuple[int, ...]

    class WeightSource(ABC):  # type: ignore[no-redef]
        """The trainer's weights: ``metadata()`` without moving anything, iteration yielding whole tensors in the
        same order (a collective per tensor under FSDP2, so every rank iterates in step)."""

        @abstractmethod
        def metadata(self) -> list[ParamMeta]: ...

        @abstractmethod
        def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]: ...

    class VLLMWeightSyncClient(Protocol):  # type: ignore[no-redef]
        """The server's weight-transfer routes as the senders call them."""

        def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None: ...

        def start_weight_update(self) -> None: ...

        def update_weights(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None: ...

        def finish_weight_update(self, weight_version: str | None = None) -> None: ...

    @dataclass
    class TrainerInitInfo:  # type: ignore[no-redef]
        """A sender's set-up; rank 0 sends, the other ranks take part in the gathers."""

        backend: ClassVar[str] = ""
        rank: int = field(default=0, kw_only=True)

        @property
        def is_sender(self) -> bool:
            return self.rank == 0

    class TrainerWeightTransferEngine(ABC, Generic[TInit]):  # type: ignore[no-redef]
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

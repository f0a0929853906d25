"""Weight sync behind one small interface: push the trainer's policy to the server, tagged with a version.

Implementations:
* ``protocol.ProtocolWeightSync``: vLLM's weight-transfer protocol (gloo on CPU, NCCL on GPUs),
  full or LoRA-merged weights;
* ``lora.LoraAdapterSync``: writes the adapter to shared storage and loads it by name.

Every implementation is called on every trainer rank (FSDP gathers are collectives); only rank 0
talks to the server.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any


@dataclass
class SyncStats:
    """What one push cost."""

    mode: str
    bytes: int
    """Bytes the push moved to the server (a delta: its headers and changes; storage: the patch read)."""
    seconds: float
    adapters_registered: int | None = None  # adapter sync: versions the server holds after the push
    dense_bytes: int | None = None
    """Bytes of the whole model in the wire dtype (what a dense push moves); None where not known."""
    changed_share: float | None = None
    """Share of the elements that differ from the previous push (None: a whole push, nothing compared)."""


class WeightSync(ABC):
    """Pushes the current policy to the vLLM server."""

    mode: str

    @abstractmethod
    def push(self, version: int) -> SyncStats:
        """Make ``version`` the policy that new tokens are sampled from."""

    def served_model_name(self, version: int) -> str | None:
        """The ``model`` field a request must name to sample from ``version`` (None: the default)."""
        return None

    def adapter_pointer(self) -> Any | None:
        """Adapter sync: the shared pointer through which the rollout worker names the newest
        registered adapter in its requests (None: requests name no adapter)."""
        return None

    @property
    def server_url(self) -> str | None:
        """The server this sync pushes to (None off rank 0)."""
        control = getattr(self, "control", None)
        return getattr(control, "base_url", None)

    def close(self) -> None:
        """Release transport resources."""

"""Where this process sits in a torchrun launch, and the process group the trainer side shares.

``DistInfo`` (rank, world size, local rank, device), joining and leaving the default process group, and
``broadcast_object`` (rank 0's decision on every rank). The step loop (``training``), the servers' pushes
(``fleet``) and checkpoints use these; nothing here knows what a step or a server is.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist


@dataclass
class DistInfo:
    """Where this process sits in a torchrun launch (1 process when not launched by torchrun)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @classmethod
    def from_env(cls) -> "DistInfo":
        return cls(
            rank=int(os.environ.get("RANK", 0)),
            world_size=int(os.environ.get("WORLD_SIZE", 1)),
            local_rank=int(os.environ.get("LOCAL_RANK", 0)),
        )

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def device(self) -> torch.device:
        if torch.cuda.is_available():
            return torch.device("cuda", self.local_rank)
        return torch.device("cpu")


def init_distributed(info: DistInfo, device: torch.device, timeout_s: float) -> bool:
    """Join the default process group (gloo on CPU; NCCL for CUDA tensors, gloo for CPU ones).

    Under torchrun the rendezvous comes from the environment; a single process without torchrun
    gets a 1-rank group on an in-process store (FSDP2 needs a group even for one rank). Returns
    False when the group already existed.
    """
    if dist.is_initialized():
        return False
    if device.type == "cuda":
        torch.cuda.set_device(device)
        backend = "cpu:gloo,cuda:nccl"  # object broadcasts stay on the CPU
    else:
        backend = "gloo"
    timeout = timedelta(seconds=timeout_s)
    if "MASTER_ADDR" in os.environ:
        dist.init_process_group(backend, timeout=timeout, rank=info.rank, world_size=info.world_size)
    elif info.world_size == 1:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    else:
        raise RuntimeError(f"WORLD_SIZE={info.world_size} without MASTER_ADDR: launch the ranks with torchrun")
    return True


def active_world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """``obj`` from rank ``src`` on every rank (unchanged without a process group)."""
    if active_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def shutdown_distributed() -> None:
    """Leave the default process group (the trainer calls it only for a group it created)."""
    if dist.is_initialized():
        dist.destroy_process_group()

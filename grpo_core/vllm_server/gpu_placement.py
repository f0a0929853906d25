"""Which GPUs the flow gives a managed server and the trainers of a run on one machine.

* One GPU: the server and the trainer share it. The server takes a share of its memory
  (``ServerOptions.gpu_memory_utilization``, ``SHARED_GPU_MEMORY_SHARE`` by default) and weights reach it through
  CUDA IPC (``weight_transfer_backend="ipc"``): NCCL refuses two processes on one device.
* Two or more: the server gets the first GPU, the trainers the next ``nproc_per_node`` (NCCL between them); the
  server's own tensor parallelism, when a user gives it through ``extra_args``, takes the GPUs it names itself.

Nothing here runs without CUDA: a CPU machine has no placement (``cpu_placement`` splits its cores instead).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GpuPlacement:
    """The GPU indices (as this machine numbers them) of the server and of the trainers."""

    server: tuple[int, ...]
    trainer: tuple[int, ...]

    @property
    def shared(self) -> bool:
        """The server runs on a GPU a trainer uses."""
        return bool(set(self.server) & set(self.trainer))

    def server_devices(self) -> str:
        """The server's ``CUDA_VISIBLE_DEVICES``."""
        return ",".join(map(str, self.server))

    def trainer_devices(self) -> str:
        """The trainers' ``CUDA_VISIBLE_DEVICES`` (torchrun's ranks take them in order)."""
        return ",".join(map(str, self.trainer))

    def describe(self) -> str:
        if self.shared:
            return f"server and trainer share GPU {self.server_devices()}"
        return f"server on GPU {self.server_devices()}, trainer on GPU {self.trainer_devices()}"


def place_on_gpus(visible: list[int], trainer_processes: int) -> GpuPlacement:
    """The placement of a server and ``trainer_processes`` trainers on the ``visible`` GPUs of this machine."""
    if not visible:
        raise ValueError("no GPU to place on: the placement is for CUDA machines only")
    if trainer_processes < 1:
        raise ValueError(f"trainer_processes={trainer_processes}: need at least 1")
    if len(visible) == 1:
        if trainer_processes > 1:
            raise ValueError(f"nproc_per_node={trainer_processes} trainers on one GPU: one trainer process per GPU; "
                             "set nproc_per_node: 1")
        return GpuPlacement(server=(visible[0],), trainer=(visible[0],))
    if trainer_processes > len(visible) - 1:
        raise ValueError(f"nproc_per_node={trainer_processes} trainers need as many GPUs beside the server's one; this "
                         f"machine has {len(visible)} (set nproc_per_node to at most {len(visible) - 1})")
    return GpuPlacement(server=(visible[0],), trainer=tuple(visible[1 : 1 + trainer_processes]))


def visible_gpus() -> list[int]:
    """The GPUs this process may use, numbered as ``CUDA_VISIBLE_DEVICES`` lists them (0.. for the count)."""
    import os

    import torch

    if not torch.cuda.is_available():
        return []
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed:
        return [int(d) for d in listed.split(",") if d.strip().isdigit()][: torch.cuda.device_count()]
    return list(range(torch.cuda.device_count()))

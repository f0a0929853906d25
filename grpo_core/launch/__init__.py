"""A training job: its file (``job.JobConfig``) and the training process it starts.

``python -m grpo_core.launch JOB.json --server-url URL`` (``__main__``) runs one training process;
the flows and the Kubernetes manifests start it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

STOPPED_RESUMABLE, STOPPED_NOT_RESUMABLE = "failed", "not-resumable"
"""The ``stopped`` values of a failed attempt's result file: a resume may get past the error (a lost server, a
preempted machine), or it cannot (the policy no longer yields a group to train: ``collector.NoLearningSignalError``)."""


def write_failure(result_file: str, global_step: int, error: BaseException, resumable: bool) -> None:
    """Rank 0's result file for an attempt that ended on ``error``: the step it stopped at, why, and whether a resume
    can change that (the flow reads it to decide, and names the error when it gives up)."""
    Path(result_file).write_text(json.dumps({
        "global_step": global_step, "stopped": STOPPED_RESUMABLE if resumable else STOPPED_NOT_RESUMABLE,
        "error": f"{type(error).__name__}: {error}"}))


@dataclass(frozen=True)
class AttemptFailure:
    """What a failed attempt's result file says."""

    why: str
    """``training stopped at step N: <error class>: <message>``."""
    resumable: bool
    """Whether a resume may get past it."""


def attempt_failure(result_file: str | Path) -> AttemptFailure | None:
    """The failure of the attempt that wrote ``result_file``; None where it wrote none (a process killed from
    outside) or finished."""
    try:
        result = json.loads(Path(result_file).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(result, dict) or result.get("stopped") not in (STOPPED_RESUMABLE, STOPPED_NOT_RESUMABLE):
        return None
    return AttemptFailure(f"training stopped at step {result.get('global_step')}: {result.get('error')}",
                          resumable=result["stopped"] == STOPPED_RESUMABLE)

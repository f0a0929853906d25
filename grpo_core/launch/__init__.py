"""A training job: its file (``job.JobConfig``) and the training process it starts.

``python -m grpo_core.launch JOB.json --server-url URL`` (``__main__``) runs one training process;
the flows and the Kubernetes manifests start it.
"""

from __future__ import annotations

import json
from pathlib import Path

NOT_RESUMABLE = "not-resumable"
"""The ``stopped`` value of a result file whose training ended on something a resume cannot change (the policy no
longer yields a group to train: ``collector.NoLearningSignalError``)."""


def write_not_resumable(result_file: str, global_step: int, error: BaseException) -> None:
    """Rank 0's result file for a run that must not be resumed: the step it stopped at and why."""
    Path(result_file).write_text(json.dumps({"global_step": global_step, "stopped": NOT_RESUMABLE,
                                             "error": f"{type(error).__name__}: {error}"}))


def not_resumable_reason(result_file: str | Path) -> str | None:
    """Why the attempt that wrote ``result_file`` must not be resumed, or None (no such file, or a finished run's)."""
    try:
        result = json.loads(Path(result_file).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(result, dict) or result.get("stopped") != NOT_RESUMABLE:
        return None
    return f"training stopped at step {result.get('global_step')}: {result.get('error')}"

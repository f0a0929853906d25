"""What a finished run answers, written where MLflow's UI shows it first: the run's description and the registered
model version's description and tags.

    record_answer(client, run_id, summary, job, registered_name)

``summary`` is the flow's summary (``summary.json``: held-out accuracy before and after with 95% intervals, the
gain, the reward of the first and last steps); ``job`` a ``JobConfig`` as a dict. The run's description is MLflow's
``mlflow.note.content`` tag (the run page's "Description", a column of the runs view); the version's description and
tags (``heldout_accuracy``, ``base_model``, ``dataset``, ``git_commit``, ...) are what the registry's pages show and
what ``search_model_versions`` filters on.
"""

from __future__ import annotations

from typing import Any

DESCRIPTION_TAG = "mlflow.note.content"
"""The tag MLflow's UI shows as a run's description."""


def _number(value: Any) -> str:
    return f"{value:.3f}" if isinstance(value, float) else str(value)


def run_description(summary: dict[str, Any], job: dict[str, Any], heldout: str) -> str:
    """The run's description (markdown): ``heldout``, the one-line held-out result, first; then the reward of the
    first and last steps and what was trained on what."""
    lines = [heldout, ""]
    if summary.get("steps"):
        lines.append(f"Reward {_number(summary.get('reward_first'))} over the first 10% of steps, "
                     f"{_number(summary.get('reward_last'))} over the last ({summary['steps']} steps).")
    lines.append(f"Model `{job.get('model')}`, data set `{job.get('dataset')}`, seed {job.get('trainer', {}).get('seed')}.")
    return "\n".join(lines)


def version_tags(summary: dict[str, Any], job: dict[str, Any], commit: str | None) -> dict[str, str]:
    """The registered version's tags: its held-out score with its interval, the base model, the data set, the commit
    and the run's step count (only those known)."""
    tags: dict[str, Any] = {
        "heldout_accuracy": summary.get("eval_accuracy_after"),
        "heldout_accuracy_ci95": summary.get("eval_accuracy_after_ci95"),
        "heldout_accuracy_before": summary.get("eval_accuracy_before"),
        "base_model": job.get("model"),
        "dataset": job.get("dataset"),
        "git_commit": commit,
        "steps": summary.get("steps"),
    }
    out = {}
    for key, value in tags.items():
        if value is None:
            continue
        out[key] = "[" + ", ".join(f"{v:.3f}" for v in value) + "]" if isinstance(value, list) else _number(value)
    return out


def run_version(client: Any, name: str, run_id: str) -> Any | None:
    """The version of registered model ``name`` that run ``run_id`` made (its newest, if several), or None."""
    versions = client.search_model_versions(f"name = '{name}' and run_id = '{run_id}'")
    return max(versions, key=lambda v: int(v.version), default=None)


def record_answer(client: Any, run_id: str, summary: dict[str, Any], job: dict[str, Any], registered_name: str | None,
                  heldout: str, commit: str | None) -> str | None:
    """Describe the run and its registered version (``run_description``, ``version_tags``); the version's number,
    or None when the run registered none."""
    description = run_description(summary, job, heldout)
    client.set_tag(run_id, DESCRIPTION_TAG, description)
    version = run_version(client, registered_name, run_id) if registered_name else None
    if version is None:
        return None
    client.update_model_version(registered_name, version.version, description=description)
    for key, value in version_tags(summary, job, commit).items():
        client.set_model_version_tag(registered_name, version.version, key, value)
    return str(version.version)

"""Which MLflow run ``grpo train`` continues when its ``output_dir`` holds a run whose whole job stopped.

A flow resumes a trainer that dies under it; when the flow itself stops (a lost machine, a killed command), running
the same command again must continue that run, not start over and write its checkpoints over the stopped run's
(docs/faults_and_resume.md, "A whole job stopped").
"""

from __future__ import annotations

import json
import logging
from typing import Any

from prefect import get_run_logger
from prefect import task as prefect_task
from prefect.cache_policies import NO_CACHE

from grpo_core.checkpoint import unfinished_run
from grpo_core.launch.job import JobConfig
from grpo_core.tracking.tracker import run_identity

log = logging.getLogger(__name__)


def flow_logger() -> Any:
    """The running flow's logger (the Prefect UI shows it), or this module's outside a flow run."""
    try:
        return get_run_logger()
    except Exception:  # noqa: BLE001 - outside a run context
        return log


@prefect_task(name="find-unfinished-run", cache_policy=NO_CACHE)  # reads the folder as it is now
def continued_run(job: JobConfig, tracking_uri: str) -> str | None:
    """The MLflow run to continue: the one an earlier ``grpo train`` of this job left unfinished in ``output_dir``
    (its whole job stopped with the machine or the flow, not only the trainer), so that running the same command
    again resumes it; None to start a new run.

    ``resume_from_checkpoint`` decides: unset, only a run of the same job (its ``config_hash`` tag) is continued,
    and a folder holding an unfinished run of another job is refused, since a new run there would write its
    checkpoints over that run's; ``true`` continues whatever run the folder holds; ``false`` starts a new run."""
    import mlflow

    wanted = job.trainer.resume_from_checkpoint
    if wanted is False or isinstance(wanted, str):  # a path: the trainer resumes from it, in a new MLflow run
        return None
    found = unfinished_run(job.trainer.output_dir, job.trainer.max_steps)
    if found is None:
        return None
    where = f"trainer.output_dir={job.trainer.output_dir!r}"
    try:
        tags = mlflow.MlflowClient(tracking_uri).get_run(found.mlflow_run_id).data.tags if found.mlflow_run_id else None
    except Exception:  # noqa: BLE001 - a run this tracking server does not hold
        tags = None
    _, identity = run_identity(json.loads(job.model_dump_json()))
    same_job = tags is not None and tags.get("config_hash") == identity["config_hash"]
    if wanted is None and not same_job:
        theirs = f"not in {tracking_uri}" if tags is None else f"of config {str(tags.get('config_hash'))[:8]}"
        raise ValueError(
            f"{where} holds an unfinished run of another job (its newest good checkpoint {found.checkpoint}, MLflow "
            f"run {found.mlflow_run_id} {theirs}; this job's config is {identity['config_hash'][:8]}): a new run "
            "there would write its checkpoints over "
            "that run's. Choose another output_dir, run the job that run was started with to continue it, or set "
            "trainer.resume_from_checkpoint: true to continue it with this job (false: start a new run there)")
    if tags is None:
        flow_logger().warning("%s: continuing from %s (step %d) in a new MLflow run: its run %s is not in %s", where,
                          found.checkpoint, found.step, found.mlflow_run_id, tracking_uri)
        return None
    flow_logger().info("%s holds an unfinished run of this job: continuing MLflow run %s from %s (step %d); "
                   "trainer.resume_from_checkpoint: false starts a new run instead", where, found.mlflow_run_id,
                   found.checkpoint, found.step)
    return found.mlflow_run_id

"""The training flow: model → vLLM server → eval → train (resuming after crashes) → eval → summary.

    grpo_train(job: JobConfig, provisioner="local")

Each stage is a small Prefect task; the flow composes them and always stops the server it started.
A training process that dies (preemption, SIGKILL) is started again from the newest good
checkpoint, after restarting the server if it died too, up to ``job.max_resumes`` times: the first
attempt follows ``job.trainer.resume_from_checkpoint``, every later one runs with it set to True
(the newest good checkpoint of this run under ``output_dir``; none yet means step 0). The summary
(also written to ``summary.json`` in the local run folder) says how often it resumed and how many
prompts were trained twice (those past the last checkpoint before each crash).

A remote ``output_dir`` (``s3://...``) holds checkpoints and the ledger only; the job file, logs,
pid file and default MLflow store go to a local run folder (``local_run_dir``). Storage credentials
come from the environment (``AWS_*`` for s3fs) or from a Prefect ``Secret`` block named by
``storage_secret`` holding a JSON object of environment variables; they reach the training process
through its environment only, never the job file, a log line or MLflow.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import re
import tempfile
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger
from prefect import task as prefect_task
from prefect.cache_policies import NO_CACHE

from flows.progress import TrainingProgress, stage
from flows.provision import LocalProvisioner, Provisioner, TrainingLaunch
from grpo_core.job import JobConfig, import_string, resolve_dataset, resolve_model
from grpo_core.server import VLLMServerSpec
from grpo_core.tracking import system_metrics

log = logging.getLogger(__name__)


def _logger() -> Any:
    try:
        return get_run_logger()
    except Exception:  # noqa: BLE001 - outside a run context
        return log


def task(**options: Any):  # noqa: ANN201
    """A Prefect task that is never cached: every task here acts on the world (servers, processes,
    storage, MLflow), so a result remembered from equal inputs would be wrong, and some inputs (the
    provisioner holds locks) cannot be hashed at all."""
    return prefect_task(cache_policy=NO_CACHE, **options)


@task(name="prepare-model", retries=1)
def prepare_model(model: str) -> str:
    with stage(f"preparing model {model}"):
        return resolve_model(model)


def server_spec(job: JobConfig, model_path: str) -> VLLMServerSpec:
    s, t = job.server, job.trainer
    return VLLMServerSpec(
        model=model_path,
        max_model_len=s.max_model_len,
        dtype=s.dtype,
        weight_transfer_backend=t.weight_transfer_backend,
        max_logprobs=max(20, t.num_sampler_logprobs + 1),
        enable_lora=s.enable_lora,
        max_lora_rank=s.max_lora_rank,
        max_loras=s.max_loras,
        kv_cache_gib=s.kv_cache_gib,
        seed=t.seed,
        extra_args=list(s.extra_args),
    )


@task(name="start-vllm-server", retries=1, retry_delay_seconds=5)
def start_server(provisioner: Provisioner, job: JobConfig, model_path: str, log_dir: str) -> str:
    with stage("starting vLLM server"):
        url = provisioner.start_server(server_spec(job, model_path), log_dir, job.server.startup_timeout_s)
    _logger().info("vLLM server serving %s at %s", model_path, url)
    return url


@task(name="evaluate")
def evaluate(job: JobConfig, model_path: str, server_url: str, label: str) -> float | None:
    if job.eval_prompts == 0:
        return None
    from transformers import AutoTokenizer

    from grpo_core.evaluation import evaluate_on_server

    data = resolve_dataset(job.dataset)
    if "eval" not in data:
        return None
    result = evaluate_on_server(
        server_url,
        AutoTokenizer.from_pretrained(model_path),
        data["eval"],
        import_string(job.eval_reward),
        samples_per_prompt=job.eval_samples_per_prompt,
        temperature=job.trainer.temperature,
        max_tokens=job.trainer.max_completion_length,
        max_prompts=job.eval_prompts,
    )
    _logger().info("held-out accuracy %s: %.3f over %d samples", label, result.accuracy, result.num_samples)
    return result.accuracy


@task(name="create-mlflow-run")
def create_mlflow_run(job: JobConfig, tracking_uri: str, tags: dict[str, str]) -> str:
    from grpo_core.tracking import MLflowTracker, run_identity

    job_dict = json.loads(job.model_dump_json())
    # Named <model>-<task>-<config hash> unless the job names it; tagged so runs of a recipe group.
    default_name, identity = run_identity(job_dict)
    tracker = MLflowTracker(tracking_uri, job.tracking.experiment, job.trainer.run_name or default_name)
    tracker.log_params({"job": job_dict})
    tracker.set_tags({**identity, **tags})
    return tracker.run_id  # type: ignore[return-value]


@task(name="log-final-model", retries=1)
def log_final_model(tracking_uri: str, run_id: str) -> str | None:
    """Copy the final checkpoint's servable files into the MLflow run, so it can be served from there."""
    import mlflow

    from grpo_core import tracking

    with stage("logging the final model to MLflow"):
        uri = tracking.log_final_model(mlflow.MlflowClient(tracking_uri), run_id)
    if uri is None:
        _logger().warning("the run has no checkpoint (save_strategy 'no'?): no final model logged")
    return uri


@task(name="train")
def train_attempt(provisioner: Provisioner, launch: TrainingLaunch, pid_file: str | None = None) -> int:
    def note_pid(pid: int) -> None:
        # Operators (and the preemption test) find the live trainer's process group here.
        if pid_file:
            Path(pid_file).write_text(str(pid))

    return provisioner.run_training(launch, on_start=note_pid)


def server_usable(provisioner: Provisioner, base_url: str) -> bool:
    """The server process runs and its engine answers: a trainer killed during a weight sync can
    leave the API process up over a dead engine, which only a new server fixes."""
    import httpx

    if not provisioner.server_alive(base_url):
        return False
    try:
        return httpx.get(f"{base_url}/health", timeout=30).status_code == 200
    except httpx.HTTPError:
        return False


def local_run_dir(job: JobConfig) -> Path:
    """Where the job file, logs and pid file go: ``output_dir`` when it is a local folder, else a
    folder under the temp dir named after the URL (object stores hold no logs that grow)."""
    from fsspec.core import url_to_fs
    from fsspec.implementations.local import LocalFileSystem

    fs, path = url_to_fs(job.trainer.output_dir)
    out = Path(path) if isinstance(fs, LocalFileSystem) else (
        Path(tempfile.gettempdir()) / "grpo-runs" / re.sub(r"[^A-Za-z0-9._-]+", "_", job.trainer.output_dir)
    )
    out.mkdir(parents=True, exist_ok=True)
    return out


def default_tracking_uri(job: JobConfig) -> str:
    if job.tracking.tracking_uri:
        return job.tracking.tracking_uri
    return f"sqlite:///{local_run_dir(job) / 'mlflow.db'}"


def load_storage_secret(name: str) -> None:
    """Put the environment variables of Prefect ``Secret`` block ``name`` into this process's
    environment, which the training processes inherit. Only the variable names are logged."""
    from prefect.blocks.system import Secret

    values = Secret.load(name).get()
    if not isinstance(values, dict):
        raise ValueError(f"Secret block {name!r} must hold a JSON object of environment variables")
    os.environ.update({str(k): str(v) for k, v in values.items()})
    _logger().info("storage credentials from Secret block %r: %s", name, sorted(values))


@task(name="report-resumes")
def report_resumes(job: JobConfig, tracking_uri: str, run_id: str, resumes: int) -> dict[str, int]:
    """Count attempts and prompts trained twice from the run's ledger, and log them to its MLflow run."""
    import mlflow

    from grpo_core.checkpoint import ledger_summary

    counts = {**ledger_summary(job.trainer.output_dir), "resumes": resumes}
    client = mlflow.MlflowClient(tracking_uri)
    for key in ("resumes", "prompts_trained_twice", "prompts_consumed"):
        client.log_metric(run_id, f"job/{key}", float(counts[key]), step=job.trainer.max_steps)
    client.set_tag(run_id, "resumes", str(resumes))
    return counts


def reward_summary(tracking_uri: str, run_id: str) -> dict[str, float]:
    """Mean reward of the first and last 10% of steps, read back from the run's metric history."""
    import mlflow

    history = mlflow.MlflowClient(tracking_uri).get_metric_history(run_id, "reward")
    by_step = {m.step: m.value for m in history}  # a resumed step logs again; the latest value wins
    rewards = [by_step[s] for s in sorted(by_step)]
    if not rewards:
        return {"steps": 0}
    k = max(1, math.ceil(0.1 * len(rewards)))
    return {
        "steps": max(by_step),
        "reward_first": sum(rewards[:k]) / k,
        "reward_last": sum(rewards[-k:]) / k,
    }


# Prints are not captured as run logs: libraries print stray output (dill disassembles functions
# through print while datasets fingerprints them); the flow reports through its logger and console.
@flow(name="grpo-train", log_prints=False)
def grpo_train(job: JobConfig, provisioner: str = "local", storage_secret: str | None = None) -> dict[str, Any]:
    """Run one GRPO training job end to end; returns the summary."""
    if storage_secret:
        load_storage_secret(storage_secret)
    prov: Provisioner = LocalProvisioner() if provisioner == "local" else _cluster_provisioner(provisioner)
    out = local_run_dir(job)
    tracking_uri = default_tracking_uri(job)
    model_path = prepare_model(job.model)
    server_url = job.server.base_url
    exit_stack = contextlib.ExitStack()
    try:
        if job.server.managed:
            server_url = start_server(prov, job, model_path, str(out))
        assert server_url, "server.base_url is required when server.managed is false"
        eval_before = evaluate(job, model_path, server_url, "before")
        run_id = create_mlflow_run(job, tracking_uri, {"model": job.model, "dataset": job.dataset})
        if job.tracking.system_metrics:
            # CPU/GPU/memory of this machine for the rest of the job (server, trainers, evaluation).
            exit_stack.enter_context(system_metrics(run_id, tracking_uri))
        job_file = out / "job.json"
        job_file.write_text(job.model_dump_json(indent=2))
        resume_file = out / "job_resume.json"
        resume_job = json.loads(job.model_dump_json())
        resume_job["trainer"]["resume_from_checkpoint"] = True
        resume_file.write_text(JobConfig.model_validate(resume_job).model_dump_json(indent=2))
        resumes = 0
        while True:
            launch = TrainingLaunch(
                job_file=str(job_file if resumes == 0 else resume_file),
                server_url=server_url, model_path=model_path, mlflow_run_id=run_id, tracking_uri=tracking_uri, result_file=str(out / "result.json"),
                nproc_per_node=job.nproc_per_node, nnodes=job.nnodes, log_file=str(out / "train.log"),
            )
            with TrainingProgress(tracking_uri, run_id, job.trainer.max_steps):
                code = train_attempt(prov, launch, pid_file=str(out / "trainer.pid"))
            if code == 0:
                break
            if resumes >= job.max_resumes:
                raise RuntimeError(f"training failed with exit code {code} after {resumes} resumes; see {out / 'train.log'}")
            resumes += 1
            _logger().warning("training process exited with %s; resume %d/%d", code, resumes, job.max_resumes)
            if job.server.managed and not server_usable(prov, server_url):
                _logger().warning("vLLM server at %s is down or unhealthy; starting a new one", server_url)
                prov.stop_server(server_url)
                server_url = start_server(prov, job, model_path, str(out))
        resume_counts = report_resumes(job, tracking_uri, run_id, resumes)
        final_model_uri = log_final_model(tracking_uri, run_id)
        eval_after = evaluate(job, model_path, server_url, "after")
    finally:
        exit_stack.close()
        if job.server.managed and server_url:
            prov.stop_server(server_url)
    summary = {
        **reward_summary(tracking_uri, run_id),
        "eval_accuracy_before": eval_before,
        "eval_accuracy_after": eval_after,
        "mlflow_tracking_uri": tracking_uri,
        "mlflow_run_id": run_id,
        "final_model_uri": final_model_uri,
        "resumes": resumes,
        "prompts_trained_twice": resume_counts["prompts_trained_twice"],
        "prompts_consumed": resume_counts["prompts_consumed"],
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def _cluster_provisioner(name: str) -> Provisioner:
    if name == "kubernetes":
        from flows.kubernetes import KubernetesProvisioner

        return KubernetesProvisioner.from_env()
    raise ValueError(f"provisioner {name!r} is unknown; use 'local' or 'kubernetes'")


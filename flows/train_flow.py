"""The training flow: model → vLLM server → eval → train (resuming after crashes) → eval → summary.

    grpo_train(job: JobConfig, provisioner="local")

Each stage is a small Prefect task; the flow composes them and always stops the server it started.
A training process that dies (preemption, SIGKILL) is started again from the newest good
checkpoint, after restarting the server if it died too, up to ``job.max_resumes`` times. The
summary (also written to ``<output_dir>/summary.json`` for local outputs) says how often it resumed.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger, task

from flows.provision import LocalProvisioner, Provisioner, TrainingLaunch
from grpo_core.job import JobConfig, import_string, resolve_dataset, resolve_model
from grpo_core.server import VLLMServerSpec

log = logging.getLogger(__name__)


def _logger() -> Any:
    try:
        return get_run_logger()
    except Exception:  # noqa: BLE001 - outside a run context
        return log


@task(name="prepare-model", retries=1)
def prepare_model(model: str) -> str:
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
    from grpo_core.tracking import MLflowTracker

    tracker = MLflowTracker(tracking_uri, job.tracking.experiment, job.trainer.run_name)
    tracker.log_params({"job": json.loads(job.model_dump_json())})
    tracker.set_tags(tags)
    return tracker.run_id  # type: ignore[return-value]


@task(name="train")
def train_attempt(provisioner: Provisioner, launch: TrainingLaunch) -> int:
    return provisioner.run_training(launch)


def default_tracking_uri(job: JobConfig) -> str:
    if job.tracking.tracking_uri:
        return job.tracking.tracking_uri
    out = Path(job.trainer.output_dir).absolute()
    out.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{out / 'mlflow.db'}"


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


@flow(name="grpo-train", log_prints=True)
def grpo_train(job: JobConfig, provisioner: str = "local") -> dict[str, Any]:
    """Run one GRPO training job end to end; returns the summary."""
    prov: Provisioner = LocalProvisioner() if provisioner == "local" else _cluster_provisioner(provisioner)
    out = Path(job.trainer.output_dir).absolute()
    out.mkdir(parents=True, exist_ok=True)
    tracking_uri = default_tracking_uri(job)
    model_path = prepare_model(job.model)
    server_url = job.server.base_url
    try:
        if job.server.managed:
            server_url = start_server(prov, job, model_path, str(out))
        assert server_url, "server.base_url is required when server.managed is false"
        eval_before = evaluate(job, model_path, server_url, "before")
        run_id = create_mlflow_run(job, tracking_uri, {"model": job.model, "dataset": job.dataset})
        job_file = out / "job.json"
        job_file.write_text(job.model_dump_json(indent=2))
        resumes = 0
        while True:
            launch = TrainingLaunch(
                job_file=str(job_file), server_url=server_url, model_path=model_path, mlflow_run_id=run_id,
                tracking_uri=tracking_uri, result_file=str(out / "result.json"),
                nproc_per_node=job.nproc_per_node, nnodes=job.nnodes, log_file=str(out / "train.log"),
            )
            code = train_attempt(prov, launch)
            if code == 0:
                break
            if resumes >= job.max_resumes:
                raise RuntimeError(f"training failed with exit code {code} after {resumes} resumes; see {out / 'train.log'}")
            resumes += 1
            _logger().warning("training process exited with %s; resume %d/%d", code, resumes, job.max_resumes)
            if job.server.managed and not prov.server_alive(server_url):
                prov.stop_server(server_url)
                server_url = start_server(prov, job, model_path, str(out))
        eval_after = evaluate(job, model_path, server_url, "after")
    finally:
        if job.server.managed and server_url:
            prov.stop_server(server_url)
    summary = {
        **reward_summary(tracking_uri, run_id),
        "eval_accuracy_before": eval_before,
        "eval_accuracy_after": eval_after,
        "mlflow_tracking_uri": tracking_uri,
        "mlflow_run_id": run_id,
        "resumes": resumes,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def _cluster_provisioner(name: str) -> Provisioner:
    if name == "kubernetes":
        from flows.kubernetes import KubernetesProvisioner

        return KubernetesProvisioner.from_env()
    raise ValueError(f"provisioner {name!r} is unknown; use 'local' or 'kubernetes'")


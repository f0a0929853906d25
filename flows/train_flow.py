"""The training flow: model → vLLM server(s) → eval → train (resuming after crashes) → eval → summary.

    grpo_train(job: JobConfig, provisioner="local")

Each stage is a small Prefect task; the flow composes them and always stops the servers it started.
``server.replicas`` servers make a fleet: one that dies during an attempt is started again at its URL
(``flows.fleet_keeper``). A training process that dies (preemption, SIGKILL) is started again, after any dead
server, from the newest good checkpoint of this run, up to ``job.max_resumes`` times; one that stopped for a reason
a resume cannot change (no learning signal left) is not, and the MLflow run is marked FAILED. The summary
(``summary.json`` in the local run folder) says how often it resumed, which prompts were trained twice, how often
an external server restarted under the trainer, and the held-out accuracy before and after with 95% intervals
(``flows.heldout``); ``run.png`` beside it pictures the run and is logged to the MLflow run.

A remote ``output_dir`` (``s3://...``) holds checkpoints and the ledger only; the job file, logs,
pid file and default MLflow store go to a local run folder (``local_run_dir``). Storage credentials
come from the environment (``AWS_*`` for s3fs) or from a prefect-aws ``AwsCredentials`` block named
by ``storage_credentials``; they reach the training process through its environment only, never the
job file, a log line or MLflow.

What a Prefect user sees: the training process's log lines in the flow run's logs, one progress
artifact (``training-progress``) per flow run that moves as steps land, across resumed attempts, and a
markdown summary artifact (``training-summary``) with the run's numbers and links at the end. What an
MLflow user sees: a run in a model-training experiment, its headline charts first, the summary
(``summary.json``) and the completions as tables among its artifacts (a file per logged step, or per block of
steps in a long run: ``tracking/tables.py``), and the final model logged as a
transformers model (``model/``) and registered (``tracking.registered_model_name``, default
``<model>-<task>``) with the run's last headline metrics.
"""

from __future__ import annotations

import contextlib
import json
import time
from concurrent.futures import ThreadPoolExecutor
import logging
import math
import os
import re
import tempfile
from pathlib import Path
from typing import Any, Iterator

from prefect import flow, get_run_logger
from prefect import task as prefect_task
from prefect.cache_policies import NO_CACHE

from flows.continued_run import continued_run
from flows.continued_run import flow_logger as _logger
from flows.fleet_keeper import FleetKeeper
from flows.heldout import heldout_line, heldout_scores, heldout_summary, log_heldout, prompts_digest
from flows.kubernetes import KubernetesProvisioner
from flows.placement import place_on_machine, server_spec
from flows.progress import TrainingProgress, stage
from flows.provision import LocalProvisioner, Provisioner, TrainingLaunch
from flows.run_picture import draw_run_picture, metric_history
from grpo_core.checkpoint import ledger_summary
from grpo_core.data.inputs import first_rows
from grpo_core.evaluation.heldout import EvalRollouts, evaluate_rewards, problem_keys
from grpo_core.launch import attempt_failure
from grpo_core.launch.job import JobConfig, import_string, resolve_dataset, resolve_job_inputs, resolve_model
from grpo_core.rollout.routing_client import server_name
from grpo_core.rollout.stages import AsyncRolloutLoop
from grpo_core.storage.store import open_url
from grpo_core.tracking import tracker
from grpo_core.tracking.run_answer import record_answer
from grpo_core.tracking.run_view import experiment_url, job_params, machine_tags, run_url, ui_command
from grpo_core.tracking.tracker import (MLflowTracker, complete_headline, git_commit, link_model_metrics, recipe_name,
                                        run_identity, system_metrics, trainer_params)
from grpo_core.training.waste import run_waste
from grpo_core.vllm_server.control import VLLMControlClient

log = logging.getLogger(__name__)


def task(**options: Any):  # noqa: ANN201
    """A Prefect task that is never cached: every task here acts on the world (servers, processes,
    storage, MLflow), so a result remembered from equal inputs would be wrong, and some inputs (the
    provisioner holds locks) cannot be hashed at all."""
    return prefect_task(cache_policy=NO_CACHE, **options)


@task(name="prepare-model", retries=1)
def prepare_model(model: str) -> str:
    with stage(f"preparing model {model}"):
        return resolve_model(model)


@task(name="start-vllm-servers", retries=1, retry_delay_seconds=5)
def start_servers(provisioner: Provisioner, job: JobConfig, model_path: str, log_dir: str) -> list[str]:
    """The job's ``server.replicas`` managed servers, started side by side; their URLs in replica order. If one
    fails to start, those that did are stopped before the error is raised (a retry starts them all again)."""
    spec, n = server_spec(job, model_path, provisioner), job.server.replicas
    with stage(f"starting {n} vLLM server{'s' if n > 1 else ''}"), ThreadPoolExecutor(max_workers=n) as pool:
        futures = [pool.submit(provisioner.start_server, spec.for_replica(i), log_dir, job.server.startup_timeout_s,
                               i, n) for i in range(n)]
        results: list[str | BaseException] = []
        for future in futures:
            try:
                results.append(future.result())
            except Exception as err:  # noqa: BLE001 - the others are stopped first
                results.append(err)
    urls = [r for r in results if isinstance(r, str)]
    failures = [r for r in results if not isinstance(r, str)]
    if failures:
        for url in urls:
            provisioner.stop_server(url)
        raise failures[0]
    for url in urls:
        _logger().info("vLLM server serving %s at %s", model_path, url)
    return urls


@task(name="evaluate")
def evaluate(job: JobConfig, model_path: str, server_url: str, label: str) -> dict[str, Any] | None:
    """The held-out accuracy (the first reward function's mean) of what the server serves, overall and per problem
    (``flows.heldout``), with the trainer's evaluation settings: ``do_eval``, ``num_generations_eval``, the reward
    functions and their weights."""
    trainer = job.trainer
    if not trainer.runs_evaluation():
        return None
    from transformers import AutoTokenizer

    if trainer.environment is None:
        data = resolve_dataset(job.dataset, trainer.seed)
        reward_funcs, weights = [import_string(name) for name in job.reward_funcs], trainer.reward_weights
    else:  # the environment's held-out split and rubric
        data, reward_funcs, weights = resolve_job_inputs(job)
    if "eval" not in data:
        return None
    # Rolled out as the training process rolls out: the job's loop class, tools and environment factory.
    rollouts = EvalRollouts(
        reward_funcs=reward_funcs, loop_cls=import_string(job.loop_cls) if job.loop_cls else AsyncRolloutLoop,
        tools=[import_string(name) for name in job.tools],
        environment_factory=import_string(job.environment_factory) if job.environment_factory else None)
    result = evaluate_rewards(
        server_url,
        AutoTokenizer.from_pretrained(model_path),
        data["eval"],
        reward_funcs,
        weights=weights,
        samples_per_prompt=trainer.num_eval_generations(),
        temperature=trainer.temperature,
        max_tokens=trainer.max_completion_length,
        config=trainer,
        rollouts=rollouts,
    )
    _logger().info("held-out accuracy %s: %.3f over %d samples (%s)", label, result.accuracy, result.num_samples,
                   ", ".join(f"{k} {v:.3f}" for k, v in result.per_func.items()))
    rows = first_rows(data["eval"], 1 << 62)
    return {**heldout_scores(result, problem_keys(rows)), "prompts_digest": prompts_digest([r["prompt"] for r in rows])}


@task(name="create-mlflow-run")
def create_mlflow_run(job: JobConfig, tracking_uri: str, tags: dict[str, str], server_urls: list[str]) -> str:
    job_dict = json.loads(job.model_dump_json())
    # Named <model>-<task>-<config hash> unless the job names it; tagged so runs of a recipe group.
    default_name, identity = run_identity(job_dict)
    tracker = MLflowTracker(tracking_uri, job.tracking.experiment, job.trainer.run_name or default_name)
    # Every setting once, under the name a TRL user knows (the project's own as grpo.*), with the servers it uses.
    tracker.log_params({**trainer_params(job.trainer, server_urls), **job_params(job_dict)})
    tracker.set_tags({**identity, **tags, **job.tracking.tags, **machine_tags(job.trainer.output_dir)})
    if tracker.flush():  # tags are queued like every write during training; these must land now
        raise RuntimeError(f"MLflow at {tracking_uri} did not take the tags of run {tracker.run_id}")
    return tracker.run_id  # type: ignore[return-value]


@task(name="log-final-model", retries=1)
def log_final_model(tracking_uri: str, run_id: str, registered_model_name: str) -> str | None:
    """Log the final checkpoint's servable files to the MLflow run as a transformers model (loadable
    with ``mlflow.transformers.load_model``), registered under ``registered_model_name``."""
    import mlflow

    with stage("logging the final model to MLflow"):
        uri = tracker.log_final_model(mlflow.MlflowClient(tracking_uri), run_id, registered_model_name)
    if uri is None:
        _logger().warning("the run has no checkpoint (save_strategy 'no'?): no final model logged")
    return uri


def training_launch(job: JobConfig, job_file: Path, server_url: str, model_path: str, run_id: str | None,
                    tracking_uri: str | None, out: Path) -> TrainingLaunch:
    """Node 0's launch of one training attempt (the topology and rendezvous from the job; outputs in ``out``)."""
    return TrainingLaunch(
        job_file=str(job_file), server_url=server_url, model_path=model_path, mlflow_run_id=run_id,
        tracking_uri=tracking_uri, result_file=str(out / "result.json"), nproc_per_node=job.nproc_per_node,
        nnodes=job.nnodes, node_rank=0, rendezvous_address=job.rendezvous_address, rendezvous_port=job.rendezvous_port,
        log_file=str(out / "train.log"),
    )


@task(name="train")
def train_attempt(provisioner: Provisioner, launch: TrainingLaunch, pid_file: str | None = None) -> int:
    def note_pid(pid: int) -> None:
        # Operators (and the preemption test) find the live trainer's process group here.
        if pid_file:
            Path(pid_file).write_text(str(pid))

    with follow_log(launch.log_file):
        return provisioner.run_training(launch, on_start=note_pid)


@task(name="restart-dead-servers")
def restart_dead_servers(provisioner: Provisioner, job: JobConfig, urls: list[str]) -> None:
    """Before a resumed attempt: every managed server that is down or unhealthy starts again at its URL (the resumed
    trainer pushes its weights to all of them before anything is generated)."""
    for url in urls:
        if not server_usable(provisioner, url):
            _logger().warning("vLLM server at %s is down or unhealthy; starting it again", url)
            provisioner.restart_server(url, job.server.startup_timeout_s)


@contextlib.contextmanager
def keep_fleet(provisioner: Provisioner, job: JobConfig, urls: list[str], tracking_uri: str,
               run_id: str) -> Iterator[None]:
    """While a training attempt runs, a managed fleet's dead servers are started again (``FleetKeeper``); each
    leaving and coming back is a tag of the MLflow run (``fleet/<server>/left_at``, ``.../back_at``, unix seconds),
    beside the trainer's ``rollout/server/<server>/serving``. A single server is restarted only when the trainer
    resumes (it waits for its server, ``server_unavailable_timeout_s``)."""
    if not job.server.managed or len(urls) < 2:
        yield
        return
    import mlflow

    client = mlflow.MlflowClient(tracking_uri)

    def record(url: str, what: str, seconds: float) -> None:
        key = {"left": "left_at", "back": "back_at", "failed": "restart_failed_at"}[what]
        try:
            client.set_tag(run_id, f"fleet/{server_name(url)}/{key}", f"{time.time():.0f}")
        except Exception as err:  # noqa: BLE001 - a tag must never stop the keeper
            _logger().warning("could not tag the MLflow run with %s %s: %s", url, what, err)

    with FleetKeeper(provisioner, urls, job.server.startup_timeout_s, on_event=record):
        yield


def server_usable(provisioner: Provisioner, base_url: str) -> bool:
    """The server process runs and its engine answers: a trainer killed during a weight sync can
    leave the API process up over a dead engine, which only a new server fixes."""
    if not provisioner.server_alive(base_url):
        return False
    client = VLLMControlClient(base_url)
    try:
        return client.answers("/health", timeout=30)
    finally:
        client.close()


def local_run_dir(job: JobConfig) -> Path:
    """Where the job file, logs and pid file go: ``output_dir`` when it is a local folder, else a
    folder under the temp dir named after the URL (object stores hold no logs that grow)."""
    from fsspec.implementations.local import LocalFileSystem

    fs, path = open_url(job.trainer.output_dir)
    out = Path(path) if isinstance(fs, LocalFileSystem) else (
        Path(tempfile.gettempdir()) / "grpo-runs" / re.sub(r"[^A-Za-z0-9._-]+", "_", job.trainer.output_dir)
    )
    out.mkdir(parents=True, exist_ok=True)
    return out


def default_tracking_uri(job: JobConfig) -> str:
    """The job's tracking URI, else ``MLFLOW_TRACKING_URI`` (MLflow's own convention), else a SQLite
    store in the run folder."""
    if job.tracking.tracking_uri:
        return job.tracking.tracking_uri
    if os.environ.get("MLFLOW_TRACKING_URI"):
        return os.environ["MLFLOW_TRACKING_URI"]
    return f"sqlite:///{local_run_dir(job) / 'mlflow.db'}"


def load_storage_credentials(name: str) -> None:
    """Put the prefect-aws ``AwsCredentials`` block ``name`` into this process's environment as the
    ``AWS_*`` variables s3fs and boto read, which the training processes inherit. Only the variable
    names are logged."""
    from prefect_aws import AwsCredentials

    block = AwsCredentials.load(name)
    values = {
        "AWS_ACCESS_KEY_ID": block.aws_access_key_id,
        "AWS_SECRET_ACCESS_KEY": block.aws_secret_access_key.get_secret_value() if block.aws_secret_access_key else None,
        "AWS_SESSION_TOKEN": block.aws_session_token,
        "AWS_DEFAULT_REGION": block.region_name,
        "AWS_ENDPOINT_URL": block.aws_client_parameters.endpoint_url,
    }
    values = {k: str(v) for k, v in values.items() if v}
    os.environ.update(values)
    _logger().info("storage credentials from AwsCredentials block %r: %s", name, sorted(values))


RESUME_COUNTS = ("resumes", "prompts_trained_twice", "prompts_consumed", "server_restarts")
"""What ``report_resumes`` counts; tags of the run under these names (one number each, not a chart)."""


@task(name="report-resumes")
def report_resumes(job: JobConfig, tracking_uri: str, run_id: str, resumes: int) -> dict[str, int]:
    """Count attempts and prompts trained twice from the run's ledger, and tag its MLflow run with them."""
    import mlflow

    counts = {**ledger_summary(job.trainer.output_dir), "resumes": resumes}
    client = mlflow.MlflowClient(tracking_uri)
    for key in RESUME_COUNTS:
        client.set_tag(run_id, key, str(counts[key]))
    return counts


@task(name="log-run-summary", retries=1)
def log_run_summary(tracking_uri: str, run_id: str, summary_file: Path, final_model_uri: str | None,
                    job: JobConfig) -> None:
    """``summary.json`` into the run's artifacts; the metrics the flow logged itself (the held-out accuracy) into
    the headline charts, as the trainer's own are, and onto the final model with the others; the held-out result as
    the run's and its registered version's description (``run_answer.record_answer``)."""
    import mlflow

    client = mlflow.MlflowClient(tracking_uri)
    client.log_artifact(run_id, str(summary_file))
    complete_headline(client, run_id)
    if final_model_uri:
        link_model_metrics(client, run_id, final_model_uri.removeprefix("models:/"))
    summary = json.loads(summary_file.read_text())
    record_answer(client, run_id, summary, json.loads(job.model_dump_json()),
                  registered_model_name(job) if final_model_uri else None, heldout_line(summary), git_commit())


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


def waste_summary(tracking_uri: str, run_id: str) -> dict[str, float]:
    """What the run generated and did not train, over all its steps (``training.waste.run_waste``)."""
    import mlflow

    client = mlflow.MlflowClient(tracking_uri)
    return run_waste(lambda name: [(m.step, m.value) for m in sorted(client.get_metric_history(run_id, name),
                                                                      key=lambda m: m.timestamp)])


# Prints are not captured as run logs: libraries print stray output (dill disassembles functions
# through print while datasets fingerprints them); the flow reports through its logger and console.
@flow(name="grpo-train", log_prints=False)
def grpo_train(job: JobConfig, provisioner: str = "local", storage_credentials: str | None = None) -> dict[str, Any]:
    """Run one GRPO training job end to end; returns the summary."""
    if storage_credentials:
        load_storage_credentials(storage_credentials)
    if provisioner == "local" and job.nnodes > 1 and not job.rendezvous_address:
        # Checked before anything starts: the launch would refuse it only after the server is up.
        raise ValueError(f"job: nnodes={job.nnodes} needs rendezvous_address (node 0's address as the other "
                         "training nodes reach it) with the local provisioner")
    prov: Provisioner = LocalProvisioner() if provisioner == "local" else _cluster_provisioner(provisioner)
    out = local_run_dir(job)
    tracking_uri = default_tracking_uri(job)
    model_path = prepare_model(job.model)
    job = place_on_machine(job, prov)
    server_urls = job.server.urls()
    continued = continued_run(job, tracking_uri)  # before anything starts: it may refuse the folder
    exit_stack = contextlib.ExitStack()
    try:
        if job.server.managed:
            server_urls = start_servers(prov, job, model_path, str(out))
        eval_before = evaluate(job, model_path, server_urls[0], "before")
        run_id = continued or create_mlflow_run(job, tracking_uri, {"model": job.model, "dataset": job.dataset},
                                                server_urls)
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
        on_step = progress_artifact()  # one for the flow run: every attempt moves it
        while True:
            first = resumes == 0 and continued is None
            launch = training_launch(job, job_file if first else resume_file, ",".join(server_urls), model_path,
                                     run_id, tracking_uri, out)
            Path(launch.result_file).unlink(missing_ok=True)  # what an earlier run in this folder left
            # A local trainer prints its step lines to this console itself; a cluster's only to its pod's log.
            with TrainingProgress(tracking_uri, run_id, job.trainer.max_steps, on_step=on_step,
                                  print_steps=not isinstance(prov, LocalProvisioner)), \
                    keep_fleet(prov, job, server_urls, tracking_uri, run_id):
                code = train_attempt(prov, launch, pid_file=str(out / "trainer.pid"))
            if code == 0:
                break
            failure = attempt_failure(launch.result_file)  # None: killed before it could say why
            why = failure.why if failure else f"the training process exited with {code}"
            if failure is not None and not failure.resumable:  # a resume would start from the same policy
                fail_training(tracking_uri, run_id, f"{why}; not resumed (see {out / 'train.log'})")
            if resumes >= job.max_resumes:
                fail_training(tracking_uri, run_id, f"training failed after {resumes} resumes; the last attempt: "
                                                    f"{why} (see {out / 'train.log'})")
            resumes += 1
            _logger().warning("%s; resume %d/%d", why, resumes, job.max_resumes)
            if job.server.managed:
                restart_dead_servers(prov, job, server_urls)
        resume_counts = report_resumes(job, tracking_uri, run_id, resumes)
        final_model_uri = log_final_model(tracking_uri, run_id, registered_model_name(job))
        eval_after = evaluate(job, model_path, server_urls[0], "after")
    finally:
        exit_stack.close()
        if job.server.managed:
            for url in server_urls:
                prov.stop_server(url)
    rewards = reward_summary(tracking_uri, run_id)
    heldout = heldout_summary(eval_before, eval_after)
    log_heldout(tracking_uri, run_id, eval_before, eval_after, last_step=rewards["steps"])
    summary = {
        **rewards,
        **heldout,
        **waste_summary(tracking_uri, run_id),
        "seed": job.trainer.seed,
        "eval_prompts_digest": (eval_after or eval_before or {}).get("prompts_digest"),
        "mlflow_tracking_uri": tracking_uri,
        "mlflow_run_id": run_id,
        "final_model_uri": final_model_uri,
        "resumes": resumes,
        "prompts_trained_twice": resume_counts["prompts_trained_twice"],
        "prompts_consumed": resume_counts["prompts_consumed"],
        # Restarts of the vLLM server the trainer met and pushed its weights to again (an external one).
        "server_restarts": resume_counts["server_restarts"],
    }
    summary["picture"] = run_picture(tracking_uri, run_id, heldout, out / "run.png", title=f"GRPO: model {job.model}, data {job.dataset}, seed {job.trainer.seed}")
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    log_run_summary(tracking_uri, run_id, out / "summary.json", final_model_uri, job)
    summary_artifact(job, summary)
    return summary


def fail_training(tracking_uri: str, run_id: str, reason: str) -> None:
    """End the job on a training failure it does not resume: the MLflow run is marked FAILED with the reason as its
    ``failure`` tag (a failed trainer leaves its run RUNNING for the flow to decide), then the flow fails."""
    import mlflow

    try:
        client = mlflow.MlflowClient(tracking_uri)
        client.set_tag(run_id, "failure", reason[:5000])
        client.set_terminated(run_id, "FAILED")
    except Exception as err:  # noqa: BLE001 - the tracking store must not hide the training failure
        _logger().warning("could not mark the MLflow run %s failed: %s", run_id, err)
    raise RuntimeError(reason)


def registered_model_name(job: JobConfig) -> str:
    """The job's ``tracking.registered_model_name``, else ``<model>-<task>`` (the run's name without its hash)."""
    return job.tracking.registered_model_name or recipe_name(json.loads(job.model_dump_json()))


def run_picture(tracking_uri: str, run_id: str, heldout: dict[str, Any], path: Path, title: str) -> str | None:
    """Draw the run (``flows.run_picture``) beside ``summary.json`` and log it to the MLflow run; its path, or None
    when it could not be drawn (a picture must never fail a finished run)."""
    import mlflow

    try:
        draw_run_picture(metric_history(tracking_uri, run_id), heldout, path, title=title)
        mlflow.MlflowClient(tracking_uri).log_artifact(run_id, str(path))
    except Exception:  # noqa: BLE001
        _logger().warning("could not draw or log the run's picture %s", path, exc_info=True)
        return None
    return str(path)


def progress_artifact() -> Any:
    """A Prefect progress artifact for this flow run, and the callback that moves it (percent of steps)."""
    from prefect.artifacts import create_progress_artifact, update_progress_artifact

    try:
        artifact_id = create_progress_artifact(progress=0.0, key="training-progress", description="training steps done")
    except Exception:  # noqa: BLE001 - outside a flow run (unit tests) there is nothing to update
        return None

    def on_step(step: int, total: int) -> None:
        update_progress_artifact(artifact_id=artifact_id, progress=100.0 * min(step, total) / max(total, 1))

    return on_step


def summary_markdown(job: JobConfig, summary: dict[str, Any], experiment_id: str) -> str:
    """The run's summary as markdown: links to the MLflow run, its charts and its experiment, then a table of
    the numbers (the MLflow run id as a link)."""
    uri, run_id = summary["mlflow_tracking_uri"], summary["mlflow_run_id"]

    def cell(key: str, value: Any) -> str:
        if key == "mlflow_run_id" and not serve:
            return f"[{value}]({run_url(uri, experiment_id, value)})"
        if isinstance(value, float):
            return f"{value:.3f}"
        return f"`{value}`" if isinstance(value, str) else str(value)

    serve = ui_command(uri, str(local_run_dir(job)))
    lines = [
        f"# GRPO run: {job.model} on {job.dataset}", "",
        (f"MLflow: `{serve}` serves the store and prints the links to the run, its charts and its experiment"
         if serve else f"MLflow: [the run]({run_url(uri, experiment_id, run_id)}), "
         f"[its charts]({run_url(uri, experiment_id, run_id, 'model-metrics')}), "
         f"[experiment {job.tracking.experiment}]({experiment_url(uri, experiment_id)})"), "",
        f"Checkpoints: `{job.trainer.output_dir}`", "",
        "| summary | value |", "|---|---|",
        *(f"| {key} | {cell(key, value)} |" for key, value in summary.items()),
    ]
    return "\n".join(lines) + "\n"


def summary_artifact(job: JobConfig, summary: dict[str, Any]) -> None:
    """The run's summary as a markdown artifact on the flow run (``summary_markdown``)."""
    import mlflow
    from prefect.artifacts import create_markdown_artifact

    try:
        client = mlflow.MlflowClient(summary["mlflow_tracking_uri"])
        experiment_id = client.get_run(summary["mlflow_run_id"]).info.experiment_id
        create_markdown_artifact(markdown=summary_markdown(job, summary, experiment_id), key="training-summary",
                                 description="GRPO run summary")
    except Exception:  # noqa: BLE001 - a summary must never fail a finished run
        _logger().warning("could not create the summary artifact", exc_info=True)


def _api_only_logger() -> tuple[logging.Logger, dict[str, Any]] | None:
    """A logger that writes to the Prefect run's logs only (the console already shows the trainer's
    own output), and the run's identifiers it must send along; None outside a run."""
    from prefect.logging.handlers import APILogHandler

    try:
        extra = dict(get_run_logger().extra)
    except Exception:  # noqa: BLE001 - outside a run context
        return None
    logger = logging.getLogger("grpo.train_log")
    logger.propagate = False
    logger.setLevel(logging.INFO)
    if not any(isinstance(h, APILogHandler) for h in logger.handlers):
        logger.addHandler(APILogHandler())
    return logger, extra


@contextlib.contextmanager
def follow_log(path: str | None) -> Iterator[None]:
    """Copy the lines a training process appends to ``path`` into the flow run's logs while the block
    runs, so the Prefect UI shows training progress as it happens."""
    import threading

    target = _api_only_logger()
    if path is None or target is None:
        yield
        return
    logger, extra = target
    stop = threading.Event()
    # Lines an earlier attempt wrote to the same file were copied then.
    start = os.path.getsize(path) if os.path.exists(path) else 0

    def follow(position: int) -> None:
        while True:
            done = stop.is_set()  # read before the file, so the last lines are copied after the stop
            try:
                with open(path, "rb") as f:
                    f.seek(position)
                    chunk = f.read()
            except OSError:
                chunk = b""
            complete, newline, _ = chunk.rpartition(b"\n")
            if newline:
                position += len(complete) + 1
                for line in complete.decode(errors="replace").splitlines():
                    logger.info("[train] %s", line, extra=extra)
            if done:
                return
            stop.wait(1.0)

    thread = threading.Thread(target=follow, args=(start,), name="follow-train-log", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=10)


def _cluster_provisioner(name: str) -> Provisioner:
    if name == "kubernetes":
        return KubernetesProvisioner.from_env()
    raise ValueError(f"provisioner {name!r} is unknown; use 'local' or 'kubernetes'")


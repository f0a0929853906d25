"""Metric logging behind one small interface: MLflow for runs, the console for people.

``make_tracker(config, ...)`` returns a ``Tracker``; the trainer calls ``log_params`` once,
``log_metrics(metrics, step)`` per logged step and ``close()`` at the end. MLflow is imported only
when used, so the library works without it. Secrets never reach a tracker: ``redact`` drops
values whose key looks like a credential before params are logged.

Writes during training (metrics, tags, checkpoint references, tables) go through an ``Outbox``: a
background thread delivers them in order and retries while the server is unreachable, so a tracking
server that is down for a while neither stops training nor loses or doubles a metric (each carries
the timestamp it was given when logged; MLflow stores a repeated identical metric once).

Run identity (``run_identity``): a name ``<model>-<task>-<config hash>`` and tags ``model``, ``task``,
``git_commit`` and ``config_hash``, so runs of one recipe group together in the MLflow UI. Large
files are referenced, not copied: ``log_artifact_uri`` records a checkpoint's URI as a small JSON
artifact; only the final model is copied in (``log_final_model``, as an MLflow transformers model,
registered under ``<model>-<task>`` unless the job names it, with the run's last headline metrics), so
that it can be served from the run. How the run reads in MLflow's UI (the experiment's kind, the
headline charts, param spelling, links) is ``run_view``'s.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import re
import subprocess
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Protocol

from grpo_core.checkpoint.folders import (
    MANIFEST,
    MASTER_FILE,
    OPTIMIZER_FILE,
    RNG_FILE,
    ROLLOUT_STATE,
    SCHEDULER_FILE,
    TRAINER_STATE,
)
from grpo_core.storage.store import open_url
from grpo_core.tracking.outbox import Outbox
from grpo_core.tracking.run_view import (
    EXPERIMENT_KIND_TAG,
    HEADLINE_METRICS,
    as_params,
    experiment_tags,
    headline_name,
    machine_tags,
    read_saved_view,
    trainer_param_values,
    with_headline,
)
from grpo_core.tracking.tables import LOGGED_ARTIFACTS_TAG, BlockRows, block_path, rows_of, table_text, with_table

log = logging.getLogger(__name__)

_SECRET_KEY = re.compile(r"(secret|password|token_value|access_key|api_key|credential|session_token)", re.I)


def redact(params: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``params`` without credential-like keys (flattened with dots)."""
    flat: dict[str, Any] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)
        elif not _SECRET_KEY.search(prefix):
            flat[prefix] = value

    walk("", params)
    return flat


class Tracker(Protocol):
    run_id: str | None
    tracking_uri: str | None
    experiment_id: str | None

    def log_params(self, params: dict[str, Any]) -> None: ...
    def log_metrics(self, metrics: dict[str, float], step: int) -> None: ...
    def set_tags(self, tags: dict[str, str]) -> None: ...
    def log_artifact_uri(self, name: str, uri: str, step: int | None = None) -> None: ...
    def log_table(self, name: str, columns: dict[str, list[Any]], step: int,
                  block: tuple[int, int] | None = None) -> None: ...
    def last_logged_step(self, key: str) -> int | None: ...
    def flush(self) -> list[str]: ...
    def close(self, status: str = "FINISHED") -> None: ...


class NullTracker:
    run_id: str | None = None
    tracking_uri: str | None = None
    experiment_id: str | None = None

    def log_params(self, params: dict[str, Any]) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        pass

    def set_tags(self, tags: dict[str, str]) -> None:
        pass

    def log_artifact_uri(self, name: str, uri: str, step: int | None = None) -> None:
        pass

    def log_table(self, name: str, columns: dict[str, list[Any]], step: int,
                  block: tuple[int, int] | None = None) -> None:
        pass

    def last_logged_step(self, key: str) -> int | None:
        return None

    def flush(self) -> list[str]:
        return []

    def close(self, status: str = "FINISHED") -> None:
        pass


class MLflowTracker:
    """One MLflow run; reopened by id on resume so a job keeps a single run.

    Creating or reopening the run and logging params talk to the server directly (a run that cannot
    start should fail); writes during training go through the outbox (see the module docstring) and
    ``close`` waits up to ``flush_timeout_s`` for them.
    """

    def __init__(
        self,
        tracking_uri: str | None,
        experiment: str,
        run_name: str | None,
        run_id: str | None = None,
        system_metrics: bool = False,
        flush_timeout_s: float = 600.0,
    ):
        import mlflow

        self._mlflow = mlflow
        self.flush_timeout_s = flush_timeout_s
        if tracking_uri:
            mlflow.set_tracking_uri(tracking_uri)
        self.tracking_uri = mlflow.get_tracking_uri()
        self._client = mlflow.MlflowClient(self.tracking_uri)
        reopened = run_id is not None
        if run_id is None:
            experiment_id = training_experiment(self._client, experiment)
            run = self._client.create_run(experiment_id, run_name=run_name)
            run_id = run.info.run_id
        else:
            self._client.update_run(run_id, status="RUNNING")
            experiment_id = self._client.get_run(run_id).info.experiment_id
        self.run_id = run_id
        self.experiment_id = experiment_id
        self._reopened = reopened
        self._tables: dict[str, Any] = {}  # table name -> its current block's rows (tables.BlockRows)
        self._resumed: set[str] = set()
        self._logged_artifacts: str | None = None
        self._outbox = Outbox(f"MLflow at {self.tracking_uri}")
        self._system_monitor = None
        if system_metrics:
            self._system_monitor = _start_system_metrics(run_id)

    def log_params(self, params: dict[str, Any]) -> None:
        """Each value as its text (``run_view.param_text``: ``learning_rate`` 2e-4 as ``0.0002``, as transformers
        writes it for a TRL run); unset ones (None, empty) are left out."""
        from mlflow.entities import Param

        existing = self._client.get_run(self.run_id).data.params
        batch = []
        for key, text in as_params(redact(params)).items():
            if key in existing:
                continue  # params are immutable in MLflow; a resumed run keeps the original ones
            batch.append(Param(key, text[:6000]))
        for i in range(0, len(batch), 100):
            self._client.log_batch(self.run_id, params=batch[i : i + 100])

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        """``metrics`` at ``step``, the headline ones also under ``run_view.HEADLINE_SECTION`` (charted first)."""
        import time

        from mlflow.entities import Metric

        # The timestamp is fixed here, once: a batch sent again after a lost reply is the same rows.
        now = int(time.time() * 1000)
        batch = [Metric(k, float(v), now, step) for k, v in with_headline(metrics).items() if v is not None]
        for i in range(0, len(batch), 500):
            chunk = batch[i : i + 500]
            self._outbox.put(f"{len(chunk)} metrics of step {step}",
                             functools.partial(self._client.log_batch, self.run_id, metrics=chunk))

    def set_tags(self, tags: dict[str, str]) -> None:
        for key, value in tags.items():
            self._outbox.put(f"tag {key}", functools.partial(self._client.set_tag, self.run_id, key, str(value)))

    def log_artifact_uri(self, name: str, uri: str, step: int | None = None) -> None:
        """Reference a large artifact (a checkpoint) by URI instead of copying it into the store.

        The URI goes into a tag (visible in the run list) and into ``checkpoints/<name>.json``, a few
        bytes in the run's artifacts that point at the real files wherever they live (S3, a volume).
        """
        reference = {"name": name, "uri": uri, "step": step}
        file_name = f"{name}.json" if step is None else f"{name}-step-{step:06d}.json"
        self._outbox.put(f"checkpoint reference {file_name}", functools.partial(
            self._client.log_text, self.run_id, json.dumps(reference, indent=2), f"checkpoints/{file_name}"))
        # After the file: the tag names the newest checkpoint, for the run list (and log_final_model).
        self._outbox.put(f"tag artifact.{name}", functools.partial(self._client.set_tag, self.run_id, f"artifact.{name}", uri))

    def log_table(self, name: str, columns: dict[str, list[Any]], step: int,
                  block: tuple[int, int] | None = None) -> None:
        """The rows of ``step`` (``columns``: names to equally long lists) into table ``name``'s file for ``block``
        (the first and last step it covers, ``tables.table_block``; ``(step, step)`` when None), which MLflow's UI
        shows as a table: the file is written again with the block's rows this process holds, and named in the tag
        ``mlflow.loggedArtifacts`` when its block starts. Nothing is read back from the store, except once by a
        reopened run (``_resumed_rows``), so a step costs at most one block's rows whatever the run's length (MLflow's
        own ``log_table`` downloads the whole table and uploads it again to add rows)."""
        block = block or (step, step)
        path = block_path(name, block)
        current = self._tables.get(name)
        if current is None or current.block != block:
            current = self._tables[name] = BlockRows(block)
            if self._reopened and name not in self._resumed:
                self._resumed.add(name)
                current.add(self._resumed_rows(path, step))
            listed = self._listed_tables()
            tag = with_table(listed, path)
            if tag is not None:
                self._logged_artifacts = tag
                self._outbox.put(f"tag {LOGGED_ARTIFACTS_TAG}", functools.partial(
                    self._client.set_tag, self.run_id, LOGGED_ARTIFACTS_TAG, tag))
            elif f'"{path}"' not in listed:
                log.warning("table %s of run %s is not named in its tag %s (MLflow's 8,000 characters are taken): "
                            "MLflow's UI shows it as a file, and read_table reads it", path, self.run_id,
                            LOGGED_ARTIFACTS_TAG)
        current.add(columns)
        self._outbox.put(f"table {path}", functools.partial(
            self._client.log_text, self.run_id, table_text(current.columns), path))

    def _listed_tables(self) -> str:
        """The run's ``mlflow.loggedArtifacts`` tag as this tracker last set it, read from the store once when the
        run was reopened."""
        if self._logged_artifacts is None:
            self._logged_artifacts = (self._client.get_run(self.run_id).data.tags.get(LOGGED_ARTIFACTS_TAG, "")
                                      if self._reopened else "")
        return self._logged_artifacts

    def _resumed_rows(self, path: str, step: int) -> dict[str, list[Any]]:
        """The rows the reopened run's earlier attempt wrote to ``path`` for steps before ``step`` (none when it wrote
        no such file): a resumed run goes on filling the block it stopped in."""
        import tempfile

        self.flush()
        try:
            with tempfile.TemporaryDirectory(prefix="grpo-table-") as tmp:
                text = Path(self._client.download_artifacts(self.run_id, path, tmp)).read_text()
        except Exception:  # noqa: BLE001 - absent: the attempt stopped before this block, and nothing is kept
            return {}
        earlier = BlockRows((0, 0), rows_of(text))
        earlier.keep_before(step)
        return earlier.columns

    def last_logged_step(self, key: str) -> int | None:
        """Highest step at which ``key`` was logged in this run (a resumed trainer marks re-runs up to it)."""
        return max((m.step for m in self._client.get_metric_history(self.run_id, key)), default=None)

    def flush(self) -> list[str]:
        """Wait up to ``flush_timeout_s`` for queued writes; returns those not delivered (named)."""
        left = self._outbox.flush(self.flush_timeout_s)
        if left:
            log.error("MLflow at %s took none of the last %d writes to run %s within %.0f s (first: %s, last: %s); "
                      "they are not in the run", self.tracking_uri, len(left), self.run_id, self.flush_timeout_s,
                      left[0], left[-1])
        return left

    def close(self, status: str = "FINISHED") -> None:
        if self._system_monitor is not None:
            try:
                self._system_monitor.finish()
            except Exception:  # noqa: BLE001 - monitoring must never fail a run
                log.debug("system metrics monitor did not stop cleanly", exc_info=True)
        self.flush()
        self._outbox.close(0.0)
        try:
            self._client.set_terminated(self.run_id, status=status)
        except Exception as err:  # noqa: BLE001 - a finished training must not fail on its last tag
            log.error("could not mark MLflow run %s %s at %s: %s", self.run_id, status, self.tracking_uri, err)


def make_tracker(config: Any, is_main: bool = True, experiment: str = "grpo") -> Tracker:
    """The tracker ``report_to`` asks for, when a script builds the trainer without one: an MLflow run in
    the store that ``MLFLOW_TRACKING_URI`` names (else MLflow's default), named ``run_name`` or after the
    output folder, with the config logged under TRL's parameter names. Only rank 0 tracks."""
    if config.report_to == "none" or not is_main:
        return NullTracker()
    try:
        import mlflow  # noqa: F401 - only whether it is there
    except ImportError as exc:
        raise ImportError(
            f"{type(config).__name__}.report_to='mlflow' needs the mlflow package, which the base install leaves out: "
            "pip install 'grpo-core[flows]' (or mlflow), or set report_to='none'"
        ) from exc
    name = config.run_name or Path(str(config.output_dir).rstrip("/")).name or None
    tracker = MLflowTracker(os.environ.get("MLFLOW_TRACKING_URI"), experiment, name,
                            flush_timeout_s=config.tracking_flush_timeout_s)
    tracker.log_params(trainer_params(config))
    tracker.set_tags(machine_tags(str(config.output_dir)))
    return tracker


def trainer_params(config: Any, server_urls: list[str] | None = None) -> dict[str, Any]:
    """The trainer's settings as top-level params (``learning_rate``, not ``job.trainer.learning_rate``): TRL's under
    TRL's names, so a search written for a TRL run (``params.learning_rate``) finds it, this project's as
    ``grpo.<name>``, and the servers the run used (``run_view.trainer_param_values``)."""
    import dataclasses

    return trainer_param_values({f.name: getattr(config, f.name) for f in dataclasses.fields(config)}, server_urls)


def training_experiment(client: Any, name: str) -> str:
    """The id of experiment ``name``, made a model-training experiment with its saved runs view
    (``run_view.experiment_tags``) when it does not exist. One that exists gets the runs view as this code defines it
    (its creation time kept when only the state changed), and a kind if it has none (a kind someone chose stays)."""
    experiment = client.get_experiment_by_name(name)
    if experiment is None:
        return client.create_experiment(name, artifact_location=_artifact_root(client.tracking_uri),
                                        tags=experiment_tags())
    for key, value in experiment_tags().items():
        current = experiment.tags.get(key)
        if key == EXPERIMENT_KIND_TAG:
            if current is None:
                client.set_experiment_tag(experiment.experiment_id, key, value)
            continue
        if current is not None and read_saved_view(current) == read_saved_view(value):
            continue  # the same view: its times stay as they are
        if current is not None and read_saved_view(current) is not None:
            value = json.dumps({**json.loads(value), "createdAt": json.loads(current)["createdAt"]})
        client.set_experiment_tag(experiment.experiment_id, key, value)
    return experiment.experiment_id


def _start_system_metrics(run_id: str):
    try:
        from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

        monitor = SystemMetricsMonitor(run_id, sampling_interval=10)
        monitor.start()
        return monitor
    except Exception:  # noqa: BLE001 - optional feature (needs psutil)
        log.info("MLflow system metrics unavailable", exc_info=True)
        return None


def _artifact_root(tracking_uri: str) -> str | None:
    """For a SQLite store, artifacts beside the database (a demo's outputs stay in one folder) rather
    than MLflow's default ``./mlruns`` under whatever the working directory is. Servers decide themselves."""
    if not tracking_uri.startswith("sqlite:///"):
        return None
    return (Path(tracking_uri.removeprefix("sqlite:///")).parent / "mlartifacts").absolute().as_uri()


def log_final_model(client: Any, run_id: str, registered_model_name: str | None = None,
                    artifact_path: str | None = None) -> str | None:
    """Log the servable files of the run's newest checkpoint to the run as an MLflow transformers model at the
    checkpoint's step, registered under ``registered_model_name`` and carrying the run's last headline metrics;
    its model URI, or None when the run wrote no checkpoint. The logged model is named ``artifact_path``, by default
    after the registered model (else ``model``), so the run's and the registry's pages name what it is.

    The newest checkpoint is the one ``log_artifact_uri("checkpoint", ...)`` recorded last (the
    trainer saves after its final step). Its servable part (weights in the serving dtype, config,
    tokenizer) is what vLLM and transformers load; optimizer, master weights and resume state stay
    behind. ``mlflow.transformers.load_model(uri, return_type="components")`` loads it back, and with
    ``registered_model_name`` it becomes a new version of that registered model.
    """
    import tempfile

    url = client.get_run(run_id).data.tags.get("artifact.checkpoint")
    if not url:
        return None
    training_only = {MANIFEST, MASTER_FILE, OPTIMIZER_FILE, RNG_FILE, ROLLOUT_STATE, SCHEDULER_FILE, TRAINER_STATE}
    fs, root = open_url(url)
    with fs.open(f"{root.rstrip('/')}/{TRAINER_STATE}") as f:
        step = int(json.load(f)["global_step"])
    with tempfile.TemporaryDirectory(prefix="grpo-final-model-") as tmp:
        for path in fs.ls(root, detail=False):
            name = path.rstrip("/").rsplit("/", 1)[-1]
            if name not in training_only and fs.isfile(path):
                fs.get_file(path, str(Path(tmp) / name))
        return log_transformers_model(client.tracking_uri, run_id, tmp, registered_model_name,
                                      artifact_path or registered_model_name or "model", step=step)


def _serving_requirements() -> list[str]:
    """The packages (at their installed versions) that load the logged model with transformers."""
    from importlib.metadata import PackageNotFoundError, version

    out = []
    for name in ("torch", "transformers", "tokenizers", "safetensors", "accelerate"):
        try:
            out.append(f"{name}=={version(name).split('+')[0]}")
        except PackageNotFoundError:
            continue
    return out


def log_transformers_model(
    tracking_uri: str, run_id: str, model_dir: str | Path, registered_model_name: str | None = None,
    artifact_path: str = "model", step: int = 0,
) -> str:
    """Log a Hugging Face model folder to ``run_id`` with MLflow's transformers flavor at ``step``; its model URI.
    The run's tag ``final_model`` names it as a person finds it: ``models:/<registered name>/<version>`` when it is
    registered (the logged model's own id is the tag ``final_model_id``).

    MLflow links every metric the run logged at ``step`` to the model (system metrics number their samples as
    steps, so one numbered like ``step`` is among them); ``link_model_metrics`` adds the last value of each
    headline metric logged at another step."""
    import mlflow

    folder = Path(model_dir)
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"{folder} is not a Hugging Face model folder (no config.json)")
    mlflow.set_tracking_uri(tracking_uri)
    client = mlflow.MlflowClient(tracking_uri)
    with mlflow.start_run(run_id=run_id):
        # Given as a folder, the checkpoint is copied without being loaded (a 70B model need not fit here).
        info = mlflow.transformers.log_model(
            transformers_model=str(folder),
            name=artifact_path,
            task="text-generation",
            registered_model_name=registered_model_name,
            # Named explicitly: MLflow's default list adds torchvision, which a text model does not need.
            pip_requirements=_serving_requirements(),
            step=step,
        )
    link_model_metrics(client, run_id, info.model_id)
    version = getattr(info, "registered_model_version", None)
    readable = f"models:/{registered_model_name}/{version}" if registered_model_name and version else info.model_uri
    client.set_tag(run_id, "final_model", readable)
    client.set_tag(run_id, "final_model_id", info.model_id)
    return info.model_uri


def complete_headline(client: Any, run_id: str) -> int:
    """Copy into the headline charts (``run_view.with_headline``) every value of a headline metric that reached the
    run without its copy: those logged by the flow itself (the held-out accuracy), not through a tracker. The copies
    keep each value's step and timestamp, so completing twice adds nothing. Returns how many were copied."""
    from mlflow.entities import Metric

    missing = []
    for key in HEADLINE_METRICS:
        copied = {(m.step, m.timestamp) for m in client.get_metric_history(run_id, headline_name(key))}
        missing += [Metric(headline_name(key), m.value, m.timestamp, m.step)
                    for m in client.get_metric_history(run_id, key) if (m.step, m.timestamp) not in copied]
    for i in range(0, len(missing), 500):
        client.log_batch(run_id, metrics=missing[i : i + 500])
    return len(missing)


def link_model_metrics(client: Any, run_id: str, model_id: str) -> int:
    """Link the last value of each headline metric of the run (``run_view.HEADLINE_METRICS``: reward, held-out
    accuracy, loss, ...) to the logged model ``model_id`` where it is not linked yet: the same rows, so the run's
    history gains none. Returns how many were linked."""
    from mlflow.entities import Metric

    linked = {(m.key, m.step) for m in client.get_logged_model(model_id).metrics or []}
    out = []
    for key in HEADLINE_METRICS:
        history = client.get_metric_history(run_id, key)
        if history:
            last = max(history, key=lambda m: (m.step, m.timestamp))
            if (key, last.step) not in linked:
                out.append(Metric(key, last.value, last.timestamp, last.step, model_id=model_id))
    if out:
        client.log_batch(run_id, metrics=out)
    return len(out)


# ------------------------------------------------------------------------------------------ run identity
# Keys that say where or under which name a run happens, not what it trains: two runs of the same
# recipe get the same hash whatever their output folder or tracking server.
_UNHASHED = {("tracking",), ("trainer", "output_dir"), ("trainer", "run_name"), ("trainer", "vllm_server_base_url"),
             ("server", "base_url"), ("server", "managed"), ("server", "startup_timeout_s")}


def config_hash(job: dict[str, Any]) -> str:
    """12 hex digits identifying the recipe in ``job`` (a ``JobConfig`` as a dict)."""

    def strip(prefix: tuple[str, ...], value: Any) -> Any:
        if not isinstance(value, dict):
            return value
        return {k: strip(prefix + (k,), v) for k, v in value.items() if prefix + (k,) not in _UNHASHED}

    canonical = json.dumps(strip((), job), sort_keys=True, default=str, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:12]


def git_commit() -> str | None:
    """The commit this code runs from: ``GRPO_GIT_COMMIT`` (set in images, which have no .git) or git."""
    if os.environ.get("GRPO_GIT_COMMIT"):
        return os.environ["GRPO_GIT_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).resolve().parent,
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    return out.stdout.strip() or None


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9.]+", "-", text).strip("-").lower()


def _model_and_task(job: dict[str, Any]) -> tuple[str, str]:
    model, dataset = str(job.get("model", "")), str(job.get("dataset", ""))
    # "tiny:arithmetic" → "tiny-arithmetic"; "Qwen/Qwen3-4B" → "qwen3-4b"; "pkg.data:load" → "load"
    return _slug(model if model.startswith("tiny:") else model.rstrip("/").split("/")[-1]), _slug(dataset.split(":")[-1])


def recipe_name(job: dict[str, Any]) -> str:
    """``<model>-<task>`` of ``job`` (a ``JobConfig`` as a dict): the registered model's default name."""
    return "-".join(_model_and_task(job))


def run_identity(job: dict[str, Any]) -> tuple[str, dict[str, str]]:
    """The default run name and the tags of a run of ``job`` (a ``JobConfig`` as a dict)."""
    model, dataset = str(job.get("model", "")), str(job.get("dataset", ""))
    model_name, task = _model_and_task(job)
    digest = config_hash(job)
    tags = {"model": model, "task": task, "dataset": dataset, "config_hash": digest}
    commit = git_commit()
    if commit:
        tags["git_commit"] = commit
        tags["mlflow.source.git.commit"] = commit  # shown by the MLflow UI as the run's source version
    return f"{model_name}-{task}-{digest[:8]}", tags


@contextmanager
def system_metrics(run_id: str, tracking_uri: str, interval_s: float = 10.0) -> Iterator[None]:
    """Sample CPU, memory, disk, network (and GPU where available) into the run while the block runs.

    The flow holds it around server start-up, evaluation and training, so the metrics cover the
    whole job on this machine, not only the trainer's process. Never fails the run.
    """
    monitor = None
    try:
        from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

        monitor = SystemMetricsMonitor(run_id, sampling_interval=interval_s, tracking_uri=tracking_uri)
        monitor.start()
    except Exception:  # noqa: BLE001 - optional (psutil; pynvml for GPUs)
        log.info("MLflow system metrics unavailable", exc_info=True)
        monitor = None
    try:
        yield
    finally:
        if monitor is not None:
            try:
                monitor.finish()
                # MLflow's monitor drops the samples taken since its last publish when it stops, so a block shorter
                # than the interval would leave no system metrics at all: publish them as one more point.
                leftover = monitor.aggregate_metrics()
                if leftover:
                    monitor.publish_metrics(leftover)
                    monitor.mlflow_logger.flush()
            except Exception:  # noqa: BLE001 - monitoring must never fail a run
                log.debug("system metrics monitor did not stop cleanly", exc_info=True)

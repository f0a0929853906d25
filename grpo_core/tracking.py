"""Metric logging behind one small interface: MLflow for runs, the console for people.

``make_tracker(config, ...)`` returns a ``Tracker``; the trainer calls ``log_params`` once,
``log_metrics(metrics, step)`` per logged step and ``close()`` at the end. MLflow is imported only
when used, so the library works without it. Secrets never reach a tracker: ``redact`` drops
values whose key looks like a credential before params are logged.
"""

from __future__ import annotations

import json
import logging
import re
from typing import Any, Protocol

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

    def log_params(self, params: dict[str, Any]) -> None: ...
    def log_metrics(self, metrics: dict[str, float], step: int) -> None: ...
    def set_tags(self, tags: dict[str, str]) -> None: ...
    def log_artifact_uri(self, name: str, uri: str) -> None: ...
    def close(self, status: str = "FINISHED") -> None: ...


class NullTracker:
    run_id: str | None = None
    tracking_uri: str | None = None

    def log_params(self, params: dict[str, Any]) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        pass

    def set_tags(self, tags: dict[str, str]) -> None:
        pass

    def log_artifact_uri(self, name: str, uri: str) -> None:
        pass

    def close(self, status: str = "FINISHED") -> None:
        pass


class MLflowTracker:
    """One MLflow run; reopened by id on resume so a job keeps a single run."""

    def __init__(
        self,
        tracking_uri: str | None,
        experiment: str,
        run_name: str | None,
        run_id: str | None = None,
        system_metrics: bool = False,
    ):
        import mlflow

        self._mlflow = mlflow
        if tracking_uri:
            mlflow.set_tracking_uri(tracking_uri)
        self.tracking_uri = mlflow.get_tracking_uri()
        self._client = mlflow.MlflowClient(self.tracking_uri)
        if run_id is None:
            experiment_obj = self._client.get_experiment_by_name(experiment)
            experiment_id = (
                experiment_obj.experiment_id if experiment_obj else self._client.create_experiment(experiment)
            )
            run = self._client.create_run(experiment_id, run_name=run_name)
            run_id = run.info.run_id
        else:
            self._client.update_run(run_id, status="RUNNING")
        self.run_id = run_id
        self._system_monitor = None
        if system_metrics:
            self._system_monitor = _start_system_metrics(run_id)

    def log_params(self, params: dict[str, Any]) -> None:
        from mlflow.entities import Param

        existing = self._client.get_run(self.run_id).data.params
        batch = []
        for key, value in redact(params).items():
            text = value if isinstance(value, str) else json.dumps(value, default=str)
            text = text[:6000]
            if key in existing:
                continue  # params are immutable in MLflow; a resumed run keeps the original ones
            batch.append(Param(key, text))
        for i in range(0, len(batch), 100):
            self._client.log_batch(self.run_id, params=batch[i : i + 100])

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        import time

        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(k, float(v), now, step) for k, v in metrics.items() if v is not None]
        for i in range(0, len(batch), 500):
            self._client.log_batch(self.run_id, metrics=batch[i : i + 500])

    def set_tags(self, tags: dict[str, str]) -> None:
        for key, value in tags.items():
            self._client.set_tag(self.run_id, key, str(value))

    def log_artifact_uri(self, name: str, uri: str) -> None:
        """Reference a large artifact (a checkpoint) by URI instead of copying it into the store."""
        self._client.set_tag(self.run_id, f"artifact.{name}", uri)

    def close(self, status: str = "FINISHED") -> None:
        if self._system_monitor is not None:
            try:
                self._system_monitor.finish()
            except Exception:  # noqa: BLE001 - monitoring must never fail a run
                log.debug("system metrics monitor did not stop cleanly", exc_info=True)
        self._client.set_terminated(self.run_id, status=status)


def _start_system_metrics(run_id: str):
    try:
        from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

        monitor = SystemMetricsMonitor(run_id, sampling_interval=10)
        monitor.start()
        return monitor
    except Exception:  # noqa: BLE001 - optional feature (needs psutil)
        log.info("MLflow system metrics unavailable", exc_info=True)
        return None

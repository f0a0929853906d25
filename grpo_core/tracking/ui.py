"""``grpo ui``: MLflow's UI for a run's store on a free port, and the links that open the run in it.

    with MLflowUI(store) as ui:        # mlflow ui on 127.0.0.1:<free port>, returned once the UI answers
        print(ui.address)
    links(ui_address, client, run_id)  # the run, its charts, its experiment's saved view, its registered version

A file or database store (what ``grpo demo`` writes) has no UI of its own: ``mlflow ui`` serves one, and takes tens
of seconds on a loaded machine before it answers (links opened sooner are refused). So the command starts it on a
port that is free (no port is assumed: 5000 is taken on some systems), waits until the page and its API answer, and
only then prints the links. The UI's process runs in its own process group, ended with it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from grpo_core.tracking.run_view import experiment_url, model_version_url, run_url
from grpo_core.vllm_server.process import free_port

UI_STARTUP_TIMEOUT_S = 300.0
"""How long ``MLflowUI`` waits for the UI to answer (a loaded two-core machine has needed ~25 s)."""


class MLflowUI:
    """``mlflow ui`` for ``store`` on ``host``:``port`` (a free port when 0), started on enter, stopped on exit."""

    def __init__(self, store: str, host: str = "127.0.0.1", port: int = 0, log_file: str | Path | None = None,
                 startup_timeout_s: float = UI_STARTUP_TIMEOUT_S):
        self.store = store
        self.host = host
        self.port = port or free_port(host)
        self.address = f"http://{host}:{self.port}"
        self.log_file = Path(log_file) if log_file else None
        self.startup_timeout_s = startup_timeout_s
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> "MLflowUI":
        log = open(self.log_file, "ab") if self.log_file else subprocess.DEVNULL
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mlflow", "ui", "--backend-store-uri", self.store, "--host", self.host,
             "--port", str(self.port)],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            # MLflow's background job runner serves its GenAI features only; it would take processes and memory.
            env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"},
        )
        try:
            self.wait_until_answering()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def answering(self) -> bool:
        """The page and the API behind it both answer (the page alone is served before the API is)."""
        try:
            page = httpx.get(f"{self.address}/", timeout=5)
            api = httpx.get(f"{self.address}/ajax-api/2.0/mlflow/experiments/search", params={"max_results": 1},
                            timeout=10)
        except httpx.HTTPError:
            return False
        return page.status_code == 200 and api.status_code == 200

    def wait_until_answering(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        while not self.answering():
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"mlflow ui for {self.store} exited with {self.proc.returncode}"
                                   + (f"; see {self.log_file}" if self.log_file else ""))
            if time.monotonic() > deadline:
                raise TimeoutError(f"mlflow ui for {self.store} did not answer at {self.address} within "
                                   f"{self.startup_timeout_s:.0f} s" + (f"; see {self.log_file}" if self.log_file else ""))
            time.sleep(0.5)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def links(ui: str, client: Any, run_id: str) -> dict[str, str]:
    """The links a person opens for run ``run_id`` in the UI at ``ui``, in "Model training" mode: the run, its charts,
    its experiment on the saved headline view, and the registered version the run made (when it made one)."""
    run = client.get_run(run_id)
    experiment_id = run.info.experiment_id
    out = {
        "the run": run_url(ui, experiment_id, run_id),
        "its charts": run_url(ui, experiment_id, run_id, "model-metrics"),
        "its completions": run_url(ui, experiment_id, run_id, "artifacts"),
        "the experiment": experiment_url(ui, experiment_id),
    }
    final = run.data.tags.get("final_model", "")
    parts = final.removeprefix("models:/").split("/")
    if final.startswith("models:/") and len(parts) == 2:
        out["the registered model"] = model_version_url(ui, parts[0], parts[1])
    return out


def print_links(ui: str, client: Any, run_id: str) -> None:
    for what, url in links(ui, client, run_id).items():
        print(f"  {what + ':':24s}{url}", flush=True)


__all__ = ["MLflowUI", "UI_STARTUP_TIMEOUT_S", "links", "print_links"]

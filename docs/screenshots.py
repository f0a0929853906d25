"""The README's pictures of a demo run as MLflow's and Prefect's UIs show it (``docs/screenshots/*.png``).

    .venv/bin/python docs/screenshots.py [--work DIR] [--max-steps N]

Starts a Prefect server (with its UI) whose home is under ``--work`` and runs ``grpo demo`` against it, so that the
flow run and its artifacts stay to be looked at; serves the demo's MLflow store with ``mlflow ui``; then captures the
experiment page, the run's metric charts and the flow run's artifacts with a headless Chromium
(``docs/screenshots.mjs``: playwright-core from npm driving Debian's ``chromium``, which it does not download).
A ``--work`` folder that already holds a finished demo is pictured again without a new run. The servers it started
are stopped by their process groups. CI does not run it: run it after a change to what a run shows, on an idle
machine (the demo trains for minutes), and commit the pictures.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Iterator

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from grpo_core.tracking.run_view import experiment_url, run_url  # noqa: E402
from grpo_core.vllm_server.process import free_port  # noqa: E402

PICTURES = REPO / "docs" / "screenshots"
TOOLS = Path(os.environ.get("GRPO_SCREENSHOT_TOOLS", Path.home() / ".cache" / "grpo-core" / "screenshot-tools"))
PLAYWRIGHT = "playwright-core@1.65.1"


def env_for(work: Path, **extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), "PREFECT_HOME": str(work / "prefect"),
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false", **extra}


@contextmanager
def serving(cmd: list[str], env: dict[str, str], health: str, log: Path) -> Iterator[None]:
    """A server in its own process group, up once ``health`` answers; stopped by its group at the end."""
    proc = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=open(log, "wb"), stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{cmd[2:4]} exited:\n{log.read_text()[-3000:]}")
            try:
                if httpx.get(health, timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{health} did not answer in 300 s:\n{log.read_text()[-3000:]}")
            time.sleep(1)
        yield
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


def playwright_dir() -> Path:
    if not (TOOLS / "node_modules" / "playwright-core").is_dir():
        subprocess.run(["npm", "install", "--no-audit", "--no-fund", "--prefix", str(TOOLS), PLAYWRIGHT], check=True)
    return TOOLS / "node_modules"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", default=None, help="folder for the demo and the Prefect server's home (kept)")
    parser.add_argument("--max-steps", type=int, default=None, help="a shorter demo (default: the demo's own)")
    args = parser.parse_args()
    work = Path(args.work or tempfile.mkdtemp(prefix="grpo-screenshots-")).absolute()
    work.mkdir(parents=True, exist_ok=True)
    demo = work / "demo"
    chromium = shutil.which("chromium") or sys.exit("needs Debian's chromium: apt-get install -y chromium")
    modules = playwright_dir()
    prefect_port, mlflow_port = free_port(), free_port()
    api = f"http://127.0.0.1:{prefect_port}/api"
    env = env_for(work, PREFECT_API_URL=api)
    with ExitStack() as stack:
        stack.enter_context(serving(
            [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(prefect_port)],
            # The UI finds its API through PREFECT_UI_API_URL; `--port` alone leaves it at the default port 4200.
            {**{k: v for k, v in env.items() if k != "PREFECT_API_URL"}, "PREFECT_UI_API_URL": api},
            f"{api}/health", work / "prefect.log"))
        if not (demo / "summary.json").is_file():
            steps = ["--max-steps", str(args.max_steps)] if args.max_steps else []
            subprocess.run([sys.executable, "-m", "flows.cli", "demo", "--output-dir", str(demo), *steps], env=env,
                           cwd=REPO, check=True)
        summary = json.loads((demo / "summary.json").read_text())
        store = summary["mlflow_tracking_uri"]
        ui = f"http://127.0.0.1:{mlflow_port}"
        stack.enter_context(serving(
            [sys.executable, "-m", "mlflow", "ui", "--backend-store-uri", store, "--host", "127.0.0.1",
             "--port", str(mlflow_port)], env, f"{ui}/health", work / "mlflow.log"))
        import mlflow

        run = mlflow.MlflowClient(store).get_run(summary["mlflow_run_id"])
        experiment, run_id = run.info.experiment_id, run.info.run_id
        # A demo run here has its flow run in this Prefect server; one run before (a --work folder holding a finished
        # demo from elsewhere) has none, and its Prefect picture is left as it is.
        flow_runs = httpx.post(f"{api}/flow_runs/filter", json={"sort": "START_TIME_DESC", "limit": 1}).json()
        PICTURES.mkdir(parents=True, exist_ok=True)
        # MLflow opens its assistant beside the page on a first visit; closed, as after that, the page shows whole.
        closed = {"mlflow.assistant.panelOpen_v1": "false", "mlflow.assistant.fab.autoOpenedOnFirstLoad_v1": "true"}
        # Each MLflow page at two sizes, a large screen's and a laptop's (1366x768): the answer must show on both
        # without scrolling. Pictures of the smaller size end in _1366.
        sizes = {"": (1600, 1000), "_1366": (1366, 768)}
        pages = [
            ("mlflow_experiment", experiment_url(ui, experiment), run.info.run_name, {}),
            ("mlflow_run_overview", run_url(ui, experiment, run_id), "held-out accuracy", {}),
            ("mlflow_run_metrics", run_url(ui, experiment, run_id, "model-metrics"), "0_headline", {"settle_ms": 6000}),
        ]
        shots = [
            {"path": str(PICTURES / f"{name}{suffix}.png"), "url": url, "text": text, "width": width,
             "height": height, "local_storage": closed, **extra}
            for name, url, text, extra in pages for suffix, (width, height) in sizes.items()
        ]
        # The experiment opened bare (no view in the URL), its saved views listed: the headline view survives a reload.
        shots.append({"path": str(PICTURES / "mlflow_saved_views.png"), "width": 1366, "height": 768,
                      "url": f"{ui}/#/experiments/{experiment}/runs?workflowType=machine_learning",
                      "click": "Views", "text": "Training: headline metrics", "local_storage": closed,
                      "optional": True})
        if flow_runs:
            shots.append({"path": str(PICTURES / "prefect_artifacts.png"),
                          "url": f"http://127.0.0.1:{prefect_port}/runs/flow-run/{flow_runs[0]['id']}?tab=Artifacts",
                          "text": "training-summary", "width": 1600, "height": 1000,
                          "click": "Artifacts"})  # the flow run page opens on its logs whatever the URL's tab says
        spec = work / "shots.json"
        spec.write_text(json.dumps({"chromium": chromium, "shots": shots}))
        subprocess.run(["node", str(REPO / "docs" / "screenshots.mjs"), str(spec)], cwd=REPO, check=True,
                       env={**os.environ, "NODE_PATH": str(modules)})
    return 0


if __name__ == "__main__":
    sys.exit(main())

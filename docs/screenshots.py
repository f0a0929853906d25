"""The pictures of a demo run as MLflow's and Prefect's UIs show it (``docs/screenshots/*.png``).

    .venv/bin/python docs/screenshots.py [--work DIR] [--demo DIR] [--max-steps N]

Starts a Prefect server (with its UI) whose home is under ``--work`` and runs ``grpo demo`` against it, so that the
flow run and its artifacts stay to be looked at (a ``--work`` folder whose ``demo/`` holds a finished demo is
pictured again without a new run); with ``--demo DIR`` it pictures that finished demo (``bash scripts/demo.sh DIR``)
without Prefect, and leaves the Prefect picture as it is. It serves the demo's MLflow store as ``grpo ui`` does
(``MLflowUI``), opens the links ``grpo ui`` prints in Debian's ``chromium`` driven by playwright (the locked PyPI
package; it downloads no browser), and captures what a person sees without scrolling: the experiment, the run's
overview and charts at 1600x1000 and 1366x768; at 1366x768, the last logged step's completions as a table, the
registered version, and the experiment clicked from the UI's home page after the two clicks ``grpo ui`` names
(``flows.cli.KEEP_VIEW_NOTE``). The servers it started are stopped by their process groups. CI does not run it
(``tests/test_mlflow_browser.py`` checks the same pages of a short run): run it after a change to what a run shows,
on an idle machine (the demo trains for minutes), and commit the pictures.
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
from typing import Any, Callable, Iterator

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from grpo_core.tracking.ui import MLflowUI, links  # noqa: E402
from grpo_core.vllm_server.process import free_port  # noqa: E402

PICTURES = REPO / "docs" / "screenshots"
# Headless Chromium in a container: no sandbox, no GPU, nothing fetched in the background, a new profile each page.
FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
         "--disable-component-update", "--disable-sync"]
# MLflow opens its assistant beside the page on a first visit; closed, as after that, the page shows whole.
ASSISTANT_CLOSED = {"mlflow.assistant.panelOpen_v1": "false", "mlflow.assistant.fab.autoOpenedOnFirstLoad_v1": "true"}
# Each MLflow page at two sizes, a large screen's and a laptop's (1366x768): the answer must show on both without
# scrolling. Pictures of the smaller size end in _1366.
SIZES = {"": (1600, 1000), "_1366": (1366, 768)}
TIMEOUT_MS = 120_000  # a loaded two-core machine draws the UI's first page in tens of seconds


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


def capture(browser: Any, path: Path, size: tuple[int, int], steps: Callable[[Any], None],
            settle_ms: int = 3000) -> None:
    """A page of a new browser profile (only the assistant closed) at ``size``, led by ``steps`` to what it shows,
    captured once charts and tables have drawn (the UIs keep polling, so "no network" never comes). A failure leaves
    what the page showed instead as ``<name>.failed.png`` and is raised."""
    context = browser.new_context(viewport={"width": size[0], "height": size[1]})
    context.add_init_script(f"if (!localStorage.getItem('grpo.seeded')) {{ localStorage.setItem('grpo.seeded', '1'); "
                            f"for (const [k, v] of Object.entries({json.dumps(ASSISTANT_CLOSED)})) "
                            f"localStorage.setItem(k, v); }}")
    page = context.new_page()
    page.set_default_timeout(TIMEOUT_MS)
    try:
        steps(page)
        page.wait_for_timeout(settle_ms)
        page.screenshot(path=str(path))
        print(f"{path} <- {page.url}", flush=True)
    except Exception:
        page.screenshot(path=str(path.with_suffix(".failed.png")))
        raise
    finally:
        context.close()


def opened(url: str, text: str) -> Callable[[Any], None]:
    """Open ``url`` and wait for ``text`` to show."""
    def steps(page: Any) -> None:
        page.goto(url)
        page.get_by_text(text, exact=False).first.wait_for()
    return steps


def completions_table(url: str, last: str) -> Callable[[Any], None]:
    """The run's artifacts, the file ``last`` of ``completions/`` chosen: MLflow's UI shows it as a table ("View as
    table" on, as it starts for a file the run's tag names as a table)."""
    def steps(page: Any) -> None:
        page.goto(url)
        page.get_by_text("completions", exact=True).first.click()
        page.get_by_text(last, exact=True).first.click()
        switch = page.get_by_role("checkbox", name="View as table")
        switch.check()
        table = page.get_by_role("table")
        table.get_by_role("columnheader").filter(has=page.get_by_role("button", name="completion", exact=True)) \
            .first.wait_for()
        table.get_by_role("cell").first.wait_for()
    return steps


def view_kept(home: str, experiment_link: str, experiment_name: str) -> Callable[[Any], None]:
    """What ``grpo ui`` says to click, once each ("Override saved view" on the page the experiment's link opens,
    "Model training" on the home page), then the experiment clicked from the home page: its runs with the headline
    columns."""
    def steps(page: Any) -> None:
        page.goto(experiment_link)
        page.get_by_role("columnheader", name="Run Name").first.wait_for()
        page.wait_for_timeout(1500)  # the view's columns are applied after the table first draws
        page.get_by_role("button", name="Override saved view").click()
        page.goto("about:blank")
        page.goto(home)
        page.get_by_text("Model training", exact=True).first.click()
        page.wait_for_timeout(1000)
        page.goto("about:blank")
        page.goto(home)
        page.get_by_role("link", name=experiment_name).first.click()
        page.wait_for_function("() => /experiments\\/\\d+\\/runs/.test(location.hash)")
        page.get_by_role("columnheader", name="Run Name").first.wait_for()
    return steps


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", default=None, help="folder for the demo and the Prefect server's home (kept)")
    parser.add_argument("--demo", default=None, help="a finished demo's output folder to picture (no new run)")
    parser.add_argument("--max-steps", type=int, default=None, help="a shorter demo (default: the demo's own)")
    args = parser.parse_args()
    work = Path(args.work or tempfile.mkdtemp(prefix="grpo-screenshots-")).absolute()
    work.mkdir(parents=True, exist_ok=True)
    demo = Path(args.demo).absolute() if args.demo else work / "demo"
    if args.demo and not (demo / "summary.json").is_file():
        sys.exit(f"{demo} holds no finished demo (summary.json)")
    chromium = shutil.which("chromium") or sys.exit("needs Debian's chromium: apt-get install -y chromium")
    prefect_port = free_port()
    api = f"http://127.0.0.1:{prefect_port}/api"
    env = env_for(work, PREFECT_API_URL=api)
    with ExitStack() as stack:
        if not args.demo:  # a demo from elsewhere has no flow run in this Prefect server
            stack.enter_context(serving(
                [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port",
                 str(prefect_port)],
                # The UI finds its API through PREFECT_UI_API_URL; `--port` alone leaves it at the default port 4200.
                {**{k: v for k, v in env.items() if k != "PREFECT_API_URL"}, "PREFECT_UI_API_URL": api},
                f"{api}/health", work / "prefect.log"))
        if not (demo / "summary.json").is_file():
            steps = ["--max-steps", str(args.max_steps)] if args.max_steps else []
            subprocess.run([sys.executable, "-m", "flows.cli", "demo", "--output-dir", str(demo), *steps], env=env,
                           cwd=REPO, check=True)
        summary = json.loads((demo / "summary.json").read_text())
        store = summary["mlflow_tracking_uri"]
        ui = stack.enter_context(MLflowUI(store, log_file=work / "mlflow.log")).address
        import mlflow

        client = mlflow.MlflowClient(store)
        run = client.get_run(summary["mlflow_run_id"])
        printed = links(ui, client, run.info.run_id)
        experiment_name = client.get_experiment(run.info.experiment_id).name
        files = sorted(a.path.rsplit("/", 1)[-1] for a in client.list_artifacts(run.info.run_id, "completions"))
        # A demo run here has its flow run in this Prefect server; one run before (a --demo folder, or a --work
        # folder holding a finished demo from elsewhere) has none, and its Prefect picture is left as it is.
        flow_runs = [] if args.demo else httpx.post(f"{api}/flow_runs/filter",
                                                    json={"sort": "START_TIME_DESC", "limit": 1}).json()
        PICTURES.mkdir(parents=True, exist_ok=True)
        pages = [
            ("mlflow_experiment", opened(printed["the experiment"], run.info.run_name), 3000),
            ("mlflow_run_overview", opened(printed["the run"], "held-out accuracy"), 3000),
            ("mlflow_run_metrics", opened(printed["its charts"], "0_headline"), 6000),
        ]
        shots: list[tuple[str, tuple[int, int], Callable[[Any], None], int]] = [
            (f"{name}{suffix}", size, steps, settle) for name, steps, settle in pages for suffix, size in SIZES.items()]
        laptop = SIZES["_1366"]
        if files:
            shots.append(("mlflow_completions_table", laptop, completions_table(printed["its completions"], files[-1]),
                          3000))
        if "the registered model" in printed:
            shots.append(("mlflow_model_version", laptop, opened(printed["the registered model"], "held-out accuracy"),
                          3000))
        shots.append(("mlflow_saved_views", laptop,
                      view_kept(f"{ui}/#/experiments", printed["the experiment"], experiment_name), 3000))
        from playwright.sync_api import sync_playwright

        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=chromium, headless=True, args=FLAGS)
            try:
                for name, size, steps, settle in shots:
                    capture(browser, PICTURES / f"{name}.png", size, steps, settle)
                if flow_runs:
                    # The flow run page opens on its logs whatever the URL's tab says: the tab is clicked.
                    url = f"http://127.0.0.1:{prefect_port}/runs/flow-run/{flow_runs[0]['id']}?tab=Artifacts"

                    def artifacts(page: Any, url: str = url) -> None:
                        page.goto(url)
                        page.get_by_text("Artifacts", exact=True).first.click()
                        page.get_by_text("training-summary", exact=False).first.wait_for()

                    capture(browser, PICTURES / "prefect_artifacts.png", (1600, 1000), artifacts)
            finally:
                browser.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

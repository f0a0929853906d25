"""A run in MLflow's UI as a person sees it: Debian's Chromium, driven by playwright (PyPI, through the lock; it uses
the system's browser and downloads none), against ``grpo ui`` of a short run, run as the demo prints it.

It opens each printed link at 1366x768 in a browser new to the UI, reloads the experiment's page, and checks the
headline columns; the completions as a table (a step's rows under their columns with "View as table" on, as it
opens, and the file's JSON text with it off); the run's description and the registered version. Then it follows
what ``grpo ui`` says once (``flows.cli.KEEP_VIEW_NOTE``) and checks that the columns stay after a reload and that
the experiment, clicked from the UI's home page, opens on its runs rather than GenAI's overview.

With ``GRPO_SCREENSHOTS=DIR`` it also leaves its pictures there. Needs ``/usr/bin/chromium`` (``apt-get install
chromium``; ``scripts/test.sh`` installs it as root); without it the test fails, naming the install.

    .venv/bin/python -m pytest -q tests/test_mlflow_browser.py
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from flows.cli import KEEP_VIEW_NOTE, print_mlflow_links
from grpo_core.tracking.run_view import HEADLINE_METRICS, runs_view_state
from tests.test_checkpoint import model_path  # noqa: F401 - fixture
from tests.test_mlflow_ui import log_a_finished_run

pytestmark = [pytest.mark.browser, pytest.mark.startup]

CHROMIUM = "/usr/bin/chromium"
# Headless Chromium in a container: no sandbox, no GPU, nothing fetched in the background, a new profile each run.
FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
         "--disable-component-update", "--disable-sync"]
SIZE = {"width": 1366, "height": 768}
PAGE_TIMEOUT_MS = 120_000  # a loaded two-core machine renders the UI's first page in tens of seconds
# MLflow's assistant opens beside the page on a first visit; closed, as after that, the page shows whole.
ASSISTANT_CLOSED = {"mlflow.assistant.panelOpen_v1": "false", "mlflow.assistant.fab.autoOpenedOnFirstLoad_v1": "true"}


@pytest.fixture(scope="module")
def served(model_path, tmp_path_factory):  # noqa: F811
    """A finished short run in a local store, with its registered model, served by ``grpo ui`` run as the demo
    prints it in a new shell; yields the printed output and the run's summary."""
    out = tmp_path_factory.mktemp("browser") / "demo"
    out.mkdir()
    store = f"sqlite:///{out / 'mlflow.db'}"
    _, summary = log_a_finished_run(store, model_path, ["http://127.0.0.1:41001"], str(out))
    (out / "summary.json").write_text(json.dumps(summary))
    import contextlib
    import io

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        print_mlflow_links(summary, str(out))
    command = next(line.strip() for line in printed.getvalue().splitlines() if " ui " in line)
    shell = subprocess.Popen(["bash", "-c", command], cwd="/", env={"PATH": "/usr/bin:/bin", "HOME": str(out.parent)},
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines: list[str] = []
    try:
        deadline = time.monotonic() + 300
        while not any("Ctrl-C stops it" in line for line in lines):
            line = shell.stdout.readline()  # type: ignore[union-attr]
            assert line or shell.poll() is None, "".join(lines)
            lines.append(line)
            assert time.monotonic() < deadline, "".join(lines)
        yield "".join(lines), summary
    finally:
        if shell.poll() is None:
            os.killpg(shell.pid, signal.SIGTERM)
        shell.wait(60)


@pytest.fixture(scope="module")
def browser():
    if not Path(CHROMIUM).is_file():
        pytest.fail(f"the browser test needs Debian's Chromium at {CHROMIUM}: apt-get install -y chromium "
                    "(bash scripts/test.sh installs it when run as root)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        engine = playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=FLAGS)
        try:
            yield engine
        finally:
            engine.close()


def new_page(browser, ui: str):  # noqa: ANN001, ANN201
    """A page of a new profile (nothing in its local storage but the assistant closed) at 1366x768."""
    context = browser.new_context(viewport=SIZE)
    context.add_init_script(f"if (!localStorage.getItem('grpo.seeded')) {{ localStorage.setItem('grpo.seeded', '1'); "
                            f"for (const [k, v] of Object.entries({json.dumps(ASSISTANT_CLOSED)})) "
                            f"localStorage.setItem(k, v); }}")
    page = context.new_page()
    page.set_default_timeout(PAGE_TIMEOUT_MS)
    return page


def columns(page) -> list[str]:  # noqa: ANN001
    """The runs table's column headers, once the run's row shows."""
    page.get_by_role("columnheader", name="Run Name").first.wait_for()
    page.wait_for_timeout(1500)  # the view's columns are applied after the table first draws
    return [h.inner_text().strip() for h in page.get_by_role("columnheader").all()]


def completions_table(page) -> tuple[list[str], list[str]]:  # noqa: ANN001
    """The column names of the logged table the Artifacts tab shows, and its ``completion`` column's cells."""
    table = page.get_by_role("table")
    table.get_by_role("cell").first.wait_for()
    names = [h.get_by_role("button").first.inner_text().strip() for h in table.get_by_role("columnheader").all()]
    assert "completion" in names, names
    column = names.index("completion")
    rows = table.get_by_role("row").all()[1:]  # under the header row
    return names, [row.get_by_role("cell").nth(column).inner_text().strip() for row in rows]


def shot(page, name: str) -> None:  # noqa: ANN001
    folder = os.environ.get("GRPO_SCREENSHOTS")
    if folder:
        Path(folder).mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(Path(folder) / f"{name}.png"))


def headline_columns() -> set[str]:
    return {c.removeprefix("metrics.`").removesuffix("`") for c in runs_view_state()["selectedColumns"]
            if c.startswith("metrics.")}


def test_the_printed_links_in_chromium(served, browser):
    printed, summary = served
    links = dict(re.findall(r"^\s+([a-z ]+):\s+(http://\S+)$", printed, re.M))
    assert {"the run", "its charts", "its completions", "the experiment", "the registered model"} <= set(links), printed
    assert printed.count(KEEP_VIEW_NOTE) == 1, printed
    ui = re.match(r"http://127\.0\.0\.1:\d+", links["the experiment"]).group(0)  # type: ignore[union-attr]
    wanted = headline_columns()
    assert {"heldout_accuracy", "loss", "reward"} <= wanted <= set(HEADLINE_METRICS) | {"heldout_accuracy"}

    # The experiment, first visit: its runs with the headline columns.
    page = new_page(browser, ui)
    page.goto(links["the experiment"])
    first = columns(page)
    assert wanted & {"heldout_accuracy", "loss", "reward"} <= set(first), first
    shot(page, "mlflow_experiment_1366")

    # What grpo ui says to click, once each: "Override saved view" on the page the link opens, and "Model training"
    # on the home page it prints first.
    page.get_by_role("button", name="Override saved view").click()
    page.reload()
    kept = set(columns(page))
    assert {"heldout_accuracy", "loss", "reward"} <= kept, kept
    home = re.search(r"^MLflow's UI: (http://\S+)$", printed, re.M).group(1)  # type: ignore[union-attr]
    page.goto("about:blank")  # a new load of the home page, as a person opening the printed link
    page.goto(home)
    page.get_by_text("Model training", exact=True).first.click()
    page.wait_for_timeout(1000)
    page.goto("about:blank")
    page.goto(home)
    page.get_by_role("link", name="grpo-ui-test").first.click()  # the experiment log_a_finished_run logs to
    page.wait_for_function("() => /experiments\\/\\d+\\/(runs|overview)/.test(location.hash)")
    assert "/runs" in page.url, page.url  # not GenAI's overview
    assert {"heldout_accuracy", "loss", "reward"} <= set(columns(page)), page.url
    shot(page, "mlflow_saved_views")
    page.context.close()

    # The run: its description leads with the held-out result, and names the registered model.
    page = new_page(browser, ui)
    page.goto(links["the run"])
    page.get_by_text("held-out accuracy 0.500", exact=False).first.wait_for()
    shot(page, "mlflow_run_overview_1366")
    page.goto(links["its charts"])
    page.get_by_text("0_headline", exact=False).first.wait_for()
    page.wait_for_timeout(3000)
    shot(page, "mlflow_run_metrics_1366")

    # The completions: a step's file opens as a table. The UI offers "View as table" only for a file the run's
    # mlflow.loggedArtifacts tag names as a table, switched on; switched off, the file shows as its JSON text.
    page.goto(links["its completions"])
    page.get_by_text("completions", exact=True).first.click()
    page.get_by_text("step-00000003.json", exact=True).first.click()
    switch = page.get_by_role("checkbox", name="View as table")
    switch.wait_for()
    assert switch.is_checked()
    assert completions_table(page) == (["step", "prompt", "completion", "reward", "accuracy_reward"],
                                       ["2", "3", "4", "5"])
    switch.uncheck()
    page.get_by_text('"columns"', exact=False).first.wait_for()  # the file's text
    assert not switch.is_checked() and page.get_by_role("table").count() == 0
    switch.check()
    assert completions_table(page)[1] == ["2", "3", "4", "5"]
    shot(page, "mlflow_completions_table")

    # The registered version: its description is the run's answer.
    page.goto(links["the registered model"])
    page.get_by_text("held-out accuracy 0.500", exact=False).first.wait_for()
    assert page.get_by_text("Version 1", exact=False).count() > 0
    shot(page, "mlflow_model_version")
    page.context.close()

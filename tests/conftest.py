"""Shared fixtures: the offline tiny model and real servers (vLLM, MLflow) started once per session.

Every integration test that can share the vLLM server does: it is started with LoRA serving on
(so LoRA tests need no second server), and every trainer pushes its own weights at start-up, so
tests do not depend on what an earlier test left on the server. It listens on ``SESSION_SERVER_HOST``,
a loopback address other than the trainers' own, so that every test also exercises the trainer's
resolution of the address a server dials back (tests/integration/test_multi_node.py checks it).
Servers are stopped by the process group they were started in, never by name.

The run begins the tiny model builds and the session server's start in the background as soon as the
tests are collected, and runs the unit tests first while they proceed (``tests/startup.py``).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch

from grpo_core.vllm_server.process import VLLMServer, VLLMServerSpec, free_port
from tests.startup import BACKGROUND, begin, order_items

SERVER_LOGS = pytest.StashKey[Path]()

# Every Python process the tests start (spawned ranks, servers, flows) prints its threads' stacks if it dies
# of a fatal signal: a rank that aborts in native code otherwise leaves only the signal's name behind.
os.environ.setdefault("PYTHONFAULTHANDLER", "1")

SHARED_MAX_LORAS = 6
SHARED_MAX_LORA_RANK = 16
SESSION_SERVER_HOST = "127.0.0.2"


def session_server(model: str, log_dir: Path) -> VLLMServer:
    """The session's CPU vLLM server: gloo weight transfer, scale-out, LoRA serving, 20 log-probs."""
    spec = VLLMServerSpec(
        model=model,
        host=SESSION_SERVER_HOST,
        max_model_len=512,
        enable_lora=True,
        max_loras=SHARED_MAX_LORAS,
        max_lora_rank=SHARED_MAX_LORA_RANK,
        max_logprobs=20,
    )
    return VLLMServer(spec, log_dir / "shared")


# Fixtures that cost minutes of start-up on two cores (a built tiny model, a real server): a test that uses
# any of them is marked ``startup``, and the fast tier (``bash scripts/test.sh --fast``) leaves it out.
STARTUP_FIXTURES = frozenset({"tiny_model_path", "vllm_server", "mlflow_server", "prefect", "server_logs"})


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if STARTUP_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.startup)
    order_items(items)


def pytest_collection_finish(session: pytest.Session) -> None:
    if session.config.option.collectonly:
        return
    logs = session.config._tmp_path_factory.mktemp("server-logs")

    def start() -> VLLMServer:
        from grpo_core.tiny import build_tiny_model

        return session_server(str(build_tiny_model()), logs).start(timeout_s=900)

    session.config.stash[SERVER_LOGS] = logs
    begin(session.items, start)


def pytest_sessionfinish(session: pytest.Session) -> None:
    # The session server may have been started for tests that were then deselected or not reached.
    if BACKGROUND.has("server"):
        try:
            BACKGROUND.result("server", timeout_s=0).stop()
        except Exception:  # noqa: BLE001 - not started, or failed: nothing to stop
            pass
    BACKGROUND.shutdown()


@pytest.fixture(scope="module")
def one_torch_thread():
    """One intra-op thread for a module's tiny models: on 2 shared cores, OpenMP's two threads stall each
    other in their many small matmuls and batched solves (a forward took seconds instead of milliseconds).
    Use with ``pytestmark = pytest.mark.usefixtures("one_torch_thread")``."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def tiny_model_path() -> str:
    from grpo_core.tiny import build_tiny_model

    return str(build_tiny_model())


@pytest.fixture(scope="session")
def server_logs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return request.config.stash.get(SERVER_LOGS, None) or tmp_path_factory.mktemp("server-logs")


@pytest.fixture(scope="session")
def vllm_server(tiny_model_path: str, server_logs: Path):
    """The session's server, started in the background at collection (or here when that did not run)."""
    if BACKGROUND.has("server"):
        server = BACKGROUND.result("server", timeout_s=1800)
    else:
        server = session_server(tiny_model_path, server_logs).start(timeout_s=900)
    # From here on the server's CPU worker shares the cores with trainers in this process; OpenMP
    # threads on the same cores stall each other (see LocalProvisioner.training_env), so the
    # trainers take half of them, as the flow's do.
    threads = torch.get_num_threads()
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    yield server
    torch.set_num_threads(threads)
    server.stop()


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory: pytest.TempPathFactory):
    """A real ``mlflow server`` on loopback with a SQLite store; yields its URL."""
    root = tmp_path_factory.mktemp("mlflow")
    port = free_port()
    log = open(root / "server.log", "wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port),
         "--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}", "--artifacts-destination", str(root / "artifacts"),
         "--workers", "1"],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        # MLflow's background job runner (five Huey consumers, for its GenAI features) is not used here
        # and would take processes and memory from the two cores the suite runs on.
        env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"},
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"mlflow server exited: {(root / 'server.log').read_text()[-2000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(1)
    else:
        os.killpg(proc.pid, signal.SIGKILL)
        raise RuntimeError("mlflow server did not start within 180 s")
    yield url
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(20)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)


# ---- Prefect ----------------------------------------------------------------------------------------------
REPO = Path(__file__).resolve().parents[1]


class RetryBusyAnswers(httpx.HTTPTransport):
    """Asks again, with growing waits for up to a minute, while a server answers 503 (or 429/502).

    The Prefect server answers 503 when its database is briefly locked or slow (it marks such errors as
    retryable, and its own client retries them); on the suite's two busy cores that happens now and then.
    A person at the UI would click again, so the tests do too, rather than failing on a passing moment.
    """

    BUSY = frozenset({429, 502, 503})

    def __init__(self, patience_s: float = 60.0, **kwargs):
        super().__init__(**kwargs)
        self.patience_s = patience_s

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        deadline = time.monotonic() + self.patience_s
        wait = 0.5
        while True:
            response = super().handle_request(request)
            if response.status_code not in self.BUSY or time.monotonic() + wait > deadline:
                return response
            response.read()
            response.close()
            time.sleep(wait)
            wait = min(wait * 2, 8.0)


# Generous: on a busy two-core machine the Prefect server can take many seconds per request.
HTTP = httpx.Client(timeout=60, transport=RetryBusyAnswers())


class Service:
    """A child process in its own process group, with its log; stopped by that group only."""

    def __init__(self, cmd: list[str], env: dict[str, str], log_path: Path):
        self.log_path = log_path
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True)

    def tail(self, chars: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._log.close()


@pytest.fixture(scope="session")
def prefect(tmp_path_factory):
    """A Prefect server; yields (API URL, the environment for clients, the server)."""
    home = tmp_path_factory.mktemp("prefect-home")
    port = free_port()
    api = f"http://127.0.0.1:{port}/api"
    env = {
        **os.environ,
        "PREFECT_HOME": str(home),
        "PREFECT_API_URL": api,
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_UI_ENABLED": "false",
        # Schedule within seconds of registration, and let the worker notice runs quickly.
        "PREFECT_SERVER_SERVICES_SCHEDULER_LOOP_SECONDS": "5",
        "PREFECT_WORKER_QUERY_SECONDS": "2",
    }
    server = Service([sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port)],
                     {k: v for k, v in env.items() if k != "PREFECT_API_URL"}, home / "server.log")
    deadline = time.monotonic() + 180
    while True:
        assert server.proc.poll() is None, f"prefect server exited:\n{server.tail()}"
        try:
            if HTTP.get(f"{api}/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, f"prefect server did not start in 180 s:\n{server.tail()}"
        time.sleep(1)
    yield api, env, server
    server.stop()


# Where the suite's time goes, per test file (printed at the end of every run; see tests/suite_timing.py).
pytest_plugins = ["tests.suite_timing"]

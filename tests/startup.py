"""Start-up work shared by the integration tests, begun in the background as soon as the run is collected.

On two cores a CPU vLLM server takes a minute or more to start and a tiny model minutes to build, and the
unit tests need neither. So when the selected tests include integration tests, the run starts the builds
they need (each in a process of its own, so they share no interpreter lock with the tests) and the
session's vLLM server on background threads, and runs the unit tests first (``order_items``). A fixture
that needs a result waits for it; an error in the background is raised in the first test that needs it.

Each job runs once per run: the tiny models are cached by their spec (``grpo_core.tiny.build``, whose
file lock also makes a fixture that asks for a model still being built wait for that build).
"""

from __future__ import annotations

import subprocess
import sys
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

import pytest

REPO = Path(__file__).resolve().parents[1]

# Integration modules in the order they run: those that need only the shared server and the arithmetic
# model first, then those that need models the background builds later (tools, the Qwen3.5 variants),
# and last the ones that start and kill servers of their own. Unit tests run before all of them.
INTEGRATION_ORDER = (
    "test_async_loop", "test_drop_in", "test_curriculum", "test_lora_sync", "test_multi_node", "test_multi_rank",
    "test_flaky_services", "test_lora_learning", "test_deployments", "test_notebook", "test_examples",
    "test_tools", "test_hybrid_models", "test_moe_models", "test_fleet", "test_server_restart", "test_server_frozen", "test_resume", "test_soak",
)


def order_items(items: list[pytest.Item]) -> None:
    """Unit tests first (those that wait for a background build or server last), then integration modules
    in ``INTEGRATION_ORDER`` (others after), each in file order."""

    def key(item: pytest.Item) -> int:
        path = Path(str(item.fspath))
        if "integration" not in path.parts:
            # A unit test that needs the built model would hold up the rest while the build runs beside it.
            return 1 if item.get_closest_marker("startup") else 0
        stem = path.stem
        return 2 + (INTEGRATION_ORDER.index(stem) if stem in INTEGRATION_ORDER else len(INTEGRATION_ORDER))

    items.sort(key=key)  # stable: file and parameter order kept within a module


def build_in_child(code: str) -> None:
    """Run ``code`` (which builds tiny models through ``grpo_core.tiny``) in a fresh interpreter."""
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"background build failed ({code}):\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}")


class Background:
    """Named jobs on background threads; ``result(name)`` waits for one and re-raises its error."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="test-startup")
        self._jobs: dict[str, Future[Any]] = {}
        self._lock = threading.Lock()

    def submit(self, name: str, job: Callable[[], Any], after: tuple[str, ...] = ()) -> None:
        """Start ``job`` once ``after``'s jobs have finished (a failed one fails this one too)."""

        def run() -> Any:
            for dependency in after:
                self._jobs[dependency].result()
            return job()

        with self._lock:
            if name not in self._jobs:
                self._jobs[name] = self._pool.submit(run)

    def has(self, name: str) -> bool:
        return name in self._jobs

    def result(self, name: str, timeout_s: float | None = None) -> Any:
        return self._jobs[name].result(timeout_s)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


BACKGROUND = Background()

# What a module's tests need, by module name: the jobs to begin when that module is selected.
NEEDS = {
    "tools": ("test_tools", "test_examples"),
    "hybrid": ("test_hybrid_models",),
    "moe": ("test_moe_models",),
}


def begin(items: list[pytest.Item], start_server: Callable[[], Any]) -> None:
    """Begin the builds and the server start that the selected ``items`` will need."""
    # Only tests marked ``startup`` (conftest: they use a built model or a server) need any of this; the
    # fast tier deselects them, and its integration checks that need no server start nothing.
    selected = {Path(str(item.fspath)).stem for item in items
                if "integration" in Path(str(item.fspath)).parts and item.get_closest_marker("startup")}
    if not selected:
        return
    BACKGROUND.submit("build:arithmetic", lambda: build_in_child(
        "from grpo_core.tiny import build_tiny_model; build_tiny_model()"))
    # The session server only where a selected test uses it (a run of the learning tests alone has servers of its own).
    if any("vllm_server" in getattr(item, "fixturenames", ()) for item in items):
        BACKGROUND.submit("server", start_server, after=("build:arithmetic",))
    if selected & set(NEEDS["tools"]):
        BACKGROUND.submit("build:tools", lambda: build_in_child(
            "from grpo_core.tiny import build_tiny_model; build_tiny_model(variant='tools')"), after=("build:arithmetic",))
    if selected & set(NEEDS["hybrid"]):
        BACKGROUND.submit("build:hybrid", lambda: build_in_child(
            "from tests.tiny_variants import build_hybrid_variants; build_hybrid_variants()"),
            after=("build:tools",) if BACKGROUND.has("build:tools") else ("build:arithmetic",))
    if selected & set(NEEDS["moe"]):
        # The Qwen3.5-MoE check build is upcycled from the hybrid's: after it, where it is being built.
        BACKGROUND.submit("build:moe", lambda: build_in_child(
            "from tests.tiny_variants import build_moe_variants; build_moe_variants()"),
            after=("build:hybrid",) if BACKGROUND.has("build:hybrid") else ("build:arithmetic",))

"""Where the suite's time goes: seconds per test file, split into start-up work and checking.

pytest's ``--durations`` names slow tests; this plugin adds what a slow test spent its time on. Per test
file it sums the setup, call and teardown seconds of its tests, and inside them the seconds spent
starting vLLM servers and building tiny models in this process (``VLLMServer.start`` and a tiny model
build are timed where they run). Servers that a flow or a script started in a child process are read
back from their logs under pytest's temporary folder (vLLM stamps its lines; a start runs from the
first stamped line to "Application startup complete"), and tiny model builds done by a child process
from the ``build_info.json`` each build writes.

At the end of the run the table is printed, and written as JSON to ``--suite-times PATH`` (default:
``suite-times.json`` in pytest's temporary folder)::

    bash scripts/test.sh --suite-times /tmp/times.json
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Iterator

import pytest

START_LINE = re.compile(r"^\(APIServer pid=(\d+)\) INFO (\d\d-\d\d \d\d:\d\d:\d\d)")
READY_LINE = "Application startup complete"


@dataclass
class FileTimes:
    """Seconds of one test file's tests, and of the start-up work done inside them in this process."""

    tests: int = 0
    setup: float = 0.0
    call: float = 0.0
    teardown: float = 0.0
    server_starts: int = 0
    server_start_s: float = 0.0
    model_builds: int = 0
    model_build_s: float = 0.0
    rss_start_mib: float = 0.0
    rss_end_mib: float = 0.0
    rss_peak_mib: float = 0.0
    lowest_available_mib: float = 0.0

    @property
    def total(self) -> float:
        return self.setup + self.call + self.teardown


@dataclass
class SuiteTimes:
    files: dict[str, FileTimes] = field(default_factory=lambda: defaultdict(FileTimes))
    current_file: str = "(session)"
    child_server_starts: list[dict[str, object]] = field(default_factory=list)
    child_model_builds: list[dict[str, object]] = field(default_factory=list)

    @contextmanager
    def timed(self, kind: str) -> Iterator[None]:
        """Add the seconds of the block to the running test file's ``kind`` (``server_start`` or ``model_build``)."""
        start = time.perf_counter()
        # Work on a background thread (tests/startup.py) overlaps the tests; it is not theirs.
        owner = self.current_file if threading.current_thread() is threading.main_thread() else "(background start-up)"
        try:
            yield
        finally:
            entry = self.files[owner]
            setattr(entry, f"{kind}s", getattr(entry, f"{kind}s") + 1)
            setattr(entry, f"{kind}_s", getattr(entry, f"{kind}_s") + time.perf_counter() - start)


TIMES = SuiteTimes()


def _wrap_start_and_build() -> None:
    """Time every in-process server start and tiny model build (the code runs unchanged inside)."""
    from grpo_core.tiny import build as tiny_build
    from grpo_core.vllm_server.process import VLLMServer

    start = VLLMServer.start

    def timed_start(self, *args, **kwargs):  # noqa: ANN001, ANN202
        with TIMES.timed("server_start"):
            return start(self, *args, **kwargs)

    VLLMServer.start = timed_start

    build = tiny_build._build_into

    def timed_build(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        with TIMES.timed("model_build"):
            return build(*args, **kwargs)

    tiny_build._build_into = timed_build


def _memory_mib() -> tuple[float, float]:
    """This process's resident memory and the machine's available memory, in MiB (0 where /proc is absent)."""
    rss = available = 0.0
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1]) / 1024
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) / 1024
    except OSError:
        pass
    return rss, available


# Memory is recorded per test because a suite that grows is killed by the machine, not by pytest, and the
# kill names no test: GRPO_TEST_MEMORY_LOG=PATH appends one line per test as it ends, to read while it runs.
MEMORY_LOG = os.environ.get("GRPO_TEST_MEMORY_LOG")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--suite-times", default=None, help="write where the suite's time went as JSON to this path")


def pytest_sessionstart(session: pytest.Session) -> None:
    _wrap_start_and_build()


def pytest_runtest_logstart(nodeid: str, location: tuple[str, int | None, str]) -> None:
    TIMES.current_file = nodeid.split("::", 1)[0]
    entry = TIMES.files[TIMES.current_file]
    if not entry.rss_start_mib:
        entry.rss_start_mib, entry.lowest_available_mib = _memory_mib()


def pytest_runtest_logfinish(nodeid: str, location: tuple[str, int | None, str]) -> None:
    rss, available = _memory_mib()
    entry = TIMES.files[nodeid.split("::", 1)[0]]
    entry.rss_end_mib = rss
    entry.rss_peak_mib = max(entry.rss_peak_mib, rss)
    entry.lowest_available_mib = min(entry.lowest_available_mib or available, available)
    if MEMORY_LOG:
        with open(MEMORY_LOG, "a") as log:
            log.write(f"{time.strftime('%H:%M:%S')} rss {rss:8.0f} MiB  available {available:8.0f} MiB  {nodeid}\n")


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    entry = TIMES.files[report.nodeid.split("::", 1)[0]]
    setattr(entry, report.when, getattr(entry, report.when) + report.duration)
    if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
        entry.tests += 1


def _stamp(text: str) -> datetime:
    return datetime.strptime(f"2000-{text}", "%Y-%m-%d %H:%M:%S")


def child_server_starts(root: Path) -> list[dict[str, object]]:
    """Every server start found in ``vllm_server.log`` files below ``root``: its log and seconds to ready.

    A start is counted from the API server's first stamped line (its Python imports before that line are
    not seen, so these are lower bounds) to its "Application startup complete", which the HTTP server
    prints without a time stamp: the last stamped line before it stands for its time."""
    starts: list[dict[str, object]] = []
    for log in sorted(root.rglob("vllm_server.log")):
        pid, first, last = None, None, None  # the API server process being started, its first and latest stamp
        for line in log.read_text(errors="replace").splitlines():
            match = START_LINE.match(line)
            if match:
                last = _stamp(match.group(2))
                if match.group(1) != pid:  # a new server process (a restart logs into the same file)
                    pid, first = match.group(1), last
            elif READY_LINE in line and first is not None and last is not None:
                starts.append({"log": str(log.relative_to(root)), "seconds": (last - first).total_seconds()})
                first = None
    return starts


def model_builds(cache: Path) -> list[dict[str, object]]:
    """Every tiny model in ``cache`` with the seconds its build took (from its ``build_info.json``)."""
    out = []
    for info in sorted(cache.glob("*/build_info.json")):
        data = json.loads(info.read_text())
        out.append({"model": info.parent.name, "seconds": data.get("build_seconds")})
    return out


def table(times: SuiteTimes) -> str:
    rows = sorted(times.files.items(), key=lambda kv: -kv[1].total)
    lines = [f"{'file':58} {'tests':>5} {'total s':>8} {'setup':>7} {'call':>7} {'servers (n, s)':>15} {'builds (n, s)':>14}"]
    for name, t in rows:
        if t.total < 1:
            continue
        lines.append(f"{name[-58:]:58} {t.tests:5d} {t.total:8.0f} {t.setup:7.0f} {t.call:7.0f} "
                     f"{t.server_starts:5d} {t.server_start_s:8.0f} {t.model_builds:5d} {t.model_build_s:7.0f}")
    total = sum(t.total for _, t in rows)
    lines.append(f"{'all':58} {sum(t.tests for _, t in rows):5d} {total:8.0f}")
    return "\n".join(lines)


def memory_table(times: SuiteTimes, rows: int = 12) -> str:
    """The test files that grew this process the most, with the lowest memory the machine had left during each."""
    grown = sorted(times.files.items(), key=lambda kv: -(kv[1].rss_end_mib - kv[1].rss_start_mib))
    lines = [f"{'file':58} {'grew MiB':>9} {'rss after':>10} {'peak':>7} {'machine min free':>17}"]
    for name, t in grown[:rows]:
        lines.append(f"{name[-58:]:58} {t.rss_end_mib - t.rss_start_mib:9.0f} {t.rss_end_mib:10.0f} "
                     f"{t.rss_peak_mib:7.0f} {t.lowest_available_mib:17.0f}")
    return "\n".join(lines)


def pytest_terminal_summary(terminalreporter, config: pytest.Config) -> None:  # noqa: ANN001
    from grpo_core.tiny.build import cache_root

    basetemp = Path(config._tmp_path_factory.getbasetemp())
    TIMES.child_server_starts = child_server_starts(basetemp)
    TIMES.child_model_builds = model_builds(cache_root() / "tiny")
    terminalreporter.write_sep("-", "where the time went (seconds per test file; servers and builds timed in this process)")
    terminalreporter.write_line(table(TIMES))
    terminalreporter.write_sep("-", "memory: this process's growth per test file (MiB)")
    terminalreporter.write_line(memory_table(TIMES))
    starts = [s["seconds"] for s in TIMES.child_server_starts if s["seconds"] is not None]
    terminalreporter.write_line(f"vLLM server starts found in logs: {len(starts)}, {sum(starts):.0f} s from first log line to ready")
    for build in TIMES.child_model_builds:
        terminalreporter.write_line(f"tiny model in cache: {build['model']} ({build['seconds'] or 0:.0f} s to build)")
    out = Path(config.getoption("--suite-times") or basetemp / "suite-times.json")
    out.write_text(json.dumps({
        "files": {name: {**asdict(t), "total": t.total} for name, t in TIMES.files.items()},
        "server_starts_in_logs": TIMES.child_server_starts,
        "model_builds": TIMES.child_model_builds,
    }, indent=2))
    terminalreporter.write_line(f"written to {out}")

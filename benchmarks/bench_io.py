"""What every benchmark script does with its figures: write the raw report as JSON, with what produced it.

The scripts run as modules from the repository root (``python -m benchmarks.SUBJECT.NAME``), so they import
this as ``from benchmarks.bench_io import write_report`` and the library as ``grpo_core``.
"""

from __future__ import annotations

import json
import os
import platform
import shlex
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
"""The repository root: where the scripts run from, and where their subprocesses start."""

COMMIT_ENV = "BENCH_COMMIT"
"""Names the commit of the copy that runs, where its own ``.git`` cannot tell (a GPU machine given the working tree,
whose ``.git`` may be another checkout's); when set it wins over git."""


def commit() -> dict[str, Any]:
    """The commit the run's code is at, and whether tracked files differ from it; ``BENCH_COMMIT`` where the
    copy's own history cannot tell (then ``dirty`` is unknown: None)."""
    if os.environ.get(COMMIT_ENV):
        return {"commit": os.environ[COMMIT_ENV], "dirty": None}
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=20)
        if head.returncode == 0:
            status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                                    capture_output=True, text=True, timeout=20)
            return {"commit": head.stdout.strip(), "dirty": bool(status.stdout.strip())}
    except (OSError, subprocess.SubprocessError):
        pass
    return {"commit": os.environ.get(COMMIT_ENV) or None, "dirty": None}


def command() -> str:
    """The command line that runs this process, as typed from the repository root (``python -m ...`` for a
    module, the script's path relative to the root otherwise)."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    if spec is not None and spec.name not in ("__main__", None):
        head = ["python", "-m", spec.name.removesuffix(".__main__")]
    else:
        script = Path(sys.argv[0]).resolve() if sys.argv and sys.argv[0] else None
        head = ["python", str(script.relative_to(ROOT)) if script and script.is_relative_to(ROOT) else str(script)]
    return shlex.join([*head, *sys.argv[1:]])


def environment() -> dict[str, Any]:
    """What the figures depend on besides the code: Python, torch and the device (no host name)."""
    env: dict[str, Any] = {"python": platform.python_version(), "platform": platform.machine()}
    try:
        import torch

        env["torch"] = torch.__version__
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        env["gpus"] = gpus
        env["device"] = torch.cuda.get_device_name(0) if gpus else "cpu"
        env["cuda"] = torch.version.cuda if gpus else None
    except ImportError:
        env["torch"] = None
    env["cpus"] = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return env


def provenance() -> dict[str, Any]:
    """What produced a report: the commit, the command and the environment."""
    return {**commit(), "command": command(), "environment": environment()}


def write_report(path: str | os.PathLike[str], report: Any, indent: int = 1, announce: bool = True,
                 default: Callable[[Any], Any] | None = None) -> None:
    """Write ``report`` to ``path`` as JSON, creating its folder; the whole file is replaced. A dict report gets
    a ``provenance`` entry (``provenance()``: commit, command, environment) unless it carries one."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    if isinstance(report, dict) and "provenance" not in report:
        report = {**report, "provenance": provenance()}
    with open(path, "w") as f:
        json.dump(report, f, indent=indent, default=default)
    if announce:
        print(f"wrote {path}", flush=True)


def brief(result: dict[str, Any]) -> dict[str, Any]:
    """A result's scalar fields, floats rounded: the line a script prints after each configuration."""
    return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in result.items() if not isinstance(v, (list, dict))}


def record(report: dict[str, Any], result: dict[str, Any], path: str, is_main: bool = True) -> None:
    """Add one configuration's ``result`` to ``report``; on the main rank print its brief line and rewrite the
    JSON, so that a later failure keeps the configurations measured so far."""
    report["results"].append(result)
    if is_main:
        print(json.dumps(brief(result)), flush=True)
        write_report(path, report, announce=False)


def print_table(results: list[dict[str, Any]], header: str, row: Callable[[dict[str, Any]], str],
                failed: Callable[[dict[str, Any]], str]) -> None:
    """The summary table a script prints at the end: ``header``, then ``row(r)`` per result, or ``failed(r)``
    followed by its error for a configuration that raised."""
    print(header)
    for r in results:
        print(f"{failed(r)} {r['error'][:70]}" if "error" in r else row(r))


def percent(value: float | None) -> str:
    """An MFU-like share as a 7-wide percentage, or n/a."""
    return f"{100 * value:6.1f}%" if value is not None else "    n/a"


def listed_choices(value: str, known: tuple[str, ...], flag: str, default: str | None = None) -> list[str]:
    """The comma-separated choices of option ``flag``; one not in ``known`` stops the script with the flag, the
    unknown values and what may be listed (``default`` too, where the option has a spelled-out default)."""
    listed = value.split(",")
    unknown = sorted(set(listed) - set(known))
    if unknown:
        allowed = f"{default}, or any of {','.join(known)}" if default else f"any of {','.join(known)}"
        raise SystemExit(f"{flag}: unknown {unknown}; use {allowed}")
    return listed

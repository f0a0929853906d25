"""What every benchmark script does with its figures: write the raw report as JSON next to the run.

Imported by the scripts in this folder as ``from bench_io import write_report`` (they run as
``python benchmarks/NAME.py``, so this folder is first on ``sys.path``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any


def write_report(path: str, report: Any, indent: int = 1, announce: bool = True) -> None:
    """Write ``report`` to ``path`` as JSON, creating its folder; the whole file is replaced."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(report, f, indent=indent)
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

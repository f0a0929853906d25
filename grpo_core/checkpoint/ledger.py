"""The run ledger: which prompt positions each step consumed, per attempt, on fsspec storage.

``<output_dir>/ledger/`` holds ``lineage.json`` (the run it belongs to), ``attempts/<n>.json`` per
process start (the checkpoint, step and prompt position it resumed from) and
``steps/<n>-<step>.json`` per optimizer step (positions trained, groups dropped, stale samples,
frontier). One small object per record because object stores cannot append; each is written before
its step counts as done. ``ledger_summary`` gives the counts a job reports.
"""

from __future__ import annotations

import json
import time
from typing import Any

from grpo_core.storage.store import Storage

class RunLedger:
    """``ledger/attempts/<n>.json`` per process start and ``ledger/steps/<n>-<step>.json`` per step."""

    def __init__(self, storage: Storage):
        self.storage = storage
        self.root = storage.path("ledger")

    def clear(self) -> None:
        if self.storage.exists(self.root):
            self.storage.rm(self.root, recursive=True)

    def lineage(self) -> str | None:
        try:
            return self.storage.read_json(self.storage.path_in(self.root, "lineage.json"))["lineage"]
        except FileNotFoundError:
            return None

    def set_lineage(self, lineage: str) -> None:
        self.storage.write_json(self.storage.path_in(self.root, "lineage.json"), {"lineage": lineage})

    def start_attempt(self, checkpoint: str | None, step: int, position: int) -> int:
        """Record a process start (resumed from ``checkpoint`` at ``step`` and prompt ``position``,
        or fresh when None); returns its attempt number, counting from 1."""
        attempt = len(self.storage.ls(self.storage.path_in(self.root, "attempts"))) + 1
        self.storage.write_json(self.storage.path_in(self.root, f"attempts/{attempt:04d}.json"), {
            "attempt": attempt, "checkpoint": checkpoint, "step": step, "position": position,
            "started_at": time.time(),
        })
        return attempt

    def record(self, *, attempt: int, step: int, **fields: Any) -> None:
        self.storage.write_json(
            self.storage.path_in(self.root, f"steps/{attempt:04d}-{step:08d}.json"),
            {"attempt": attempt, "step": step, **fields},
        )


def read_ledger(output_dir: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """``(attempts, steps)`` of the ledger under ``output_dir``, each in order."""
    storage = Storage(output_dir)
    root = storage.path("ledger")

    def load(sub: str) -> list[dict[str, Any]]:
        paths = sorted(e["name"] for e in storage.ls(storage.path_in(root, sub)) if e["name"].endswith(".json"))
        blobs = storage.cat(paths) if paths else {}
        return [json.loads(blobs[p]) for p in paths]

    return load("attempts"), load("steps")


def surviving_steps(attempts: list[dict[str, Any]], steps: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The step records whose training the final model contains: a resume from step s discards
    every earlier record past s (those steps died with their process)."""
    kept: list[dict[str, Any]] = []
    for attempt in attempts:
        kept = [r for r in kept if r["step"] <= attempt["step"]]
        kept += [r for r in steps if r["attempt"] == attempt["attempt"]]
    return kept


def attempts_per_position(steps: list[dict[str, Any]]) -> dict[int, set[int]]:
    """The attempts that consumed each prompt position. A group whose samples spread over two steps
    of one attempt was trained once; a prompt consumed by two attempts was trained twice."""
    seen: dict[int, set[int]] = {}
    for record in steps:
        for position in record["trained"] + record["dropped_groups"]:
            seen.setdefault(position, set()).add(record["attempt"])
    return seen


def ledger_summary(output_dir: str) -> dict[str, int]:
    """Counts a job reports: attempts, resumes, prompts consumed, and prompts trained more than once."""
    attempts, steps = read_ledger(output_dir)
    seen = attempts_per_position(steps)
    return {
        "attempts": len(attempts),
        "resumes": max(0, len(attempts) - 1),
        "prompts_consumed": len(seen),
        "prompts_trained_twice": sum(1 for a in seen.values() if len(a) > 1),
        "stale_dropped": sum(r["stale_dropped"] for r in steps),
        "foreign_dropped": sum(r.get("foreign_dropped", 0) for r in steps),
        "server_restarts": server_restarts(steps),
    }


def server_restarts(steps: list[dict[str, Any]]) -> int:
    """vLLM server restarts the run met: each step record holds its attempt's count so far."""
    per_attempt: dict[int, int] = {}
    for record in steps:
        per_attempt[record["attempt"]] = max(per_attempt.get(record["attempt"], 0), record.get("server_restarts", 0))
    return sum(per_attempt.values())

"""Checkpoints on fsspec storage and resume (being implemented; see issue 5)."""

from __future__ import annotations

from typing import Any


class Checkpointer:
    def __init__(self, args: Any, dist: Any):
        self.args = args
        self.dist = dist

    def find_resume_point(self) -> str | None:
        return None

    def restore(self, trainer: Any, checkpoint: str) -> None:
        raise NotImplementedError

    def should_save(self, step: int) -> bool:
        return False

    def save(self, trainer: Any) -> dict[str, float]:
        return {}

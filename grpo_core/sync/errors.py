"""The named errors of a weight sync: each says which server, which weight version and which phase.

``WeightSyncError`` (a ``RuntimeError``) is what a push raises when it fails; its subclasses say why:
``WeightSyncTimeout`` (a phase passed its deadline, ``timing.deadline``), ``ServedVersionMismatch`` (the
server reports another weight version than the one just pushed) and ``ServedWeightsMismatch`` (the
weights it serves are not the trainer's, ``grpo_core.fleet.verify`` and ``storage_sync``). The trainer recovers
from any of them by pushing again over a new session, and fails the attempt when that fails too.
"""

from __future__ import annotations


class WeightSyncError(RuntimeError):
    """A push, or the check after it, failed; ``server``, ``version`` and ``phase`` say where."""

    def __init__(self, message: str, *, server: str, version: int | str | None, phase: str):
        super().__init__(message)
        self.server = server
        self.version = version
        self.phase = phase


class WeightSyncTimeout(WeightSyncError):
    """A phase of a push passed its deadline."""


class ServedVersionMismatch(WeightSyncError):
    """After a push the server reports another weight version than the one pushed."""


class ServedWeightsMismatch(WeightSyncError):
    """The weights a server holds after a push are not the trainer's."""

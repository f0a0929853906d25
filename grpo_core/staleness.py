"""The limits that follow from ``max_staleness``, each defined once.

A sample is trainable while the weights it was sampled under are at most ``max_staleness`` updates behind the
trainer's. Everything sized by that rule (the rollout queue's bound, the LoRA window, the server's adapter slots,
the mismatch metrics' staleness buckets) asks these functions, so that no module writes its own ``+ 1``.

``max_staleness`` is validated once, where the config is built (``AsyncGRPOConfig.max_staleness``: an int >= 0);
these functions take it as given.
"""

from __future__ import annotations


def versions_in_flight(max_staleness: int) -> int:
    """Weight versions a trainable sample may have been sampled under: the current one and ``max_staleness`` older.

    The LoRA window keeps this many adapters registered, the mismatch metrics keep one bucket per version, and
    the rollout worker may run this many weight pushes' worth of samples ahead of the trainer.
    """
    return max_staleness + 1


def samples_ahead(max_staleness: int, weight_sync_steps: int, samples_per_step: int) -> int:
    """The rollout queue's bound: samples that may be ahead of the trainer (queued, being scored, or still being
    generated) without going stale.

    The trainer takes ``samples_per_step`` samples a step and pushes weights every ``weight_sync_steps`` steps, so
    each version in flight is consumed as ``weight_sync_steps x samples_per_step`` samples; a sample admitted now is
    trained before the trainer is more than ``max_staleness`` pushes past its weights only if at most this many are
    ahead of it. The scheduler admits new groups within it, and it is the default ceiling on rollouts in flight.
    """
    return versions_in_flight(max_staleness) * weight_sync_steps * samples_per_step


def resident_adapters(max_staleness: int) -> int:
    """LoRA adapters a server holds at once: the window, plus the next version loaded before the oldest goes."""
    return versions_in_flight(max_staleness) + 1

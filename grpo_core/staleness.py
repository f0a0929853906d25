"""The limits that follow from ``max_staleness``, each defined once.

A sample is trainable while the weights it was sampled under are at most ``max_staleness`` updates behind the
trainer's. Everything sized by that rule (the rollout budget, the LoRA window, the server's adapter slots, the
mismatch metrics' staleness buckets) asks these functions, so that no module writes its own ``+ 1``.
"""

from __future__ import annotations


def versions_in_flight(max_staleness: int) -> int:
    """Weight versions a trainable sample may have been sampled under: the current one and ``max_staleness`` older.

    The LoRA window keeps this many adapters registered, the mismatch metrics keep one bucket per version, and
    the rollout worker may run this many weight pushes' worth of samples ahead of the trainer.
    """
    if max_staleness < 0:
        raise ValueError(f"max_staleness must be >= 0, got {max_staleness}")
    return max_staleness + 1


def resident_adapters(max_staleness: int) -> int:
    """LoRA adapters a server holds at once: the window, plus the next version loaded before the oldest goes."""
    return versions_in_flight(max_staleness) + 1

"""A reward that asks some prompts for long answers, so that a run's completion lengths have a heavy tail.

The tiny arithmetic model answers in a few tokens. ``long_answer_reward`` pays, for the problems whose first operand
is odd, the share of ``LONG_TOKENS`` a completion runs to (at most 1); for the others nothing. With
``accuracy_reward`` beside it, half the prompts pull toward long answers and half toward short ones, so lengths
spread to ``max_completion_length`` on some groups while the rest stay short: the long groups finish last, the
situation in which a policy that drops late samples trains on shorter answers than it generates.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

LONG_TOKENS = 48
"""Completion tokens at which a long-answer prompt's reward is full."""


def asks_for_length(problem: str) -> bool:
    """Whether ``problem`` (``"7 + 5"``) is one of the long-answer half: its first operand is odd."""
    first = problem.split()[0]
    return first.lstrip("-").isdigit() and int(first) % 2 == 1


def long_answer_reward(completion_ids: Sequence[Sequence[int]], problem: Sequence[str], **_: Any) -> list[float]:
    """Per completion: ``len / LONG_TOKENS`` (at most 1) on a long-answer problem, else 0."""
    return [min(len(ids) / LONG_TOKENS, 1.0) if asks_for_length(p) else 0.0
            for ids, p in zip(completion_ids, problem, strict=True)]

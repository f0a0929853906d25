"""A task whose completion lengths have a heavy tail: half the prompts are answered at length.

The tiny arithmetic model answers in a few tokens, whatever it is rewarded for, so a length reward alone leaves its
lengths as they are within a short run. Here the answer to a problem whose first operand is odd is made to run on:
``LongTailLoop`` samples it with vLLM's ``min_tokens`` (``LONG_MIN_TOKENS``), the way a task that asks some prompts
for a worked solution makes them long, and ``long_answer_reward`` pays those prompts for length (the share of
``LONG_TOKENS`` an answer runs to). The long groups take several times as long to generate as the short ones and
finish last: the situation in which a policy that drops late samples trains on shorter answers than it generates.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextvars import ContextVar
from typing import Any

from grpo_core.rollout.stages import AsyncRolloutLoop
from grpo_core.rollout.types import Rollout

LONG_TOKENS = 48
"""Completion tokens at which a long-answer prompt's reward is full."""
LONG_MIN_TOKENS = 40
"""The fewest tokens a long-answer prompt's completion is sampled with."""

_ASKS_FOR_LENGTH: ContextVar[bool] = ContextVar("asks_for_length", default=False)
"""Whether the rollout this task generates is one of a long-answer prompt (each rollout runs in a task of its own)."""


def asks_for_length(problem: str) -> bool:
    """Whether ``problem`` (``"7 + 5"``) is one of the long-answer half: its first operand is odd."""
    first = problem.split()[0] if problem.split() else ""
    return first.lstrip("-").isdigit() and int(first) % 2 == 1


def long_answer_reward(completion_ids: Sequence[Sequence[int]], problem: Sequence[str], **_: Any) -> list[float]:
    """Per completion: ``len / LONG_TOKENS`` (at most 1) on a long-answer problem, else 0."""
    return [min(len(ids) / LONG_TOKENS, 1.0) if asks_for_length(p) else 0.0
            for ids, p in zip(completion_ids, problem, strict=True)]


class LongTailLoop(AsyncRolloutLoop):
    """The rollout loop with the long-answer prompts sampled at ``min_tokens=LONG_MIN_TOKENS``."""

    async def generate_one(self, row_index: int, row: dict[str, Any], rollout_index: int) -> Rollout:
        _ASKS_FOR_LENGTH.set(asks_for_length(str(row.get("problem", ""))))
        return await super().generate_one(row_index, row, rollout_index)

    def sampling_params(self) -> dict[str, Any]:
        params = super().sampling_params()
        if _ASKS_FOR_LENGTH.get():
            params["min_tokens"] = min(LONG_MIN_TOKENS, params["max_tokens"])
        return params

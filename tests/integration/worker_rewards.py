"""Reward functions that integration tests hand to trainers, in a module that imports nothing.

A function from an importable module reaches the rollout process by reference (``grpo_core.rollout.worker``), so
that process imports the function's module before it starts. Defined in a test module, they made every rollout
process import that module and everything it imports: the trainer, torch and vLLM (about 12 s on two loaded cores
for ``test_drop_in``), before its first request.
"""

from __future__ import annotations


def raises_on_row(completions, **kwargs):
    raise KeyError("answer")


def returns_one(completions, **kwargs):
    return [1.0]


def returns_text(completions, **kwargs):
    return ["good"] * len(completions)


def returns_nan(completions, **kwargs):
    return [float("nan")] * len(completions)


def returns_inf(completions, **kwargs):
    return [1.0] * (len(completions) - 1) + [float("-inf")]

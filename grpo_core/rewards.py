"""Built-in reward functions: answer accuracy (via math_verify) and answer format.

A reward function takes ``(prompts, completions, **dataset_columns)`` and returns one float per
completion, or ``None`` where it cannot judge (the trainer then leaves that reward out). A completion
is either a list of chat messages (the last assistant message is the answer) or a plain string.
The functions live at module level so that they pickle into the rollout worker process.

    from grpo_core.rewards import accuracy_reward, format_reward
    accuracy_reward(prompts, [[{"role": "assistant", "content": "\\boxed{12}"}]], solution=["12"])  # [1.0]
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Sequence
from typing import Any

# Imported lazily: math_verify pulls in sympy, which costs about a second and is not needed to
# unpickle this module or to call format_reward.
_BOXED = "\\boxed{"
_TRAILING_OK = re.compile(r"[\s.]*")


def completion_text(completion: Any) -> str:
    """The answer text of one completion: a string as is, or the content of its last assistant message."""
    if isinstance(completion, str):
        return completion
    for message in reversed(list(completion)):
        if message.get("role") == "assistant":
            return _content_text(message.get("content"))
    return ""


def _content_text(content: Any) -> str:
    # OpenAI-style content may be a list of parts; only the text parts carry the answer.
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(part.get("text", "") for part in content if isinstance(part, dict) and part.get("type") == "text")


def _parse_timeout() -> int | None:
    # math_verify's timeout uses signal.alarm, which only works on the main thread; elsewhere the
    # inputs here are short boxed answers, so running without a timeout is the lesser risk.
    return 5 if threading.current_thread() is threading.main_thread() else None


class _DropDisabledTimeoutNotice(logging.Filter):
    """math_verify warns once per process when called without a timeout; that is our deliberate
    choice off the main thread (see ``_parse_timeout``), so the notice would only be noise in logs."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Timeout is disabled")


for _name in ("math_verify.parser", "math_verify.grader"):
    logging.getLogger(_name).addFilter(_DropDisabledTimeoutNotice())


def accuracy_reward(prompts: Sequence[Any], completions: Sequence[Any], solution: Sequence[str], **kwargs: Any) -> list[float | None]:
    """1.0 when math_verify finds the completion's answer equal to ``solution``, else 0.0.

    Returns None for a row whose gold solution cannot be parsed, so a broken label does not count as
    a wrong answer.
    """
    from math_verify import parse, verify

    if len(solution) != len(completions):
        raise ValueError(f"got {len(completions)} completions but {len(solution)} solutions")
    timeout = _parse_timeout()
    rewards: list[float | None] = []
    for completion, gold_text in zip(completions, solution, strict=True):
        gold = parse(str(gold_text), parsing_timeout=timeout)
        if not gold:
            rewards.append(None)
            continue
        answer = parse(completion_text(completion), parsing_timeout=timeout)
        ok = bool(answer) and verify(gold, answer, timeout_seconds=timeout)
        rewards.append(1.0 if ok else 0.0)
    return rewards


def _boxed_span(text: str, start: int) -> int | None:
    """Index just past the brace that closes the ``\\boxed{`` opened at ``start``, or None."""
    depth = 0
    for i in range(start + len(_BOXED) - 1, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


def has_answer_format(text: str) -> bool:
    """True when ``text`` ends with its only ``\\boxed{...}``, after optional reasoning.

    Reasoning may be free text or a closed ``<think>...</think>`` block; the box must come after the
    block, be non-empty, and be followed by nothing but whitespace or a full stop.
    """
    if text.count(_BOXED) != 1:
        return False
    if "<think>" in text:
        if text.count("<think>") != 1 or text.count("</think>") != 1 or text.index("<think>") > text.index("</think>"):
            return False
        text = text[text.index("</think>") + len("</think>"):]
    elif "</think>" in text:
        return False
    if _BOXED not in text:
        return False
    start = text.index(_BOXED)
    end = _boxed_span(text, start)
    if end is None or not text[start + len(_BOXED): end - 1].strip():
        return False
    return _TRAILING_OK.fullmatch(text[end:]) is not None


def format_reward(prompts: Sequence[Any], completions: Sequence[Any], **kwargs: Any) -> list[float]:
    """1.0 when the final assistant message ends with exactly one ``\\boxed{...}`` answer, else 0.0."""
    return [1.0 if has_answer_format(completion_text(c)) else 0.0 for c in completions]

"""Chat-template variants that make multi-turn re-tokenisation drift the way real templates do.

Both are edits of the tiny model's ChatML template, used by the loop tests (here, in
``test_loop_multiturn.py``; ``COMPACT_ARGS_TEMPLATE`` also in ``integration/test_tools.py``) to exercise
each reconcile outcome:

* ``NO_THINK_TEMPLATE`` (FORK). Qwen3 with ``enable_thinking=False`` opens every generation with an
  empty ``<think>\\n\\n</think>\\n\\n`` block, and when it re-renders the history it drops the
  reasoning of earlier assistant turns, the empty block included. The block sat in the *prompt* of
  the earlier turn, before its answer, so the next turn's prompt disagrees with the held tokens
  before the answer: no realign can repair that without retraining context, so the turn forks.
* ``COMPACT_ARGS_TEMPLATE`` (REALIGN). The model writes tool-call arguments as it was taught,
  ``{"expression": "7 + 5"}``; this template re-serialises the parsed arguments with compact JSON
  separators, ``{"expression":"7 + 5"}``, as templates that call ``tojson`` with their own style
  do. The drift lies inside the previous answer and ends before ``"}}`` / ``</tool_call>``, where
  the re-tokenised tail matches the sampled one again: a realign of a few tokens.

The unmodified template re-renders a well-formed call byte for byte, so turns reconcile CLEAN.

A realign across the answer *boundary* cannot happen with ChatML templates: the answer ends with the
special ``<|im_end|>`` token, which BPE never merges with what follows. Realistic realigns sit inside
the answer, where the template rewrites what the model wrote (arguments, stripped whitespace) or the
sampled tokens were not the canonical tokenisation of their own text.
"""

from __future__ import annotations

from typing import Any

import pytest

from grpo_core.rollout.reconcile import TurnKind, align_turn
from grpo_core.tiny.tokenizer import CHAT_TEMPLATE

_GENERATION_PROMPT = "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
_ASSISTANT_TEXT = "{%- set text = message.content if message.content is string else '' -%}"
_ARGUMENTS = "{{- fn.arguments | tojson -}}"


def _edit(template: str, old: str, new: str) -> str:
    if template.count(old) != 1:
        raise AssertionError(f"the tiny chat template changed; cannot find {old!r} once")
    return template.replace(old, new)


NO_THINK_TEMPLATE = _edit(
    _edit(
        CHAT_TEMPLATE,
        _GENERATION_PROMPT,
        "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n' -}}{%- endif -%}",
    ),
    _ASSISTANT_TEXT,
    _ASSISTANT_TEXT
    + "\n{%- if '</think>' in text -%}{%- set text = text.split('</think>')[-1].lstrip('\\n') -%}{%- endif -%}",
)

# Drops the reasoning of earlier assistant turns and nothing else (no think block in the generation
# prompt): what the model wrote before ``</think>`` leaves the history when it is re-rendered.
DROP_REASONING_TEMPLATE = _edit(
    CHAT_TEMPLATE,
    _ASSISTANT_TEXT,
    _ASSISTANT_TEXT
    + "\n{%- if '</think>' in text -%}{%- set text = text.split('</think>')[-1].lstrip('\\n') -%}{%- endif -%}",
)

COMPACT_ARGS_TEMPLATE = _edit(CHAT_TEMPLATE, _ARGUMENTS, "{{- fn.arguments | tojson(separators=(',', ':')) -}}")


def with_template(tokenizer: Any, template: str) -> Any:
    """A copy of ``tokenizer`` that renders with ``template`` (the original is left alone)."""
    import copy

    variant = copy.deepcopy(tokenizer)
    variant.chat_template = template
    return variant


# --------------------------------------------------------------------------------------------------
# The variants do what the docstring claims (on the tiny tokenizer, no model needed)
# --------------------------------------------------------------------------------------------------

CALL = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "7 + 5"}}}
SAMPLED_CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "7 + 5"}}\n</tool_call>'
PROMPT = [{"role": "user", "content": "What is 7 + 5?"}]


@pytest.fixture(scope="module")
def tokenizer():  # noqa: ANN201 - a PreTrainedTokenizerFast
    from grpo_core.tiny.spec import TaskSpec, TokenizerSpec
    from grpo_core.tiny.tokenizer import train_tokenizer

    return train_tokenizer(TaskSpec(), TokenizerSpec(), seed=0)


def _ids(tok: Any, messages: list[dict[str, Any]]) -> list[int]:
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tok(text, add_special_tokens=False)["input_ids"]


def _classify(tok: Any, output_text: str) -> TurnKind:
    """Turn 1 samples ``output_text``; how does turn 2's prompt line up with what was held?"""
    first = _ids(tok, PROMPT)
    output = tok(output_text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    history = PROMPT + [{"role": "assistant", "content": "", "tool_calls": [CALL]},
                        {"role": "tool", "name": "calculator", "content": "12"}]
    return align_turn(first + output, len(first), _ids(tok, history), fork_threshold_tokens=64).kind


def test_plain_template_is_clean(tokenizer) -> None:  # noqa: ANN001
    assert _classify(tokenizer, SAMPLED_CALL) is TurnKind.CLEAN


def test_compact_arguments_realign(tokenizer) -> None:  # noqa: ANN001
    variant = with_template(tokenizer, COMPACT_ARGS_TEMPLATE)
    assert '{"expression":"7 + 5"}' in variant.apply_chat_template(
        PROMPT + [{"role": "assistant", "content": "", "tool_calls": [CALL]}], tokenize=False
    )
    assert _classify(variant, SAMPLED_CALL) is TurnKind.REALIGN


def test_no_think_template_forks(tokenizer) -> None:  # noqa: ANN001
    variant = with_template(tokenizer, NO_THINK_TEMPLATE)
    assert variant.apply_chat_template(PROMPT, tokenize=False, add_generation_prompt=True).endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )
    rendered = variant.apply_chat_template(
        PROMPT + [{"role": "assistant", "content": "<think>\n7 + 5 = 12\n</think>\n\n\\boxed{12}"}], tokenize=False
    )
    assert "<think>" not in rendered and rendered.endswith("<|im_start|>assistant\n\\boxed{12}<|im_end|>\n")
    assert _classify(variant, SAMPLED_CALL) is TurnKind.FORK


def test_dropped_reasoning_realigns_or_forks_by_its_length(tokenizer) -> None:  # noqa: ANN001
    # The tools model thinks before it calls; this template drops that thought from the history, a
    # drift of the thought's length inside the previous answer: REALIGN below the threshold, FORK above.
    variant = with_template(tokenizer, DROP_REASONING_TEMPLATE)
    thought = "<think>\n7 + 5\n</think>"
    assert variant.apply_chat_template(PROMPT, tokenize=False, add_generation_prompt=True).endswith("<|im_start|>assistant\n")
    first = _ids(variant, PROMPT)
    output = variant(f"{thought}\n{SAMPLED_CALL}", add_special_tokens=False)["input_ids"] + [variant.eos_token_id]
    history = PROMPT + [{"role": "assistant", "content": thought, "tool_calls": [CALL]},
                        {"role": "tool", "name": "calculator", "content": "12"}]
    assert "<think>" not in variant.apply_chat_template(history, tokenize=False)
    drift = len(variant(f"{thought}\n", add_special_tokens=False)["input_ids"])
    below = align_turn(first + output, len(first), _ids(variant, history), fork_threshold_tokens=drift + 1)
    assert below.kind is TurnKind.REALIGN and below.drift_tokens == drift
    above = align_turn(first + output, len(first), _ids(variant, history), fork_threshold_tokens=drift - 1)
    assert above.kind is TurnKind.FORK
    # The tiny template keeps the thought, so the same turn is CLEAN there.
    plain = align_turn(first + output, len(first), _ids(tokenizer, history), fork_threshold_tokens=1)
    assert plain.kind is TurnKind.CLEAN

"""Tokens in, tokens out for multi-turn rollouts: the next turn's prompt extends the sampled tokens.

The message path (``AsyncRolloutLoop.prompt_ids``) renders the whole conversation with the chat template
each turn and tokenises it again; the result need not start with the tokens the server sampled (the
sampler may pick a non-canonical tokenisation of its own text, templates re-serialise tool-call
arguments or drop earlier reasoning), which ``reconcile.py`` then repairs (REALIGN) or splits (FORK).

The token path never re-tokenises what was already said. Turn k's prompt is

    prompt_ids[k-1] + output_ids[k-1] + continuation

where ``continuation`` is the template's text between the end of the previous answer and the next
generation prompt: what closes the assistant turn after its end-of-turn token (ChatML: a newline), the
new messages (tool results, an environment's observation) and the generation prompt. It is found by
rendering the same new messages after a minimal two-message history, with and without them, and taking
the text the second rendering adds; only that text is tokenised. Every turn then reconciles CLEAN, and
the trained tokens are exactly the sampled ones in exactly the context they were sampled in.

The path needs the previous answer to end with the template's end-of-turn token (a special token the
server returned among the output ids) and a template whose rendering of the history does not change
when messages are appended. When either fails, ``continuation_ids`` returns None and the caller falls
back to the message path for that turn (``rollout/token_path_fallbacks`` counts these turns).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

_STAND_IN_USER = {"role": "user", "content": "x"}
"""The history the continuation is rendered after: one user message and the real previous answer."""


def _render(tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
            generation_prompt: bool, template_kwargs: dict[str, Any] | None) -> str:
    return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                         add_generation_prompt=generation_prompt, **(template_kwargs or {}))


def continuation_text(
    tokenizer: Any,
    answer: dict[str, Any],
    new_messages: Sequence[dict[str, Any]],
    end_of_turn: str,
    tools: list[dict[str, Any]] | None = None,
    template_kwargs: dict[str, Any] | None = None,
) -> str | None:
    """The template's text after ``end_of_turn`` closing ``answer``, through the next generation prompt.

    None when the template renders the answer differently once messages follow it (the suffix cannot
    be cut off by string prefix), or renders no ``end_of_turn`` after the answer.
    """
    history = [_STAND_IN_USER, answer]
    before = _render(tokenizer, history, tools, False, template_kwargs)
    after = _render(tokenizer, [*history, *new_messages], tools, True, template_kwargs)
    if not after.startswith(before) or end_of_turn not in before:
        return None
    closing = before.rsplit(end_of_turn, 1)[1]
    return closing + after[len(before):]


def continuation_ids(
    tokenizer: Any,
    answer: dict[str, Any],
    answer_ids: Sequence[int],
    new_messages: Sequence[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
    template_kwargs: dict[str, Any] | None = None,
) -> list[int] | None:
    """Token ids to append after the sampled ``answer_ids`` so that the next turn can be generated.

    None when the token path cannot be taken for this turn: the answer did not end with a special
    token (cut off, or stopped by a stop string the server left out), or ``continuation_text`` is None.
    """
    if not answer_ids or int(answer_ids[-1]) not in set(tokenizer.all_special_ids):
        return None
    end_of_turn = tokenizer.decode([int(answer_ids[-1])], skip_special_tokens=False)
    text = continuation_text(tokenizer, answer, new_messages, end_of_turn, tools, template_kwargs)
    if text is None:
        return None
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def extended_prompt(prompt_ids: Sequence[int], output_ids: Sequence[int], continuation: Sequence[int]) -> list[int]:
    """The next turn's prompt: what the server saw and sampled, then the continuation."""
    return [*map(int, prompt_ids), *map(int, output_ids), *map(int, continuation)]


def sampled_exactly(sequences: Sequence[Any], turns: Sequence[Any]) -> bool:
    """Whether every turn's sampled tokens are trained, in exactly the context they were sampled in.

    True when for each turn some training sequence starts with ``prompt_ids + output_ids`` of that turn
    (counted from the sequence's start, so a forked sequence that opens on the turn's prompt counts)
    and trains every one of the turn's output positions. A REALIGN breaks it: the drifted span is
    context, and the tokens after it are trained under a context they were not sampled in.
    """
    for record in turns:
        sampled = [*map(int, record.prompt_ids), *map(int, record.output_ids)]
        start = len(record.prompt_ids)
        found = False
        for seq in sequences:
            if len(seq.token_ids) < len(sampled):
                continue
            if [int(t) for t in seq.token_ids[: len(sampled)]] != sampled:
                continue
            # Position 0 is never trained (nothing predicts it): only reachable with an empty first prompt.
            mask = seq.completion_mask[max(start, 1): len(sampled)]
            if bool(mask.all()):
                found = True
                break
        if not found:
            return False
    return True

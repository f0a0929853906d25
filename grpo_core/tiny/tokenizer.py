"""Byte-level BPE tokenizer and ChatML chat template for the tiny model, trained from a seeded corpus.

Digits are always single tokens (a digit-isolating pre-tokenizer runs before the byte-level split),
so that the model sees ``12`` as ``1``, ``2`` and arithmetic has a learnable structure. The chat
template is written for this project in the Qwen3 / ChatML layout: ``<|im_start|>role\\n...<|im_end|>\\n``,
tools listed in the system turn, calls as ``<tool_call>`` JSON and tool results as a user turn of
``<tool_response>`` blocks. It marks assistant text with ``{% generation %}`` so that
``apply_chat_template(..., return_assistant_tokens_mask=True)`` gives a loss mask.
"""

from __future__ import annotations

import functools
import json
import random
from collections.abc import Sequence
from typing import Any

from jinja2 import Template, nodes
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

from grpo_core.tiny import tasks
from grpo_core.tiny.spec import TaskSpec, TokenizerSpec

PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (PAD_TOKEN, IM_START, IM_END)
# Single tokens that stay in decoded text (tool-call and reasoning parsers need to see them).
TAG_TOKENS = ("<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")

CHAT_TEMPLATE = r"""
{%- macro render_call(call) -%}
{%- set fn = call.function if call.function is defined else call -%}
{{- '<tool_call>\n{"name": "' + fn.name + '", "arguments": ' -}}
{%- if fn.arguments is string -%}{{- fn.arguments -}}{%- else -%}{{- fn.arguments | tojson -}}{%- endif -%}
{{- '}\n</tool_call>' -}}
{%- endmacro -%}
{%- set has_system = messages | length > 0 and messages[0].role == 'system' -%}
{%- if tools -%}
{{- '<|im_start|>system\n' -}}
{%- if has_system -%}{{- messages[0].content + '\n\n' -}}{%- endif -%}
{{- '# Tools\n\nYou may call these functions:\n<tools>' -}}
{%- for tool in tools -%}{{- '\n' + (tool | tojson) -}}{%- endfor -%}
{{- '\n</tools>\n\nTo call a function, reply with\n<tool_call>\n{"name": <function name>, "arguments": <arguments object>}\n</tool_call><|im_end|>\n' -}}
{%- elif has_system -%}
{{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' -}}
{%- endif -%}
{%- for message in messages -%}
{%- if message.role == 'system' -%}
{%- if not loop.first -%}{{- '<|im_start|>system\n' + message.content + '<|im_end|>\n' -}}{%- endif -%}
{%- elif message.role == 'user' -%}
{{- '<|im_start|>user\n' + message.content + '<|im_end|>\n' -}}
{%- elif message.role == 'assistant' -%}
{{- '<|im_start|>assistant\n' -}}
{%- generation -%}
{%- set text = message.content if message.content is string else '' -%}
{{- text -}}
{%- for call in (message.tool_calls or []) -%}
{%- if text or not loop.first -%}{{- '\n' -}}{%- endif -%}
{{- render_call(call) -}}
{%- endfor -%}
{{- '<|im_end|>' -}}
{%- endgeneration -%}
{{- '\n' -}}
{%- elif message.role == 'tool' -%}
{%- if loop.first or loop.previtem.role != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}
{{- '\n<tool_response>\n' + message.content + '\n</tool_response>' -}}
{%- if loop.last or loop.nextitem.role != 'tool' -%}{{- '<|im_end|>\n' -}}{%- endif -%}
{%- else -%}
{{- raise_exception('unsupported role: ' + message.role) -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}
""".strip()


class _GenerationBlock(Extension):
    """Accept ``{% generation %}`` as a no-op, for rendering the corpus before a tokenizer exists."""

    tags = {"generation"}

    def parse(self, parser: Any) -> Any:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body, lineno=lineno)


def _tojson(value: Any) -> str:
    # Same output as transformers' tojson filter: default separators, non-ASCII kept.
    return json.dumps(value, ensure_ascii=False)


def _raise(message: str) -> None:
    raise ValueError(message)


@functools.cache
def _compiled_template() -> Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    return env.from_string(CHAT_TEMPLATE)


def render_chat(
    messages: Sequence[dict[str, Any]],
    tools: Sequence[dict[str, Any]] | None = None,
    add_generation_prompt: bool = False,
) -> str:
    """Render ``CHAT_TEMPLATE`` without a tokenizer (the environment mirrors transformers' settings)."""
    return _compiled_template().render(messages=list(messages), tools=list(tools) if tools else None,
                           add_generation_prompt=add_generation_prompt)


def corpus(task: TaskSpec, size: int, seed: int) -> list[str]:
    """Rendered conversations covering every text the model will meet: both variants, all phrasings,
    right and wrong answers, tool calls, and operands outside the task range for robustness."""
    rng = random.Random(f"corpus-{seed}")
    problems = tasks.all_problems(task.max_operand, task.ops)
    wide = tasks.all_problems(99, ("+", "-"))
    texts: list[str] = []
    for i in range(size):
        problem = rng.choice(problems if i % 4 else wide)
        system = tasks.SYSTEM_PROMPT if rng.random() < 0.5 else None
        template = rng.randrange(len(tasks.QUESTION_TEMPLATES))
        if i % 3 == 0:
            texts.append(render_chat(tasks.tool_conversation(problem, template, system),
                                     tools=[tasks.CALCULATOR_SCHEMA]))
        else:
            value = problem.value + rng.choice((0, 0, -1, 1, 2))
            answer = tasks.answer_text(problem, value, rng.randrange(len(tasks.ANSWER_TEMPLATES)))
            prompt = tasks.make_prompt(problem, template, system)
            texts.append(render_chat([*prompt, {"role": "assistant", "content": answer}]))
    return texts


def _strip_added(text: str) -> str:
    # Special and tag tokens become single ids anyway; learning merges over them would waste vocab.
    for token in (*SPECIAL_TOKENS, *TAG_TOKENS):
        text = text.replace(token, "")
    return text


def train_tokenizer(task: TaskSpec, spec: TokenizerSpec, seed: int) -> PreTrainedTokenizerFast:
    """Train the BPE merges on the seeded corpus and wrap the result with the chat template."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True),
         pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
    )
    tok.decoder = decoders.ByteLevel()
    # Untrimmed offsets keep character spans exact, which the assistant-mask machinery relies on.
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_size - len(TAG_TOKENS),
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    texts = [_strip_added(t) for t in corpus(task, spec.corpus_size, seed)]
    tok.train_from_iterator(texts, trainer=trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TAG_TOKENS])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=IM_END,
        pad_token=PAD_TOKEN,
        additional_special_tokens=[IM_START],
        chat_template=CHAT_TEMPLATE,
        model_max_length=512,
        clean_up_tokenization_spaces=False,
        padding_side="left",
    )

"""Sampled evaluation of the tiny model with transformers: accuracy and format rate at temperature 1.

Used to tune the warm-up and by the slow test. Tool calls in the output are parsed, run through
``tasks.calculator`` and fed back as a ``tool`` message, so the tools variant is measured on the
same multi-turn loop that RL will use.

    .venv/bin/python -m grpo_core.tiny --variant arithmetic   # builds (or reuses) and prints (``__main__``)
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerFast

from grpo_core.rewards import accuracy_reward, format_reward
from grpo_core.tiny import tasks

_TOOL_CALL = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.DOTALL)


@dataclass
class EvalResult:
    accuracy: float
    format_rate: float
    tool_call_rate: float
    mean_completion_tokens: float
    samples: list[list[dict[str, Any]]] = field(default_factory=list, repr=False)


def parse_tool_calls(text: str) -> list[dict[str, Any]]:
    """Tool calls in the model's text, as chat-message ``tool_calls`` entries (malformed ones dropped)."""
    calls = []
    for raw in _TOOL_CALL.findall(text):
        try:
            obj = json.loads(raw)
        except json.JSONDecodeError:
            continue
        if isinstance(obj, dict) and isinstance(obj.get("name"), str) and isinstance(obj.get("arguments"), dict):
            calls.append({"type": "function", "function": {"name": obj["name"], "arguments": obj["arguments"]}})
    return calls


def _run_tool(call: dict[str, Any]) -> str:
    fn = call["function"]
    if fn["name"] != "calculator":
        return f"error: unknown tool {fn['name']}"
    return tasks.calculator(str(fn["arguments"].get("expression", "")))


@torch.no_grad()
def _sample_batch(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerFast, conversations: Sequence[list[dict[str, Any]]],
    tools: list[dict[str, Any]] | None, max_new_tokens: int,
) -> tuple[list[str], list[int]]:
    texts = [tokenizer.apply_chat_template(c, tools=tools, add_generation_prompt=True, tokenize=False) for c in conversations]
    enc = tokenizer(texts, return_tensors="pt", padding=True, padding_side="left")
    out = model.generate(
        **enc, do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=max_new_tokens,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    new = out[:, enc["input_ids"].shape[1]:]
    lengths = []
    for row in new.tolist():
        n = len(row)
        if tokenizer.eos_token_id in row:
            n = row.index(tokenizer.eos_token_id) + 1
        lengths.append(n)
    decoded = [tokenizer.decode(row[:n], skip_special_tokens=True) for row, n in zip(new.tolist(), lengths, strict=True)]
    return decoded, lengths


def sampled_eval(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerFast,
    prompts: Sequence[list[dict[str, Any]]],
    solutions: Sequence[str],
    *,
    seed: int = 0,
    tools: list[dict[str, Any]] | None = None,
    max_turns: int = 1,
    max_new_tokens: int = 48,
    batch_size: int = 64,
) -> EvalResult:
    """Sample one completion per prompt (temperature 1, no top-k/top-p) and score it."""
    completions: list[list[dict[str, Any]]] = [[] for _ in prompts]
    token_counts = [0] * len(prompts)
    used_tool = [False] * len(prompts)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        pending = list(range(len(prompts)))
        for _turn in range(max_turns):
            next_pending = []
            for lo in range(0, len(pending), batch_size):
                idx = pending[lo: lo + batch_size]
                convs = [list(prompts[i]) + completions[i] for i in idx]
                texts, lengths = _sample_batch(model, tokenizer, convs, tools, max_new_tokens)
                for i, text, n in zip(idx, texts, lengths, strict=True):
                    token_counts[i] += n
                    calls = parse_tool_calls(text) if tools else []
                    if calls:
                        used_tool[i] = True
                        completions[i].append({"role": "assistant", "content": text, "tool_calls": calls})
                        completions[i].extend({"role": "tool", "name": c["function"]["name"], "content": _run_tool(c)} for c in calls)
                        next_pending.append(i)
                    else:
                        completions[i].append({"role": "assistant", "content": text})
            pending = next_pending
    acc = accuracy_reward(list(prompts), completions, solution=list(solutions))
    fmt = format_reward(list(prompts), completions)
    n = max(1, len(prompts))
    return EvalResult(
        accuracy=sum(a or 0.0 for a in acc) / n,
        format_rate=sum(fmt) / n,
        tool_call_rate=sum(used_tool) / n,
        mean_completion_tokens=sum(token_counts) / n,
        samples=completions,
    )

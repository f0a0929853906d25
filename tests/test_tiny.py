"""Tests of the offline tiny model kit (grpo_core/tiny): split, data set, tokenizer, template, cached build.

The fast tests build a much smaller spec; the one ``slow`` test builds the real model and checks the
warm-up landed in the accuracy window that RL needs.
"""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path

import pytest

from grpo_core.tiny import arithmetic_dataset, build_from_spec, build_tiny_model, model_dir, tasks
from grpo_core.tiny.spec import ModelSpec, TinySpec, TokenizerSpec, WarmupSpec, default_spec
from grpo_core.tiny.tokenizer import IM_END, TAG_TOKENS, render_chat, train_tokenizer

SMALL = TinySpec(
    tokenizer=TokenizerSpec(corpus_size=400),
    model=ModelSpec(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                    num_attention_heads=2, num_key_value_heads=1, head_dim=32),
    warmup=WarmupSpec(steps=4, batch_size=4, num_examples=32, warmup_steps=2),
    eval_samples=0,
)


@pytest.fixture(scope="module")
def tokenizer():  # noqa: ANN201 - a PreTrainedTokenizerFast
    return train_tokenizer(SMALL.task, SMALL.tokenizer, seed=0)


# --- task data ---------------------------------------------------------------------------------------

def test_split_is_disjoint_and_mirrored() -> None:
    train, held = tasks.split_problems(9, ("+",), 0.2, seed=1234)
    assert len(train) + len(held) == 100 and len(held) == 20
    assert not set(train) & set(held)
    for p in held:  # every held-out a + b can be reached through commutativity
        assert tasks.Problem(p.b, "+", p.a) in train


def test_split_with_subtraction() -> None:
    train, held = tasks.split_problems(9, ("+", "-"), 0.2, seed=0)
    assert not set(train) & set(held)
    assert {p.op for p in held} == {"+", "-"}
    assert all(p.value >= 0 for p in train + held)


def test_dataset_rows_and_holdout() -> None:
    ds = arithmetic_dataset(num_train=300, num_eval=50, seed=3)
    assert set(ds) == {"train", "eval"} and len(ds["train"]) == 300 and len(ds["eval"]) == 50
    row = ds["train"][0]
    assert [m["role"] for m in row["prompt"]] == ["system", "user"]
    assert row["solution"].isdigit()
    user_texts = lambda split: {r["prompt"][-1]["content"] for r in ds[split]}  # noqa: E731
    assert not user_texts("train") & user_texts("eval")
    assert arithmetic_dataset(num_train=300, num_eval=50, seed=3)["train"]["prompt"] == ds["train"]["prompt"]
    assert arithmetic_dataset(num_train=10, num_eval=5, system_prompt=None)["train"][0]["prompt"][0]["role"] == "user"


@pytest.mark.parametrize(("expr", "out"), [("7 + 5", "12"), ("9 - 12", "-3"), (" 3*4 ", "12"), ("-2 + 1", "-1")])
def test_calculator(expr: str, out: str) -> None:
    assert tasks.calculator(expr) == out


@pytest.mark.parametrize("expr", ["__import__('os')", "2 ** 10", "1 / 2", "x + 1", "1 +", "1.5 + 1"])
def test_calculator_rejects(expr: str) -> None:
    assert tasks.calculator(expr).startswith("error:")


# --- tokenizer and chat template -----------------------------------------------------------------------

def test_tokenizer_tokens(tokenizer) -> None:  # noqa: ANN001
    ids = tokenizer("12345 + 678", add_special_tokens=False)["input_ids"]
    pieces = [tokenizer.decode([i]) for i in ids]
    assert [p for p in pieces if p.strip().isdigit()] == list("12345678")  # one token per digit
    for tag in TAG_TOKENS:
        assert len(tokenizer(tag, add_special_tokens=False)["input_ids"]) == 1
        assert tag not in tokenizer.all_special_tokens
    assert tokenizer.eos_token == IM_END and tokenizer.pad_token == "<|endoftext|>"
    assert "<|im_start|>" in tokenizer.all_special_tokens
    assert 256 < len(tokenizer) <= SMALL.tokenizer.vocab_size


def test_tokenizer_is_deterministic(tokenizer) -> None:  # noqa: ANN001
    again = train_tokenizer(SMALL.task, SMALL.tokenizer, seed=0)
    assert again.backend_tokenizer.to_str() == tokenizer.backend_tokenizer.to_str()


def test_chat_template_layout(tokenizer) -> None:  # noqa: ANN001
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "What is 1 + 2?"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nWhat is 1 + 2?<|im_end|>\n<|im_start|>assistant\n"
    assert text == render_chat(messages, add_generation_prompt=True)


def test_the_calculator_tool_renders_the_schema_the_model_was_trained_on() -> None:
    """A rollout renders a tool's schema from its docstring and hints; for ``calculator`` that must be the
    trained ``CALCULATOR_SCHEMA`` exactly (shown a "return" entry it never saw, the tools variant wrote
    malformed calls in most rollouts)."""
    from grpo_core.rollout.tool_calls import ToolRegistry

    assert ToolRegistry([tasks.calculator]).schemas() == [tasks.CALCULATOR_SCHEMA]
    # The example environment's method too (examples/environment.yaml trains the tools model with it).
    from examples.environments import CalculatorEnv
    from grpo_core.rollout.agent import RolloutTools

    assert RolloutTools([], CalculatorEnv()).schemas() == [tasks.CALCULATOR_SCHEMA]


def test_chat_template_tools(tokenizer) -> None:  # noqa: ANN001
    conv = tasks.tool_conversation(tasks.Problem(7, "+", 5), template=0, system_prompt="S")
    # A second tool message must join the first in one user turn.
    conv.insert(4, {"role": "tool", "content": "also 12"})
    text = tokenizer.apply_chat_template(conv, tools=[tasks.CALCULATOR_SCHEMA], tokenize=False)
    assert text == render_chat(conv, tools=[tasks.CALCULATOR_SCHEMA])
    assert text.startswith("<|im_start|>system\nS\n\n# Tools\n")
    assert json.dumps(tasks.CALCULATOR_SCHEMA) in text
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "7 + 5"}}\n'
            "</tool_call><|im_end|>\n") in text
    assert ("<|im_start|>user\n<tool_response>\n12\n</tool_response>\n<tool_response>\nalso 12\n"
            "</tool_response><|im_end|>\n") in text
    # Arguments given as a JSON string (OpenAI style) are written as they are.
    call = {"role": "assistant", "content": "ok", "tool_calls": [{"function": {"name": "f", "arguments": '{"x": 1}'}}]}
    assert 'ok\n<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>' in render_chat([call])


def test_chat_template_is_prefix_stable(tokenizer) -> None:  # noqa: ANN001
    # Multi-turn rollouts re-tokenise the conversation; the prompt's tokens must stay its prefix.
    conv = tasks.tool_conversation(tasks.Problem(3, "+", 4), template=1, system_prompt=None)
    tools = [tasks.CALCULATOR_SCHEMA]
    for cut in (1, 3):
        prompt = tokenizer.apply_chat_template(conv[:cut], tools=tools, add_generation_prompt=True)["input_ids"]
        full = tokenizer.apply_chat_template(conv[: cut + 1], tools=tools)["input_ids"]
        assert full[: len(prompt)] == prompt


def test_assistant_mask(tokenizer) -> None:  # noqa: ANN001
    messages = [{"role": "user", "content": "What is 1 + 2?"}, {"role": "assistant", "content": "\\boxed{3}"}]
    enc = tokenizer.apply_chat_template(messages, return_dict=True, return_assistant_tokens_mask=True)
    masked = [t for t, m in zip(enc["input_ids"], enc["assistant_masks"], strict=True) if m]
    assert tokenizer.decode(masked) == "\\boxed{3}<|im_end|>"


# --- cached, deterministic build -------------------------------------------------------------------------

def test_small_build_is_cached_and_deterministic(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    first = build_from_spec(SMALL, tmp_path / "a")
    assert first == model_dir(SMALL, tmp_path / "a") and first.name.startswith("arithmetic-")
    for name in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                 "tokenizer_config.json", ".complete", "build_info.json"):
        assert (first / name).is_file(), name
    assert json.loads((first / "generation_config.json").read_text())["eos_token_id"] == json.loads(
        (first / "config.json").read_text())["eos_token_id"]

    # A second call must reuse the folder, not rebuild.
    monkeypatch.setattr("grpo_core.tiny.build._build_into", lambda *a, **k: pytest.fail("rebuilt"))
    assert build_from_spec(SMALL, tmp_path / "a") == first
    monkeypatch.undo()

    second = build_from_spec(SMALL, tmp_path / "b")
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (first / name).read_bytes() == (second / name).read_bytes(), name

    other = build_from_spec(replace(SMALL, seed=1), tmp_path / "a")
    assert other != first and (other / "model.safetensors").read_bytes() != (first / "model.safetensors").read_bytes()

    model = AutoModelForCausalLM.from_pretrained(first)
    tok = AutoTokenizer.from_pretrained(first)
    assert model.config.head_dim == 32 and model.config.vocab_size == len(tok)
    assert tok.eos_token_id == model.generation_config.eos_token_id


def test_the_warm_up_learns_from_right_answers_first_then_from_noisy_ones(tokenizer) -> None:  # noqa: ANN001
    from grpo_core.tiny.warmup import encode_pool, init_model, warmup_conversations, warmup_train

    train, _ = tasks.split_problems(9, ("+",), 0.2, 1234)
    clean = replace(SMALL.warmup, correct_prob=1.0)
    chats = warmup_conversations(clean, train, with_tools=False, seed=0)
    for chat in (next(chats) for _ in range(50)):
        a, b = re.search(r"(\d+) \+ (\d+)", chat[-2]["content"]).groups()
        assert chat[-1]["content"].endswith(f"\\boxed{{{int(a) + int(b)}}}")
    w = replace(SMALL.warmup, clean_steps=SMALL.warmup.steps)
    pool = encode_pool(clean, tokenizer, train, with_tools=False, seed=0)
    model = init_model(SMALL.model, tokenizer, seed=0)
    with pytest.raises(ValueError, match="clean_pool"):
        warmup_train(model, pool, w, pad_id=tokenizer.pad_token_id, seed=0)
    # Every step is a clean one here, so the (empty) noisy pool is never drawn from.
    assert len(warmup_train(model, [], w, pad_id=tokenizer.pad_token_id, seed=0, clean_pool=pool)) == w.steps
    with pytest.raises(ValueError, match="clean_steps"):
        replace(SMALL.warmup, clean_steps=SMALL.warmup.steps + 1)


def test_incomplete_folder_is_rebuilt(tmp_path: Path) -> None:
    stale = model_dir(SMALL, tmp_path)
    stale.mkdir(parents=True)
    (stale / "config.json").write_text("{}")  # no marker: must be replaced
    assert (build_from_spec(SMALL, tmp_path) / ".complete").is_file()


def test_cache_location(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GRPO_CORE_CACHE", str(tmp_path))
    spec = default_spec("tools", seed=2)
    assert model_dir(spec) == tmp_path / "tiny" / f"tools-{spec.digest()}"
    assert default_spec("arithmetic").digest() != spec.digest()
    assert default_spec("arithmetic").digest() != replace(default_spec(), warmup=replace(WarmupSpec(), steps=1)).digest()


# --- the real model ----------------------------------------------------------------------------------------

@pytest.mark.slow
def test_real_build_hits_the_accuracy_window(tiny_model_path: str) -> None:
    """The default build, as the run's other tests and users get it: the cache's (built once per run, from
    scratch on a fresh machine; the digest tests above pin that the folder is the default spec's)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from grpo_core.tiny.evaluate import sampled_eval

    path = tiny_model_path
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert model.config.head_dim == 64
    ds = arithmetic_dataset(num_train=10, num_eval=300, seed=7)["eval"]
    torch.set_num_threads(2)
    result = sampled_eval(model, tokenizer, ds["prompt"], ds["solution"], seed=1)
    assert result.format_rate > 0.8, result
    assert 0.15 <= result.accuracy <= 0.45, result

"""Hand-written cases for the built-in reward functions (grpo_core/rewards.py)."""

from __future__ import annotations

import pickle
import threading

import numpy as np
import pytest

from grpo_core.rewards import accuracy_reward, completion_text, format_reward, has_answer_format


def _chat(text: str) -> list[dict[str, str]]:
    return [{"role": "assistant", "content": text}]


@pytest.mark.parametrize(
    ("text", "gold", "expected"),
    [
        ("7 + 5 = 12. The answer is \\boxed{12}", "12", 1.0),
        ("\\boxed{12}", "12", 1.0),
        ("<think>\n7 + 5 = 12\n</think>\n\n\\boxed{12}", "12", 1.0),
        ("\\boxed{12.0}", "12", 1.0),
        ("\\boxed{13}", "12", 0.0),
        ("7 + 5 = 13. The answer is \\boxed{12}", "12", 1.0),  # the boxed answer wins over the working
        ("I do not know", "12", 0.0),
        ("", "12", 0.0),
        ("\\boxed{-3}", "-3", 1.0),
        ("\\boxed{3}", "-3", 0.0),
        ("\\boxed{\\frac{1}{2}}", "0.5", 1.0),
    ],
)
def test_accuracy_cases(text: str, gold: str, expected: float) -> None:
    assert accuracy_reward([None], [_chat(text)], solution=[gold]) == [expected]


def test_accuracy_accepts_strings_and_extra_columns() -> None:
    out = accuracy_reward(["p1", "p2"], ["\\boxed{4}", "\\boxed{5}"], solution=["4", "4"], other_column=[1, 2])
    assert out == [1.0, 0.0]


def test_accuracy_none_for_unparseable_gold() -> None:
    assert accuracy_reward([None], [_chat("\\boxed{4}")], solution=["no number here ))"]) == [None]


def test_accuracy_uses_last_assistant_message() -> None:
    completion = [
        {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "calculator", "arguments": {}}}]},
        {"role": "tool", "content": "99"},
        {"role": "assistant", "content": "The answer is \\boxed{12}"},
    ]
    assert accuracy_reward([None], [completion], solution=["12"]) == [1.0]
    # The tool's text is not an answer.
    assert accuracy_reward([None], [completion[:2]], solution=["99"]) == [0.0]


def test_accuracy_length_mismatch_raises() -> None:
    with pytest.raises(ValueError):
        accuracy_reward([None], ["\\boxed{1}"], solution=["1", "2"])


def test_accuracy_works_off_the_main_thread() -> None:
    # math_verify's default timeout uses signals, which only the main thread may install.
    result: list[object] = []
    worker = threading.Thread(target=lambda: result.append(accuracy_reward([None], ["\\boxed{3}"], solution=["3"])))
    worker.start()
    worker.join()
    assert result == [[1.0]]


@pytest.mark.parametrize(
    ("text", "ok"),
    [
        ("\\boxed{12}", True),
        ("7 + 5 = 12. The answer is \\boxed{12}", True),
        ("<think>\nadd them\n</think>\n\n\\boxed{12}", True),
        ("\\boxed{12}.", True),
        ("\\boxed{12}  \n", True),
        ("\\boxed{\\frac{1}{2}}", True),  # nested braces
        ("The answer is 12", False),
        ("\\boxed{12} because 7 + 5 = 12", False),  # the box must end the message
        ("\\boxed{11} no, \\boxed{12}", False),  # exactly one box
        ("<think>\\boxed{12}</think>\n\\boxed{12}", False),  # a box inside the reasoning counts too
        ("<think>\n7 + 5 = 12\n\\boxed{12}", False),  # unclosed reasoning
        ("</think>\\boxed{12}", False),
        ("\\boxed{}", False),
        ("\\boxed{ }", False),
        ("\\boxed{12", False),
        ("", False),
    ],
)
def test_format_cases(text: str, ok: bool) -> None:
    assert has_answer_format(text) is ok
    assert format_reward([None], [_chat(text)]) == [1.0 if ok else 0.0]
    assert format_reward([None], [text]) == [1.0 if ok else 0.0]


def test_completion_text_variants() -> None:
    assert completion_text("plain") == "plain"
    assert completion_text([{"role": "assistant", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]) == "ab"
    assert completion_text([{"role": "assistant", "content": None}]) == ""
    assert completion_text([{"role": "tool", "content": "x"}]) == ""


def test_reward_functions_pickle() -> None:
    for fn in (accuracy_reward, format_reward):
        assert pickle.loads(pickle.dumps(fn)) is fn


# ---- what a reward function may return (checked in the rollout process) --------------------------------
@pytest.mark.parametrize("values,message", [
    ([1.0, float("inf")], r"'f' returned inf for completion 1 of dataset row 7; rewards must be finite"),
    ([float("-inf"), 0.0], r"'f' returned -inf for completion 0 of dataset row 7"),
    ([float("nan"), 0.0], r"'f' returned nan for completion 0"),
    ([True, 0.0], r"'f' returned True \(bool\) for completion 0"),
    ("0.5", r"'f' returned str '0.5' for dataset row 7"),
    ([0.5], r"'f' returned 1 values for the 2 completions of dataset row 7"),
])
def test_reward_values_that_are_refused_name_function_row_and_value(values, message):
    from grpo_core.data.inputs import InputError, check_reward_values

    with pytest.raises(InputError, match=message):
        check_reward_values("f", 7, values, expected=2)


def test_none_stays_not_scored_and_numbers_become_floats():
    import math

    from grpo_core.data.inputs import check_reward_values

    out = check_reward_values("f", 0, [None, 1, np.float32(0.25)], expected=3)
    assert math.isnan(out[0]) and out[1:] == [1.0, 0.25] and all(type(v) is float for v in out)

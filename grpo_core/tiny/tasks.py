"""Synthetic arithmetic task: problems, the held-out split, prompts, answers and the calculator tool.

Everything here is pure Python and seeded, so the RL data set (``arithmetic_dataset``), the tokenizer
corpus and the supervised warm-up corpus all come from the same small set of functions and cannot
drift apart.

    from grpo_core.tiny.tasks import arithmetic_dataset
    ds = arithmetic_dataset(num_train=1000, num_eval=100)
    ds["train"][0]  # {"prompt": [{"role": "system", ...}, {"role": "user", ...}], "solution": "12", "problem": "7 + 5"}
"""

from __future__ import annotations

import ast
import operator
import random
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from grpo_core.tiny.spec import TaskSpec

if TYPE_CHECKING:
    from datasets import DatasetDict

Message = dict[str, Any]

SYSTEM_PROMPT = "Solve the problem. Put the final answer in \\boxed{}."

# Several phrasings so that the model keys on the numbers, not on one fixed sentence.
QUESTION_TEMPLATES: tuple[str, ...] = (
    "What is {expr}?",
    "Compute {expr}.",
    "Calculate {expr}.",
    "{expr} = ?",
    "How much is {expr}?",
)

# Answer styles seen in the warm-up: a worked line, a short think block, or the bare box.
# All end with exactly one \boxed{...}, which is what `format_reward` checks.
ANSWER_TEMPLATES: tuple[str, ...] = (
    "{expr} = {value}. The answer is \\boxed{{{value}}}",
    "<think>\n{expr} = {value}\n</think>\n\n\\boxed{{{value}}}",
    "\\boxed{{{value}}}",
)


@dataclass(frozen=True, order=True)
class Problem:
    """One binary arithmetic problem such as ``7 + 5``."""

    a: int
    op: str
    b: int

    @property
    def expr(self) -> str:
        return f"{self.a} {self.op} {self.b}"

    @property
    def value(self) -> int:
        return self.a + self.b if self.op == "+" else self.a - self.b


def all_problems(max_operand: int, ops: tuple[str, ...]) -> list[Problem]:
    """Every problem with operands in ``[0, max_operand]``; subtraction keeps results non-negative."""
    out: list[Problem] = []
    for op in ops:
        if op not in ("+", "-"):
            raise ValueError(f"unsupported operator {op!r}; use '+' or '-'")
        for a in range(max_operand + 1):
            for b in range(max_operand + 1):
                if op == "-" and b > a:
                    continue
                out.append(Problem(a, op, b))
    return out


def split_problems(
    max_operand: int, ops: tuple[str, ...], eval_fraction: float, seed: int
) -> tuple[list[Problem], list[Problem]]:
    """Split the problem space into (train, eval) by ordered operand pair: no problem is in both.

    For addition, a held-out ``a + b`` always has its mirror ``b + a`` in train (and ``a != b``): the
    single-digit space is too small to hold out whole unordered pairs and still leave a tiny model
    able to answer the held-out ones, while commutativity gives a fair route to generalise.
    Subtraction problems have no mirror and are held out at random.
    """
    rng = random.Random(f"split-{seed}")
    problems = all_problems(max_operand, ops)
    n_eval = round(eval_fraction * len(problems))
    held: set[Problem] = set()
    add_pairs = [(a, b) for a in range(max_operand + 1) for b in range(a + 1, max_operand + 1)]
    subs = [p for p in problems if p.op == "-"]
    rng.shuffle(add_pairs)
    rng.shuffle(subs)
    # Share the held-out budget between operators in proportion to their problem counts.
    n_add = round(n_eval * sum(p.op == "+" for p in problems) / len(problems)) if "+" in ops else 0
    for a, b in add_pairs[:n_add]:
        held.add(Problem(a, "+", b) if rng.random() < 0.5 else Problem(b, "+", a))
    held.update(subs[: n_eval - len(held)])
    train = sorted(p for p in problems if p not in held)
    return train, sorted(held)


def question_text(problem: Problem, template: int) -> str:
    return QUESTION_TEMPLATES[template % len(QUESTION_TEMPLATES)].format(expr=problem.expr)


def make_prompt(problem: Problem, template: int, system_prompt: str | None) -> list[Message]:
    """The conversational prompt for one problem (a system message only when one is given)."""
    messages: list[Message] = []
    if system_prompt:
        messages.append({"role": "system", "content": system_prompt})
    messages.append({"role": "user", "content": question_text(problem, template)})
    return messages


def answer_text(problem: Problem, value: int, style: int) -> str:
    """An assistant answer that states ``value`` (which the warm-up may set to a wrong number)."""
    return ANSWER_TEMPLATES[style % len(ANSWER_TEMPLATES)].format(expr=problem.expr, value=value)


# --- calculator tool (module-level so that it pickles into the rollout worker) ----------------------

_BIN_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def _eval_node(node: ast.AST) -> int:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_eval_node(node.operand)
    if isinstance(node, ast.BinOp) and type(node.op) in _BIN_OPS:
        left, right = _eval_node(node.left), _eval_node(node.right)
        # Bound the operands so a sampled expression cannot ask for a huge product.
        if max(abs(left), abs(right)) > 10**9:
            raise ValueError("operand too large")
        return _BIN_OPS[type(node.op)](left, right)
    raise ValueError("only integers with + - * are supported")


def calculator(expression: str):  # noqa: ANN201 - no return hint: see below
    """Evaluate an integer arithmetic expression.

    Args:
        expression: such as 7 + 5
    """
    # The docstring and hints are the tool's schema as a rollout renders it (transformers' get_json_schema),
    # and that must be CALCULATOR_SCHEMA, the one the tools variant was trained on: a return hint would add a
    # "return" entry, and a tiny model shown a schema it never saw writes malformed calls (tests/test_tiny.py).
    # Never eval(): the expression comes from a sampled policy. Errors are returned as text so the
    # model sees them as the tool's answer instead of crashing the rollout.
    try:
        return str(_eval_node(ast.parse(expression.strip(), mode="eval").body))
    except (SyntaxError, ValueError, RecursionError) as err:
        return f"error: {err}"


# What ``calculator``'s docstring and hints render to (tests/test_tiny.py checks they agree).
CALCULATOR_SCHEMA: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an integer arithmetic expression.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "such as 7 + 5"}},
            "required": ["expression"],
        },
    },
}


def tool_conversation(problem: Problem, template: int, system_prompt: str | None, reasoning: bool = False) -> list[Message]:
    """A full tool-using exchange: the call, the calculator's reply and the boxed answer. With
    ``reasoning`` the call is preceded by a short think block naming the expression."""
    call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": problem.expr}}}
    result = calculator(problem.expr)
    thought = f"<think>\n{problem.expr}\n</think>" if reasoning else ""
    return [
        *make_prompt(problem, template, system_prompt),
        {"role": "assistant", "content": thought, "tool_calls": [call]},
        {"role": "tool", "name": "calculator", "content": result},
        {"role": "assistant", "content": f"The answer is \\boxed{{{result}}}"},
    ]


def _rows(problems: list[Problem], num: int, rng: random.Random, system_prompt: str | None) -> dict[str, list[Any]]:
    # Cycle through every (problem, phrasing) pair in a fresh shuffled order each pass, so that even
    # a small data set covers the problems evenly.
    combos = [(p, t) for p in problems for t in range(len(QUESTION_TEMPLATES))]
    prompts: list[list[Message]] = []
    solutions: list[str] = []
    exprs: list[str] = []
    while len(prompts) < num:
        rng.shuffle(combos)
        for problem, template in combos[: num - len(prompts)]:
            prompts.append(make_prompt(problem, template, system_prompt))
            solutions.append(str(problem.value))
            exprs.append(problem.expr)
    # ``problem`` names what a row asks, whatever its phrasing: held-out intervals count problems, not prompts.
    return {"prompt": prompts, "solution": solutions, "problem": exprs}


def arithmetic_dataset(
    num_train: int = 2000,
    num_eval: int = 100,
    seed: int = 0,
    *,
    system_prompt: str | None = SYSTEM_PROMPT,
    task: TaskSpec | None = None,
) -> DatasetDict:
    """The RL data set: ``train`` and ``eval`` splits of rows ``{"prompt": messages, "solution": "12", "problem": "7 + 5"}``.

    The split is by problem (see ``split_problems``) and fixed by ``task.split_seed``, so it agrees with
    the problems the tiny model was warmed up on whatever ``seed`` is; ``seed`` only orders the rows.
    """
    from datasets import Dataset, DatasetDict

    task = task or TaskSpec()
    train, held = split_problems(task.max_operand, task.ops, task.eval_fraction, task.split_seed)
    rng = random.Random(f"dataset-{seed}")
    return DatasetDict({
        "train": Dataset.from_dict(_rows(train, num_train, rng, system_prompt)),
        "eval": Dataset.from_dict(_rows(held, num_eval, rng, system_prompt)),
    })

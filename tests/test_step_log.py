"""The console and the completions table of ``grpo_core.training.step_log``: one line per logged step, a compact
completions table every ``print_completions_steps``, a column per reward function.

    .venv/bin/python -m pytest -q tests/test_step_log.py
"""

from __future__ import annotations

import logging

import numpy as np

from grpo_core.config import AsyncGRPOConfig
from grpo_core.packing.planner import StepPlan
from grpo_core.rollout.types import GroupReport
from grpo_core.tracking.tracker import NullTracker
from grpo_core.training.collector import StepBatch
from grpo_core.training.step_log import (
    StepLog,
    completions_columns,
    completions_table,
    eta_s,
    progress_line,
    spread_rows,
)


def batch(step: int) -> StepBatch:
    reports = [GroupReport(position=g, row_index=g, epoch=0, rewards=np.array([1.5, np.nan]),
                           rewards_per_func={"accuracy_reward": np.array([1.0, np.nan]),
                                             "format_reward": np.array([0.5, 0.0])},
                           num_samples=2, dropped=False, completions=[f"<answer>{g}</answer>", "no\nanswer " * 40],
                           prompt_text=f"What is {g} + {step}?\nAnswer in tags.") for g in range(2)]
    return StepBatch(plan=StepPlan(microbatches=[], token_budget=64, world_size=1, gradient_accumulation_steps=1),
                     samples=[], reports=reports, stale_dropped=0, staleness=[], wait_s=0.0)


class TableRecorder(NullTracker):
    def __init__(self) -> None:
        self.tables: list[tuple[str, dict, int]] = []

    def log_table(self, name, columns, step, block=None):  # noqa: ANN001
        self.tables.append((name, columns, step))


def test_the_table_has_a_column_per_reward_function():
    table = completions_columns(7, batch(7))
    assert list(table) == ["step", "prompt", "completion", "reward", "accuracy_reward", "format_reward"]
    assert table["step"] == [7] * 4 and table["reward"] == [1.5, None, 1.5, None]
    assert table["accuracy_reward"] == [1.0, None, 1.0, None] and table["format_reward"] == [0.5, 0.0, 0.5, 0.0]


def test_the_console_table_is_a_line_per_completion_within_its_width():
    text = completions_table(completions_columns(7, batch(7)), rows=3, width=100)
    lines = text.splitlines()
    assert len(lines) == 4 and all(len(line) <= 100 for line in lines), text  # a header and three rows
    assert lines[0].split()[:3] == ["reward", "accuracy_reward", "format_reward"]
    # One row per prompt first: both groups show; a prompt is cut to its line; a missing score is "-".
    assert "What is 0 + 7?" in lines[1] and "What is 1 + 7?" in lines[2] and "-" in lines[3].split()[:2]


def test_one_line_per_logged_step_and_a_completions_table_every_n_steps(caplog):
    args = AsyncGRPOConfig(max_steps=40, log_completions=True, num_completions_to_print=2, print_completions_steps=20)
    tracker = TableRecorder()
    step_log = StepLog(args, tracker, True, [], frozenset())
    with caplog.at_level(logging.INFO, logger="grpo_core.training.trainer"):
        for step in range(1, 41):
            step_log.record(step, {"reward": 1.0, "loss": 0.1})
            step_log.completions(step, batch(step))
    lines = [line for record in caplog.records for line in record.getMessage().splitlines()]
    assert len([r for r in caplog.records if r.getMessage().startswith("step ")]) == 40
    tables = [r.getMessage() for r in caplog.records if r.getMessage().startswith("completions of step")]
    assert [t.splitlines()[0] for t in tables] == ["completions of step 20 (2 of 4):", "completions of step 40 (2 of 4):"]
    assert len(lines) == 40 + 2 * 4  # step lines, and twice a title, a header and two rows
    # Every logged step's completions still go to the tracker, whole.
    assert [step for _, _, step in tracker.tables] == list(range(1, 41))
    assert all(len(columns["completion"]) == 4 for _, columns, _ in tracker.tables)


def test_the_step_line_says_how_far_and_how_long_is_left():
    line = progress_line(5, 120, {"reward": 1.3121, "loss": -0.058, "rollout/generated_tok_s": 1060.2,
                                  "perf/rollout_wait_s": 0.02}, eta_s((0.0, 1), (10.0, 5), 120))
    assert line == "step 5/120  reward 1.312  loss -0.0580  gen 1,060 tok/s  wait 0.02s  eta 4m48s"
    assert eta_s((0.0, 1), (0.0, 1), 120) is None and eta_s((0.0, 1), (9.0, 4), 0) is None
    assert progress_line(3, 0, {}, None) == "step 3  reward -  loss -  gen - tok/s  wait -  eta ?"


def test_a_few_rows_show_several_prompts():
    assert spread_rows(["a", "a", "b", "b", "c"], 2) == [0, 2]
    assert spread_rows(["a", "a", "b"], 3) == [0, 2, 1] and spread_rows(["a"], 3) == [0]

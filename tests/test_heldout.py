"""Held-out accuracy with its uncertainty (intervals over problems), the demo's seeded held-out prompts, the run's
picture and the waits that announce themselves.

    .venv/bin/python -m pytest -q tests/test_heldout.py
"""

from __future__ import annotations

import io
import math
import random
import time

import numpy as np
import pytest

from flows.heldout import heldout_line, heldout_scores, heldout_summary, prompts_digest
from grpo_core.evaluation.heldout import EvalResult, _per_prompt, problem_keys
from grpo_core.evaluation.intervals import cluster_means, interval, paired_gain, t_quantile
from grpo_core.waiting import announced_wait, heartbeat_line, wait_notice


# ---- intervals --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("df,exact", [(3, 3.182446), (4, 2.776445), (9, 2.262157), (19, 2.093024), (99, 1.984217)])
def test_t_quantile_matches_the_tables(df: int, exact: float) -> None:
    assert t_quantile(0.975, df) == pytest.approx(exact, abs=0.004)


def test_interval_is_the_student_t_interval_of_the_values() -> None:
    values = [0.1, 0.3, 0.2, 0.6, 0.3]
    ci = interval(values)
    mean, sd = np.mean(values), np.std(values, ddof=1)
    half = 2.776445 * sd / math.sqrt(5)
    assert ci.mean == pytest.approx(mean) and ci.n == 5
    assert ci.low == pytest.approx(mean - half, abs=1e-3) and ci.high == pytest.approx(mean + half, abs=1e-3)
    assert math.isnan(interval([0.4]).low) and interval([0.4]).mean == 0.4 and interval([]).n == 0
    assert interval([0.2, math.nan, 0.4]).n == 2  # an unjudged problem is left out


def test_cluster_means_average_each_problem_over_its_prompts() -> None:
    means = cluster_means([1.0, 0.0, 0.5, math.nan, 1.0], ["a", "a", "b", "c", "b"])
    assert means["a"] == 0.5 and means["b"] == 0.75 and math.isnan(means["c"])
    with pytest.raises(ValueError, match="3 scores but 2"):
        cluster_means([1.0, 0.0, 1.0], ["a", "b"])


def test_paired_gain_is_over_the_same_problems() -> None:
    before = {"a": 0.2, "b": 0.4, "c": 0.3}
    after = {"a": 0.5, "b": 0.6, "c": 0.4}
    gain = paired_gain(before, after)
    assert gain.mean == pytest.approx(0.2) and gain.n == 3 and gain.excludes_zero() is (gain.low > 0)
    # Paired: how hard each problem is cancels, so a uniform gain has no spread at all.
    shifted = paired_gain(before, {k: v + 0.1 for k, v in before.items()})
    assert shifted.low == pytest.approx(0.1) and shifted.high == pytest.approx(0.1)
    with pytest.raises(ValueError, match="different problems"):
        paired_gain(before, {"a": 0.5, "b": 0.6})


def test_prompts_of_one_problem_are_not_counted_as_independent_draws() -> None:
    # 20 problems x 5 phrasings: whether the answer is right depends on the problem, not on how it is asked.
    rng = random.Random(0)
    problems = [f"p{i}" for i in range(20) for _ in range(5)]
    gains = {f"p{i}": rng.choice([-0.3, 0.0, 0.1, 0.4]) for i in range(20)}
    before = [0.3] * 100
    after = [0.3 + gains[p] + rng.uniform(-0.02, 0.02) for p in problems]
    per_prompt = interval(a - b for a, b in zip(after, before, strict=True))
    per_problem = paired_gain(cluster_means(before, problems), cluster_means(after, problems))
    assert per_problem.mean == pytest.approx(per_prompt.mean)
    assert per_problem.n == 20 and per_prompt.n == 100
    # The per-problem interval is about sqrt(5) times as wide: five copies of one draw are one draw.
    assert (per_problem.high - per_problem.low) > 2 * (per_prompt.high - per_prompt.low)


# ---- the flow's summary -------------------------------------------------------------------------------------------

def _scores(accuracy: float, problems: dict[str, float]) -> dict:
    return {"accuracy": accuracy, "num_prompts": 5 * len(problems), "num_samples": 40 * len(problems), "problems": problems}


def test_heldout_summary_reports_both_evaluations_and_the_paired_gain() -> None:
    before = _scores(0.3, {"a": 0.2, "b": 0.4, "c": 0.3})
    after = _scores(0.5, {"a": 0.5, "b": 0.6, "c": 0.4})
    summary = heldout_summary(before, after)
    assert summary["eval_accuracy_before"] == 0.3 and summary["eval_accuracy_after"] == 0.5
    low, high = summary["eval_accuracy_after_ci95"]
    assert low < 0.5 < high
    assert summary["eval_gain"] == pytest.approx(0.2)
    gain = paired_gain(before["problems"], after["problems"])
    assert summary["eval_gain_ci95"] == [gain.low, gain.high]
    assert (summary["eval_problems"], summary["eval_prompts"], summary["eval_samples"]) == (3, 15, 120)
    line = heldout_line(summary)
    assert "0.300 [" in line and "-> 0.500 [" in line and "gain +0.200, 95% CI [" in line and "3 problems" in line


def test_heldout_summary_without_an_evaluation_has_no_gain() -> None:
    summary = heldout_summary(None, None)
    assert summary["eval_accuracy_before"] is None and summary["eval_gain"] is None
    assert heldout_line(summary).startswith("held-out accuracy n/a -> n/a")
    one = heldout_summary(_scores(0.3, {"a": 0.3, "b": 0.3}), None)
    assert one["eval_accuracy_before"] == 0.3 and one["eval_gain"] is None


def test_heldout_scores_group_prompts_by_problem() -> None:
    result = EvalResult(accuracy=0.5, num_prompts=3, num_samples=6, mean_length=4.0, prompt_scores=[1.0, 0.0, 0.5])
    scores = heldout_scores(result, ["1 + 2", "1 + 2", "3 + 4"])
    assert scores["problems"] == {"1 + 2": 0.5, "3 + 4": 0.5} and scores["accuracy"] == 0.5


def test_per_prompt_scores_follow_the_completion_layout() -> None:
    values = np.array([1.0, 0.0, np.nan, 1.0, 1.0, np.nan, np.nan])
    scores = _per_prompt(values, [2, 3, 2])
    assert scores[:2] == [0.5, 1.0] and math.isnan(scores[2])


def test_problem_keys_use_the_problem_column_or_each_row_alone() -> None:
    assert problem_keys([{"prompt": "x", "problem": "1 + 2"}, {"prompt": "y", "problem": "1 + 2"}]) == ["1 + 2", "1 + 2"]
    assert problem_keys([{"prompt": "x"}, {"prompt": "y"}]) == [0, 1]


# ---- the demo's data: seeded, and held-out problems disjoint from the training ones ------------------------------

def test_one_seed_gives_the_same_held_out_prompts_and_they_are_never_trained_on() -> None:
    from grpo_core.launch.job import resolve_dataset

    first, again, other = (resolve_dataset("tiny:arithmetic", seed) for seed in (3, 3, 4))
    assert prompts_digest(first["eval"]["prompt"]) == prompts_digest(again["eval"]["prompt"])
    assert first["eval"]["prompt"] == again["eval"]["prompt"] and first["train"]["prompt"] == again["train"]["prompt"]
    assert first["train"]["prompt"] != other["train"]["prompt"]  # the seed orders the rows
    held, trained = set(first["eval"]["problem"]), set(first["train"]["problem"])
    assert len(held) == 20 and not held & trained
    for row in first["eval"]:
        assert row["problem"] in row["prompt"][-1]["content"]
        a, _, b = row["problem"].split()
        assert row["solution"] == str(int(a) + int(b))
    # The held-out problems are the tiny model's, whatever the seed: it was warmed up on the others only.
    assert set(other["eval"]["problem"]) == held


# ---- announced waits ----------------------------------------------------------------------------------------------

def test_a_wait_says_what_it_waits_for_how_long_and_what_to_do() -> None:
    assert wait_notice("the server at http://x", 240, "check the URL") == \
        "waiting for the server at http://x (at most 240 s); check the URL"
    assert "at most 10 min 00 s" in wait_notice("x", 600, "h")
    assert "about 2 min" in wait_notice("x", None, "h", limit_text="about 2 min")
    assert heartbeat_line("x", 30, 240, "log: loading") == "  ... still waiting for x: 30 s of at most 240 s (log: loading)"


def test_announced_wait_prints_at_once_and_shows_it_is_alive() -> None:
    out = io.StringIO()
    with announced_wait("the thing", 5, "do this", every_s=0.05, out=out, detail=lambda: "busy"):
        time.sleep(0.3)
    lines = out.getvalue().splitlines()
    assert lines[0] == "waiting for the thing (at most 5 s); do this"
    assert len(lines) >= 3 and all("still waiting for the thing" in line and "(busy)" in line for line in lines[1:])
    done = len(lines)
    time.sleep(0.15)
    assert len(out.getvalue().splitlines()) == done  # silent once the wait is over


def test_a_wait_that_ends_before_its_delay_says_nothing() -> None:
    out = io.StringIO()
    with announced_wait("the thing", 5, "do this", delay_s=1.0, out=out):
        pass
    assert out.getvalue() == ""


# ---- the run's picture --------------------------------------------------------------------------------------------

def test_the_run_picture_is_a_png_with_or_without_held_out_results(tmp_path) -> None:
    from flows.run_picture import PICTURE_METRICS, draw_run_picture

    history = {key: [(s, 1.0 + 0.01 * s) for s in range(1, 31)] for key in PICTURE_METRICS}
    full = heldout_summary(_scores(0.3, {"a": 0.2, "b": 0.4, "c": 0.3}), _scores(0.5, {"a": 0.5, "b": 0.6, "c": 0.4}))
    for name, heldout in (("full.png", full), ("none.png", heldout_summary(None, None))):
        path = draw_run_picture(history, heldout, tmp_path / name)
        data = path.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    draw_run_picture({}, full, tmp_path / "empty.png")  # a run with no steps logged still gets its picture
    assert (tmp_path / "empty.png").stat().st_size > 0

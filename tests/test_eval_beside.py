"""Held-out evaluation beside training (``evaluation.beside``): one at a time, handed back with its version.

    .venv/bin/python -m pytest -q tests/test_eval_beside.py
"""

from __future__ import annotations

import threading

import pytest

from grpo_core.config import AsyncGRPOConfig
from grpo_core.evaluation.beside import EvaluationBeside
from grpo_core.evaluation.heldout import EvalResult, eval_metrics


def test_an_evaluation_runs_beside_and_comes_back_with_the_version_it_evaluated():
    beside = EvaluationBeside()
    release, entered = threading.Event(), threading.Event()

    def slow() -> dict[str, float]:
        entered.set()
        release.wait(10)
        return {"eval/reward": 0.5}

    assert beside.start(4, slow)  # returns at once: the caller's step goes on
    assert entered.wait(10) and beside.running == 4 and beside.finished() == []
    # A second one while the first runs is skipped, not queued (it would evaluate a later version than asked).
    assert not beside.start(6, lambda: {"eval/reward": 1.0}) and beside.skipped == 1
    release.set()
    assert beside.wait(10) == [(4, {"eval/reward": 0.5})]
    assert beside.running is None and beside.finished() == []
    assert beside.start(8, lambda: {"eval/reward": 0.25})
    assert beside.wait(10) == [(8, {"eval/reward": 0.25})]
    # One that ended before the next started, uncollected, comes back with it: none is lost.
    assert beside.start(10, lambda: {"eval/reward": 0.1})
    beside.wait(10)  # collected here ...
    assert beside.start(12, lambda: {"eval/reward": 0.2})
    done = threading.Event()
    beside._pool.submit(done.set)  # runs after version 12's evaluation on the one thread
    assert done.wait(10)
    assert beside.start(14, lambda: {"eval/reward": 0.3})  # 12 ended, not collected yet
    assert beside.wait(10) == [(12, {"eval/reward": 0.2}), (14, {"eval/reward": 0.3})]
    beside.close()


def test_an_evaluation_that_fails_raises_where_its_result_is_collected():
    beside = EvaluationBeside()

    def broken() -> dict[str, float]:
        raise RuntimeError("reward function 'x' raised")

    beside.start(2, broken)
    with pytest.raises(RuntimeError, match="reward function 'x' raised"):
        beside.wait(10)
    beside.close()


def test_the_version_share_is_of_completions_sampled_under_the_version_asked_for():
    result = EvalResult(accuracy=0.5, num_prompts=2, num_samples=4, mean_length=3.0, versions=[4, 4, 5, 4])
    assert eval_metrics(result, 1.0, version=4)["eval/version_share"] == 0.75
    assert eval_metrics(result, 1.0, version=6)["eval/version_share"] == 0.0


def test_evaluation_beside_training_is_off_by_default_and_typed():
    assert AsyncGRPOConfig().eval_beside_training is False
    with pytest.raises(Exception, match="eval_beside_training"):
        AsyncGRPOConfig(eval_beside_training="sometimes")
    # Set where it would do nothing: refused, naming the field and the fix.
    with pytest.raises(ValueError, match=r"eval_beside_training=True is invalid: .*set eval_strategy='steps'"):
        AsyncGRPOConfig(eval_beside_training=True)
    assert AsyncGRPOConfig(eval_beside_training=True, eval_strategy="steps").eval_beside_training

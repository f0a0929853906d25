"""Held-out evaluation scores through the rollout loop's own path, against the real CPU vLLM server (the session's).

* an ``async`` reward function, a sync one that returns ``None`` for every completion, and reward weights: each
  function's mean and the weighted sum are those of the completions the server sampled;
* an environment (``environment_factory``): its ``reset`` sees the row's columns and its ``get_reward`` scores
  each rollout, reported as ``rollout_reward``;
* a verifiers taskset (``vf-tiny-sums``, tests/environments/vf_tiny_sums, installed by scripts/test.sh): its async
  rubric functions score the held-out split under their own names;
* ``grpo train`` with an async reward and with the verifiers taskset, the demo's default held-out evaluation
  before and after training on: it reports both accuracies instead of failing before the first step.
"""

from __future__ import annotations

import asyncio
import json
import math
import threading

import numpy as np
import pytest
import yaml
from transformers import AutoTokenizer

from grpo_core.evaluation.heldout import EvalRollouts, evaluate_rewards
from grpo_core.rewards import accuracy_reward
from grpo_core.tiny import arithmetic_dataset
from tests.integration.grpo_cli import grpo_train

pytestmark = pytest.mark.integration

_SEEN: list[tuple[str, str]] = []  # (completion text, solution) of every completion the recording reward saw
_SEEN_LOCK = threading.Lock()  # sync rewards run on the loop's thread pool


async def async_accuracy(completions: list, solution: list, **kwargs) -> list[float | None]:
    """The built-in accuracy, as a coroutine function (as a verifiers rubric function is one)."""
    await asyncio.sleep(0)
    return accuracy_reward(completions=completions, solution=solution, **kwargs)


def records_and_abstains(completions: list, solution: list, **_) -> list[None]:
    """Scores nothing (``None``), so its weight must add nothing; keeps what it was shown."""
    with _SEEN_LOCK:
        _SEEN.extend((_text(c), s) for c, s in zip(completions, solution, strict=True))
    return [None] * len(completions)


def _text(completion) -> str:
    return completion if isinstance(completion, str) else completion[-1]["content"]


class DigitCounter:
    """An environment that scores a rollout by the share of its answer's characters that are digits, and checks that
    its ``reset`` saw the row's columns."""

    def reset(self, solution: str, **_) -> None:
        self.solution = solution

    def get_reward(self, completion: list[dict]) -> float:
        assert self.solution.isdigit()
        text = completion[-1]["content"] or ""
        return sum(ch.isdigit() for ch in text) / max(len(text), 1)


def _rows(n: int):
    return arithmetic_dataset(num_train=1, num_eval=n, seed=5)["eval"]


def test_an_async_reward_a_none_reward_and_weights_score_as_in_training(vllm_server, tiny_model_path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    _SEEN.clear()
    result = evaluate_rewards(vllm_server.base_url, tokenizer, _rows(8), [async_accuracy, records_and_abstains],
                              weights=[2.0, 0.5], samples_per_prompt=3, temperature=1.0, max_tokens=16)
    assert result.num_prompts == 8 and result.num_samples == 24 and len(_SEEN) == 24
    # The accuracy the async reward gave is the accuracy of the completions the server sampled, recomputed here.
    expected = np.array(accuracy_reward(prompts=[None] * len(_SEEN), completions=[[{"role": "assistant", "content": t}] for t, _ in _SEEN],
                                        solution=[s for _, s in _SEEN]), dtype=float)
    assert result.per_func["async_accuracy"] == pytest.approx(float(np.mean(expected)))
    assert result.accuracy == result.per_func["async_accuracy"]
    assert math.isnan(result.per_func["records_and_abstains"])  # nothing scored
    assert result.reward == pytest.approx(2.0 * float(np.mean(expected)))  # the None function's weight adds nothing
    assert len(result.prompt_scores) == 8 and 0.0 <= min(result.prompt_scores)
    assert 0 < result.mean_length <= 16


def test_an_environment_scores_held_out_rollouts_with_its_get_reward(vllm_server, tiny_model_path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    result = evaluate_rewards(vllm_server.base_url, tokenizer, _rows(6), [], samples_per_prompt=2, max_tokens=16,
                              rollouts=EvalRollouts(reward_funcs=[], environment_factory=DigitCounter))
    assert set(result.per_func) == {"rollout_reward"} and result.num_samples == 12
    # The tiny model answers sums with digits: a share of its characters are digits, not none and not all.
    assert 0.0 < result.accuracy < 1.0 and result.reward == pytest.approx(result.accuracy)


def test_a_verifiers_taskset_scores_its_held_out_split_with_its_rubric(vllm_server, tiny_model_path) -> None:
    pytest.importorskip("vf_tiny_sums")
    from grpo_core.environments import load_environment

    inputs = load_environment("verifiers:vf-tiny-sums", {"num_tasks": 40})
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    result = evaluate_rewards(vllm_server.base_url, tokenizer, inputs.eval_dataset, inputs.reward_funcs,
                              weights=inputs.reward_weights, samples_per_prompt=2, max_tokens=24)
    assert list(result.per_func) == ["brief", "correct"] and result.num_prompts == 4
    for name, value in result.per_func.items():
        assert 0.0 <= value <= 1.0, (name, value)
    # The weighted sum is the rubric's weights over the same scores (every rollout is scored by both functions).
    assert result.reward == pytest.approx(0.5 * result.per_func["brief"] + 1.0 * result.per_func["correct"])


def _job(tmp_path, name: str, values: dict) -> tuple:
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(values))
    return path, tmp_path / name


SHORT_TRAINER = {"max_steps": 2, "num_generations": 4, "per_device_train_batch_size": 16, "max_completion_length": 16,
                 "num_generations_eval": 2, "save_strategy": "no"}


@pytest.mark.parametrize("kind", ["async_reward", "verifiers"])
def test_grpo_train_evaluates_before_and_after_with_the_default_settings(kind, vllm_server, prefect, tmp_path) -> None:
    if kind == "verifiers":
        pytest.importorskip("vf_tiny_sums")
        job = {"model": "tiny:arithmetic", "trainer": {**SHORT_TRAINER, "environment": "verifiers:vf-tiny-sums",
                                                       "environment_args": {"num_tasks": 80}}}
    else:
        job = {"model": "tiny:arithmetic", "trainer": SHORT_TRAINER,
               "reward_funcs": ["tests.integration.test_heldout_scoring:async_accuracy"]}
    _, env, _ = prefect
    path, out = _job(tmp_path, kind, job)
    grpo_train(path, out, vllm_server.base_url, env, f"sqlite:///{tmp_path / 'mlflow.db'}")
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 2
    for when in ("before", "after"):
        accuracy = summary[f"eval_accuracy_{when}"]
        assert accuracy is not None and 0.0 <= accuracy <= 1.0, summary


def test_evaluation_beside_training_logs_each_version_at_its_step(vllm_server, tiny_model_path, tmp_path) -> None:
    from grpo_core.config import AsyncGRPOConfig
    from grpo_core.training.trainer import AsyncGRPOTrainer

    data = arithmetic_dataset(num_train=400, num_eval=16, seed=1)
    args = AsyncGRPOConfig(
        output_dir=str(tmp_path / "run"), vllm_server_base_url=vllm_server.base_url, report_to="none", max_steps=4,
        learning_rate=1e-4, num_generations=4, per_device_train_batch_size=16, max_completion_length=16,
        save_strategy="no", eval_strategy="steps", eval_steps=2, eval_beside_training=True, num_generations_eval=4)
    history = AsyncGRPOTrainer(tiny_model_path, reward_funcs=[async_accuracy], train_dataset=data["train"],
                               eval_dataset=data["eval"], args=args).train()
    trained = [h for h in history if "loss" in h]
    evaluated = [h for h in history if "eval/reward" in h]
    skipped = [h["step"] for h in trained if h.get("eval/skipped")]
    assert [h["step"] for h in trained] == [1.0, 2.0, 3.0, 4.0]
    # Each due evaluation ran beside its step (none of the step's own entries holds it) or was skipped while the one
    # before it still ran; each that ran came back as an entry of its own, at the step whose weights it evaluated.
    assert sorted([h["step"] for h in evaluated] + skipped) == [2.0, 4.0] and evaluated
    for entry in evaluated:
        at = next(i for i, h in enumerate(history) if h is entry)
        step_at = next(i for i, h in enumerate(history) if "loss" in h and h["step"] == entry["step"])
        assert at > step_at  # logged after its step went on
        assert 0.0 <= entry["eval/rewards/async_accuracy"] <= 1.0 and 0.0 <= entry["eval/version_share"] <= 1.0

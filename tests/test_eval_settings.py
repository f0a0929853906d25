"""One set of held-out evaluation settings: AsyncGRPOConfig's (TRL's names); the job flow derives from them.

    .venv/bin/python -m pytest -q tests/test_eval_settings.py
"""

from __future__ import annotations

import pytest

from grpo_core.config import AsyncGRPOConfig
from grpo_core.evaluation.heldout import EvalResult
from grpo_core.launch.job import JobConfig
from grpo_core.rewards import accuracy_reward, format_reward
from grpo_core.rollout.stages import AsyncRolloutLoop


@pytest.mark.parametrize("key,value,field", [
    ("eval_prompts", 0, "trainer.do_eval"),
    ("eval_samples_per_prompt", 4, "trainer.num_generations_eval"),
    ("eval_reward", "grpo_core.rewards:accuracy_reward", "reward_funcs"),
])
def test_the_old_job_keys_are_refused_naming_the_field_that_replaced_them(key: str, value: object, field: str) -> None:
    with pytest.raises(ValueError, match=rf"JobConfig\.{key} is gone: set {field}"):
        JobConfig.model_validate({key: value})


def test_evaluation_runs_when_the_trainer_says_so() -> None:
    assert not AsyncGRPOConfig().runs_evaluation()  # transformers' and TRL's default: no evaluation
    assert AsyncGRPOConfig(do_eval=True).runs_evaluation()
    assert AsyncGRPOConfig(eval_strategy="steps").runs_evaluation()
    assert JobConfig().trainer.runs_evaluation()  # the demo job reports held-out accuracy before and after
    assert not JobConfig(trainer={"do_eval": False}).trainer.runs_evaluation()


@pytest.fixture
def flow_evaluation(monkeypatch):
    """The flow's evaluate task with the server call recorded (no server, no tokenizer download)."""
    import transformers

    from flows import train_flow

    calls: list[dict] = []

    def record(base_url, tokenizer, dataset, reward_funcs, **kwargs):
        calls.append({"dataset": dataset, "reward_funcs": reward_funcs, **kwargs})
        return EvalResult(accuracy=0.25, num_prompts=len(dataset), num_samples=2 * len(dataset), mean_length=3.0,
                          prompt_scores=[0.0, 0.5, 0.5])

    eval_rows = [{"prompt": "e1", "problem": "1 + 2"}, {"prompt": "e2", "problem": "1 + 2"}, {"prompt": "e3", "problem": "4 + 5"}]
    monkeypatch.setattr(train_flow, "evaluate_rewards", record)  # the name the flow's task calls
    monkeypatch.setattr(train_flow, "resolve_dataset", lambda spec, seed: {"train": ["t"], "eval": eval_rows})
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", staticmethod(lambda path: "tokenizer"))
    return train_flow.evaluate.fn, calls


def test_the_flow_evaluates_with_the_trainers_settings(flow_evaluation) -> None:
    evaluate, calls = flow_evaluation
    job = JobConfig(trainer={"num_generations_eval": 3, "reward_weights": [1.0, 0.5], "temperature": 0.7,
                             "max_completion_length": 20})
    scores = evaluate(job, "model", "http://server", "before")
    # The overall accuracy, and the mean per problem (two phrasings of 1 + 2 count as one problem).
    assert scores["accuracy"] == 0.25 and scores["problems"] == {"1 + 2": 0.25, "4 + 5": 0.5}
    assert scores["num_prompts"] == 3 and scores["num_samples"] == 6
    (call,) = calls
    assert [r["prompt"] for r in call["dataset"]] == ["e1", "e2", "e3"] and call["reward_funcs"] == [accuracy_reward, format_reward]
    assert call["samples_per_prompt"] == 3 and call["weights"] == [1.0, 0.5]
    assert call["temperature"] == 0.7 and call["max_tokens"] == 20
    # Rolled out and scored by the training process's loop: the run's config, loop class, tools and environment.
    assert call["config"] is job.trainer and call["rollouts"].reward_funcs == [accuracy_reward, format_reward]
    assert call["rollouts"].loop_cls is AsyncRolloutLoop and call["rollouts"].tools == []
    assert call["rollouts"].environment_factory is None
    assert evaluate(JobConfig(trainer={"do_eval": False}), "model", "http://server", "after") is None
    assert len(calls) == 1

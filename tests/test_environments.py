"""Environments users already have (grpo_core.environments): reasoning-gym generators and a verifiers taskset as a
run's data and rewards, the config field that names them and the job file that carries it. No server here; the
training runs are in integration/test_environments.py.

The verifiers taskset is ``vf-tiny-sums`` (tests/environments/vf_tiny_sums), which scripts/test.sh installs with the
environments set; on the base set (``GRPO_CORE_EXTRAS=``) these tests are skipped.
"""

from __future__ import annotations

import asyncio
import json
import pickle

import pytest

from grpo_core.config import AsyncGRPOConfig, ConfigError
from grpo_core.environments import environment_inputs, load_environment, parse_environment

TINY_GYM_ARGS = dict(size=16, eval_size=4, min_terms=2, max_terms=2, min_digits=1, max_digits=1, operators=["+"],
                     allow_parentheses=False, allow_negation=False, answer_format="boxed")


def reply(text: str) -> list[dict[str, str]]:
    return [{"role": "assistant", "content": text}]


# ---- the config field ---------------------------------------------------------------------------------------------
def test_environment_field_names_the_forms_it_takes() -> None:
    with pytest.raises(ConfigError, match=r"environment='gym:x'.*'verifiers:<taskset id>'.*'reasoning_gym:"):
        AsyncGRPOConfig(environment="gym:x")
    with pytest.raises(ConfigError, match=r"environment_args=.*set environment too"):
        AsyncGRPOConfig(environment_args={"size": 3})
    with pytest.raises(ValueError, match="reasoning_gym:<generator name>"):
        parse_environment("reasoning_gym:")
    assert parse_environment("verifiers:vf-tiny-sums") == ("verifiers", "vf-tiny-sums")


def test_an_environment_refuses_reward_functions_or_data_passed_beside_it() -> None:
    args = AsyncGRPOConfig(environment="reasoning_gym:basic_arithmetic", environment_args=TINY_GYM_ARGS)
    with pytest.raises(ValueError, match="gives the data set and the reward functions; pass neither"):
        environment_inputs(args, [len], None, None)
    with pytest.raises(ValueError, match="reward_weights has 2 entries but the environment"):
        environment_inputs(args.replace(reward_weights=[1.0, 2.0]), [], None, None)


# ---- reasoning-gym -------------------------------------------------------------------------------------------------
def test_reasoning_gym_generator_by_name_scored_by_its_own_rule() -> None:
    pytest.importorskip("reasoning_gym")
    from grpo_core.environments.reasoning_gym_tasks import stated_answer

    inputs = load_environment("reasoning_gym:basic_arithmetic", dict(TINY_GYM_ARGS), seed=3)
    assert len(inputs.train_dataset) == 16 and len(inputs.eval_dataset) == 4 and inputs.reward_weights == [1.0]
    row = inputs.train_dataset[0]
    assert row["prompt"][0]["role"] == "system" and row["prompt"][1]["content"].startswith("Calculate ")
    entry = json.loads(row["rg_entry"])
    assert entry["answer"] == row["solution"] == str(eval(entry["metadata"]["expression"]))  # noqa: S307 - a sum of digits
    reward = pickle.loads(pickle.dumps(inputs.reward_funcs[0]))  # crosses to the rollout process
    assert reward.__name__ == "reasoning_gym_basic_arithmetic"
    scores = reward(completions=[reply(f"so \\boxed{{{row['solution']}}}"), reply("\\boxed{-1}"), reply(row["solution"])],
                    rg_entry=[row["rg_entry"]] * 3)
    assert scores == [1.0, 0.0, 0.0]  # the third states no boxed answer
    # the same seed gives the same prompts; the held-out ones come from another seed
    again = load_environment("reasoning_gym:basic_arithmetic", dict(TINY_GYM_ARGS), seed=3)
    assert again.train_dataset["prompt"] == inputs.train_dataset["prompt"]
    assert stated_answer("<answer> 7 </answer> then <answer>8</answer>", "answer_tag") == "8"
    assert stated_answer("\\boxed{\\frac{1}{2}}", "boxed") == "\\frac{1}{2}"
    assert stated_answer("work\n\n 42 \n", "last_line") == "42"
    with pytest.raises(ValueError, match="answer_format='xml'"):
        stated_answer("", "xml")


def test_an_unknown_generator_is_named_with_the_closest_ones() -> None:
    pytest.importorskip("reasoning_gym")
    with pytest.raises(ValueError, match=r"reasoning_gym:basic_arithmetik': no such generator; did you mean basic_arithmetic"):
        load_environment("reasoning_gym:basic_arithmetik", {})


# ---- verifiers ----------------------------------------------------------------------------------------------------
def test_verifiers_taskset_gives_prompts_and_one_reward_function_per_rubric_function() -> None:
    pytest.importorskip("vf_tiny_sums")
    inputs = load_environment("verifiers:vf-tiny-sums", {"num_tasks": 20, "eval_fraction": 0.25})
    assert len(inputs.train_dataset) == 15 and len(inputs.eval_dataset) == 5
    # verifiers runs a rubric in descending priority, then by name; the weights are the rubric's own
    assert [f.__name__ for f in inputs.reward_funcs] == ["brief", "correct"] and inputs.reward_weights == [0.5, 1.0]
    row = inputs.train_dataset[0]
    assert [m["role"] for m in row["prompt"]] == ["system", "user"] and row["prompt"][1]["content"].startswith("What is ")
    answer = json.loads(row["vf_task"])["answer"]
    completions = [reply(f"The answer is \\boxed{{{answer}}}"), reply(f"\\boxed{{{answer + 1}}}"), reply(str(answer))]
    brief, correct = (pickle.loads(pickle.dumps(f)) for f in inputs.reward_funcs)

    async def score() -> tuple[list[float | None], list[float | None]]:
        kwargs = dict(prompts=[row["prompt"]] * 3, completions=completions, vf_task=[row["vf_task"]] * 3)
        return await brief(**kwargs), await correct(**kwargs)

    assert asyncio.run(score()) == ([0.0, 1.0, 0.0], [1.0, 0.0, 0.0])


def test_verifiers_taskset_arguments_are_checked_by_its_config() -> None:
    pytest.importorskip("vf_tiny_sums")
    with pytest.raises(ValueError, match=r"(?s)environment_args for .verifiers:vf-tiny-sums.*num_taks"):
        load_environment("verifiers:vf-tiny-sums", {"num_taks": 3})
    with pytest.raises(ValueError, match=r"environment='verifiers:no-such-taskset'"):
        load_environment("verifiers:no-such-taskset", {})


# ---- the job file -------------------------------------------------------------------------------------------------
def test_a_job_names_the_environment_in_its_trainer_and_nothing_else() -> None:
    pytest.importorskip("reasoning_gym")
    from grpo_core.launch.job import JobConfig, resolve_job_inputs

    trainer = {"environment": "reasoning_gym:basic_arithmetic", "environment_args": TINY_GYM_ARGS}
    job = JobConfig.model_validate({"trainer": trainer})
    data, funcs, weights = resolve_job_inputs(job)
    assert len(data["train"]) == 16 and len(data["eval"]) == 4 and weights == [1.0]
    assert [f.__name__ for f in funcs] == ["reasoning_gym_basic_arithmetic"]
    with pytest.raises(ValueError, match=r"JobConfig.reward_funcs is set, but trainer.environment="):
        JobConfig.model_validate({"trainer": trainer, "reward_funcs": ["grpo_core.rewards:accuracy_reward"]})

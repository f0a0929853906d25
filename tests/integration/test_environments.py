"""Existing environments train the tiny model against the real CPU vLLM server (the session's).

* A verifiers taskset package (``vf-tiny-sums``, tests/environments/vf_tiny_sums, installed by scripts/test.sh)
  named by ``AsyncGRPOConfig.environment``: the reward rises over a short run and each rubric function is a metric
  of the MLflow run.
* A reasoning-gym generator from a job file through ``grpo train`` (the flow, the Prefect server); the learning run
  from Python is ``-m long`` (docs/tools_and_environments.md has its figures).
* The OpenEnv example (examples/openenv_calculator.py): its environment server runs in a local process, and the
  rollouts reach it through ``environment_factory``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from grpo_core.config import AsyncGRPOConfig
from grpo_core.training.trainer import AsyncGRPOTrainer
from tests.integration.grpo_cli import grpo_train

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]

# A short run at a learning rate the tiny model takes without collapsing (1e-3 undid its sums within 20 steps);
# the rubric's ``brief`` is a style the model already writes a third of the time, so GRPO moves it within the run.
SHORT = dict(max_steps=20, learning_rate=3e-4, num_generations=8, per_device_train_batch_size=32, max_completion_length=24,
             max_staleness=2, num_sampler_logprobs=8, token_budget=4096, seed=0, bf16=False, save_strategy="no")
MARGIN = 0.1
"""Least a fitted reward gain over the run must be (the line through the per-step means, first step to last)."""

GYM_ARGS = {"size": 400, "min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1, "operators": ["+"],
            "allow_parentheses": False, "allow_negation": False, "answer_format": "boxed",
            "system_prompt": "Solve the problem. Put the final answer in \\boxed{}."}
"""Sums of two digits, asked the way the tiny model knows (``Calculate 5 + 3.``), answered in ``\\boxed{}``."""


def fitted_gain(history: list[dict[str, float]], key: str = "reward") -> float:
    values = np.array([h[key] for h in history])
    slope, _ = np.polyfit(np.arange(len(values)), values, 1)
    return float(slope * (len(values) - 1))


def test_verifiers_taskset_trains_and_logs_its_rubric(vllm_server, mlflow_server, tiny_model_path, tmp_path) -> None:  # noqa: ANN001
    pytest.importorskip("vf_tiny_sums")
    import mlflow

    from grpo_core.tracking.tracker import MLflowTracker

    args = AsyncGRPOConfig(output_dir=str(tmp_path / "run"), vllm_server_base_url=vllm_server.base_url, report_to="mlflow",
                           environment="verifiers:vf-tiny-sums", environment_args={"num_tasks": 400}, **SHORT)
    tracker = MLflowTracker(mlflow_server, "environments", "verifiers")
    trainer = AsyncGRPOTrainer(tiny_model_path, args=args, tracker=tracker)
    assert trainer.args.reward_weights == [0.5, 1.0]  # the rubric's weights
    history = trainer.train()
    tracker.close()
    rewards = [round(h["reward"], 3) for h in history]
    gain = fitted_gain(history)
    print(json.dumps({"verifiers_gain": gain, "brief_gain": fitted_gain(history, "rewards/brief/mean"), "per_step": rewards}))
    assert len(history) == SHORT["max_steps"]
    assert gain > MARGIN, f"fitted reward gain {gain:.3f} over {len(rewards)} steps: {rewards}"
    client = mlflow.MlflowClient(mlflow_server)
    for name in ("rewards/brief/mean", "rewards/correct/mean"):
        assert len(client.get_metric_history(tracker.run_id, name)) == SHORT["max_steps"], name


def test_reasoning_gym_generator_trains_from_a_job_file(vllm_server, prefect, tmp_path) -> None:  # noqa: ANN001
    pytest.importorskip("reasoning_gym")
    import mlflow

    _, env, _ = prefect
    job = {"model": "tiny:arithmetic", "trainer": {"environment": "reasoning_gym:basic_arithmetic",
                                                   "environment_args": {**GYM_ARGS, "size": 64, "eval_size": 8},
                                                   "do_eval": False, "max_steps": 2, "num_generations": 4,
                                                   "per_device_train_batch_size": 16, "max_completion_length": 24}}
    path = tmp_path / "gym.yaml"
    path.write_text(yaml.safe_dump(job))
    out = tmp_path / "run"
    tracking_uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    grpo_train(path, out, vllm_server.base_url, env, tracking_uri)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 2
    metrics = mlflow.MlflowClient(tracking_uri).get_run(summary["mlflow_run_id"]).data.metrics
    assert "rewards/reasoning_gym_basic_arithmetic/mean" in metrics, sorted(metrics)


@pytest.mark.long
def test_reasoning_gym_generator_learns_from_python(vllm_server, tiny_model_path, tmp_path) -> None:  # noqa: ANN001
    """Correctness alone moves slower than a style: 100 steps at 4e-4 (docs/tools_and_environments.md)."""
    pytest.importorskip("reasoning_gym")
    settings = {**SHORT, "max_steps": 100, "learning_rate": 4e-4}
    args = AsyncGRPOConfig(output_dir=str(tmp_path / "run"), vllm_server_base_url=vllm_server.base_url, report_to="none",
                           environment="reasoning_gym:basic_arithmetic", environment_args=GYM_ARGS, **settings)
    history = AsyncGRPOTrainer(tiny_model_path, args=args).train()
    gain = fitted_gain(history)
    print(json.dumps({"reasoning_gym_gain": gain, "per_step": [round(h["reward"], 3) for h in history]}))
    assert gain > MARGIN


def test_openenv_example_trains_through_environment_factory(vllm_server, tmp_path) -> None:  # noqa: ANN001
    pytest.importorskip("openenv.core")
    done = subprocess.run(
        [sys.executable, "-m", "examples.openenv_calculator", "--server-url", vllm_server.base_url,
         "--output-dir", str(tmp_path / "run"), "--max-steps", "2"],
        cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=900,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    steps = [json.loads(line) for line in done.stdout.splitlines() if line.startswith('{"step"')]
    assert len(steps) == 2
    # every rollout opened an OpenEnv session and was scored by it (0 or 1: whether a call computed the answer)
    assert all("env/reward" in s for s in steps), steps

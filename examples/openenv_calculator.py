"""An OpenEnv environment trained through ``environment_factory``, served locally: no container, no download.

Three parts, as an OpenEnv environment is usually split:

* the server side: ``CalculatorEnvironment``, an ``openenv.core.env_server.Environment`` whose action is an
  expression and whose observation is its value; a step that computes the task's answer is rewarded 1.
  ``serve()`` puts it behind OpenEnv's own FastAPI app (``create_app``) with uvicorn, in a process of its own;
* the client side: ``CalculatorClient``, an ``openenv.core.EnvClient`` speaking to that server over its WebSocket;
* the trainer side: ``OpenEnvCalculator``, the ``environment_factory`` class. Each rollout gets one, with its own
  client session: ``reset`` starts an episode for the row's problem, the ``calculator`` method (the model's
  tool, the schema the tiny tools model knows) steps it, ``get_reward`` returns the best step reward.

    .venv/bin/python -m examples.openenv_calculator --server-url http://127.0.0.1:8000 --max-steps 3

starts the environment server on a free loopback port, trains the tiny tools model (``grpo_core.tiny``) against
the vLLM server at ``--server-url`` and stops the environment server. Needs the ``environments`` extra
(``GRPO_CORE_EXTRAS=environments bash scripts/setup.sh``), which installs ``openenv-core``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any

import httpx
from openenv.core import EnvClient
from openenv.core.client_types import StepResult
from openenv.core.env_server import Action, Environment, Observation, State, create_fastapi_app

from grpo_core.tiny import calculator as evaluate

SERVER_URL_VARIABLE = "OPENENV_CALCULATOR_URL"
"""Where ``OpenEnvCalculator`` finds the environment server (set by ``main`` for the rollout process)."""


# ---- server side ----------------------------------------------------------------------------------------------
class CalculatorAction(Action):
    expression: str


class CalculatorObservation(Observation):
    value: str = ""


class CalculatorEnvironment(Environment[CalculatorAction, CalculatorObservation, State]):
    """One episode per problem: every step evaluates an expression; computing the solution earns 1."""

    SUPPORTS_CONCURRENT_SESSIONS = True  # each WebSocket session gets its own instance

    def __init__(self) -> None:
        super().__init__()
        self._state = State(episode_id="", step_count=0)
        self.solution = ""

    def reset(self, seed: int | None = None, episode_id: str | None = None, solution: str = "", **_: Any) -> CalculatorObservation:
        self._state = State(episode_id=episode_id or "", step_count=0)
        self.solution = solution
        return CalculatorObservation(value="", reward=0.0)

    def step(self, action: CalculatorAction, timeout_s: float | None = None, **_: Any) -> CalculatorObservation:
        self._state.step_count += 1
        value = evaluate(action.expression)
        return CalculatorObservation(value=value, reward=float(bool(self.solution) and value == self.solution))

    @property
    def state(self) -> State:
        return self._state


def serve(port: int) -> None:
    import uvicorn

    app = create_fastapi_app(CalculatorEnvironment, CalculatorAction, CalculatorObservation, max_concurrent_envs=256)
    # "critical": the server logs a traceback each time a client closes its session, which is how every rollout ends.
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="critical")


# ---- client side ----------------------------------------------------------------------------------------------
class CalculatorClient(EnvClient[CalculatorAction, CalculatorObservation, State]):
    def _step_payload(self, action: CalculatorAction) -> dict[str, Any]:
        return {"expression": action.expression}

    def _parse_result(self, payload: dict[str, Any]) -> StepResult[CalculatorObservation]:
        observation = CalculatorObservation(**payload.get("observation", {}))
        return StepResult(observation=observation, reward=payload.get("reward"), done=bool(payload.get("done", False)))

    def _parse_state(self, payload: dict[str, Any]) -> State:
        return State(**payload)


# ---- trainer side ---------------------------------------------------------------------------------------------
class OpenEnvCalculator:
    """The environment_factory class: one OpenEnv session per rollout."""

    async def reset(self, solution: str, **_: Any) -> None:
        self.client = CalculatorClient(base_url=os.environ[SERVER_URL_VARIABLE])
        await self.client.connect()
        await self.client.reset(solution=solution)
        self.best = 0.0

    # No return hint: the schema must be the one the tiny tools model was trained on (grpo_core.tiny.CALCULATOR_SCHEMA).
    async def calculator(self, expression: str):  # noqa: ANN201
        """Evaluate an integer arithmetic expression.

        Args:
            expression: such as 7 + 5
        """
        result = await self.client.step(CalculatorAction(expression=expression))
        self.best = max(self.best, float(result.reward or 0.0))
        return result.observation.value

    def get_reward(self, completion: list[dict[str, Any]]) -> float:
        return self.best

    async def close(self) -> None:
        client = getattr(self, "client", None)
        if client is not None:
            await client.close()


def start_environment_server(timeout_s: float = 60.0) -> tuple[subprocess.Popen[bytes], str]:
    """The environment server in a process of its own on a free loopback port; returns it and its URL."""
    from grpo_core.vllm_server.process import free_port

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "examples.openenv_calculator", "--serve", str(port)],
                            start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the OpenEnv server exited with code {proc.returncode} before answering")
        try:
            if httpx.get(f"{url}/health", timeout=2.0).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.terminate()
    raise RuntimeError(f"the OpenEnv server did not answer {url}/health within {timeout_s:.0f} s")


def train(server_url: str, output_dir: str, max_steps: int) -> list[dict[str, float]]:
    from grpo_core.config import AsyncGRPOConfig
    from grpo_core.rewards import accuracy_reward
    from grpo_core.tiny import arithmetic_dataset, build_tiny_model
    from grpo_core.training.trainer import AsyncGRPOTrainer

    args = AsyncGRPOConfig(output_dir=output_dir, vllm_server_base_url=server_url, report_to="none", save_strategy="no",
                           max_steps=max_steps, learning_rate=1e-5, num_generations=8, per_device_train_batch_size=32,
                           max_completion_length=64)
    trainer = AsyncGRPOTrainer(str(build_tiny_model(variant="tools")), accuracy_reward, args=args,
                               train_dataset=arithmetic_dataset(num_train=256, num_eval=1)["train"],
                               environment_factory=OpenEnvCalculator)
    return trainer.train()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--server-url", help="the vLLM server to sample from")
    parser.add_argument("--output-dir", default="outputs/openenv_calculator")
    parser.add_argument("--max-steps", type=int, default=3)
    parser.add_argument("--serve", type=int, metavar="PORT", help=argparse.SUPPRESS)  # the environment server's process
    args = parser.parse_args(argv)
    if args.serve:
        serve(args.serve)
        return 0
    if not args.server_url:
        parser.error("--server-url is required")
    proc, url = start_environment_server()
    os.environ[SERVER_URL_VARIABLE] = url  # the rollout process inherits it
    try:
        history = train(args.server_url, args.output_dir, args.max_steps)
    finally:
        proc.terminate()
        proc.wait(timeout=20)
    for step, h in enumerate(history, start=1):
        shown = {k: round(v, 3) for k, v in h.items() if k in ("reward", "env/reward", "env/scored_frac", "tools/calculator/calls")}
        print(json.dumps({"step": step, **shown}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

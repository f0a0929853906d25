"""An environment for the tool-using tiny model: the calculator as a tool, a bonus for using it.

Used by ``examples/environment.yaml`` as ``environment_factory: examples.environments:CalculatorEnv``;
the trainer builds one per rollout.
"""

from __future__ import annotations

from typing import Any

from grpo_core.tiny import calculator


class CalculatorEnv:
    """One rollout's calculator: remembers whether the model used it."""

    def reset(self, solution: str, **columns: Any) -> None:
        self.solution, self.used = solution, False

    # No return hint: the schema a rollout renders from this docstring and these hints must be the one the
    # tiny tools model was trained on (grpo_core.tiny.CALCULATOR_SCHEMA), or it writes malformed calls.
    def calculator(self, expression: str):  # noqa: ANN201
        """Evaluate an integer arithmetic expression.

        Args:
            expression: such as 7 + 5
        """
        self.used = True
        return calculator(expression)

    def get_reward(self, completion: list[dict[str, Any]]) -> float:
        return 0.5 if self.used else 0.0

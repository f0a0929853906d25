"""Environments users already have, as a run's data and rewards: one config field names one.

``AsyncGRPOConfig.environment`` is ``"<ecosystem>:<name>"`` and ``environment_args`` its keyword arguments:

    verifiers:<taskset id>       an installed verifiers taskset package (``verifiers_tasksets``): its tasks become
                                 the prompts, its rubric's ``@vf.reward`` functions the reward functions (one
                                 each, logged under their own names), their weights the run's ``reward_weights``
    reasoning_gym:<generator>    a reasoning-gym generator by its registered name (``reasoning_gym_tasks``): its
                                 questions become the prompts, its own ``score_answer`` the reward

OpenEnv environments plug in through ``environment_factory`` instead (they are tools and a reward per rollout);
``examples/openenv_calculator.py`` shows one. The ecosystems are optional: ``pip install grpo-core[environments]``,
or ``GRPO_CORE_EXTRAS=environments bash scripts/setup.sh`` for the tested set.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from grpo_core.environments.inputs import EnvironmentInputs

ECOSYSTEMS = ("verifiers", "reasoning_gym")
"""What ``AsyncGRPOConfig.environment`` may name before its ``:``."""


def parse_environment(spec: str) -> tuple[str, str]:
    """``"ecosystem:name"`` → (ecosystem, name); a ValueError names the field and the forms it takes."""
    ecosystem, sep, name = spec.partition(":")
    if not sep or ecosystem not in ECOSYSTEMS or not name.strip():
        raise ValueError(f"AsyncGRPOConfig.environment={spec!r}: write 'verifiers:<taskset id>' (an installed "
                         "verifiers taskset package) or 'reasoning_gym:<generator name>'")
    return ecosystem, name.strip()


def load_environment(spec: str, args: dict[str, Any] | None = None, seed: int = 0) -> EnvironmentInputs:
    """The data and rewards of the environment ``spec`` names, built with ``args``."""
    ecosystem, name = parse_environment(spec)
    if ecosystem == "verifiers":
        from grpo_core.environments.verifiers_tasksets import load_verifiers_taskset

        return load_verifiers_taskset(name, dict(args or {}))
    from grpo_core.environments.reasoning_gym_tasks import load_reasoning_gym

    return load_reasoning_gym(name, dict(args or {}), seed=seed)


def environment_inputs(args: Any, reward_funcs: list[Callable[..., Any]], train_dataset: Any,
                       eval_dataset: Any) -> tuple[Any, list[Callable[..., Any]], Any, Any]:
    """The trainer's (config, reward functions, train and eval data) when ``args.environment`` names one.

    The environment gives all of them, so a caller that also passes reward functions or a data set gets an
    error rather than one of the two being ignored. The rubric's weights become ``reward_weights`` unless the
    config sets its own (one per rubric function).
    """
    if reward_funcs or train_dataset is not None or eval_dataset is not None:
        raise ValueError(f"AsyncGRPOConfig.environment={args.environment!r} gives the data set and the reward "
                         "functions; pass neither reward_funcs nor train_dataset/eval_dataset, or unset environment")
    inputs = load_environment(args.environment, args.environment_args, seed=args.seed)
    if args.reward_weights is None:
        args = args.replace(reward_weights=inputs.reward_weights)
    elif len(args.reward_weights) != len(inputs.reward_funcs):
        names = [getattr(f, "__name__", "?") for f in inputs.reward_funcs]
        raise ValueError(f"AsyncGRPOConfig.reward_weights has {len(args.reward_weights)} entries but the environment "
                         f"{args.environment!r} has {len(names)} reward functions {names}; give one weight each or "
                         "leave reward_weights unset to use the environment's own")
    eval_dataset = inputs.eval_dataset if args.runs_evaluation() else None
    return args, inputs.reward_funcs, inputs.train_dataset, eval_dataset

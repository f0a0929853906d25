"""A verifiers taskset package as a run's prompts and rubric.

``load_verifiers_taskset("my-taskset", {...})`` loads the installed taskset package the id names through verifiers'
own loader (``vf.load_taskset`` of the taskset's config type, validated with ``environment_args``), so the
package's ``Taskset.load()`` builds the tasks, exactly as verifiers' own evaluation would. Each task becomes a
prompt row (its system prompt and prompt as chat messages) that carries the task's data as JSON. Each ``@vf.reward``
method of the task type (and each reward the task's config plugs in) becomes one reward function of the run,
named as in the rubric, so MLflow logs ``rewards/<name>/mean`` per rubric function; the rubric's weights become
the run's ``reward_weights``.

Scoring a rollout builds a verifiers ``Trace`` of the conversation (system, user, the assistant and tool messages
the rollout added) and runs the task's own ``Task.score`` on it, once per rollout: each reward function reads its
entry from that one scoring. Rewards that need a runtime (a sandbox) are skipped by verifiers when none is given,
and so are here: such a function scores NaN (unscored).

What runs the conversation is this project's rollout loop (tokens in, tokens out against the run's vLLM server),
not a verifiers harness: a taskset whose harness launches an agent program (a coding agent in a container, a
tool server over MCP) needs that harness, which this adapter does not start.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections import OrderedDict
from typing import Any

from grpo_core.environments.inputs import EnvironmentInputs

_CACHE_ROLLOUTS = 4096
"""Scored rollouts kept per process, so that every rubric function of a group reads one scoring."""


def _vf() -> Any:
    try:
        import verifiers.v1 as vf
    except ImportError as exc:
        raise ImportError("AsyncGRPOConfig.environment='verifiers:...' needs verifiers: pip install "
                          "'grpo-core[environments]' (or GRPO_CORE_EXTRAS=environments bash scripts/setup.sh)") from exc
    return vf


def load_taskset(taskset_id: str, args: dict[str, Any]) -> Any:
    """The installed taskset ``taskset_id`` built from its config type and ``args`` (verifiers' own loader)."""
    vf = _vf()
    try:
        config_type = vf.taskset_config_type(taskset_id)
    except (ModuleNotFoundError, TypeError, AttributeError, ValueError) as exc:
        raise ValueError(f"AsyncGRPOConfig.environment='verifiers:{taskset_id}': {exc}") from exc
    try:
        config = config_type.model_validate({**args, "id": taskset_id})
    except Exception as exc:  # pydantic's ValidationError names the bad key
        raise ValueError(f"AsyncGRPOConfig.environment_args for 'verifiers:{taskset_id}': {exc}") from exc
    return vf.load_taskset(config)


def task_messages(data: Any) -> list[dict[str, Any]]:
    """A task's opening conversation as chat messages: its system prompt, then its prompt."""
    messages: list[dict[str, Any]] = []
    if data.system_prompt:
        messages.append({"role": "system", "content": data.system_prompt})
    if isinstance(data.prompt, str):
        messages.append({"role": "user", "content": data.prompt})
    else:
        messages.extend(m.model_dump(exclude_none=True) if hasattr(m, "model_dump") else dict(m) for m in data.prompt or [])
    if not any(m.get("role") == "user" for m in messages):
        raise ValueError(f"verifiers task {data.idx} has no prompt: the rollout loop starts from a user message")
    return messages


def rubric_names(task: Any) -> tuple[list[str], list[float]]:
    """The names and weights of the task's reward functions, in the order verifiers runs them."""
    hooks = task.hooks("reward")
    return [fn.__name__ for fn in hooks], [float(getattr(fn, "_vf_weight", 1.0)) for fn in hooks]


def _vf_message(message: dict[str, Any], index: int) -> Any:
    vf = _vf()
    role, content = message.get("role"), message.get("content")
    if role == "system":
        return vf.SystemMessage(content=content or "")
    if role == "user":
        return vf.UserMessage(content=content or "")
    if role == "tool":
        return vf.ToolMessage(tool_call_id=str(message.get("tool_call_id") or f"call_{index}"), content=content or "",
                              name=message.get("name"))
    calls = [vf.ToolCall(id=f"call_{index}_{k}", name=c["function"]["name"],
                         arguments=json.dumps(c["function"].get("arguments") or {}))
             for k, c in enumerate(message.get("tool_calls") or [])]
    return vf.AssistantMessage(content=content, tool_calls=calls or None)


def conversation_trace(task: Any, messages: list[dict[str, Any]]) -> Any:
    """A verifiers ``Trace`` of ``messages`` on ``task``: one chain of message nodes, the assistant's sampled."""
    vf = _vf()
    from verifiers.v1.graph import MessageNode

    nodes = [MessageNode(parent=i - 1 if i else None, message=_vf_message(m, i), sampled=m.get("role") == "assistant")
             for i, m in enumerate(messages)]
    return vf.Trace(task=vf.TraceTask(type=type(task).__name__, data=task.data, key=task.key, hash=task.hash),
                    agent=vf.AgentInfo(config=vf.AgentConfig()), nodes=nodes, is_completed=True, ok=True)


class _Rubric:
    """One process's view of a taskset: its task type and config, and the scorings already done."""

    _lock = threading.Lock()
    _by_key: dict[str, "_Rubric"] = {}

    def __init__(self, taskset_id: str, args: dict[str, Any]) -> None:
        taskset = load_taskset(taskset_id, args)
        self.task_type = type(taskset).task_type()
        self.task_config = taskset.config.task
        self.scored: OrderedDict[str, dict[str, float | None]] = OrderedDict()
        self.scoring: dict[str, asyncio.Future[dict[str, float | None]]] = {}

    @classmethod
    def of(cls, taskset_id: str, args: dict[str, Any]) -> "_Rubric":
        key = json.dumps([taskset_id, args], sort_keys=True, default=str)
        with cls._lock:
            if key not in cls._by_key:
                cls._by_key[key] = cls(taskset_id, args)
            return cls._by_key[key]

    async def rewards(self, task_json: str, prompt: list[dict[str, Any]], completion: list[dict[str, Any]]) -> dict[str, float | None]:
        """The rubric's scores of one rollout (name → score, None where verifiers skipped the function)."""
        key = json.dumps([task_json, completion], sort_keys=True, default=str)
        if key in self.scored:
            return self.scored[key]
        if key not in self.scoring:  # the group's reward functions run one after another; the first one scores
            self.scoring[key] = asyncio.ensure_future(self._score(task_json, prompt, completion))
        try:
            result = await self.scoring[key]
        finally:
            self.scoring.pop(key, None)
        self.scored[key] = result
        while len(self.scored) > _CACHE_ROLLOUTS:
            self.scored.popitem(last=False)
        return result

    async def _score(self, task_json: str, prompt: list[dict[str, Any]], completion: list[dict[str, Any]]) -> dict[str, float | None]:
        data = self.task_type.data_type().model_validate_json(task_json)
        task = self.task_type(data, self.task_config)
        trace = conversation_trace(task, [*prompt, *completion])
        await task.score(trace)
        return {name: (None if r is None else float(r.score)) for name, r in trace.rewards.items()}


class RubricFunction:
    """One rubric function of a verifiers taskset as a reward function of the run (async, picklable)."""

    def __init__(self, taskset_id: str, args: dict[str, Any], name: str) -> None:
        self.taskset_id = taskset_id
        self.args = args
        self.__name__ = name

    async def __call__(self, prompts: list[Any], completions: list[Any], vf_task: list[str], **_: Any) -> list[float | None]:
        rubric = _Rubric.of(self.taskset_id, self.args)
        scores = await asyncio.gather(*(rubric.rewards(t, p, c) for t, p, c in zip(vf_task, prompts, completions, strict=True)))
        return [s.get(self.__name__) for s in scores]


def load_verifiers_taskset(taskset_id: str, args: dict[str, Any]) -> EnvironmentInputs:
    """Prompts, rubric functions and weights of the installed verifiers taskset ``taskset_id``.

    ``args`` are the taskset config's fields (verifiers validates them), plus ``eval_fraction`` (default 0.1): the
    share of the tasks held out as the eval split (the last ones in ``load()`` order).
    """
    from datasets import Dataset

    args = dict(args)
    eval_fraction = float(args.pop("eval_fraction", 0.1))
    if not 0.0 <= eval_fraction < 1.0:
        raise ValueError(f"AsyncGRPOConfig.environment_args.eval_fraction={eval_fraction}: use a share in [0, 1)")
    taskset = load_taskset(taskset_id, args)
    if not taskset.bounded:
        raise ValueError(f"AsyncGRPOConfig.environment='verifiers:{taskset_id}' is an infinite taskset; bound it in "
                         "environment_args (the taskset's own size or select settings)")
    tasks = list(taskset)
    if not tasks:
        raise ValueError(f"AsyncGRPOConfig.environment='verifiers:{taskset_id}' loaded no tasks")
    names, weights = rubric_names(tasks[0])
    if not names:
        raise ValueError(f"verifiers taskset {taskset_id!r} has no @vf.reward function: nothing would score the rollouts")
    rows = {"prompt": [task_messages(t.data) for t in tasks],
            "vf_task": [t.data.model_dump_json() for t in tasks]}
    held = int(round(len(tasks) * eval_fraction))
    everything = Dataset.from_dict(rows)
    train = everything.select(range(len(tasks) - held))
    held_out = everything.select(range(len(tasks) - held, len(tasks))) if held else None
    return EnvironmentInputs(train_dataset=train, eval_dataset=held_out,
                             reward_funcs=[RubricFunction(taskset_id, args, n) for n in names], reward_weights=weights)

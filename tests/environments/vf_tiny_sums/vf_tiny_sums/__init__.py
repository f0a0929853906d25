"""A verifiers taskset of sums the tiny arithmetic model knows (``grpo_core.tiny``), built in code: no download.

Its rubric has two reward functions, so a run logs both: ``correct`` (the last ``\\boxed{}`` holds the sum) and
``brief`` (weight 0.5: the reply is the boxed answer alone, no working). The tiny model answers in three styles, one
of them the bare ``\\boxed{}`` (``grpo_core.tiny.tasks.ANSWER_TEMPLATES``), so ``brief`` is a preference a short run
can move.
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterable

import verifiers.v1 as vf

SYSTEM_PROMPT = "Solve the problem. Put the final answer in \\boxed{}."
_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")


class SumData(vf.TaskData):
    answer: int = 0
    """The sum asked for."""


class SumTask(vf.Task[SumData]):
    @vf.reward
    async def correct(self, task: SumData, trace: vf.Trace) -> float:
        found = _BOXED.findall(trace.messages[-1].content or "")
        return float(bool(found) and found[-1].strip() == str(task.answer))

    @vf.reward(weight=0.5)
    async def brief(self, trace: vf.Trace) -> float:
        return float(bool(_BOXED.fullmatch((trace.messages[-1].content or "").strip())))


class SumTasksetConfig(vf.TasksetConfig):
    num_tasks: int = 200
    """How many sums."""
    max_operand: int = 9
    """Operands are drawn from 0..max_operand."""
    seed: int = 0
    """Orders the sums."""


class SumTaskset(vf.Taskset[SumTask, SumTasksetConfig]):
    def load(self) -> Iterable[SumTask]:
        rng = random.Random(self.config.seed)
        for _ in range(self.config.num_tasks):
            a, b = rng.randint(0, self.config.max_operand), rng.randint(0, self.config.max_operand)
            yield SumTask(SumData(prompt=f"What is {a} + {b}?", system_prompt=SYSTEM_PROMPT, answer=a + b),
                          self.config.task)


__all__ = ["SumTaskset"]

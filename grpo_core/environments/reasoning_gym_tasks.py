"""reasoning-gym generators as a run's prompts and reward: any generator by name, scored by its own rule.

``load_reasoning_gym("basic_arithmetic", {...})`` builds the generator with ``reasoning_gym.create_dataset`` (its
configuration keywords pass through), turns each entry into a prompt row and scores completions with the
generator's own ``score_answer`` on the answer the completion states. Nothing is downloaded: the generators are
procedural, so the data set is a function of the generator's configuration and the seed.

Keywords of ``environment_args`` read here (everything else goes to the generator):

``size`` (default 1000)
    Training prompts; ``eval_size`` (default 100) held-out prompts, drawn with another seed.
``system_prompt``
    The system message of every prompt (default: state the answer in ``<answer>`` tags, reasoning-gym's
    convention); None for none.
``answer_format`` (``"answer_tag"`` default, ``"boxed"``, ``"last_line"``)
    Where the completion's answer is read from: the last ``<answer>...</answer>``, the last ``\\boxed{...}``, or
    the last non-empty line. A completion with none scores 0.

The reward function is named ``reasoning_gym_<generator>`` (``rewards/reasoning_gym_<generator>/mean``).
"""

from __future__ import annotations

import json
import re
from typing import Any

from grpo_core.environments.inputs import EnvironmentInputs

ANSWER_TAG_PROMPT = "Think it through, then give only the final answer between <answer> and </answer>."
"""The default system prompt: reasoning-gym's own answer convention."""

ANSWER_FORMATS = ("answer_tag", "boxed", "last_line")

_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def _last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}``, braces balanced."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 0, start + len("\\boxed{") - 1
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1: j]
    return None


def stated_answer(text: str, answer_format: str) -> str | None:
    """The answer ``text`` states in ``answer_format``; None when it states none."""
    if answer_format == "answer_tag":
        found = _TAG.findall(text)
        return found[-1].strip() if found else None
    if answer_format == "boxed":
        found = _last_boxed(text)
        return found.strip() if found is not None else None
    if answer_format == "last_line":
        lines = [line.strip() for line in text.splitlines() if line.strip()]
        return lines[-1] if lines else None
    raise ValueError(f"environment_args.answer_format={answer_format!r}: use one of {list(ANSWER_FORMATS)}")


def completion_text(completion: Any) -> str:
    """The assistant text of a completion (a string, or the messages a rollout added)."""
    if isinstance(completion, str):
        return completion
    return "\n".join(str(m.get("content") or "") for m in completion if m.get("role") == "assistant")


class GeneratorReward:
    """The generator's own ``score_answer`` on the stated answer; picklable, rebuilt lazily in each process."""

    def __init__(self, generator: str, config: dict[str, Any], answer_format: str) -> None:
        self.generator = generator
        self.config = config
        self.answer_format = answer_format
        self.__name__ = f"reasoning_gym_{generator}"
        self._scorer: Any = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_scorer": None}

    def _dataset(self) -> Any:
        if self._scorer is None:
            import reasoning_gym

            self._scorer = reasoning_gym.create_dataset(self.generator, **{**self.config, "size": 1})
        return self._scorer

    def __call__(self, completions: list[Any], rg_entry: list[str], **_: Any) -> list[float]:
        scorer = self._dataset()
        scores = []
        for completion, entry in zip(completions, rg_entry, strict=True):
            answer = stated_answer(completion_text(completion), self.answer_format)
            scores.append(0.0 if answer is None else float(scorer.score_answer(answer, json.loads(entry))))
        return scores


def _rows(dataset: Any, system_prompt: str | None) -> dict[str, list[Any]]:
    prompts, entries, answers = [], [], []
    for entry in dataset:
        messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
        prompts.append([*messages, {"role": "user", "content": entry["question"]}])
        # The entry goes to the reward whole (score_answer reads its answer and metadata), as JSON text: generators'
        # metadata differ from entry to entry, which an Arrow struct column cannot hold.
        entries.append(json.dumps(entry, default=str))
        answers.append(str(entry["answer"]))
    return {"prompt": prompts, "rg_entry": entries, "solution": answers}


def load_reasoning_gym(generator: str, args: dict[str, Any], seed: int = 0) -> EnvironmentInputs:
    """Prompts and reward of the reasoning-gym generator ``generator`` (see the module docstring for ``args``)."""
    try:
        import reasoning_gym
        from reasoning_gym.factory import DATASETS
    except ImportError as exc:
        raise ImportError("AsyncGRPOConfig.environment='reasoning_gym:...' needs reasoning-gym: pip install "
                          "'grpo-core[environments]' (or GRPO_CORE_EXTRAS=environments bash scripts/setup.sh)") from exc
    from datasets import Dataset

    if generator not in DATASETS:
        import difflib

        close = difflib.get_close_matches(generator, list(DATASETS), n=3)
        raise ValueError(f"AsyncGRPOConfig.environment='reasoning_gym:{generator}': no such generator"
                         f"{'; did you mean ' + ', '.join(close) if close else ''} (reasoning_gym.factory.DATASETS "
                         f"lists all {len(DATASETS)})")
    size = int(args.pop("size", 1000))
    eval_size = int(args.pop("eval_size", 100))
    system_prompt = args.pop("system_prompt", ANSWER_TAG_PROMPT)
    answer_format = args.pop("answer_format", "answer_tag")
    stated_answer("", answer_format)  # names a bad format before any data is built
    data_seed = int(args.pop("seed", seed))
    train = reasoning_gym.create_dataset(generator, size=size, seed=data_seed, **args)
    held = reasoning_gym.create_dataset(generator, size=eval_size, seed=data_seed + 1_000_003, **args)
    reward = GeneratorReward(generator, {**args, "seed": data_seed}, answer_format)
    return EnvironmentInputs(
        train_dataset=Dataset.from_dict(_rows(train, system_prompt)),
        eval_dataset=Dataset.from_dict(_rows(held, system_prompt)),
        reward_funcs=[reward],
        reward_weights=[1.0],
    )

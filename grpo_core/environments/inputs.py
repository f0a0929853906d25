"""What an environment gives a run, as one record: the ecosystems' loaders fill it, ``grpo_core.environments`` hands
it to the trainer. It sits apart so that the loaders (imported only when their optional package is wanted) and the
package's face both import it, and neither imports the other.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any


@dataclasses.dataclass
class EnvironmentInputs:
    """What an environment gives a run: its prompts, its reward functions and their weights."""

    train_dataset: Any
    eval_dataset: Any
    reward_funcs: list[Callable[..., Any]]
    reward_weights: list[float]

"""The records that move along the data path: TurnRecord → Rollout → RolloutGroup → RolloutSample.

A ``RolloutSample`` is the only object that crosses the process boundary between the rollout worker
and the trainer, so it holds compact numpy arrays (not Python lists of floats) and pickles cheaply.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass
class TurnRecord:
    """One generation call: the prompt tokens sent, the tokens generated and their sampler log-probs."""

    prompt_ids: list[int]
    output_ids: list[int]
    output_logprobs: list[float]
    # Sampler top-N per generated token: ids [n_out, N] and log-probs [n_out, N]; None when N == 0.
    top_ids: np.ndarray | None = None
    top_logprobs: np.ndarray | None = None
    # Candidate set that survived top-k/top-p per generated token (None when the server cannot say).
    sampling_masks: list[np.ndarray] | None = None
    finish_reason: str | None = None
    # Policy version that produced the tokens (the adapter version in LoRA adapter mode).
    policy_version: int = 0
    # Experts the sampler routed each forwarded token to: [len(prompt_ids) + len(output_ids) - 1, layers, k]
    # (uint8 up to 256 experts, else uint16), the prompt and every output token but the last; None when the
    # model has no MoE layer or the server does not return routes.
    routed_experts: np.ndarray | None = None


@dataclass
class Rollout:
    """One conversation: the turns that produced it, its messages and its reward."""

    rollout_id: str
    row_index: int
    messages: list[dict[str, Any]]
    turns: list[TurnRecord] = field(default_factory=list)
    completion_text: str = ""
    # Set by a custom ``generate_one`` to score the rollout itself; summed with reward functions.
    reward: float | None = None
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class RolloutGroup:
    """``num_generations`` rollouts of one prompt; the unit that is scored and gets one baseline."""

    row_index: int
    epoch: int
    prompt: list[dict[str, Any]]
    rollouts: list[Rollout]
    # [num_generations] summed reward per rollout, NaN where no function scored it.
    rewards: np.ndarray = field(default_factory=lambda: np.zeros(0))
    # [num_generations, num_funcs] per-function rewards (NaN = not scored).
    rewards_per_func: np.ndarray = field(default_factory=lambda: np.zeros((0, 0)))
    reward_func_names: list[str] = field(default_factory=list)
    row: dict[str, Any] = field(default_factory=dict)


@dataclass
class GroupReport:
    """Sent once per group (kept or dropped), ahead of its samples: reward statistics and the
    prompt position it covers, so the trainer can log rewards and track which prompts are done."""

    position: int
    row_index: int
    epoch: int
    rewards: np.ndarray  # [G] summed reward, NaN = not scored
    rewards_per_func: dict[str, np.ndarray]  # name -> [G]
    num_samples: int  # samples queued for this group (0 when dropped or filtered)
    dropped: bool
    filtered: bool = False  # rejected by filter_prompt before generation
    generated_tokens: int = 0
    completion_lengths: np.ndarray = field(default_factory=lambda: np.zeros(0))
    metrics: dict[str, float] = field(default_factory=dict)
    completions: list[str] = field(default_factory=list)
    prompt_text: str = ""  # the prompt's last message, for completion tables
    server: str | None = None
    """The fleet server that generated the group (the one it ended on, if its first was lost)."""
    fleet: dict[str, float] = field(default_factory=dict)
    """Each server's gauges and running counts when the group finished (``rollout.routing_client.RoutingClient.snapshot``)."""


def merge_counters(parts: Iterable[Mapping[str, float]]) -> dict[str, float]:
    """Sum counters key by key; a key ending in ``_max`` keeps the largest value.

    The one rule for per-rollout counters (tools, environments, reconcile) carried in
    ``GroupReport.metrics``: a group's are the sum over its rollouts, a step's the sum over its groups.
    """
    merged: dict[str, float] = {}
    for part in parts:
        for key, value in part.items():
            value = float(value)
            if key.endswith("_max"):
                merged[key] = max(merged.get(key, value), value)
            else:
                merged[key] = merged.get(key, 0.0) + value
    return merged


@dataclass
class RolloutSample:
    """One training sequence with its advantage: what the trainer consumes.

    Arrays are aligned with ``token_ids`` ([L]); the top-N arrays are aligned with the trained
    positions (``np.flatnonzero(completion_mask)``), in order.
    """

    token_ids: np.ndarray  # int32 [L]: prompt + completion (+ tool results)
    completion_mask: np.ndarray  # bool [L]: True where the token is trained
    sampler_logprobs: np.ndarray  # float32 [L]: sampler log-prob of each token (0 where not generated)
    advantage: float
    reward: float
    group_id: int  # dataset row index x epoch key: samples of one prompt share it (packing affinity)
    row_index: int  # dataset row this sample came from
    epoch: int
    rollout_id: str
    policy_version: int  # oldest weight version that sampled one of the trained tokens
    position: int = -1  # global prompt position (epoch * num_prompts + index in the epoch's order)
    sampler_top_ids: np.ndarray | None = None  # int32 [T, N]
    sampler_top_logprobs: np.ndarray | None = None  # float32 [T, N]
    sampling_masks: list[np.ndarray] | None = None  # per trained token: candidate ids (int32)
    # uint8/uint16 [L - 1, layers, k]: the experts the sampler routed token i to, for every token but the
    # last (which nothing forwards); None without routes (a dense model, a server that does not return them).
    routed_experts: np.ndarray | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    # Weight updates pushed after ``policy_version`` when the trainer took the sample (``StepCollector`` sets it;
    # the per-staleness mismatch metrics read it).
    staleness: int = 0

    def __post_init__(self) -> None:
        n = len(self.token_ids)
        if len(self.completion_mask) != n or len(self.sampler_logprobs) != n:
            raise ValueError(
                f"RolloutSample arrays disagree: token_ids {n}, completion_mask "
                f"{len(self.completion_mask)}, sampler_logprobs {len(self.sampler_logprobs)}"
            )
        if self.completion_mask[0] if n else False:
            raise ValueError("RolloutSample.completion_mask[0] must be False: no position predicts token 0")
        if not math.isfinite(self.advantage):
            raise ValueError(f"RolloutSample.advantage must be finite, got {self.advantage}")
        if self.routed_experts is not None and (self.routed_experts.ndim != 3 or len(self.routed_experts) != max(n - 1, 0)):
            raise ValueError(f"RolloutSample.routed_experts must be [token_ids - 1, layers, k] = [{max(n - 1, 0)}, ...], "
                             f"got {list(self.routed_experts.shape)}")

    @property
    def num_trained(self) -> int:
        return int(self.completion_mask.sum())

    def __len__(self) -> int:
        return len(self.token_ids)

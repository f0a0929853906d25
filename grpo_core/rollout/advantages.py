"""Group advantages: one baseline per GROUP (one prompt x num_generations rollouts).

Pure numpy, run in the rollout process before a group becomes SAMPLEs. Tests:
``.venv/bin/python -m pytest tests/test_advantages.py -q``.
"""

from __future__ import annotations

import numpy as np

# Keeps the division finite for a group whose scored rewards are (almost) equal; small enough not
# to shrink advantages of groups with a real spread (0/1 rewards over 16 rollouts have std >= 0.24).
STD_EPSILON = 1e-4


def group_advantages(rewards: np.ndarray, scale: bool, eps: float = STD_EPSILON) -> np.ndarray:
    """Per-rollout advantages [G] from rewards [G] (NaN = no reward function scored it).

    The baseline is the mean over scored rollouts only, so an unscored rollout neither counts as
    a 0 reward nor shifts the others. With ``scale`` the centered rewards are divided by
    (std + eps), std being the population std (ddof=0) of the scored rewards: the group is the
    whole population the baseline is taken over. Unscored rollouts get advantage 0, so they
    contribute no gradient. Returns float64.
    """
    rewards = np.asarray(rewards, dtype=np.float64)
    if rewards.ndim != 1:
        raise ValueError(f"rewards must be 1-D [G], got shape {rewards.shape}")
    scored = ~np.isnan(rewards)
    advantages = np.zeros_like(rewards)
    if not scored.any():
        return advantages
    values = rewards[scored]
    if values.max() == values.min():
        # The float mean of equal values can be off by an ulp; an all-equal group must give 0.
        return advantages
    centered = values - values.mean()
    if scale:
        centered = centered / (values.std() + eps)
    advantages[scored] = centered
    return advantages


def should_drop_group(rewards: np.ndarray) -> bool:
    """True when a group can teach nothing: fewer than 2 scored rollouts, or all scored equal.

    Such a group has zero advantage everywhere, so training on it costs a forward and backward
    pass and changes nothing. Exact equality on purpose: rewards that differ at all are kept.
    """
    rewards = np.asarray(rewards, dtype=np.float64)
    values = rewards[~np.isnan(rewards)]
    return values.size < 2 or bool(values.max() == values.min())

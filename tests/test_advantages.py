"""Group advantages and the drop rule, against hand-computed values."""

from __future__ import annotations

import math

import numpy as np
import pytest

from grpo_core.rollout.advantages import STD_EPSILON, group_advantages, should_drop_group

NAN = float("nan")


def test_centered_without_scaling():
    # mean(1, 0, 0, 1, 3) = 1
    adv = group_advantages(np.array([1.0, 0.0, 0.0, 1.0, 3.0]), scale=False)
    np.testing.assert_array_equal(adv, [0.0, -1.0, -1.0, 0.0, 2.0])  # exact: small integers, mean 5/5


def test_scaled_uses_population_std_plus_eps():
    # rewards 0, 1: mean 0.5, population std 0.5 -> +-0.5 / (0.5 + eps)
    adv = group_advantages(np.array([0.0, 1.0]), scale=True)
    expected = 0.5 / (0.5 + STD_EPSILON)
    # Exact: ±0.5, 0.25 and sqrt(0.25) are exact in binary, then the same (std + eps) and division.
    np.testing.assert_array_equal(adv, [-expected, expected])
    # rewards 1, 2, 3, 4: mean 2.5, population variance (2.25+0.25+0.25+2.25)/4 = 1.25
    adv = group_advantages(np.array([1.0, 2.0, 3.0, 4.0]), scale=True, eps=0.0)
    # Exact: the deviations and the variance 5/4 are exact in binary, sqrt is correctly rounded (IEEE)
    # on both sides, then the same division.
    np.testing.assert_array_equal(adv, np.array([-1.5, -0.5, 0.5, 1.5]) / math.sqrt(1.25))


def test_unscored_rollouts_get_zero_and_do_not_move_the_baseline():
    # baseline over the scored 2 and 4 only: 3; std 1
    adv = group_advantages(np.array([2.0, NAN, 4.0, NAN]), scale=True, eps=0.0)
    np.testing.assert_array_equal(adv, [-1.0, 0.0, 1.0, 0.0])  # exact: mean 3, deviations ±1, std 1
    assert not np.isnan(adv).any()


def test_all_unscored_and_equal_groups_give_zero_not_nan():
    np.testing.assert_array_equal(group_advantages(np.array([NAN, NAN]), scale=True), [0.0, 0.0])
    np.testing.assert_array_equal(group_advantages(np.array([0.7, 0.7, 0.7]), scale=True), 0.0)
    np.testing.assert_array_equal(group_advantages(np.array([5.0]), scale=True), [0.0])


def test_rejects_non_vector():
    with pytest.raises(ValueError):
        group_advantages(np.zeros((2, 2)), scale=False)


@pytest.mark.parametrize(
    ("rewards", "drop"),
    [
        ([1.0, 1.0, 1.0], True),  # all equal
        ([0.0, NAN, 0.0], True),  # scored ones equal
        ([1.0, NAN, NAN], True),  # one scored
        ([NAN, NAN], True),  # none scored
        ([], True),
        ([0.0, 1.0], False),
        ([0.0, NAN, 1e-9], False),  # any difference keeps the group
    ],
)
def test_should_drop_group(rewards, drop):
    assert should_drop_group(np.array(rewards)) is drop

"""Importance-sampling correction modes and mismatch metrics against hand-computed references.

Each mode's loss value and gradient on one hand-built micro-batch of two samples (``HAND`` below), the
sequence-level modes' geometric means, a prefix-tree row whose shared token carries each sample's own weight,
score centering's baseline weights per mode, and the ``mismatch/*`` metrics per staleness. Expected values are
computed with ``math`` from the definitions in docs/mismatch.md, never with the code under test.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from grpo_core.packing.collator import pack_row
from grpo_core.packing.trie import TreeRow
from grpo_core.training.loss import LossConfig, LossInputs, _centering_weights, finalize_metrics, grpo_loss
from grpo_core.training.mismatch import (
    SEQ_SUMS,
    STALENESS_BUCKETS_MAX,
    TOKEN_SUMS,
    Correction,
    correction_factors,
    finalize_mismatch,
    mismatch_parts,
    staleness_buckets,
)
from tests.test_packing_trie import make_sample

F64 = torch.float64
REL = 1e-12  # fp64 through a handful of exp/log and sums of at most 7 terms


def config(mode: str = "token_mask", enabled: bool = True, **overrides) -> LossConfig:
    values = dict(
        epsilon=0.2, epsilon_high=0.28, score_centering=False, score_centering_weights="importance",
        vllm_importance_sampling_clip_min=0.5, vllm_importance_sampling_clip_max=2.0,
        vllm_importance_sampling_correction=enabled, vllm_importance_sampling_mode=mode,
        vllm_importance_sampling_cap=2.0, max_staleness=2,
    )
    return LossConfig(**{**values, **overrides})


# ---------------------------------------------------------------------------------------------
# One micro-batch, two samples. Clip region [0.8, 1.28], mask [0.5, 2.0], cap 2.
#   sample 0 (A = +1, staleness 0): r = 1.1, 0.6, 1.2, 1.5   (1.5 > 1.28 with A > 0: the high clip binds)
#   sample 1 (A = -1, staleness 2): r = 2.5, 3.0, 1.8        (A < 0 above 1: no clip binds)
# Geometric means R0 = (1.1 * 0.6 * 1.2 * 1.5)^(1/4) = 1.188^(1/4) = 1.0440, R1 = 13.5^(1/3) = 2.3811.
# ---------------------------------------------------------------------------------------------
RATIOS = [1.1, 0.6, 1.2, 1.5, 2.5, 3.0, 1.8]
ADV = [1.0, 1.0, 1.0, 1.0, -1.0, -1.0, -1.0]
SAMPLER = [-1.0, -0.5, -2.0, -0.3, -1.5, -2.5, -0.7]
SAMPLE = [0, 0, 0, 0, 1, 1, 1]
STALENESS = [0, 2]
N = 7
R0 = (1.1 * 0.6 * 1.2 * 1.5) ** 0.25
R1 = (2.5 * 3.0 * 1.8) ** (1 / 3)
HIGH = 1.28  # 1 + epsilon_high: the clipped value of token 3

# Per mode: (per-token loss value, per-token d loss / d logprob), both before the division by N. An unclipped
# token's value and gradient are both -A w, with w the mode's weight; the clipped token 3 has value
# -(w / r) * 1.28 and gradient 0.
EXPECTED = {
    "off": ([-1.1, -0.6, -1.2, -HIGH, 2.5, 3.0, 1.8], [-1.1, -0.6, -1.2, 0.0, 2.5, 3.0, 1.8]),
    "token_mask": ([-1.1, -0.6, -1.2, -HIGH, 0.0, 0.0, 1.8], [-1.1, -0.6, -1.2, 0.0, 0.0, 0.0, 1.8]),
    "token_truncate": ([-1.1, -0.6, -1.2, -HIGH, 2.0, 2.0, 1.8], [-1.1, -0.6, -1.2, 0.0, 2.0, 2.0, 1.8]),
    # R1 > 2: sample 1 is masked whole; sample 0's tokens all weigh R0
    "sequence_mask": ([-R0, -R0, -R0, -R0 / 1.5 * HIGH, 0.0, 0.0, 0.0], [-R0, -R0, -R0, 0.0, 0.0, 0.0, 0.0]),
    # R1 truncated to 2
    "sequence_truncate": ([-R0, -R0, -R0, -R0 / 1.5 * HIGH, 2.0, 2.0, 2.0], [-R0, -R0, -R0, 0.0, 2.0, 2.0, 2.0]),
}
MASKED = {"off": [], "token_mask": [4, 5], "token_truncate": [], "sequence_mask": [4, 5, 6], "sequence_truncate": []}
TRUNCATED = {"off": [], "token_mask": [], "token_truncate": [4, 5], "sequence_mask": [], "sequence_truncate": [4, 5, 6]}


def hand_inputs(**extra) -> LossInputs:
    sampler = torch.tensor(SAMPLER, dtype=F64)
    logprobs = (sampler + torch.log(torch.tensor(RATIOS, dtype=F64))).requires_grad_()
    return LossInputs(logprobs, sampler, torch.tensor(ADV, dtype=F64), sample_index=torch.tensor(SAMPLE),
                      sample_staleness=torch.tensor(STALENESS), **extra)


def mode_config(mode: str, **overrides) -> LossConfig:
    if mode == "off":
        return config(enabled=False, **overrides)
    return config(mode, **overrides)


@pytest.mark.parametrize("mode", list(EXPECTED))
def test_each_mode_hand_computed(mode):
    inputs = hand_inputs()
    loss, _ = grpo_loss(inputs, mode_config(mode), N)
    loss.backward()
    values, grads = EXPECTED[mode]
    assert loss.item() == pytest.approx(sum(values) / N, rel=REL, abs=REL)
    np.testing.assert_allclose(inputs.logprobs.grad.numpy(), np.array(grads) / N, rtol=REL, atol=0)


@pytest.mark.parametrize("mode", list(EXPECTED))
def test_each_mode_flags_the_tokens_it_masks_or_truncates(mode):
    inputs = hand_inputs()
    log_ratio = inputs.logprobs.detach() - inputs.sampler_logprobs
    factors = correction_factors(log_ratio, inputs.sampler_logprobs, mode_config(mode).correction,
                                 inputs.sample_index, 2)
    assert torch.nonzero(factors.masked).flatten().tolist() == MASKED[mode]
    assert torch.nonzero(factors.truncated).flatten().tolist() == TRUNCATED[mode]
    # the sequence ratio is the geometric mean of each sample's own token ratios
    np.testing.assert_allclose(factors.sample_log_ratio.numpy(), [math.log(R0), math.log(R1)], rtol=REL)


def test_default_mode_is_the_earlier_mask_bit_for_bit():
    """token_mask multiplies by exactly 1 or 0: the earlier objective's values, the same floating-point ops."""
    inputs = hand_inputs()
    loss, _ = grpo_loss(inputs, config("token_mask"), N)
    sampler, lp = inputs.sampler_logprobs, inputs.logprobs.detach()
    ratio = torch.exp(lp - sampler)
    adv = inputs.advantages
    keep = (ratio >= 0.5) & (ratio <= 2.0)
    clipped = ((ratio < 0.8) & (adv < 0)) | ((ratio > 1.28) & (adv > 0))
    value = torch.where(clipped, ratio.clamp(0.8, 1.28) * adv, ratio * adv)
    assert loss.item() == (-torch.where(keep, value, torch.zeros_like(value))).sum().item() / N


def test_sequence_weights_need_no_sample_index_for_one_sequence():
    """Without sample_index the call's tokens are one sequence: R is the geometric mean of all seven."""
    sampler = torch.tensor(SAMPLER[:4], dtype=F64)
    logprobs = (sampler + torch.log(torch.tensor(RATIOS[:4], dtype=F64))).requires_grad_()
    loss, _ = grpo_loss(LossInputs(logprobs, sampler, torch.tensor(ADV[:4], dtype=F64)), config("sequence_truncate"), 4)
    loss.backward()
    np.testing.assert_allclose(logprobs.grad.numpy(), np.array([-R0, -R0, -R0, 0.0]) / 4, rtol=REL)


def test_tokens_without_a_finite_ratio_get_no_weight_and_stay_out_of_the_mean():
    # token 1: the sampler's -9999 stand-in; token 2: -inf under the trainer's candidate set
    sampler = torch.tensor([-1.0, -9999.0, -0.5, -2.0], dtype=F64)
    logprobs = torch.tensor([-1.0 + math.log(1.2), -3.0, float("-inf"), -2.0 + math.log(0.9)],
                            dtype=F64, requires_grad=True)
    for mode in ("off", *list(EXPECTED)[1:]):
        logprobs.grad = None
        loss, parts = grpo_loss(LossInputs(logprobs, sampler, torch.ones(4, dtype=F64)), mode_config(mode), 4)
        loss.backward()
        assert torch.isfinite(logprobs.grad).all(), mode
        assert logprobs.grad[1].item() == 0.0 and logprobs.grad[2].item() == 0.0, mode
        seq = math.sqrt(1.2 * 0.9)  # geometric mean of the two finite ratios only
        expected = [-seq, -seq] if mode.startswith("sequence") else [-1.2, -0.9]
        np.testing.assert_allclose(logprobs.grad[[0, 3]].numpy(), np.array(expected) / 4, rtol=REL)
        m = finalize_metrics([parts])
        assert m["mismatch/masked_token_share"] == 0.5, mode  # the two without a ratio


# ---------------------------------------------------------------------------------------------
# Tree rows: a token shared by two samples carries each sample's own weight
# ---------------------------------------------------------------------------------------------
# a = [1 2 3 4 5], b = [1 2 3 4 6], the last two tokens trained: the trained token 4 of both is predicted at the
# shared position 2 (node (3, 4)), 5 and 6 at their own positions 3 and 4.
# Trainer log-probs by position: 2 -> -1.2, 3 -> -0.3, 4 -> -0.9.
# a (A = +1, staleness 0): sampler 4: -1.0, 5: -0.5 -> log r = -0.2, +0.2 -> R_a = exp(0) = 1
# b (A = -1, staleness 1): sampler 4: -1.6, 6: -0.2 -> log r = +0.4, -0.7 -> R_b = exp(-0.15)
#   (b's token 6: r = exp(-0.7) = 0.497 < 0.8 with A < 0: the low clip binds, and it is below the mask's 0.5)
def tree_row():
    a = make_sample([1, 2, 3, 4, 5], 2, advantage=1.0)
    b = make_sample([1, 2, 3, 4, 6], 2, advantage=-1.0)
    a.sampler_logprobs[3:] = [-1.0, -0.5]
    b.sampler_logprobs[3:] = [-1.6, -0.2]
    a.staleness, b.staleness = 0, 1
    row = TreeRow()
    row.add(a)
    row.add(b)
    return pack_row(row)


def tree_loss(mode: str):
    row = tree_row()
    assert row.logit_index.tolist() == [2, 3, 2, 4]  # the first trained token of each shares position 2
    assert row.sample_index.tolist() == [0, 0, 1, 1]
    per_position = torch.tensor([0.0, 0.0, -1.2, -0.3, -0.9], dtype=F64, requires_grad=True)
    inputs = LossInputs(per_position[row.logit_index], row.sampler_logprobs.to(F64), row.advantages.to(F64),
                        sample_index=row.sample_index, sample_staleness=row.sample_staleness)
    loss, parts = grpo_loss(inputs, mode_config(mode), 4)
    loss.backward()
    return per_position.grad, parts


@pytest.mark.parametrize("mode, shared, own_a", [
    # d loss / d (log-prob at position 2) = (-A_a w_a + A_b w_b') summed over the two samples' entries
    ("token_mask", -math.exp(-0.2) + math.exp(0.4), -math.exp(0.2)),
    ("token_truncate", -math.exp(-0.2) + math.exp(0.4), -math.exp(0.2)),
    ("sequence_mask", -1.0 + math.exp(-0.15), -1.0),
    ("sequence_truncate", -1.0 + math.exp(-0.15), -1.0),
])
def test_shared_tree_token_carries_each_samples_own_weight(mode, shared, own_a):
    grad, _ = tree_loss(mode)
    # the row holds sampler log-probs in fp32 (as a RolloutSample does): 1e-6 relative
    np.testing.assert_allclose(grad.numpy(), np.array([0.0, 0.0, shared, own_a, 0.0]) / 4, rtol=1e-6, atol=0)


def test_tree_row_metrics_per_staleness():
    _, parts = tree_loss("token_mask")
    m = finalize_metrics([parts])
    a, b = [-0.2, 0.2], [0.4, -0.7]  # log-ratios of each sample's tokens

    def k3(x):
        return math.expm1(x) - x

    assert m["mismatch/k1_token/staleness_0"] == pytest.approx(-sum(a) / 2, abs=1e-7)
    assert m["mismatch/k1_token/staleness_1"] == pytest.approx(-sum(b) / 2, rel=1e-6)
    assert m["mismatch/k3_token/staleness_1"] == pytest.approx(sum(map(k3, b)) / 2, rel=1e-6)
    assert m["mismatch/k3_seq"] == pytest.approx((sum(map(k3, a)) + sum(map(k3, b))) / 2, rel=1e-6)
    assert m["mismatch/max_token_gap"] == pytest.approx(0.7, rel=1e-6)
    assert m["mismatch/max_token_gap/staleness_0"] == pytest.approx(0.2, rel=1e-6)
    # b's token 6 (r = 0.497) is below the mask's 0.5: one token of four, one sequence of two
    assert m["mismatch/masked_token_share"] == 0.25
    assert m["mismatch/masked_seq_share"] == 0.5
    assert m["mismatch/masked_seq_share/staleness_1"] == 1.0
    assert "mismatch/k1_token/staleness_2" not in m  # no sample that stale in the step


# ---------------------------------------------------------------------------------------------
# Metrics on the hand micro-batch
# ---------------------------------------------------------------------------------------------
def _k3(r: float) -> float:
    return r - 1 - math.log(r)


@pytest.mark.parametrize("mode", list(EXPECTED))
def test_metrics_hand_computed(mode):
    _, parts = grpo_loss(hand_inputs(), mode_config(mode), N)
    m = finalize_metrics([parts])
    k1 = [-math.log(r) for r in RATIOS]
    k3 = [_k3(r) for r in RATIOS]
    rel = 1e-6  # fp32 sums
    assert m["mismatch/k1_token"] == pytest.approx(sum(k1) / 7, rel=rel)
    assert m["mismatch/k3_token"] == pytest.approx(sum(k3) / 7, rel=rel)
    assert m["mismatch/k1_seq"] == pytest.approx(sum(k1) / 2, rel=rel)  # sum over each sequence, mean over 2
    assert m["mismatch/k3_seq"] == pytest.approx(sum(k3) / 2, rel=rel)
    assert m["mismatch/k1_token/staleness_0"] == pytest.approx(sum(k1[:4]) / 4, rel=rel)
    assert m["mismatch/k3_seq/staleness_2"] == pytest.approx(sum(k3[4:]), rel=rel)
    assert m["mismatch/max_token_gap"] == pytest.approx(math.log(3.0), rel=rel)
    assert m["mismatch/max_token_gap/staleness_0"] == pytest.approx(-math.log(0.6), rel=rel)  # |log r|
    assert m["mismatch/masked_token_share"] == len(MASKED[mode]) / 7
    assert m["mismatch/truncated_token_share"] == len(TRUNCATED[mode]) / 7
    assert m["mismatch/masked_seq_share"] == (0.5 if MASKED[mode] else 0.0)
    assert m["mismatch/truncated_seq_share"] == (0.5 if TRUNCATED[mode] else 0.0)
    assert m["mismatch/masked_token_share/staleness_0"] == 0.0
    assert "mismatch/k1_token/staleness_1" not in m
    assert "mismatch/route_mismatch_share" not in m  # a dense model: no routes


def test_route_mismatch_share_per_staleness():
    differs = torch.tensor([True, False, False, False, True, True, False])
    known = torch.tensor([True, True, True, False, True, True, True])
    _, parts = grpo_loss(hand_inputs(route_differs=differs, route_known=known), config(), N)
    m = finalize_metrics([parts])
    assert m["mismatch/route_mismatch_share"] == 3 / 6
    assert m["mismatch/route_mismatch_share/staleness_0"] == 1 / 3
    assert m["mismatch/route_mismatch_share/staleness_2"] == 2 / 3


def test_metrics_of_two_micro_batches_equal_one_call():
    """Split by sample into two calls, the step's metrics are those of one call (sums and maxima reduce)."""
    inputs = hand_inputs()
    _, whole = grpo_loss(inputs, config("sequence_truncate"), N)
    lp, sp, adv = inputs.logprobs.detach(), inputs.sampler_logprobs, inputs.advantages
    first = LossInputs(lp[:4], sp[:4], adv[:4], sample_index=torch.zeros(4, dtype=torch.int64),
                       sample_staleness=torch.tensor([0]))
    second = LossInputs(lp[4:], sp[4:], adv[4:], sample_index=torch.zeros(3, dtype=torch.int64),
                        sample_staleness=torch.tensor([2]))
    parts = [grpo_loss(x, config("sequence_truncate"), N)[1] for x in (first, second)]
    split, one = finalize_metrics(parts), finalize_metrics([whole])
    assert split.keys() == one.keys()
    for key, value in one.items():
        assert split[key] == pytest.approx(value, rel=1e-6, abs=1e-7), key


def test_staleness_past_the_last_bucket_counts_in_it():
    inputs = hand_inputs()
    inputs.sample_staleness = torch.tensor([0, 7])
    _, parts = grpo_loss(inputs, config(max_staleness=2), N)
    assert finalize_metrics([parts])["mismatch/tokens/staleness_2"] == 3


# ---------------------------------------------------------------------------------------------
# Score centering under each mode: the baseline's weights are q_j w_j, renormalised
# ---------------------------------------------------------------------------------------------
# One position, three candidates, A = -1 (the low clip binds below 0.8 only): sampler q = 0.5, 0.3, 0.2,
# trainer ratios 1.2, 3.0, 0.9, so pi = 0.6, 0.9, 0.18 (only the top-N's own values enter).
Q = [0.5, 0.3, 0.2]
PI_RATIOS = [1.2, 3.0, 0.9]


@pytest.mark.parametrize("mode, weights", [
    ("off", [0.5 * 1.2, 0.3 * 3.0, 0.2 * 0.9]),
    ("token_mask", [0.5 * 1.2, 0.0, 0.2 * 0.9]),  # 3.0 > 2.0: as if sampled, it would be dropped
    ("token_truncate", [0.5 * 1.2, 0.3 * 2.0, 0.2 * 0.9]),  # min(pi_j, C q_j)
    ("sequence_mask", Q),  # the sequence's weight is the same for every candidate: q_j
    ("sequence_truncate", Q),
])
def test_importance_centering_weights_per_mode(mode, weights):
    q = torch.tensor([Q], dtype=F64).log()
    top = q + torch.tensor([PI_RATIOS], dtype=F64).log()
    inputs = LossInputs(top[:, 0].clone(), q[:, 0].clone(), torch.tensor([-1.0], dtype=F64),
                        top_logprobs=top, sampler_top_logprobs=q)
    got = _centering_weights(inputs, mode_config(mode, score_centering=True), inputs.advantages)
    expected = np.array(weights) / sum(weights)
    np.testing.assert_allclose(got.numpy()[0], expected, rtol=REL)


@pytest.mark.parametrize("mode", list(EXPECTED))
def test_centering_changes_no_value_in_any_mode(mode):
    """Centering adds a zero-valued term, and combines with every mode and the PPO clip."""
    rng = torch.Generator().manual_seed(0)
    top_sampler = torch.log_softmax(torch.randn(N, 4, generator=rng, dtype=F64), -1)
    top = (top_sampler + 0.3 * torch.randn(N, 4, generator=rng, dtype=F64)).requires_grad_()
    plain, _ = grpo_loss(hand_inputs(), mode_config(mode), N)
    centered_inputs = hand_inputs(top_logprobs=top, sampler_top_logprobs=top_sampler)
    centered, _ = grpo_loss(centered_inputs, mode_config(mode, score_centering=True), N)
    assert centered.item() == pytest.approx(plain.item(), rel=REL, abs=REL)
    centered.backward()
    assert torch.isfinite(top.grad).all() and top.grad.abs().sum() > 0


def test_correction_rejects_bad_settings():
    with pytest.raises(ValueError, match="vllm_importance_sampling_mode"):
        Correction(enabled=True, mode="sequence_product", clip_min=0.5, clip_max=2.0, cap=2.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="vllm_importance_sampling_cap"):
        Correction(enabled=True, mode="token_truncate", clip_min=0.5, clip_max=2.0, cap=1.0)


def test_config_names_the_bad_field():
    from grpo_core.config import AsyncGRPOConfig, ConfigError

    with pytest.raises(ConfigError, match="vllm_importance_sampling_mode"):
        AsyncGRPOConfig(vllm_importance_sampling_mode="sequence_product")
    with pytest.raises(ConfigError, match="vllm_importance_sampling_cap"):
        AsyncGRPOConfig(vllm_importance_sampling_cap=0.5)
    loss = LossConfig.from_config(AsyncGRPOConfig(vllm_importance_sampling_mode="sequence_truncate",
                                                  vllm_importance_sampling_cap=3.0, max_staleness=1))
    assert loss.correction.mode == "sequence_truncate" and loss.correction.cap == 3.0 and loss.max_staleness == 1


def test_truncation_bounds_a_ratio_too_large_for_fp32():
    """exp(200) overflows fp32: the truncated weight is still exactly the cap, and the gradient finite."""
    sampler = torch.tensor([-201.0, -1.0])
    logprobs = torch.tensor([-1.0, -1.0 + math.log(1.1)], requires_grad=True)
    loss, _ = grpo_loss(LossInputs(logprobs, sampler, torch.tensor([-1.0, 1.0])), config("token_truncate"), 2)
    loss.backward()
    assert logprobs.grad.tolist() == pytest.approx([2.0 / 2, -1.1 / 2], rel=1e-6)


@pytest.mark.parametrize("setting", ["demo", "harsh"])
def test_comparison_runs_set_one_mode_each(setting):
    """scripts/mismatch_runs.py: each row's trainer settings are a valid config with that mode and setting."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("mismatch_runs", Path(__file__).parents[1] / "scripts" / "mismatch_runs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    MODES, run_name, trainer_settings = module.MODES, module.run_name, module.trainer_settings
    from flows.cli import DEMO_TRAINER
    from grpo_core.config import AsyncGRPOConfig

    names = set()
    for mode in MODES:
        name = run_name("arithmetic-hybrid-moe", mode, setting, routing_replay=False, seed=1)
        args = AsyncGRPOConfig(**trainer_settings(mode, setting, False, 1, 3, "/tmp/unused", name, evaluate=False))
        assert args.vllm_importance_sampling_correction is (mode != "none")
        assert mode == "none" or args.vllm_importance_sampling_mode == mode
        assert (args.max_steps, args.routing_replay, args.do_eval, args.run_name) == (3, False, False, name)
        assert args.learning_rate == (1e-3 if setting == "harsh" else DEMO_TRAINER["learning_rate"])
        assert args.max_staleness == (4 if setting == "harsh" else DEMO_TRAINER["max_staleness"])
        names.add(name)
    assert len(names) == len(MODES)


@pytest.mark.parametrize("mode", list(EXPECTED))
def test_loss_is_linear_in_each_advantage(mode):
    """The advantages stay on the graph: d loss_t / d A_t = loss_t / A_t (callers weigh terms with it)."""
    adv = torch.tensor(ADV, dtype=F64, requires_grad=True)
    inputs = hand_inputs()
    inputs.advantages = adv
    loss, _ = grpo_loss(inputs, mode_config(mode), N)
    loss.backward()
    values, _ = EXPECTED[mode]
    np.testing.assert_allclose(adv.grad.numpy(), np.array(values) / np.array(ADV) / N, rtol=REL, atol=1e-15)


def test_an_unbounded_max_staleness_keeps_a_bounded_number_of_buckets():
    """A run may allow any staleness (10^6 in the fleet tests); the metric parts stay a few per bucket, the oldest
    bucket holding every older sample."""
    assert staleness_buckets(0) == 1
    assert staleness_buckets(3) == 4
    assert staleness_buckets(1_000_000) == STALENESS_BUCKETS_MAX
    log_ratio = torch.tensor([0.1, -0.2, 0.05, 0.0])
    correction = Correction(enabled=True, mode="token_mask", clip_min=0.5, clip_max=2.0, cap=2.0)
    factors = correction_factors(log_ratio, torch.zeros(4), correction, torch.tensor([0, 0, 1, 1]), 2)
    parts = mismatch_parts(log_ratio, factors, torch.tensor([0, 0, 1, 1]), torch.tensor([0, 50]),
                           staleness_buckets(1_000_000))
    assert len(parts) == STALENESS_BUCKETS_MAX * (len(TOKEN_SUMS) + len(SEQ_SUMS) + 1)
    published = finalize_mismatch({k: float(v) for k, v in parts.items()})
    assert published["mismatch/tokens/staleness_0"] == 2
    assert published[f"mismatch/tokens/staleness_{STALENESS_BUCKETS_MAX - 1}"] == 2  # staleness 50 counts there


@pytest.mark.parametrize("mode", list(EXPECTED))
def test_leaving_the_metrics_out_changes_neither_loss_nor_gradient(mode):
    """``mismatch_metrics=False`` (a benchmark's way to time them) drops the ``mismatch/*`` parts and nothing else."""
    with_metrics, without = hand_inputs(), hand_inputs()
    loss_on, parts_on = grpo_loss(with_metrics, mode_config(mode), N)
    loss_off, parts_off = grpo_loss(without, mode_config(mode, mismatch_metrics=False), N)
    loss_on.backward()
    loss_off.backward()
    assert loss_off.item() == loss_on.item()
    assert torch.equal(without.logprobs.grad, with_metrics.logprobs.grad)
    published_on, published_off = finalize_metrics([parts_on]), finalize_metrics([parts_off])
    assert any(k.startswith("mismatch/") for k in published_on)
    assert not any(k.startswith("mismatch/") for k in published_off)
    assert published_off == {k: v for k, v in published_on.items() if not k.startswith("mismatch/")}

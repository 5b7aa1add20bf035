"""Tests for gspo_trl.objective.sampling_correction: truncated / masked importance sampling against the sampling
engine."""

import math

import pytest
import torch

from gspo_trl.objective.sampling_correction import CORRECTION_MODES, correction_for, sampling_correction
from gspo_trl.training.micro_batch import MicroBatch

F64 = torch.float64
# Row 0: three tokens with log(π_old / π_sampler) = (0.3, -0.1, 1.6); row 1: two tokens (-1.5, -0.1), one pad.
OLD = torch.tensor([[-1.0, -2.0, -0.4], [-2.0, -0.5, 0.0]], dtype=F64)
SAMPLING = torch.tensor([[-1.3, -1.9, -2.0], [-0.5, -0.4, float("nan")]], dtype=F64)
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=F64)
DIFFS = [[0.3, -0.1, 1.6], [-1.5, -0.1]]


def test_token_truncate_hand_computed():
    weights, stats = sampling_correction(OLD, SAMPLING, MASK, "token_truncate", clip_min=0.5, clip_max=3.0)
    # e^0.3 = 1.35, e^-0.1 = 0.905, e^1.6 = 4.95 -> 3.0, e^-1.5 = 0.223 -> 0.5, padding 0.
    expected = [[math.exp(0.3), math.exp(-0.1), 3.0], [0.5, math.exp(-0.1), 0.0]]
    torch.testing.assert_close(weights, torch.tensor(expected, dtype=F64))
    assert stats["corrected_fraction"].item() == pytest.approx(2 / 5)
    assert stats["ratio_max"].item() == pytest.approx(math.exp(1.6))  # before truncation
    assert stats["ratio_min"].item() == pytest.approx(math.exp(-1.5))
    flat = [d for row in DIFFS for d in row]
    assert stats["ratio_mean"].item() == pytest.approx(sum(math.exp(d) for d in flat) / 5)
    assert stats["sampling_logp_difference_mean"].item() == pytest.approx(sum(abs(d) for d in flat) / 5)
    assert stats["sampling_logp_difference_max"].item() == pytest.approx(1.6)
    assert stats["mismatch_kl"].item() == pytest.approx(sum(math.exp(d) - d - 1 for d in flat) / 5)


def test_token_mask_zeroes_tokens_outside_the_bounds():
    weights, _ = sampling_correction(OLD, SAMPLING, MASK, "token_mask", clip_min=0.5, clip_max=3.0)
    expected = [[math.exp(0.3), math.exp(-0.1), 0.0], [0.0, math.exp(-0.1), 0.0]]
    torch.testing.assert_close(weights, torch.tensor(expected, dtype=F64))


def test_sequence_weight_is_the_geometric_mean_of_token_ratios():
    # Row 0: mean log-ratio (0.3 - 0.1 + 1.6) / 3 = 0.6; row 1: (-1.5 - 0.1) / 2 = -0.8 (length-normalised, Eq. 7's
    # normalisation; TRL's sum would give e^1.8 and e^-1.6).
    weights, stats = sampling_correction(OLD, SAMPLING, MASK, "sequence_truncate", clip_min=0.5, clip_max=1.5)
    expected = [[1.5] * 3, [0.5, 0.5, 0.0]]  # e^0.6 = 1.82 -> 1.5; e^-0.8 = 0.449 -> 0.5
    torch.testing.assert_close(weights, torch.tensor(expected, dtype=F64))
    assert stats["ratio_max"].item() == pytest.approx(math.exp(0.6))
    assert stats["ratio_min"].item() == pytest.approx(math.exp(-0.8))
    assert stats["corrected_fraction"].item() == pytest.approx(1.0)

    weights, stats = sampling_correction(OLD, SAMPLING, MASK, "sequence_mask", clip_min=None, clip_max=1.5)
    torch.testing.assert_close(weights, torch.tensor([[0.0] * 3, [math.exp(-0.8)] * 2 + [0.0]], dtype=F64))
    assert stats["corrected_fraction"].item() == pytest.approx(0.5)


def test_sequence_weight_does_not_drift_with_length():
    # The same per-token mismatch on a 4-token and a 400-token completion gives the same sequence weight.
    short, long_ = torch.full((1, 4), 0.05, dtype=F64), torch.full((1, 400), 0.05, dtype=F64)
    w_short, _ = sampling_correction(short, torch.zeros_like(short), torch.ones_like(short), "sequence_mask")
    w_long, _ = sampling_correction(long_, torch.zeros_like(long_), torch.ones_like(long_), "sequence_mask")
    assert w_short[0, 0].item() == pytest.approx(math.exp(0.05)) == pytest.approx(w_long[0, 0].item())


def test_identical_policies_give_weight_one_and_no_mismatch():
    for mode in CORRECTION_MODES:
        weights, stats = sampling_correction(OLD, OLD, MASK, mode)
        torch.testing.assert_close(weights, MASK)
        assert stats["mismatch_kl"].item() == 0.0 and stats["corrected_fraction"].item() == 0.0


def test_tokens_the_engine_did_not_score_get_weight_one():
    sampling = SAMPLING.clone()
    sampling[0, 2] = float("nan")
    weights, stats = sampling_correction(OLD, sampling, MASK, "token_truncate", clip_max=3.0)
    assert weights[0, 2].item() == 1.0
    assert stats["sampling_logp_difference_max"].item() == pytest.approx(1.5)  # 1.6 is no longer seen
    assert torch.isfinite(torch.stack(list(stats.values()))).all()


def test_empty_batch_reports_neutral_ratios():
    mask = torch.zeros_like(MASK)
    weights, stats = sampling_correction(OLD, SAMPLING, mask, "sequence_mask")
    assert weights.abs().sum().item() == 0.0
    assert stats["ratio_min"].item() == stats["ratio_max"].item() == stats["ratio_mean"].item() == 1.0


def test_bad_mode_and_crossed_bounds_are_value_errors():
    with pytest.raises(ValueError, match="vllm_importance_sampling_mode"):
        sampling_correction(OLD, SAMPLING, MASK, "sequence")
    with pytest.raises(ValueError, match="crossed"):
        sampling_correction(OLD, SAMPLING, MASK, "token_truncate", clip_min=2.0, clip_max=1.0)


def test_mismatch_kl_of_a_tiny_fp32_gap_is_not_rounded_to_zero():
    old = torch.full((1, 4), -2.0)
    weights, stats = sampling_correction(old, old - 1e-5, torch.ones(1, 4), "token_truncate")
    assert stats["mismatch_kl"].item() == pytest.approx(0.5e-10, rel=1e-3)  # d^2 / 2


def test_a_truncating_decoding_loop_reports_the_mass_cut_away_and_no_weights():
    # The trained model's own loop: π_old is the policy, so there is nothing to reweight; the mean over completion
    # tokens of 1 − Z is reported, (1/4 + 1/2 + 0) / 3 here (the padded fourth token left out).
    from types import SimpleNamespace

    ids = torch.ones(2, 4, dtype=torch.long)
    log_mass = torch.tensor([[math.log(0.75), math.log(0.5)], [0.0, -3.0]])
    batch = MicroBatch(
        ids,
        torch.ones(2, 4),
        ids[:, 2:],
        torch.tensor([[1, 1], [1, 0]]),
        sampling_logps=torch.full((2, 2), -1.0),
        sampled_by_policy=True,
        kept_log_mass=log_mass,
    )
    args = SimpleNamespace(
        vllm_importance_sampling_mode="token_truncate",
        vllm_importance_sampling_clip_min=None,
        vllm_importance_sampling_clip_max=3.0,
        vllm_importance_sampling_correction=True,
    )
    weights, stats = correction_for(batch, torch.zeros(2, 2), args)
    assert weights is None and set(stats) == {"truncated_mass"}
    assert stats["truncated_mass"].item() == pytest.approx(0.75 / 3, abs=1e-6)  # float32 expm1: a few ulp
    batch.kept_log_mass = None
    assert correction_for(batch, torch.zeros(2, 2), args) == (None, {})

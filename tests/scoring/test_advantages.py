"""Tests for gspo_trl.scoring.advantages: hand-derived group/batch/none advantages, zero-std groups, invalid rows,
errors."""

import math

import pytest
import torch

from gspo_trl.scoring.advantages import (
    aggregate_rewards,
    batch_advantages,
    decoupled_rewards,
    discounted_returns,
    group_advantages,
    token_advantages,
    turn_advantages,
)

NAN = float("nan")


def close(actual, expected, tol=1e-5):
    return torch.allclose(actual, torch.tensor(expected, dtype=actual.dtype), atol=tol, rtol=0)


# ---- aggregate_rewards ----------------------------------------------------------------------------------------------


def test_aggregate_weighted_nansum_and_valid():
    rewards_per_func = torch.tensor([[1.0, 2.0], [NAN, 3.0], [NAN, NAN], [4.0, NAN]])  # (4, 2)
    weights = torch.tensor([0.5, 2.0])
    rewards, valid = aggregate_rewards(rewards_per_func, weights)
    # row0: 0.5*1 + 2*2 = 4.5 ; row1: 2*3 = 6 ; row2: nothing -> 0 ; row3: 0.5*4 = 2
    assert close(rewards, [4.5, 6.0, 0.0, 2.0])
    assert valid.tolist() == [True, True, False, True]


def test_aggregate_shape_errors():
    with pytest.raises(ValueError, match="rewards_per_func"):
        aggregate_rewards(torch.zeros(4), torch.ones(1))
    with pytest.raises(ValueError, match="reward_weights"):
        aggregate_rewards(torch.zeros(4, 2), torch.ones(3))


# ---- group_advantages: the three scalings ---------------------------------------------------------------------------

# Two groups of G=4.
# group 0: [1, 2, 3, 4]  mean 2.5, deviations [-1.5, -0.5, 0.5, 1.5], sum sq = 2.25+0.25+0.25+2.25 = 5
#          unbiased var = 5/3, std = sqrt(5/3) = 1.2909944
# group 1: [0, 0, 2, 2]  mean 1.0, deviations [-1, -1, 1, 1], sum sq = 4, unbiased var = 4/3, std = 1.1547005
REWARDS = torch.tensor([1.0, 2.0, 3.0, 4.0, 0.0, 0.0, 2.0, 2.0])
STD0, STD1 = math.sqrt(5 / 3), math.sqrt(4 / 3)


def test_group_scaling():
    advantages, stats = group_advantages(REWARDS, num_generations=4, scale_rewards="group")
    expected = [d / STD0 for d in (-1.5, -0.5, 0.5, 1.5)] + [d / STD1 for d in (-1, -1, 1, 1)]
    assert close(advantages, expected)
    # reward = (10 + 4) / 8 = 1.75 ; reward_std = batch std (as TRL logs it):
    # deviations from 1.75: [-.75, .25, 1.25, 2.25, -1.75, -1.75, .25, .25], sum sq = 13.5, var = 13.5/7
    assert stats["reward"] == pytest.approx(1.75)
    assert stats["reward_std"] == pytest.approx(math.sqrt(13.5 / 7), rel=1e-6)
    assert stats["frac_reward_zero_std"] == 0.0
    assert stats["num_invalid"] == 0


def test_batch_scaling():
    # batch mean 1.75; deviations [-.75, .25, 1.25, 2.25, -1.75, -1.75, .25, .25]
    # squares .5625 + .0625 + 1.5625 + 5.0625 + 3.0625 + 3.0625 + .0625 + .0625 = 13.5 ; var = 13.5/7
    batch_std = math.sqrt(13.5 / 7)
    advantages, _ = group_advantages(REWARDS, num_generations=4, scale_rewards="batch")
    expected = [d / batch_std for d in (-1.5, -0.5, 0.5, 1.5, -1, -1, 1, 1)]
    assert close(advantages, expected)


def test_no_scaling():
    advantages, _ = group_advantages(REWARDS, num_generations=4, scale_rewards="none")
    assert close(advantages, [-1.5, -0.5, 0.5, 1.5, -1, -1, 1, 1])


def test_boolean_scale_rewards_aliases():
    assert torch.equal(group_advantages(REWARDS, 4, True)[0], group_advantages(REWARDS, 4, "group")[0])
    assert torch.equal(group_advantages(REWARDS, 4, False)[0], group_advantages(REWARDS, 4, "none")[0])


def test_integer_rewards_become_float():
    advantages, _ = group_advantages(torch.tensor([0, 1]), num_generations=2, scale_rewards="none")
    assert advantages.dtype == torch.float32
    assert close(advantages, [-0.5, 0.5])


# ---- zero-std groups ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("scale_rewards", ["group", "batch", "none"])
def test_zero_std_groups_are_zero_and_counted(scale_rewards):
    # group 0 constant (0.1 is not exact in binary: mean round-off must not leak), group 1 = [0, 1]
    rewards = torch.tensor([0.1, 0.1, 0.1, 0.0, 1.0, 1.0])
    advantages, stats = group_advantages(rewards, num_generations=3, scale_rewards=scale_rewards)
    assert torch.equal(advantages[:3], torch.zeros(3))
    assert torch.isfinite(advantages).all()
    assert stats["frac_reward_zero_std"] == pytest.approx(0.5)
    # batch [.1, .1, .1, 0, 1, 1]: mean 2.3/6; reward_std is the batch's unbiased std
    assert stats["reward_std"] == pytest.approx(
        torch.tensor(rewards.tolist(), dtype=torch.float64).std().item(), rel=1e-5
    )


def test_all_groups_constant_gives_all_zero_no_nan():
    advantages, stats = group_advantages(torch.full((6,), 3.0), num_generations=3, scale_rewards="batch")
    assert torch.equal(advantages, torch.zeros(6))
    assert stats["frac_reward_zero_std"] == 1.0
    assert stats["reward_std"] == 0.0


# ---- invalid rows ---------------------------------------------------------------------------------------------------


def test_invalid_rows_excluded_from_baseline_and_zero():
    # group 0: [1, <invalid 100>, 3] -> valid [1, 3], mean 2, std sqrt(2) ; group 1: [5, 7, 9] mean 7, std 2
    rewards = torch.tensor([1.0, 100.0, 3.0, 5.0, 7.0, 9.0])
    valid = torch.tensor([True, False, True, True, True, True])
    advantages, stats = group_advantages(rewards, 3, "group", valid=valid)
    assert close(advantages, [-1 / math.sqrt(2), 0.0, 1 / math.sqrt(2), -1.0, 0.0, 1.0])
    assert advantages[1].item() == 0.0
    assert stats["num_invalid"] == 1
    assert stats["reward"] == pytest.approx((1 + 3 + 5 + 7 + 9) / 5)


def test_invalid_rows_excluded_from_batch_std():
    # valid values [1, 3, 5, 7, 9]: mean 5, sum sq 16+4+0+4+16 = 40, var 10 ; NaN row must not poison anything
    rewards = torch.tensor([1.0, NAN, 3.0, 5.0, 7.0, 9.0])
    advantages, stats = group_advantages(rewards, 3, "batch")  # valid defaults to isfinite
    assert close(advantages, [-1 / math.sqrt(10), 0.0, 1 / math.sqrt(10), -2 / math.sqrt(10), 0.0, 2 / math.sqrt(10)])
    assert stats["num_invalid"] == 1


def test_group_with_single_valid_row_is_zero_std():
    rewards = torch.tensor([4.0, NAN, NAN, 1.0, 2.0, 3.0])
    advantages, stats = group_advantages(rewards, 3, "group")
    assert torch.equal(advantages[:3], torch.zeros(3))
    assert close(advantages[3:], [-1.0, 0.0, 1.0])
    assert stats["frac_reward_zero_std"] == pytest.approx(0.5)
    assert stats["num_invalid"] == 2


def test_no_valid_rows():
    advantages, stats = group_advantages(torch.full((4,), NAN), 2)
    assert torch.equal(advantages, torch.zeros(4))
    assert math.isnan(stats["reward"])
    assert stats["num_invalid"] == 4
    assert stats["frac_reward_zero_std"] == 1.0


def test_pipeline_aggregate_then_group():
    rewards_per_func = torch.tensor([[1.0, NAN], [NAN, NAN], [3.0, 1.0], [0.0, 0.0]])
    rewards, valid = aggregate_rewards(rewards_per_func, torch.ones(2))
    advantages, stats = group_advantages(rewards, 2, "none", valid=valid)
    # group 0: only row 0 valid -> zero-std ; group 1: [4, 0] mean 2 -> [2, -2]
    assert close(advantages, [0.0, 0.0, 2.0, -2.0])
    assert stats["num_invalid"] == 1


# ---- errors ---------------------------------------------------------------------------------------------------------


def test_errors():
    with pytest.raises(ValueError, match="divisible by num_generations"):
        group_advantages(torch.zeros(5), 2)
    with pytest.raises(ValueError, match="num_generations"):
        group_advantages(torch.zeros(4), 1)
    with pytest.raises(ValueError, match=r"scale_rewards.*'group', 'batch', 'none'"):
        group_advantages(torch.zeros(4), 2, scale_rewards="std")
    with pytest.raises(ValueError, match="valid"):
        group_advantages(torch.zeros(4), 2, valid=torch.ones(3, dtype=torch.bool))
    with pytest.raises(ValueError, match="rewards must be 1-D"):
        group_advantages(torch.zeros(2, 2), 2)
    with pytest.raises(ValueError, match="empty"):
        group_advantages(torch.zeros(0), 2)
    with pytest.raises(ValueError, match="marked valid"):
        group_advantages(torch.tensor([1.0, NAN]), 2, valid=torch.ones(2, dtype=torch.bool))


# --- multi-turn: per-turn returns and advantages ------------------------------------------------


def test_discounted_returns_hand_computed():
    rewards = torch.tensor([[1.0, 0.0, 2.0], [0.5, 3.0, 9.0]])
    reached = torch.tensor([[True, True, True], [True, True, False]])  # row 1 stopped after two turns
    # gamma = 0.5: row 0 -> (1 + 0.5 * (0 + 0.5 * 2), 0 + 0.5 * 2, 2) = (1.5, 1, 2); row 1 -> (0.5 + 1.5, 3, 0).
    expected = torch.tensor([[1.5, 1.0, 2.0], [2.0, 3.0, 0.0]])
    torch.testing.assert_close(discounted_returns(rewards, reached, gamma=0.5), expected)
    torch.testing.assert_close(discounted_returns(rewards, reached), torch.tensor([[3.0, 2.0, 2.0], [3.5, 3.0, 0.0]]))


def test_discounted_returns_checks_inputs():
    with pytest.raises(ValueError, match="gamma"):
        discounted_returns(torch.zeros(2, 2), torch.ones(2, 2, dtype=torch.bool), gamma=1.5)
    with pytest.raises(ValueError, match="reached"):
        discounted_returns(torch.zeros(2, 2), torch.ones(2, 3, dtype=torch.bool))


def test_turn_advantages_normalise_each_turn_over_the_members_that_reached_it():
    # One group of 3 episodes, gamma 1. Returns: episode 0 (1 turn, r=1) -> (1); episode 1 (2 turns, r=0, 2) ->
    # (2, 2); episode 2 (3 turns, r=0, 0, 1) -> (1, 1, 1).
    rewards = torch.tensor([[1.0, 0.0, 0.0], [0.0, 2.0, 0.0], [0.0, 0.0, 1.0]])
    reached = torch.tensor([[True, False, False], [True, True, False], [True, True, True]])
    advantages = turn_advantages(rewards, reached, num_generations=3, scale_rewards="none")
    # Turn 0: returns (1, 2, 1), mean 4/3. Turn 1: episodes 1, 2 with (2, 1), mean 1.5. Turn 2: one member -> 0.
    expected = torch.tensor([[-1 / 3, 0.0, 0.0], [2 / 3, 0.5, 0.0], [-1 / 3, -0.5, 0.0]])
    torch.testing.assert_close(advantages, expected)
    scaled = turn_advantages(rewards, reached, num_generations=3, scale_rewards="group")
    turn0_std = torch.tensor([1.0, 2.0, 1.0]).std()
    turn1_std = torch.tensor([2.0, 1.0]).std()
    torch.testing.assert_close(scaled[:, 0], expected[:, 0] / turn0_std)
    torch.testing.assert_close(scaled[1:, 1], expected[1:, 1] / turn1_std)


def test_turn_advantages_with_one_turn_equal_group_advantages():
    g = torch.Generator().manual_seed(0)
    rewards = torch.randn(12, generator=g)
    valid = torch.ones(12, dtype=torch.bool)
    valid[5] = False
    for scale in ("group", "batch", "none"):
        expected, _ = group_advantages(rewards, 4, scale, valid)
        got = turn_advantages(rewards[:, None], torch.ones(12, 1, dtype=torch.bool), 4, scale, valid=valid)
        torch.testing.assert_close(got[:, 0], expected)


def test_token_advantages_gather_each_tokens_turn():
    per_turn = torch.tensor([[1.0, -2.0], [0.5, 0.0]])
    turn_ids = torch.tensor([[0, 0, -1, 1], [0, 1, 1, 5]])  # -1 / 5: environment or padding tokens
    torch.testing.assert_close(
        token_advantages(per_turn, turn_ids), torch.tensor([[1.0, 1.0, 1.0, -2.0], [0.5, 0.0, 0.0, 0.0]])
    )


# --- GDPO: normalise each reward function within its group, then sum (multi_objective_aggregation) ---------------


def test_decoupled_rewards_normalise_each_function_within_its_group_before_the_weighted_sum():
    # Group 1: f1 = [1, 0, 0] has mean 1/3 and (Bessel) std 1/sqrt(3), so z1 = [2, -1, -1] / sqrt(3); f2 = [10, 10,
    # 40] has mean 20 and std 10 sqrt(3), so z2 = [-1, -1, 2] / sqrt(3). Group 2: f1 is constant (adds 0), f2 = [1, 2,
    # 3] gives z2 = [-1, 0, 1]. Summed with weights (1, 1), f2's larger scale no longer drowns f1.
    table = torch.tensor([[1.0, 10.0], [0.0, 10.0], [0.0, 40.0], [5.0, 1.0], [5.0, 2.0], [5.0, 3.0]])
    rewards, valid = decoupled_rewards(table, torch.ones(2), num_generations=3)
    root3 = 3**0.5
    expected = torch.tensor([1 / root3, -2 / root3, 1 / root3, -1.0, 0.0, 1.0])
    torch.testing.assert_close(rewards, expected)  # float32 rounding of O(1) values: the default rtol 1.3e-6
    assert valid.all()
    # GDPO's last step: the batch's own mean (0 here) and Bessel std: sum of squares 4 over 5, std 2/sqrt(5).
    torch.testing.assert_close(batch_advantages(rewards, valid), expected * 5**0.5 / 2)


def test_decoupled_rewards_skip_a_function_where_it_gave_none_and_rows_with_no_reward_are_invalid():
    nan = float("nan")
    table = torch.tensor([[1.0, nan], [3.0, 2.0], [nan, 4.0], [nan, nan]])  # groups of 2
    rewards, valid = decoupled_rewards(table, torch.tensor([1.0, 2.0]), num_generations=2)
    # Group 1: f1 = [1, 3] gives [-1, 1] / sqrt(2); f2 has one number (no spread) and adds 0. Group 2: f1 one number,
    # f2 one number: nothing to compare, 0.
    torch.testing.assert_close(rewards, torch.tensor([-(0.5**0.5), 0.5**0.5, 0.0, 0.0]))
    assert valid.tolist() == [True, True, True, False]
    advantages = batch_advantages(rewards, valid)
    assert advantages[3] == 0


def test_decoupled_advantages_equal_trls_normalize_then_sum_up_to_its_epsilon():
    # TRL 1.16 (GRPOTrainer, multi_objective_aggregation="normalize_then_sum") divides by std + 1e-4 twice; gspo-trl
    # divides by the std. Each normalised reward z = d / s then shrinks by a relative 1e-4 / s, so a row's summed
    # reward moves by at most e_i = sum_k |w_k z_k| 1e-4 / s_k, the batch std by at most the std of those moves
    # (|std(r) - std(r')| <= std(r - r') <= sqrt(sum e_i^2 / (N - 1))), and TRL adds 1e-4 to it: a row's advantage
    # then moves by at most (e_i + |A_i| (sqrt(sum e^2 / (N - 1)) + 1e-4)) / std, the bound each row is held to (and
    # float32 rounding, 1e-5).
    generator = torch.Generator().manual_seed(0)
    groups, size, functions = 16, 8, 3
    table = torch.randn(groups * size, functions, generator=generator) * torch.tensor([1.0, 10.0, 0.1])
    weights = torch.tensor([1.0, 0.5, 2.0])
    grouped = table.view(groups, size, functions)
    mean_k, std_k = grouped.mean(dim=1, keepdim=True), grouped.std(dim=1, keepdim=True)
    z = (grouped - mean_k) / std_k  # (groups, G, F)
    trl_rewards = (((grouped - mean_k) / (std_k + 1e-4)).view(-1, functions) * weights).sum(dim=1)
    trl_std = trl_rewards.std()
    trl_advantages = (trl_rewards - trl_rewards.mean()) / (trl_std + 1e-4)
    rewards, valid = decoupled_rewards(table, weights, size)
    ours = batch_advantages(rewards, valid)
    reward_shift = ((z.abs() * weights * 1e-4 / std_k).sum(dim=2)).view(-1)  # (N,)
    std_shift = (reward_shift.square().sum() / (reward_shift.numel() - 1)).sqrt()
    bound = (reward_shift + trl_advantages.abs() * (std_shift + 1e-4)) / trl_std
    assert ((ours - trl_advantages).abs() <= 1.01 * bound + 1e-5).all()
    assert (ours - trl_advantages).abs().max() > 1e-5  # the epsilon is visible: the comparison is not vacuous

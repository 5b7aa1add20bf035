"""Tests for gspo_trl.scoring.score: a rollout's reward table to this process's advantages (one process here; the
multi-process gathering is exercised by test_distributed.py)."""

from types import SimpleNamespace

import torch

from gspo_trl.scoring.advantages import group_advantages, turn_advantages
from gspo_trl.scoring.score import score_rollout


class OneProcess:
    process_index = 0

    @staticmethod
    def gather(tensor):
        return tensor

    @staticmethod
    def pad_across_processes(tensor, dim=0):
        return tensor


def args(**overrides):
    values = dict(
        num_generations=2,
        scale_rewards="none",
        turn_discount=1.0,
        advantage_granularity="trajectory",
        multi_objective_aggregation="sum_then_normalize",
        skip_rollouts_without_rewards=False,
    )
    values.update(overrides)
    return SimpleNamespace(**values)


def test_single_turn_rows_get_group_advantages_of_the_weighted_sum():
    table = torch.tensor([[1.0, float("nan")], [0.0, 2.0], [3.0, 1.0], [1.0, 1.0]])
    scores = score_rollout(table, torch.tensor([1.0, 0.5]), args(), OneProcess)
    totals = torch.tensor([1.0, 1.0, 3.5, 1.5])
    torch.testing.assert_close(scores.rewards, totals)
    torch.testing.assert_close(scores.advantages, group_advantages(totals, 2, "none")[0])
    assert scores.stats["reward"] == totals.mean().item()


def test_episodes_put_the_environment_return_first_and_add_the_functions_to_the_last_turn():
    rollout = SimpleNamespace(turn_ids=torch.tensor([[0, 0, -1, 1], [0, -1, 1, 1]]))
    episodes = SimpleNamespace(
        turn_rewards=torch.tensor([[0.0, 1.0], [1.0, 0.0]]),
        reached=torch.tensor([[True, True], [True, True]]),
        rollout=rollout,
    )
    functions = torch.tensor([[2.0], [0.0]])  # one reward function, scored on the whole episode
    trajectory = score_rollout(functions, torch.ones(1), args(), OneProcess, episodes)
    torch.testing.assert_close(trajectory.rewards_per_func, torch.tensor([[1.0, 2.0], [1.0, 0.0]]))
    torch.testing.assert_close(trajectory.rewards, torch.tensor([3.0, 1.0]))  # returns: env + functions
    torch.testing.assert_close(trajectory.advantages, torch.tensor([1.0, -1.0]))
    per_turn = score_rollout(functions, torch.ones(1), args(advantage_granularity="turn"), OneProcess, episodes)
    expected = turn_advantages(torch.tensor([[0.0, 3.0], [1.0, 0.0]]), episodes.reached, 2, "none")  # (2, 2)
    torch.testing.assert_close(per_turn.advantages, expected.gather(1, rollout.turn_ids.clamp(min=0)))


def test_a_rollout_without_any_reward_raises_naming_the_functions():
    import pytest

    table = torch.full((4, 2), float("nan"))
    with pytest.raises(ValueError, match=r"Every reward function \(accuracy, format\) returned None.*skip_rollouts_"):
        score_rollout(table, torch.ones(2), args(), OneProcess, function_names=["accuracy", "format"])
    table[1, 0] = 1.0  # one number anywhere in the rollout: the other rows are left out, as before
    assert score_rollout(table, torch.ones(2), args(), OneProcess).stats["num_invalid"] == 3


def test_a_rollout_without_any_reward_is_skipped_with_a_warning_when_asked(caplog):
    # skip_rollouts_without_rewards: no error; a warning naming the functions with one of the prompts, every advantage
    # 0 and `skipped` set (so that the loss of its `MicroBatch` is multiplied by 0). A rollout with one number
    # is scored as without the option, `skipped` False; without the option, `skipped` is None.
    table = torch.full((4, 2), float("nan"))
    with caplog.at_level("WARNING"):
        scores = score_rollout(
            table,
            torch.ones(2),
            args(skip_rollouts_without_rewards=True),
            OneProcess,
            function_names=["accuracy", "format"],
            prompts=["What is 2 + 2?", "Name a colour."],
        )
    assert "Every reward function (accuracy, format) returned None" in caplog.text
    assert "'What is 2 + 2?'" in caplog.text
    assert scores.skipped is True and scores.advantages.tolist() == [0.0] * 4
    assert scores.stats["num_invalid"] == 4 and scores.stats["frac_reward_zero_std"] == 1.0
    table[1, 0] = 1.0
    scored = score_rollout(table, torch.ones(2), args(skip_rollouts_without_rewards=True), OneProcess)
    assert scored.skipped is False
    torch.testing.assert_close(scored.advantages, score_rollout(table, torch.ones(2), args(), OneProcess).advantages)
    assert score_rollout(table, torch.ones(2), args(), OneProcess).skipped is None


def test_normalize_then_sum_takes_gdpo_advantages_and_logs_the_summed_reward():
    from gspo_trl.scoring.advantages import batch_advantages, decoupled_rewards

    table = torch.tensor([[1.0, 10.0], [0.0, 30.0], [1.0, 1.0], [0.0, 2.0]])
    weights = torch.tensor([1.0, 0.5])
    scores = score_rollout(table, weights, args(multi_objective_aggregation="normalize_then_sum"), OneProcess)
    expected = batch_advantages(*decoupled_rewards(table, weights, 2))
    torch.testing.assert_close(scores.advantages, expected)
    torch.testing.assert_close(scores.rewards, torch.tensor([6.0, 15.0, 1.5, 1.0]))  # the weighted sum, as logged
    assert not torch.allclose(expected, score_rollout(table, weights, args(), OneProcess).advantages)


def test_a_group_of_one_measures_rewards_and_gives_no_advantage():
    # Evaluation with num_generations_eval=1: no group to compare within.
    table = torch.tensor([[1.0], [3.0], [float("nan")]])
    scores = score_rollout(table, torch.ones(1), args(), OneProcess, group_size=1)
    assert scores.advantages.tolist() == [0.0, 0.0, 0.0]
    stats = scores.stats
    assert (stats["reward"], stats["num_invalid"], stats["frac_reward_zero_std"]) == (2.0, 1, 1.0)
    assert abs(stats["reward_std"] / 2**0.5 - 1) < 1e-6  # the sample std of (1, 3) in float32

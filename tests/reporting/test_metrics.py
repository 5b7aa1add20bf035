"""Metric buffering and the derived rollout/loss metrics."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from gspo_trl.reporting.metrics import (
    MetricsBuffer,
    completion_length_metrics,
    loss_metrics,
    metric_counts,
    reduce_across_processes,
    reward_columns,
    reward_function_metrics,
)


def test_buffer_averages_ignoring_nan_and_clears():
    buffer = MetricsBuffer()
    for value in (1.0, math.nan, torch.tensor(3.0)):
        buffer.add("train", "reward", value)
    buffer.add("train", "only_nan", math.nan)
    assert buffer.pop_averages("train") == {"reward": 2.0}
    assert buffer.pop_averages("train") == {}


def test_completion_length_metrics():
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    metrics = completion_length_metrics(mask, torch.tensor([False, True]))
    assert metrics == {
        "completions/mean_length": 2.5,
        "completions/min_length": 2.0,
        "completions/max_length": 3.0,
        "completions/clipped_ratio": 0.5,
    }


def test_loss_metrics_renames_and_drops_kl_without_beta():
    stats = {"clip_fraction_low": 0.1, "clip_fraction": 0.3, "ratio_mean": 1.0, "kl_mean": 0.0}
    assert loss_metrics(stats, 2.0, beta=0.0) == {
        "clip_ratio/low": 0.1,
        "clip_ratio/region": 0.3,
        "ratio/mean": 1.0,
        "entropy": 2.0,
    }
    assert loss_metrics(stats, 2.0, beta=0.1)["kl"] == 0.0


def test_reduce_across_processes_uses_min_max_for_ratio_extremes():
    def two_processes(row):  # accelerator.gather with a second process whose values (not counts) are doubled
        values, counts = row.chunk(2, dim=1)
        return torch.cat([row, torch.cat([values * 2, counts], dim=1)])

    reduced = reduce_across_processes({"ratio/min": 0.9, "ratio/max": 1.1, "entropy": 1.0}, two_processes)
    assert reduced["ratio/min"].item() == pytest.approx(0.9)
    assert reduced["ratio/max"].item() == pytest.approx(2.2)
    assert reduced["entropy"].item() == pytest.approx(1.5)


def test_reduce_across_processes_weights_means_by_each_process_count():
    # Process 0: 3 tokens in 1 sequence, kl mean 1.0; process 1: 1 token in 1 sequence, kl mean 5.0. One process
    # holding all 4 tokens would log (3 * 1 + 1 * 5) / 4 = 2.0, not the unweighted 3.0. The sequence-level ratio mean
    # weighs the two sequences equally; a process with no valid token (count 0) adds nothing.
    masks = [torch.tensor([[1, 1, 1]]), torch.tensor([[1, 0, 0]]), torch.tensor([[0, 0, 0]])]
    local = [
        {"kl": 1.0, "ratio/mean": 1.2, "aux_loss": 1.0},
        {"kl": 5.0, "ratio/mean": 0.8, "aux_loss": 3.0},
        {"kl": 0.0, "ratio/mean": 1.0, "aux_loss": 2.0},
    ]
    rows = []

    def gather_all(values):  # the first call records each process's row in turn; returns them all
        rows.append(values)
        return torch.cat(rows)

    for metrics, mask in zip(local, masks):
        reduced = reduce_across_processes(metrics, gather_all, metric_counts(mask, "sequence"))
    assert reduced["kl"].item() == pytest.approx(2.0)
    assert reduced["ratio/mean"].item() == pytest.approx(1.0)
    assert reduced["aux_loss"].item() == pytest.approx(2.0)  # no unit: the plain mean
    counts = metric_counts(masks[0], "token")
    assert counts["units"].item() == 3 and counts["sequences"].item() == 1
    assert reduce_across_processes({"kl": 4.0}, lambda v: v, metric_counts(masks[2], "token"))["kl"].item() == 4.0


def test_reward_function_metrics_ignore_none_rows():
    rewards = torch.tensor([[1.0, math.nan], [3.0, math.nan], [math.nan, 2.0]])
    metrics = reward_function_metrics(rewards, ["a", "b"])
    assert metrics["rewards/a/mean"] == 2.0 and metrics["rewards/a/std"] == pytest.approx(math.sqrt(2))
    assert metrics["rewards/b/mean"] == 2.0 and math.isnan(metrics["rewards/b/std"])  # one score: no spread


def test_reward_columns_name_the_environments_return_and_drop_it_for_tools():
    scores = SimpleNamespace(rewards_per_func=torch.tensor([[0.5, 1.0], [1.0, 0.0]]))  # with episodes: env first
    names, table = reward_columns(scores, ["f", "g"], episodes=None, uses_tools=False)
    assert names == ["f", "g"] and table is scores.rewards_per_func  # no episodes: the functions' own table
    names, table = reward_columns(scores, ["f"], episodes=object(), uses_tools=False)
    assert names == ["env", "f"] and table.tolist() == [[0.5, 1.0], [1.0, 0.0]]
    names, table = reward_columns(scores, ["f"], episodes=object(), uses_tools=True)
    assert names == ["f"] and table.tolist() == [[1.0], [0.0]]  # tool episodes have no step rewards

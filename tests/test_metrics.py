"""Metric buffering and the derived rollout/loss metrics."""

from __future__ import annotations

import math

import torch

from gspo_trl.metrics import MetricsBuffer, completion_length_metrics, loss_metrics


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
        "completions/mean_length": 2.5, "completions/min_length": 2.0, "completions/max_length": 3.0,
        "completions/clipped_ratio": 0.5,
    }


def test_loss_metrics_renames_and_drops_kl_without_beta():
    stats = {"clip_fraction_low": 0.1, "clip_fraction": 0.3, "ratio_mean": 1.0, "kl_mean": 0.0}
    assert loss_metrics(stats, 2.0, beta=0.0) == {"clip_ratio/low": 0.1, "clip_ratio/region": 0.3, "ratio/mean": 1.0, "entropy": 2.0}
    assert loss_metrics(stats, 2.0, beta=0.1)["kl"] == 0.0

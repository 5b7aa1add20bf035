"""What reward functions log with TRL's `log_metric` and `log_extra`: the checks on what they pass, and each metric's
mean over every call (the mean over processes runs in the two-process test of test_completion_logs.py)."""

from __future__ import annotations

import math
import types

import pytest
import torch

from gspo_trl.reporting.reward_logs import RewardFunctionLogs

ONE_PROCESS = types.SimpleNamespace(num_processes=1)


def test_a_metric_is_the_mean_over_every_call_and_nan_counts_as_not_logged():
    logs = RewardFunctionLogs(3)
    logs.log_metric("accuracy", 1.0)
    logs.log_metric("accuracy", torch.tensor(0.5))  # a one-element tensor
    logs.log_metric("accuracy", True)  # a bool counts as 0/1, as rewards do
    logs.log_metric("format", float("nan"))
    means = logs.metric_means(ONE_PROCESS)
    assert means["accuracy"] == pytest.approx(2.5 / 3)
    assert math.isnan(means["format"])  # only NaN logged: NaN, which the metric buffer leaves out of the log


def test_log_metric_refuses_what_is_not_one_number():
    logs = RewardFunctionLogs(2)
    with pytest.raises(TypeError, match="log_metric\\('acc', value\\): value must be a number, got list"):
        logs.log_metric("acc", [1.0, 0.0])
    with pytest.raises(TypeError, match="got a tensor of shape \\(2,\\)"):
        logs.log_metric("acc", torch.tensor([1.0, 0.0]))
    with pytest.raises(TypeError, match="name must be a str"):
        logs.log_metric(3, 1.0)


def test_log_extra_keeps_one_value_per_completion_and_refuses_the_rest():
    logs = RewardFunctionLogs(2, taken_columns=["count_digits"])
    logs.log_extra("note", ("a", "b"))
    logs.log_extra("score", torch.tensor([1.0, 2.0]))
    assert logs.columns == {"note": ["a", "b"], "score": [1.0, 2.0]}
    with pytest.raises(ValueError, match="got 3 values for 2 completions"):
        logs.log_extra("other", [1, 2, 3])
    with pytest.raises(ValueError, match="called twice for the same completions"):
        logs.log_extra("note", ["c", "d"])
    for taken in ("count_digits", "advantage", "prompt"):  # a reward function's column and the table's own
        with pytest.raises(ValueError, match=f"has a column '{taken}' already"):
            logs.log_extra(taken, ["c", "d"])
    with pytest.raises(TypeError, match="values must be a list with one entry per completion, got str"):
        logs.log_extra("text", "ab")
    assert list(logs.columns) == ["note", "score"]

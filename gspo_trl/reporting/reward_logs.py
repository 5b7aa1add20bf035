"""What reward functions log through TRL's two hooks, for one scored batch of completions.

`log_metric(name, value)` logs a scalar: the number logged for the rollout is the mean over every call on every
process (TRL's sum and count over processes), then averaged with the other rollouts between two logs like any
metric. `log_extra(column, values)` adds a column to the completion table: one value per completion the reward
functions were called on, gathered with the rows (a process that did not log a column shows None there).

Owns the hooks handed to reward functions, what they accept, and combining one batch's metrics over processes.
Does not own calling the reward functions (`scoring.rewards`), the metric buffer (`metrics`) or the table
(`completion_logs`).
"""

from __future__ import annotations

import math
import numbers

import torch

# Columns the completion table has already (the reward functions' own names are added per run).
TABLE_COLUMNS = ("step", "prompt", "completion", "advantage")


class RewardFunctionLogs:
    """The hooks `log_metric` and `log_extra` for one batch of `num_completions` completions on this process;
    `taken_columns`: the table's own column names, which `log_extra` must not overwrite."""

    def __init__(self, num_completions: int, taken_columns=()):
        self.num_completions = num_completions
        self.taken_columns = set(TABLE_COLUMNS) | set(taken_columns)
        self.metrics: dict[str, list[float]] = {}
        self.columns: dict[str, list] = {}

    def log_metric(self, name: str, value) -> None:
        """Log a scalar `value` under `name` (a number, a bool or a one-element tensor; NaN counts as not logged)."""
        if not isinstance(name, str):
            raise TypeError(f"log_metric(name, value): name must be a str, got {type(name).__name__}")
        if isinstance(value, torch.Tensor):
            if value.numel() != 1:
                raise TypeError(
                    f"log_metric({name!r}, value): value must be one number, got a tensor of shape {tuple(value.shape)}"
                )
            value = value.item()
        if not isinstance(value, numbers.Real):
            raise TypeError(f"log_metric({name!r}, value): value must be a number, got {type(value).__name__}")
        self.metrics.setdefault(name, []).append(float(value))

    def log_extra(self, column: str, values) -> None:
        """Add `column` to the completion table: `values` holds one entry per completion, in the order given."""
        if not isinstance(column, str):
            raise TypeError(f"log_extra(column, values): column must be a str, got {type(column).__name__}")
        if column in self.taken_columns:
            raise ValueError(
                f"log_extra({column!r}, values): the completion table has a column {column!r} already (its own, or a "
                "reward function's); choose another name"
            )
        if isinstance(values, (str, bytes)) or not hasattr(values, "__len__"):
            raise TypeError(
                f"log_extra({column!r}, values): values must be a list with one entry per completion, got "
                f"{type(values).__name__}"
            )
        values = values.tolist() if isinstance(values, torch.Tensor) else list(values)
        if len(values) != self.num_completions:
            raise ValueError(
                f"log_extra({column!r}, values): got {len(values)} values for {self.num_completions} completions; "
                "pass one value per completion"
            )
        if column in self.columns:
            raise ValueError(
                f"log_extra({column!r}, values) was called twice for the same completions (by two reward functions, "
                "or twice by one): give each column its own name"
            )
        self.columns[column] = values

    def metric_means(self, accelerator) -> dict[str, float]:
        """Each logged metric's mean over every call on every process (a collective: every process calls it). A
        metric some processes did not log averages over the calls that did; NaN values count as not logged."""
        local = {name: _sum_and_count(values) for name, values in self.metrics.items()}
        parts = [local]
        if accelerator.num_processes > 1:
            from accelerate.utils import gather_object

            parts = gather_object([local])
        totals: dict[str, list[float]] = {}
        for part in parts:
            for name, (total, count) in part.items():
                entry = totals.setdefault(name, [0.0, 0])
                entry[0] += total
                entry[1] += count
        return {name: (total / count if count else math.nan) for name, (total, count) in sorted(totals.items())}


def _sum_and_count(values: list[float]) -> tuple[float, int]:
    finite = [value for value in values if not math.isnan(value)]
    return sum(finite), len(finite)

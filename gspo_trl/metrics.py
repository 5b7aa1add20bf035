"""Training metrics: what a rollout and a loss step report, buffered until the trainer logs.

Owns the metric names users see (`reward`, `completions/mean_length`, `clip_ratio/low`, ...) and
their averaging over the steps between two logs. The numbers themselves come from the modules
that own the quantities (the loss, the advantages, the rollout).
"""

from __future__ import annotations

import math
from collections import defaultdict

import torch

# Names of `policy_loss` stats as logged (TRL's names where TRL has the same metric).
LOSS_STAT_NAMES = {
    "clip_fraction_low": "clip_ratio/low",
    "clip_fraction_high": "clip_ratio/high",
    "clip_fraction": "clip_ratio/region",
    "ratio_mean": "ratio/mean",
    "ratio_min": "ratio/min",
    "ratio_max": "ratio/max",
    "log_ratio_abs_mean": "ratio/log_abs_mean",
    "kl_mean": "kl",
    "sapo_gate_weight": "sapo/gate_weight",
    "cispo_clip_fraction": "cispo_clip_ratio",
    "vespo_weight_mean": "vespo/phi_seq_mean",
    "off_policy_masked_fraction": "off_policy/masked_fraction",
}


class MetricsBuffer:
    """Per-mode lists of values, averaged (ignoring NaN) and cleared at each log."""

    def __init__(self):
        self._values = {"train": defaultdict(list), "eval": defaultdict(list)}

    def add(self, mode: str, name: str, value) -> None:
        if isinstance(value, torch.Tensor):
            value = value.detach().float().item()
        self._values[mode][name].append(float(value))

    def add_many(self, mode: str, values: dict) -> None:
        for name, value in values.items():
            self.add(mode, name, value)

    def pop_averages(self, mode: str) -> dict[str, float]:
        averages = {}
        for name, values in self._values[mode].items():
            finite = [v for v in values if not math.isnan(v)]
            if finite:
                averages[name] = sum(finite) / len(finite)
        self._values[mode].clear()
        return averages


def reward_function_metrics(rewards_per_func: torch.Tensor, names: list[str]) -> dict[str, float]:
    """Mean and std of each reward function's scores (N, F), ignoring its None (NaN) rows."""
    metrics = {}
    for index, name in enumerate(names):
        scored = rewards_per_func[:, index][~torch.isnan(rewards_per_func[:, index])]  # (n_scored,)
        metrics[f"rewards/{name}/mean"] = scored.mean().item() if scored.numel() else float("nan")
        metrics[f"rewards/{name}/std"] = scored.std().item() if scored.numel() > 1 else float("nan")
    return metrics


def completion_length_metrics(completion_mask: torch.Tensor, is_truncated: torch.Tensor) -> dict[str, float]:
    lengths = completion_mask.sum(dim=1).float()  # (N,)
    return {
        "completions/mean_length": lengths.mean().item(),
        "completions/min_length": lengths.min().item(),
        "completions/max_length": lengths.max().item(),
        "completions/clipped_ratio": is_truncated.float().mean().item(),
    }


def loss_metrics(stats: dict, entropy_mean: torch.Tensor, beta: float) -> dict[str, float]:
    metrics = {LOSS_STAT_NAMES[k]: v for k, v in stats.items() if k in LOSS_STAT_NAMES}
    if beta == 0:
        metrics.pop("kl", None)
    metrics["entropy"] = entropy_mean
    return metrics


# What each loss metric is a mean over, so that the mean over processes weights each process by its count and
# equals the one-process number. "units": sequences at the sequence level, tokens otherwise (the loss's own unit).
METRIC_UNITS = {
    "clip_ratio/low": "units", "clip_ratio/high": "units", "clip_ratio/region": "units",
    "ratio/mean": "units", "ratio/log_abs_mean": "units", "sapo/gate_weight": "units", "cispo_clip_ratio": "units",
    "kl": "tokens", "entropy": "tokens",
    "vespo/phi_seq_mean": "sequences", "off_policy/masked_fraction": "sequences",
}


def metric_counts(completion_mask: torch.Tensor, importance_sampling_level: str) -> dict[str, torch.Tensor]:
    """The counts this process's loss metrics average over: valid tokens, valid sequences, and the level's unit."""
    mask = completion_mask.bool()  # (B, T)
    tokens, sequences = mask.sum(), mask.any(dim=1).sum()
    return {"tokens": tokens, "sequences": sequences,
            "units": sequences if importance_sampling_level == "sequence" else tokens}


def reduce_across_processes(metrics: dict, gather, counts: dict | None = None) -> dict[str, torch.Tensor]:
    """Combine each process's loss metrics with one collective: min/max for the ratio extremes, otherwise the mean
    weighted by each process's count (`metric_counts`, as `METRIC_UNITS` assigns them): the number one process
    would log for the whole micro-batch. Metrics without a unit (and all of them without counts) take the plain
    mean; so does a metric whose count is zero on every process."""
    names = list(metrics)
    device = next((v.device for v in metrics.values() if isinstance(v, torch.Tensor)), None)

    def as_row(values):
        return torch.stack([torch.as_tensor(v, dtype=torch.float32, device=device).reshape(()) for v in values])

    unit_counts = [counts[METRIC_UNITS[name]] if counts and name in METRIC_UNITS else 1.0 for name in names]
    local = torch.cat([as_row(metrics[name] for name in names), as_row(unit_counts)])  # (2K,)
    gathered = gather(local.unsqueeze(0))  # (processes, 2K)
    values, weights = gathered[:, : len(names)], gathered[:, len(names):]
    reduced = {}
    for index, name in enumerate(names):
        column, weight = values[:, index], weights[:, index]
        if name == "ratio/min":
            reduced[name] = column.min()
        elif name == "ratio/max":
            reduced[name] = column.max()
        else:
            total = weight.sum()
            weighted = (column * weight).sum() / total.clamp(min=1e-12)
            reduced[name] = torch.where(total > 0, weighted, column.mean())
    return reduced

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


def reduce_across_processes(metrics: dict, gather) -> dict[str, torch.Tensor]:
    """Combine each process's loss metrics with one collective: min/max for the ratio extremes, mean otherwise."""
    names = list(metrics)
    device = next((v.device for v in metrics.values() if isinstance(v, torch.Tensor)), None)
    values = torch.stack(
        [torch.as_tensor(metrics[name], dtype=torch.float32, device=device).reshape(()) for name in names]
    )
    gathered = gather(values.unsqueeze(0))  # (processes, K)
    reduced = {}
    for index, name in enumerate(names):
        column = gathered[:, index]
        reduced[name] = column.min() if name == "ratio/min" else column.max() if name == "ratio/max" else column.mean()
    return reduced

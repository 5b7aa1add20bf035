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

# Names of `sampling_correction` stats as logged (TRL's names, plus the mismatch KL and the corrected share).
SAMPLING_STAT_NAMES = {
    "sampling_logp_difference_mean": "sampling/sampling_logp_difference/mean",
    "sampling_logp_difference_max": "sampling/sampling_logp_difference/max",
    "mismatch_kl": "sampling/mismatch_kl",
    "ratio_min": "sampling/importance_sampling_ratio/min",
    "ratio_mean": "sampling/importance_sampling_ratio/mean",
    "ratio_max": "sampling/importance_sampling_ratio/max",
    "corrected_fraction": "sampling/corrected_fraction",
    "truncated_mass": "sampling/truncated_mass",
}


# Loss metrics that the passes of one micro-batch add up to (the micro-batch's is the sum of its passes').
PASS_SHARES = ("policy_loss",)


class MetricsBuffer:
    """Per-mode lists of values, averaged (ignoring NaN) and cleared at each log."""

    def __init__(self):
        self._values = {"train": defaultdict(list), "eval": defaultdict(list)}
        self.passes: list[tuple[dict, dict]] = []  # (metrics, counts) of a micro-batch's training passes so far

    def add_pass(self, mode: str, metrics: dict, counts: dict, last: bool, gather) -> None:
        """Keep one training pass's loss metrics (`counts`: `metric_counts`); after the micro-batch's `last` pass,
        add the micro-batch's, over all its passes and processes (`reduce_across_processes`)."""
        self.passes.append((metrics, counts))
        if last:
            parts, self.passes = self.passes, []
            # A pass's loss is its share of the micro-batch's: every pass carries the micro-batch's, their sum.
            totals = {name: sum(m[name] for m, _ in parts) for name in PASS_SHARES if name in parts[0][0]}
            parts = [({**m, **totals}, c) for m, c in parts]
            self.add_many(mode, reduce_across_processes([m for m, _ in parts], gather, [c for _, c in parts]))

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
    "clip_ratio/low": "units",
    "clip_ratio/high": "units",
    "clip_ratio/region": "units",
    "ratio/mean": "units",
    "ratio/log_abs_mean": "units",
    "sapo/gate_weight": "units",
    "cispo_clip_ratio": "units",
    "kl": "tokens",
    "entropy": "tokens",
    "vespo/phi_seq_mean": "sequences",
    "off_policy/masked_fraction": "sequences",
    "sampling/sampling_logp_difference/mean": "tokens",
    "sampling/mismatch_kl": "tokens",
    "sampling/importance_sampling_ratio/mean": "correction_units",
    "sampling/corrected_fraction": "correction_units",
    "sampling/truncated_mass": "tokens",
}


def sampling_metrics(stats: dict) -> dict:
    return {SAMPLING_STAT_NAMES[name]: value for name, value in stats.items() if name in SAMPLING_STAT_NAMES}


def metric_counts(
    completion_mask: torch.Tensor, importance_sampling_level: str, correction_mode: str | None = None
) -> dict[str, torch.Tensor]:
    """The counts this process's loss metrics average over: valid tokens, valid sequences, the level's unit, and
    the sampling correction's unit (sequences for its sequence modes)."""
    mask = completion_mask.bool()  # (B, T)
    tokens, sequences = mask.sum(), mask.any(dim=1).sum()
    return {
        "tokens": tokens,
        "sequences": sequences,
        "units": sequences if importance_sampling_level == "sequence" else tokens,
        "correction_units": sequences if (correction_mode or "").startswith("sequence") else tokens,
    }


def reduce_across_processes(
    metrics: dict | list[dict], gather, counts: dict | list[dict] | None = None
) -> dict[str, torch.Tensor]:
    """Combine each process's loss metrics with one collective: min/max for extremes (names ending in /min, /max),
    otherwise the mean
    weighted by each process's count (`metric_counts`, as `METRIC_UNITS` assigns them): the number one process
    would log for the whole micro-batch. Metrics without a unit (and all of them without counts) take the plain
    mean; so does a metric whose count is zero on every process. A micro-batch trained in several passes gives a
    list of metrics and a list of counts, one per pass, combined the same way."""
    parts = metrics if isinstance(metrics, list) else [metrics]
    part_counts = counts if isinstance(counts, list) else [counts] * len(parts)
    names = list(parts[0])
    device = next((v.device for v in parts[0].values() if isinstance(v, torch.Tensor)), None)

    def as_row(values):
        return torch.stack([torch.as_tensor(v, dtype=torch.float32, device=device).reshape(()) for v in values])

    def local_row(part, part_count):
        unit_counts = [part_count[METRIC_UNITS[name]] if part_count and name in METRIC_UNITS else 1.0 for name in names]
        return torch.cat([as_row(part[name] for name in names), as_row(unit_counts)])  # (2K,)

    local = torch.stack([local_row(part, part_count) for part, part_count in zip(parts, part_counts)])  # (passes, 2K)
    gathered = gather(local)  # (processes × passes, 2K)
    values, weights = gathered[:, : len(names)], gathered[:, len(names) :]
    reduced = {}
    for index, name in enumerate(names):
        column, weight = values[:, index], weights[:, index]
        if name.endswith("/min"):
            reduced[name] = column.min()
        elif name.endswith("/max"):
            reduced[name] = column.max()
        else:
            total = weight.sum()
            weighted = (column * weight).sum() / total.clamp(min=1e-12)
            reduced[name] = torch.where(total > 0, weighted, column.mean())
    return reduced


# Thresholds of the health summary's hints. GSPO clips whole sequences: the paper reports about 15% of them
# clipped with its schedule, so only far larger fractions are flagged.
HEALTH_ZERO_STD_SHARE, HEALTH_CLIP_FRACTION, HEALTH_LENGTH_RATIO = 0.5, 0.4, 0.5


def training_health(log_history: list[dict], window: int = 3) -> dict:
    """A finished run's health from its logged metrics: the share of groups with no reward spread, the clip
    fraction on off-policy steps (those whose ratios are not all 1), the ratio's extremes, the completion-length
    trend over the first and last `window` rollouts, and a one-line hint for each figure that looks off."""
    rollouts = [e for e in log_history if "reward" in e]
    steps = [e for e in log_history if "clip_ratio/region" in e]
    off_policy = [e for e in steps if e.get("ratio/min", 1.0) != 1.0 or e.get("ratio/max", 1.0) != 1.0]

    def mean(values):
        values = [v for v in values if v is not None and not math.isnan(v)]
        return sum(values) / len(values) if values else None

    window = max(1, min(window, len(rollouts) // 2))
    health = {
        "zero_std_group_share": mean([e.get("frac_reward_zero_std") for e in rollouts]),
        "off_policy_steps": len(off_policy),
        "clip_ratio_off_policy": mean([e["clip_ratio/region"] for e in off_policy]),
        "ratio_min": min((e["ratio/min"] for e in steps if "ratio/min" in e), default=None),
        "ratio_max": max((e["ratio/max"] for e in steps if "ratio/max" in e), default=None),
        "length_first": mean([e.get("completions/mean_length") for e in rollouts[:window]]),
        "length_last": mean([e.get("completions/mean_length") for e in rollouts[-window:]]),
    }
    hints = []
    if health["zero_std_group_share"] is not None and health["zero_std_group_share"] > HEALTH_ZERO_STD_SHARE:
        hints.append(
            f"{health['zero_std_group_share']:.0%} of the groups got equal rewards (no learning signal): the "
            "task is too easy or too hard for the model; change its difficulty or num_generations."
        )
    if not off_policy and steps:
        hints.append(
            "Every step was on-policy (ratio 1): clipping never acted. steps_per_generation > "
            "gradient_accumulation_steps trains several optimizer steps per rollout, as the paper does."
        )
    elif health["clip_ratio_off_policy"] is not None and health["clip_ratio_off_policy"] > HEALTH_CLIP_FRACTION:
        hints.append(
            f"{health['clip_ratio_off_policy']:.0%} of the sequences were clipped on off-policy steps: the "
            "policy moves far within a rollout; lower learning_rate or steps_per_generation."
        )
    if (
        health["length_first"]
        and health["length_last"] is not None
        and (health["length_last"] < HEALTH_LENGTH_RATIO * health["length_first"])
    ):
        hints.append(
            f"Completions shrank from {health['length_first']:.1f} to {health['length_last']:.1f} tokens: "
            "check that the reward does not simply favour short answers."
        )
    health["hints"] = hints
    return health


def format_health(health: dict) -> str:
    """The health summary as the few lines the final report starts with."""

    def number(value, spec):
        return "n/a" if value is None else format(value, spec)

    lines = [
        "Training health:",
        f"  groups with equal rewards: {number(health['zero_std_group_share'], '.0%')}",
        f"  sequences clipped on off-policy steps: {number(health['clip_ratio_off_policy'], '.1%')} "
        f"({health['off_policy_steps']} off-policy steps)",
        f"  importance ratio range: {number(health['ratio_min'], '.4f')} to {number(health['ratio_max'], '.4f')}",
        f"  mean completion length: {number(health['length_first'], '.1f')} -> {number(health['length_last'], '.1f')} "
        "tokens (first -> last rollouts)",
    ]
    lines += [f"  hint: {hint}" for hint in health["hints"]]
    return "\n".join(lines)


def episode_metrics(
    reached: torch.Tensor,
    turn_rewards: torch.Tensor | None,
    sampled_tokens: torch.Tensor,
    env_tokens: torch.Tensor,
    end_codes: torch.Tensor,
    end_reasons: tuple[str, ...],
    tool_calls: torch.Tensor | None = None,
    tool_failures: torch.Tensor | None = None,
) -> dict[str, float]:
    """What a batch of multi-turn episodes did (all tensors over every process): turns per episode, the share of
    completion tokens that came from the environment, how episodes ended (`end_codes` index `end_reasons`), the
    mean step reward at each turn index over the episodes that reached it (`turn_rewards` None: tool episodes, which
    have no step rewards), and with tools TRL's
    ``tools/call_frequency`` (calls per episode) and ``tools/failure_frequency`` (failed calls per call)."""
    metrics = {
        "episodes/turns/mean": reached.sum(dim=1).float().mean().item(),
        "episodes/turns/max": reached.sum(dim=1).max().item(),
        "episodes/env_token_fraction": (
            env_tokens.sum() / (env_tokens.sum() + sampled_tokens.sum()).clamp(min=1)
        ).item(),
    }
    for code, reason in enumerate(end_reasons):
        metrics[f"episodes/ended_by/{reason}"] = (end_codes == code).float().mean().item()
    if tool_calls is not None:
        calls = tool_calls.sum()
        metrics["tools/call_frequency"] = (calls / max(tool_calls.numel(), 1)).item()
        metrics["tools/failure_frequency"] = (tool_failures.sum() / calls).item() if calls > 0 else 0.0
    for turn in range(reached.shape[1] if turn_rewards is not None else 0):
        played = reached[:, turn]
        if played.any():
            metrics[f"episodes/reward_turn_{turn}/mean"] = turn_rewards[played, turn].float().mean().item()
    return metrics


def reward_columns(scores, reward_names: list[str], episodes, uses_tools: bool) -> tuple[list[str], torch.Tensor]:
    """(names, (N, F') table) of the rewards shown per function: the environment's return first as "env" with
    episodes, none with tool episodes (which have no step rewards). `scores`: a `scoring.RolloutScores`."""
    names, table = list(reward_names), scores.rewards_per_func
    if episodes is not None and uses_tools:
        table = table[:, 1:]
    elif episodes is not None:
        names = ["env"] + names  # the environment's return is the table's first column
    return names, table


def record_rollout_metrics(
    metrics: MetricsBuffer, mode: str, sampled, scores, reward_names: list[str], uses_tools: bool, accelerator
) -> None:
    """Log what a scored rollout did, over every process: rewards per function and in total, completion lengths
    (model tokens, as TRL counts them with tools) and, for episodes, `episode_metrics`. `sampled`: the
    `SampledRollout`; `scores`: its `scoring.RolloutScores`."""
    from ..rollout.episodes import END_REASONS, end_codes

    rollout, episodes, gather = sampled.rollout, sampled.episodes, accelerator.gather
    sampled_mask = rollout.sampled_mask
    names, table = reward_columns(scores, reward_names, episodes, uses_tools)
    metrics.add_many(mode, reward_function_metrics(table, names))
    for name in ("reward", "reward_std", "frac_reward_zero_std"):
        metrics.add(mode, name, scores.stats[name])
    if scores.skipped is not None:  # skip_rollouts_without_rewards: the share of rollouts skipped
        metrics.add(mode, "rollout/skipped", float(scores.skipped))
    sampled_tokens = sampled_mask.sum(1, keepdim=True)  # (n, 1)
    truncated = gather(rollout.is_truncated.unsqueeze(1)).squeeze(1)
    metrics.add_many(mode, completion_length_metrics(gather(sampled_tokens), truncated))
    if episodes is None:
        return
    device = sampled_mask.device

    def gathered(tensor, padded=False):
        tensor = tensor.to(device)
        return gather(accelerator.pad_across_processes(tensor, dim=1) if padded else tensor)

    env_tokens = rollout.completion_mask.sum(1, keepdim=True) - sampled_tokens
    episode_figures = episode_metrics(
        gathered(episodes.reached, padded=True),
        None if uses_tools else gathered(episodes.turn_rewards, padded=True),
        gather(sampled_tokens),
        gather(env_tokens),
        gathered(end_codes(episodes.ends)),
        END_REASONS,
        gathered(episodes.tool_calls) if uses_tools else None,
        gathered(episodes.tool_failures) if uses_tools else None,
    )
    metrics.add_many(mode, episode_figures)

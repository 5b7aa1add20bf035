"""Group-relative advantages from per-function rewards.

Owns: combining a (N, F) reward table into one scalar reward per completion, and turning those rewards into
group-relative advantages (GRPO/GSPO style: reward minus the mean of the prompt's group, optionally divided by a
standard deviation), plus the reward statistics the trainer logs.

Does not own: calling reward functions (see ``gspo_trl.rewards``), distributed gathering/slicing, or the policy loss.
Everything here is pure torch on whatever device the inputs live on, with no trainer state.

Conventions (kept identical across functions):
  * ``NaN`` in the reward table means "this reward function returned None / is not applicable".
  * A row is *valid* when at least one function gave a number; invalid rows never influence a baseline and always
    get an advantage of exactly 0.
  * Standard deviations are unbiased (Bessel's correction, like ``torch.std`` and TRL's ``nanstd``).
  * A group whose standard deviation is below ``ZERO_STD_TOLERANCE`` (all rewards equal), or which has fewer than
    two valid rows (std undefined), is a *zero-std group*: all its advantages are exactly 0. We do not add an epsilon
    to the denominator (TRL adds 1e-4) because that turns float round-off in a "constant" group into huge
    advantages; an explicit tolerance gives exact zeros instead.
"""

from __future__ import annotations

import torch

ZERO_STD_TOLERANCE = 1e-6
SCALE_REWARDS_OPTIONS = ("group", "batch", "none")


def aggregate_rewards(
    rewards_per_func: torch.Tensor, reward_weights: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Weighted sum over reward functions, ignoring NaN ("not applicable") entries.

    Args:
        rewards_per_func: (N, F) float, NaN where a function returned None.
        reward_weights: (F,) weight of each function.

    Returns:
        rewards: (N,) ``nansum_f(weight_f * reward_f)``; rows with no reward at all hold 0 here, so they must be
            masked with ``valid`` (``group_advantages`` does that).
        valid: (N,) bool, True where at least one function gave a number.
    """
    if rewards_per_func.ndim != 2:
        raise ValueError(f"rewards_per_func must be 2-D (N, F), got shape {tuple(rewards_per_func.shape)}")
    reward_weights = torch.as_tensor(reward_weights)
    if reward_weights.ndim != 1 or reward_weights.shape[0] != rewards_per_func.shape[1]:
        raise ValueError(
            f"reward_weights must have shape ({rewards_per_func.shape[1]},) to match rewards_per_func "
            f"{tuple(rewards_per_func.shape)}, got {tuple(reward_weights.shape)}"
        )
    rewards_per_func = rewards_per_func.float()
    weights = reward_weights.to(device=rewards_per_func.device, dtype=rewards_per_func.dtype)
    valid = ~torch.isnan(rewards_per_func).all(dim=1)  # (N,)
    rewards = (rewards_per_func * weights.unsqueeze(0)).nansum(dim=1)  # (N,)
    return rewards, valid


def normalize_scale_rewards(scale_rewards: str | bool) -> str:
    """Map TRL's accepted spellings to one of ``SCALE_REWARDS_OPTIONS`` (True -> "group", False -> "none")."""
    if isinstance(scale_rewards, bool):
        return "group" if scale_rewards else "none"
    if scale_rewards not in SCALE_REWARDS_OPTIONS:
        raise ValueError(
            f"scale_rewards must be one of {', '.join(repr(o) for o in SCALE_REWARDS_OPTIONS)} (or True/False), "
            f"got {scale_rewards!r}"
        )
    return scale_rewards


def _check_group_inputs(rewards: torch.Tensor, num_generations: int, valid: torch.Tensor | None) -> None:
    if rewards.ndim != 1:
        raise ValueError(f"rewards must be 1-D (N,), got shape {tuple(rewards.shape)}")
    if isinstance(num_generations, bool) or not isinstance(num_generations, int) or num_generations < 2:
        raise ValueError(
            f"num_generations must be an int >= 2 (a group needs two samples to compare), got {num_generations!r}"
        )
    if rewards.numel() == 0:
        raise ValueError("rewards is empty; need at least one group of num_generations completions")
    if rewards.numel() % num_generations != 0:
        raise ValueError(
            f"number of rewards ({rewards.numel()}) must be divisible by num_generations ({num_generations})"
        )
    if valid is not None and tuple(valid.shape) != tuple(rewards.shape):
        raise ValueError(f"valid must have the same shape as rewards {tuple(rewards.shape)}, got {tuple(valid.shape)}")


def _masked_mean_and_std(values: torch.Tensor, mask: torch.Tensor, dim: int | None) -> tuple[torch.Tensor, ...]:
    """Mean and unbiased std over ``mask``ed entries. Returns (mean, std, count); std is 0 where count < 2."""
    if dim is None:
        values, mask, dim = values.reshape(1, -1), mask.reshape(1, -1), 1
    count = mask.sum(dim=dim)
    masked = torch.where(mask, values, torch.zeros_like(values))
    mean = masked.sum(dim=dim) / count.clamp(min=1)
    centered = torch.where(mask, values - mean.unsqueeze(dim), torch.zeros_like(values))
    # Bessel's correction; clamp keeps the (discarded) count<2 branch finite instead of 0/0.
    variance = (centered**2).sum(dim=dim) / (count - 1).clamp(min=1)
    std = torch.where(count >= 2, variance.sqrt(), torch.zeros_like(variance))
    return mean, std, count


def group_advantages(
    rewards: torch.Tensor,
    num_generations: int,
    scale_rewards: str | bool = "group",
    valid: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Group-relative advantages ``A = r - mean_group(r)``, optionally scaled.

    Args:
        rewards: (N,) one scalar reward per completion; N = num_groups * num_generations with each prompt's
            completions contiguous (rows ``[g*G:(g+1)*G]`` form group g).
        num_generations: G, completions per prompt (>= 2).
        scale_rewards: "group" divides by the group's std, "batch" by the std of all valid rewards in the batch,
            "none" leaves ``r - mean`` unscaled. True/False mean "group"/"none" (TRL's older boolean form).
        valid: (N,) bool; rows marked False are left out of their group's mean/std (and the batch std) and get
            advantage 0. Defaults to "reward is finite".

    Returns:
        advantages: (N,) same dtype as ``rewards`` (float32 for integer input); never NaN/inf.
        stats: ``reward`` mean over valid rows (NaN if none is valid), ``reward_std`` std of the valid rewards
            over the batch (TRL's meaning; 0 with fewer than 2), ``frac_reward_zero_std`` fraction of zero-std groups,
            ``num_invalid`` number of rows without a reward.
    """
    scale_rewards = normalize_scale_rewards(scale_rewards)
    _check_group_inputs(rewards, num_generations, valid)
    if not rewards.is_floating_point():
        rewards = rewards.float()
    valid = torch.isfinite(rewards) if valid is None else valid.to(device=rewards.device, dtype=torch.bool)
    if not torch.isfinite(rewards[valid]).all():
        raise ValueError("rewards contains NaN/inf in rows marked valid; mark them invalid instead")

    grouped = rewards.view(-1, num_generations)  # (groups, G)
    grouped_valid = valid.view(-1, num_generations)  # (groups, G)
    group_mean, group_std, _ = _masked_mean_and_std(grouped, grouped_valid, dim=1)  # (groups,) each
    zero_std_group = group_std < ZERO_STD_TOLERANCE  # (groups,); also True when < 2 valid rows (std set to 0)

    if scale_rewards == "group":
        scale = group_std  # (groups,)
    elif scale_rewards == "batch":
        _, batch_std, _ = _masked_mean_and_std(rewards, valid, dim=None)  # (1,)
        scale = batch_std.expand_as(group_std)  # (groups,)
    else:
        scale = torch.ones_like(group_std)  # (groups,)

    # A near-zero scale cannot carry signal either; treat it like a zero-std group rather than dividing by it.
    zero_advantage = zero_std_group | (scale < ZERO_STD_TOLERANCE)  # (groups,)
    safe_scale = torch.where(zero_advantage, torch.ones_like(scale), scale)  # (groups,)
    centered = grouped - group_mean.unsqueeze(1)  # (groups, G)
    advantages = centered / safe_scale.unsqueeze(1)  # (groups, G)
    keep = grouped_valid & ~zero_advantage.unsqueeze(1)  # (groups, G)
    advantages = torch.where(keep, advantages, torch.zeros_like(advantages)).reshape(-1)  # (N,)

    num_valid = int(valid.sum().item())
    stats = {
        "reward": rewards[valid].mean().item() if num_valid > 0 else float("nan"),
        # TRL's meaning: the spread of rewards over the whole batch (unbiased), not within groups.
        "reward_std": rewards[valid].std().item() if num_valid > 1 else 0.0,
        "frac_reward_zero_std": zero_std_group.float().mean().item(),
        "num_invalid": int(valid.numel() - num_valid),
    }
    return advantages, stats

"""Group-relative advantages from per-function rewards.

Owns: combining a (N, F) reward table into one scalar reward per completion, and turning those rewards into
group-relative advantages (GRPO/GSPO style: reward minus the mean of the prompt's group, optionally divided by a
standard deviation), plus the reward statistics the trainer logs; for multi-turn episodes, per-turn returns
(reward-to-go) normalised within the group at each turn index (`turn_advantages`).

Does not own: calling reward functions (see ``gspo_trl.scoring.rewards``), distributed gathering/slicing, or the policy
loss.
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
# How several reward functions combine (TRL's `multi_objective_aggregation`): sum the weighted rewards, then take
# group-relative advantages; or normalise each function within its group first (GDPO), then sum and scale.
AGGREGATION_OPTIONS = ("sum_then_normalize", "normalize_then_sum")


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


def decoupled_rewards(
    rewards_per_func: torch.Tensor, reward_weights: torch.Tensor, num_generations: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """GDPO's reward (arXiv 2601.05242): each function's rewards normalised within the prompt's group, then summed.

    For function f and group g, ``z_f = (r_f - mean_g(r_f)) / std_g(r_f)`` over the rows where f gave a number;
    the reward is ``sum_f weight_f * z_f``. A function that is constant within a group (std below
    ``ZERO_STD_TOLERANCE``) or gave no number for a row adds 0 there, so one function's scale cannot drown another's.

    Args:
        rewards_per_func: (N, F) float, NaN where a function returned None; groups of ``num_generations`` rows.
        reward_weights: (F,) weight of each function.

    Returns:
        rewards: (N,) the weighted sum of the normalised rewards (0 on rows without any reward).
        valid: (N,) bool, True where at least one function gave a number.
    """
    _, valid = aggregate_rewards(rewards_per_func, reward_weights)  # the shape checks; (N,)
    _check_group_inputs(valid.float(), num_generations, None)
    table = rewards_per_func.float()
    weights = torch.as_tensor(reward_weights).to(device=table.device, dtype=table.dtype)
    grouped = table.view(-1, num_generations, table.shape[1])  # (groups, G, F)
    present = ~torch.isnan(grouped)  # (groups, G, F)
    mean, std, _ = _masked_mean_and_std(grouped, present, dim=1)  # (groups, F) each
    constant = std < ZERO_STD_TOLERANCE  # (groups, F)
    normalized = (grouped - mean.unsqueeze(1)) / torch.where(constant, torch.ones_like(std), std).unsqueeze(1)
    normalized = torch.where(present & ~constant.unsqueeze(1), normalized, torch.zeros_like(normalized))
    return (normalized * weights).sum(dim=2).reshape(-1), valid


def batch_advantages(rewards: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """(N,) ``(r - mean) / std`` over the valid rows of the whole batch (GDPO's last step); 0 on invalid rows, and
    everywhere when the batch's std is below ``ZERO_STD_TOLERANCE``."""
    mean, std, _ = _masked_mean_and_std(rewards.float(), valid, dim=None)  # (1,) each
    if float(std) < ZERO_STD_TOLERANCE:
        return torch.zeros_like(rewards, dtype=torch.float32)
    advantages = (rewards.float() - mean) / std
    return torch.where(valid, advantages, torch.zeros_like(advantages))


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

    stats = {**reward_stats(rewards, valid), "frac_reward_zero_std": zero_std_group.float().mean().item()}
    return advantages, stats


def reward_stats(rewards: torch.Tensor, valid: torch.Tensor) -> dict[str, float]:
    """``reward``: the mean over valid rows (NaN if none is valid); ``reward_std``: their unbiased std over the batch
    (TRL's meaning, not within groups; 0 with fewer than 2); ``num_invalid``: rows without a reward."""
    num_valid = int(valid.sum().item())
    return {
        "reward": rewards[valid].mean().item() if num_valid > 0 else float("nan"),
        "reward_std": rewards[valid].std().item() if num_valid > 1 else 0.0,
        "num_invalid": int(valid.numel() - num_valid),
    }


def discounted_returns(turn_rewards: torch.Tensor, reached: torch.Tensor, gamma: float = 1.0) -> torch.Tensor:
    """Reward-to-go of every turn of an episode: G_k = r_k + gamma * G_(k+1), summed over the turns reached.

    Args:
        turn_rewards: (N, K) the reward after each assistant turn (anything where a turn was not reached).
        reached: (N, K) bool, True for the turns an episode played (a prefix of each row).
        gamma: discount per turn, in [0, 1].

    Returns:
        (N, K) float returns, 0 where a turn was not reached.
    """
    if turn_rewards.ndim != 2 or tuple(reached.shape) != tuple(turn_rewards.shape):
        raise ValueError(
            f"turn_rewards and reached must both be (N, K), got {tuple(turn_rewards.shape)} and {tuple(reached.shape)}"
        )
    if not 0 <= gamma <= 1:
        raise ValueError(f"gamma must be in [0, 1], got {gamma}")
    rewards = torch.where(reached, turn_rewards.float(), torch.zeros_like(turn_rewards, dtype=torch.float32))
    returns = torch.zeros_like(rewards)
    following = torch.zeros_like(rewards[:, 0])  # (N,) G_(k+1)
    for k in range(rewards.shape[1] - 1, -1, -1):
        following = rewards[:, k] + gamma * following
        returns[:, k] = following
    return torch.where(reached, returns, torch.zeros_like(returns))


def turn_advantages(
    turn_rewards: torch.Tensor,
    reached: torch.Tensor,
    num_generations: int,
    scale_rewards: str | bool = "group",
    gamma: float = 1.0,
    valid: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-turn group-relative advantages: the return from turn k (`discounted_returns`), normalised within the
    prompt's group over the members that reached turn k, as `group_advantages` normalises whole episodes.

    A turn that fewer than two members of the group reached has no baseline and gets advantage 0; so do the turns an
    episode did not reach and rows that are not ``valid``. With one turn per episode this is `group_advantages`.

    Returns:
        (N, K) advantages.
    """
    returns = discounted_returns(turn_rewards, reached, gamma)  # (N, K)
    if valid is None:
        valid = torch.ones(reached.shape[0], dtype=torch.bool, device=reached.device)
    valid = valid.to(device=reached.device, dtype=torch.bool)  # (N,)
    columns = [
        group_advantages(returns[:, k], num_generations, scale_rewards, reached[:, k] & valid)[0]
        for k in range(returns.shape[1])
    ]
    return torch.stack(columns, dim=1)


def token_advantages(per_turn: torch.Tensor, turn_ids: torch.Tensor) -> torch.Tensor:
    """(N, T) advantage of each completion token: that of its turn. ``per_turn`` (N, K); ``turn_ids`` (N, T) with the
    turn of each token in [0, K) (other values, e.g. on environment tokens, are clamped: mask them in the loss)."""
    ids = turn_ids.long().clamp(0, per_turn.shape[1] - 1)
    return per_turn.gather(1, ids)


def episode_advantages(
    turn_rewards: torch.Tensor,
    reached: torch.Tensor,
    final_rewards: torch.Tensor,
    num_generations: int,
    scale_rewards: str | bool = "group",
    gamma: float = 1.0,
    granularity: str = "trajectory",
) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """Advantages of every turn of multi-turn episodes (N, K), the episodes' returns (N,), and their statistics.

    The reward after turn k is the environment's step reward; ``final_rewards`` (N,) (the reward functions' weighted
    sum, scored on the whole episode) joins the reward of the episode's last turn. The episode's return is
    ``G_0 = sum_k gamma^k r_k``. ``granularity="trajectory"``: every turn gets the group-relative advantage of G_0
    (`group_advantages`). ``"turn"``: turn k gets that of its own return G_k (`turn_advantages`).
    """
    if granularity not in ("trajectory", "turn"):
        raise ValueError(f"granularity must be 'trajectory' or 'turn', got {granularity!r}")
    rows = torch.arange(reached.shape[0], device=reached.device)
    last_turn = (reached.sum(dim=1) - 1).clamp(min=0)  # (N,)
    rewards = torch.where(reached, turn_rewards.float(), torch.zeros_like(turn_rewards, dtype=torch.float32))
    rewards[rows, last_turn] += final_rewards.float()
    returns = discounted_returns(rewards, reached, gamma)  # (N, K)
    trajectory, stats = group_advantages(returns[:, 0], num_generations, scale_rewards)  # (N,)
    if granularity == "trajectory":
        return trajectory.unsqueeze(1).expand_as(returns).clone(), returns[:, 0], stats
    return turn_advantages(rewards, reached, num_generations, scale_rewards, gamma), returns[:, 0], stats

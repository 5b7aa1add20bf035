"""From a scored rollout to advantages: the reward table gathered over every process (a prompt's group may span
processes), combined, and turned into group-relative advantages, for single-turn rollouts and for multi-turn
episodes (whose step rewards join the table as its first column, "env").

Owns which rows and tokens get which advantage and the reward statistics that go with them, what reward functions
are shown of a rollout (`completions_for_rewards`) and the scored rollout's record (`scored_batch`). The math is in
`advantages`; calling reward functions is `rewards.compute_rewards`; playing episodes is `rollout.episodes`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers.utils import logging

from ..reporting.reward_logs import RewardFunctionLogs
from ..rollout import is_conversational_prompt
from ..training.micro_batch import MicroBatch
from .advantages import (
    aggregate_rewards,
    batch_advantages,
    decoupled_rewards,
    discounted_returns,
    episode_advantages,
    group_advantages,
    reward_stats,
    token_advantages,
)
from .rewards import compute_rewards

logger = logging.get_logger(__name__)


@dataclass
class RolloutScores:
    advantages: torch.Tensor  # this process's rows: (n,), or (n, C) per token with per-turn advantages
    stats: dict[str, float]  # reward, reward_std, frac_reward_zero_std, num_invalid (over every process)
    rewards_per_func: torch.Tensor  # (N, F) over every process; with episodes the environment's return first
    rewards: torch.Tensor  # (N,) each row's total reward
    row_rewards: torch.Tensor | None = None  # (n,) this process's rows' total reward, NaN where none was given
    # With `skip_rollouts_without_rewards`: whether no reward function scored any completion (the rollout trains on
    # nothing, `scored_batch`); None without the option.
    skipped: bool | None = None


def completions_per_prompt(args, mode: str) -> int:
    """The group size of a rollout in `mode`: `num_generations` in training, `num_generations_eval` (default the
    same) in evaluation."""
    return args.num_generations if mode == "train" else args.num_generations_eval or args.num_generations


def score_rollout(
    local_rewards: torch.Tensor,
    reward_weights: torch.Tensor,
    args,
    accelerator,
    episodes=None,
    function_names: Sequence[str] = (),
    group_size: int | None = None,
    prompts: Sequence = (),
) -> RolloutScores:
    """Advantages of this process's rows from its (n, F) reward-function table (`episodes`: its `EpisodeBatch`).

    A rollout without episodes in which no reward function gave a number for any completion raises a `ValueError`
    naming the functions (on every process alike: the table is gathered first): it would train on zero advantages.
    With `skip_rollouts_without_rewards` it is skipped instead: a warning naming the functions and showing one of
    this process's `prompts`, zero advantages, and `skipped` set, so that `scored_batch` leaves it out of the loss.
    `group_size`: completions per prompt (default `num_generations`; evaluation's `num_generations_eval` may be 1:
    rewards are measured and every advantage is 0).
    """
    group_size = group_size or args.num_generations
    device = local_rewards.device
    n = local_rewards.shape[0]
    local = slice(accelerator.process_index * n, (accelerator.process_index + 1) * n)
    function_table = accelerator.gather(local_rewards)  # (N, F)
    rewards, valid = aggregate_rewards(function_table, reward_weights.to(device))  # (N,), NaN-free
    aggregation = args.multi_objective_aggregation
    if episodes is None:
        row_rewards = torch.where(valid, rewards, torch.full_like(rewards, float("nan")))  # (N,)
        skipping = args.skip_rollouts_without_rewards
        if not valid.any():
            names = ", ".join(function_names) or f"all {function_table.shape[1]}"
            message = f"Every reward function ({names}) returned None for every completion of this rollout"
            if not skipping:
                raise ValueError(
                    f"{message}, so it has no signal to train on. Return a number for the completions a function "
                    "applies to, or set skip_rollouts_without_rewards=True to skip such rollouts."
                )
            sample = f" One of its prompts: {repr(prompts[0])[:300]}." if len(prompts) else ""
            logger.warning(f"{message}: skipping it (skip_rollouts_without_rewards=True).{sample}")
        if group_size == 1 or not valid.any():  # no group to compare within, or nothing scored
            stats = {**reward_stats(rewards, valid), "frac_reward_zero_std": 1.0}
            skipped = not bool(valid.any()) if skipping else None
            return RolloutScores(
                torch.zeros_like(rewards)[local], stats, function_table, rewards, row_rewards[local], skipped
            )
        advantages, stats = group_advantages(rewards, group_size, args.scale_rewards, valid)
        if aggregation == "normalize_then_sum":  # GDPO; the statistics stay those of the summed reward
            decoupled, _ = decoupled_rewards(function_table, reward_weights.to(device), group_size)
            advantages = batch_advantages(decoupled, valid)
        return RolloutScores(
            advantages[local], stats, function_table, rewards, row_rewards[local], False if skipping else None
        )
    if aggregation != "sum_then_normalize":  # refused at construction (`dataset_checks.check_datasets`)
        raise ValueError(f"multi_objective_aggregation={aggregation!r} is for single-turn rollouts.")

    def gathered(tensor):  # episodes on different processes may have played different numbers of turns
        return accelerator.gather(accelerator.pad_across_processes(tensor.to(device), dim=1))

    turn_rewards, reached = gathered(episodes.turn_rewards), gathered(episodes.reached)  # (N, K) each
    per_turn, returns, stats = episode_advantages(
        turn_rewards,
        reached,
        rewards,
        group_size,
        args.scale_rewards,
        args.turn_discount,
        args.advantage_granularity,
    )  # (N, K), (N,)
    if args.advantage_granularity == "turn":
        advantages = token_advantages(per_turn[local], episodes.rollout.turn_ids.to(device))  # (n, C)
    else:
        advantages = per_turn[local, 0]  # (n,)
    env_return = discounted_returns(turn_rewards, reached, args.turn_discount)[:, :1]  # (N, 1)
    table = torch.cat([env_return, function_table], dim=1)
    return RolloutScores(advantages, stats, table, returns, returns[local])


def completions_for_rewards(batch: list[dict], sampled, tokenizer) -> tuple[list, list, list[str], dict]:
    """What reward functions get of a `SampledRollout` of the dataset rows `batch`: (completions: texts or chat
    messages, their sampled token ids, the decoded texts, the dataset's other columns and the rollout's own)."""
    rollout, episodes = sampled.rollout, sampled.episodes
    texts = tokenizer.batch_decode(rollout.completion_ids, skip_special_tokens=True)
    columns = {key: [row[key] for row in batch] for key in batch[0] if key != "prompt"}
    columns.update(sampled.reward_columns)
    if episodes is not None:
        columns["environments"] = episodes.environments
        return episodes.completions, episodes.completion_ids, texts, columns
    if is_conversational_prompt(sampled.prompts[0]):
        completions = [[{"role": "assistant", "content": text}] for text in texts]
    else:
        completions = texts
    completion_ids = [ids[mask.bool()].tolist() for ids, mask in zip(rollout.completion_ids, rollout.completion_mask)]
    return completions, completion_ids, texts, columns


def scored_batch(sampled, scores: RolloutScores, mask_truncated_completions: bool) -> MicroBatch:
    """The record of a `SampledRollout` with its `scores`: trained on the tokens the model sampled (not an environment's
    observations), without truncated completions when `mask_truncated_completions`; a skipped rollout (no reward
    function scored it, `skip_rollouts_without_rewards`) has a loss of 0. π_old is set where the sampling weights
    will be gone (`old_logps`, async_rollouts), else by the schedule per micro-batch."""
    rollout = sampled.rollout
    completion_mask = rollout.sampled_mask
    if mask_truncated_completions:
        completion_mask = completion_mask * (~rollout.is_truncated).unsqueeze(1).long()
    return MicroBatch(
        **{**rollout.model_inputs(), "completion_mask": completion_mask},
        advantages=scores.advantages,
        rewards=scores.row_rewards,
        sampling_logps=rollout.sampling_logps,
        sampled_by_policy=rollout.sampled_by_policy,
        kept_log_mass=rollout.kept_log_mass,
        old_logps=sampled.old_logps,
        turn_ids=rollout.turn_ids,  # multi-turn episodes only
        vision=rollout.vision,  # vision-language prompts only
        # Skipped = trained on with a loss of 0 (`MicroBatch.skipped`), rather than resampled: the rollout still fills
        # its micro-steps, so the schedule (the prompts each step takes, optimizer steps, checkpoints) is unchanged.
        skipped=bool(scores.skipped),
        sampling_routes=rollout.sampling_routes,  # Mixture-of-Experts models
    )


def reward_and_score(
    batch: list[dict],
    sampled,
    reward_funcs,
    reward_weights,
    tokenizer,
    state,
    args,
    accelerator,
    log_metric,
    group_size: int | None = None,
) -> tuple[RolloutScores, list[str], dict[str, list]]:
    """(the `RolloutScores` of a `SampledRollout` of the dataset rows `batch`, its decoded completions, the columns
    reward functions logged with `log_extra`): every reward function called on this process's rows, the metrics they
    logged with TRL's `log_metric` averaged over every process and handed to `log_metric(name, value)` (a
    collective), then `score_rollout` over every process."""
    completions, completion_ids, texts, columns = completions_for_rewards(batch, sampled, tokenizer)
    names = [function.name for function in reward_funcs]
    table_columns = names if sampled.episodes is None else ["env", *names]  # the completion table's reward columns
    reward_logs = RewardFunctionLogs(len(completions), taken_columns=table_columns)
    local_rewards = compute_rewards(
        reward_funcs,
        sampled.prompts,
        completions,
        completion_ids,
        columns,
        state,
        log_metric=reward_logs.log_metric,
        log_extra=reward_logs.log_extra,
    ).to(accelerator.device)  # (n, F)
    for name, mean in reward_logs.metric_means(accelerator).items():  # over every process, as TRL averages them
        log_metric(name, mean)
    scores = score_rollout(
        local_rewards, reward_weights, args, accelerator, sampled.episodes, names, group_size, sampled.prompts
    )
    return scores, texts, reward_logs.columns

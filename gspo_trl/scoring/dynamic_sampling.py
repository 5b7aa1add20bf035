"""Dynamic sampling (DAPO, arXiv 2503.14476 §3.2; verl's `filter_groups`): a rollout trains on informative groups only.

A group whose completions all got the same total reward has zero advantage and teaches nothing. With
`dynamic_sampling=True` the trainer scores its rollout, drops those groups, and samples more prompts in extra
generation rounds until the rollout holds `generation_batch_size / num_generations` informative groups, or
`dynamic_sampling_max_rounds` rounds have run; then the rollout is filled up with dropped groups (the earliest
first), so every rollout keeps its shape, and a warning says so.

Owns: which groups are informative (`informative_groups`), which groups of the rounds make the trained rollout
(`choose_groups`), the extra prompts of each round (`extra_prompt_indices`, a pure function of the seed, the step
and the round, alike on every process), putting the chosen rows together across rounds and processes, and the
advantages' scale where it spans the batch (scale_rewards='batch': recomputed over the trained rollout). What it
does not own: sampling and scoring a round (the trainer's `_generate_and_score`, or the async pipeline's engines),
and how the rollout is cut into micro-batches (`schedule`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch
from transformers.utils import logging

from ..rollout.streams import stream_keys
from ..training.gather import gather_rollout
from ..training.micro_batch import _ROW_FIELDS, MicroBatch
from .advantages import ZERO_STD_TOLERANCE, group_advantages

logger = logging.get_logger(__name__)

# The stream id of the extra prompts' draws (the sampling streams use 0 for training and 1 for evaluation).
EXTRA_PROMPTS_STREAM = 2


def informative_groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """(N / G,) bool: whether each group of `group_size` consecutive rows has a spread of total rewards.

    `rewards` (N,) is each row's total reward, NaN where no reward function gave a number (such rows are left out,
    as in `advantages.group_advantages`). A group is uninformative when the unbiased std of its rewards is below
    `ZERO_STD_TOLERANCE`, or when fewer than two of its rows have a reward: exactly the groups whose advantages
    `group_advantages` sets to zero.
    """
    if rewards.ndim != 1 or rewards.numel() % group_size != 0:
        raise ValueError(f"rewards must be (N,) with N a multiple of {group_size}, got {tuple(rewards.shape)}.")
    grouped = rewards.double().view(-1, group_size)  # (groups, G)
    valid = ~torch.isnan(grouped)
    count = valid.sum(dim=1)  # (groups,)
    mean = torch.nan_to_num(grouped).sum(dim=1) / count.clamp(min=1)
    squares = torch.where(valid, grouped - mean.unsqueeze(1), torch.zeros_like(grouped)) ** 2
    std = (squares.sum(dim=1) / (count - 1).clamp(min=1)).sqrt()  # unbiased, as group_advantages'
    return (count >= 2) & (std >= ZERO_STD_TOLERANCE)


def choose_groups(informative: list[torch.Tensor], target: int) -> list[tuple[int, int]]:
    """The (round, group) pairs of the trained rollout, in order: the first `target` informative groups over the
    rounds (round by round, group by group); if there are fewer, then the dropped ones in the same order."""
    pairs = [(r, int(g)) for r, flags in enumerate(informative) for g in range(flags.numel())]
    kept = [pair for pair in pairs if bool(informative[pair[0]][pair[1]])]
    dropped = [pair for pair in pairs if not bool(informative[pair[0]][pair[1]])]
    if len(pairs) < target:
        raise ValueError(f"choose_groups needs at least {target} groups, got {len(pairs)}.")
    chosen = (kept + dropped)[:target]
    return sorted(chosen)


def extra_prompt_indices(dataset_size: int, num_prompts: int, seed: int, step: int, round_index: int) -> list[int]:
    """The dataset indices of the prompts of extra round `round_index` (1, 2, ...) of the rollout trained from
    optimizer step `step`: a shuffle of the dataset drawn from (seed, step, round), the same on every process and
    in a resumed run. Within a round no prompt repeats unless the dataset has fewer than `num_prompts`."""
    key = int(stream_keys(seed, step, EXTRA_PROMPTS_STREAM, round_index)) & 0x7FFFFFFFFFFFFFFF
    generator = torch.Generator().manual_seed(key)
    order = torch.randperm(dataset_size, generator=generator)
    repeats = -(-num_prompts // dataset_size)
    return order.repeat(repeats)[:num_prompts].tolist()


def concat_rollouts(batches: list[MicroBatch], pad_token_id: int) -> MicroBatch:
    """The rows of `batches` as one batch: prompts left-padded and completions right-padded to the longest."""
    if len(batches) == 1:
        return batches[0]
    prompt_widths = [b.input_ids.shape[1] - b.completion_ids.shape[1] for b in batches]
    prompt_width, completion_width = max(prompt_widths), max(b.completion_ids.shape[1] for b in batches)

    def padded(tensor, width, value, left):
        missing = width - tensor.shape[1]
        return torch.nn.functional.pad(tensor, (missing, 0) if left else (0, missing), value=value)

    parts: dict[str, list] = {name: [] for name in _ROW_FIELDS}
    for batch, width in zip(batches, prompt_widths):
        for name in _ROW_FIELDS:
            value = getattr(batch, name)
            if name in ("input_ids", "attention_mask"):
                fill = pad_token_id if name == "input_ids" else 0
                value = torch.cat(
                    [
                        padded(value[:, :width], prompt_width, fill, left=True),
                        padded(value[:, width:], completion_width, fill, left=False),
                    ],
                    dim=1,
                )
            elif value is not None and value.dim() == 2:  # completion-aligned
                value = padded(value, completion_width, pad_token_id if name == "completion_ids" else 0, left=False)
            parts[name].append(value)
    for name, values in parts.items():
        if any(value is None for value in values) and not all(value is None for value in values):
            raise ValueError(f"concat_rollouts: {name} is set in some batches only; they were not scored alike.")
    joined = {name: None if values[0] is None else torch.cat(values) for name, values in parts.items()}
    return replace(batches[0], **joined)


class DynamicSampler:
    """The trainer's dynamic sampling: `fill` turns a scored rollout into one of informative groups."""

    def __init__(self, args, dataset, pad_token_id: int, log_metric: Callable[[str, float], None]):
        self.args, self.dataset, self.pad_token_id, self.log_metric = args, dataset, pad_token_id, log_metric

    @classmethod
    def create(cls, args, dataset, pad_token_id: int, metrics) -> DynamicSampler | None:
        """The trainer's sampler (None without `dynamic_sampling`), logging into its `MetricsBuffer`."""
        if not args.dynamic_sampling:
            return None
        if not hasattr(dataset, "__len__"):
            raise ValueError(
                "dynamic_sampling draws its extra prompts from the training dataset by index, which a streamed "
                f"dataset ({type(dataset).__name__}) does not offer: set dynamic_sampling=False or use a map-style "
                "Dataset."
            )
        return cls(args, dataset, pad_token_id, lambda name, value: metrics.add("train", name, value))

    def fill(self, rollout: MicroBatch, step: int, accelerator, score_more: Callable) -> MicroBatch:
        """This process's share of the trained rollout, starting from the scored `rollout` (this process's rows of
        round 0). `score_more(rows, first_row)` samples and scores dataset rows as the global rows from `first_row`
        on (their sampling streams); it is called alike on every process, which all take the same decisions."""
        args, processes, local_rows = self.args, accelerator.num_processes, rollout.rows
        mine = slice(accelerator.process_index * local_rows, (accelerator.process_index + 1) * local_rows)
        max_rounds = args.dynamic_sampling_max_rounds
        group, global_rows = args.num_generations, rollout.rows * accelerator.num_processes
        target = global_rows // group

        def gathered(batch):
            return batch if processes == 1 else gather_rollout(batch, accelerator, self.pad_token_id)

        rounds = [gathered(rollout)]
        informative = [informative_groups(rounds[0].rewards, group)]
        while sum(int(flags.sum()) for flags in informative) < target and len(rounds) < max_rounds:
            prompts = extra_prompt_indices(len(self.dataset), target, args.seed, step, len(rounds))
            rows = [prompt for prompt in prompts for _ in range(group)]
            scored = score_more([self._row(index) for index in rows[mine]], len(rounds) * global_rows)
            rounds.append(gathered(scored))
            informative.append(informative_groups(rounds[-1].rewards, group))
        chosen = choose_groups(informative, target)
        parts = []
        for index, batch in enumerate(rounds):
            groups = [g for r, g in chosen if r == index]
            if groups:
                parts.append(batch.select(torch.cat([torch.arange(g * group, (g + 1) * group) for g in groups])))
        trained = concat_rollouts(parts, self.pad_token_id)
        self._rescale(trained)
        self._log(rounds, informative, trained, target, warn=accelerator.is_main_process)
        return trained.select(mine)

    def _row(self, index: int) -> dict:
        row = self.dataset[index]  # the dataloader's batches keep only the prompt with remove_unused_columns=True
        return {"prompt": row["prompt"]} if self.args.remove_unused_columns else dict(row)

    def _rescale(self, trained: MicroBatch) -> None:
        """With scale_rewards='batch' the advantages divide by the std of the trained rollout's rewards (each round
        was scaled by its own): recomputed from the rows' total rewards, as `scoring.score_rollout` computes them."""
        if self.args.scale_rewards != "batch":
            return
        valid = ~torch.isnan(trained.rewards)
        advantages, _ = group_advantages(torch.nan_to_num(trained.rewards), self.args.num_generations, "batch", valid)
        trained.advantages = advantages.to(trained.advantages.dtype)

    def _log(self, rounds, informative, trained, target, warn: bool) -> None:
        num_informative = sum(int(flags.sum()) for flags in informative)
        filler = max(target - num_informative, 0)
        sampled_tokens = sum(float(batch.completion_mask.sum()) for batch in rounds)
        trained_tokens = float(trained.completion_mask.sum())
        self.log_metric("rollout/dynamic_sampling_rounds", float(len(rounds)))
        self.log_metric("rollout/dynamic_sampling_groups_dropped", float(sum(f.numel() for f in informative) - target))
        self.log_metric("rollout/dynamic_sampling_filler_groups", float(filler))
        self.log_metric("rollout/sampled_tokens_per_trained_token", sampled_tokens / max(trained_tokens, 1.0))
        if filler and warn:  # once, not per process
            logger.warning(
                f"dynamic_sampling: {len(rounds)} generation rounds (dynamic_sampling_max_rounds) found "
                f"{num_informative} of {target} informative groups; the rollout is filled up with {filler} groups of "
                "equal rewards, which have zero advantage. Raise dynamic_sampling_max_rounds or make the task's "
                "rewards vary more."
            )

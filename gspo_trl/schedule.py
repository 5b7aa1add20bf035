"""The rollout schedule: where a rollout's micro-batches fall among optimizer steps, and which need π_old.

A rollout is cut into `steps_per_generation` micro-batches, and each is trained on once per pass,
for `num_iterations` passes: use number k = j · steps_per_generation + i (pass j, micro-batch i)
comes k micro-steps after the rollout was sampled. `transformers.Trainer` steps the optimizer after
every `gradient_accumulation_steps` micro-steps of an epoch (and after a shorter last window when
the epoch does not divide evenly). GSPO's ratio compares the current policy with π_old, the weights
that sampled the rollout. While no optimizer step has happened since sampling, the current weights
*are* π_old, so the loss may use old = sg[log π] (ratio exactly 1) and skip a forward pass; a
micro-batch that is also trained after an optimizer step needs π_old computed before that step.

Owns that rule (`micro_batches_needing_old_logprobs`) and the micro-step position a resumed run
continues from (`micro_steps_into_epoch`), and the cut of a rollout into micro-batches of whole groups
(`split_into_micro_batches`), as pure functions. What it does not own: running the
forwards (the trainer) and the objective (`loss`).
"""

from __future__ import annotations

import math

import torch


def micro_batches_needing_old_logprobs(
    *,
    steps_per_generation: int,
    num_iterations: int,
    gradient_accumulation_steps: int,
    window_offset: int = 0,
    first_use: int = 0,
) -> list[bool]:
    """For each micro-batch i of a rollout, whether any of its uses meets weights moved since sampling.

    The rollout is sampled just before use number `first_use` (0, or later for a run resumed mid-
    rollout from a checkpoint that holds no saved rollout, which re-samples and continues), when `window_offset`
    micro-steps of the current
    accumulation window are already done. The next optimizer step then comes after the use number
    `first_use + gradient_accumulation_steps - window_offset - 1`: windows after the current one are
    full, because an epoch ends only where a rollout ends (the last uses of a rollout are in the
    epoch's last window, whatever its length). Micro-batch i is last used at
    u = (num_iterations - 1) · steps_per_generation + i, so it needs π_old exactly when

        u >= first_use  and  window_offset + (u - first_use) >= gradient_accumulation_steps.

    Micro-batches whose uses all come before `first_use` are not trained again: False.
    """
    if min(steps_per_generation, num_iterations, gradient_accumulation_steps) < 1:
        raise ValueError("steps_per_generation, num_iterations and gradient_accumulation_steps must be >= 1.")
    if not 0 <= window_offset < gradient_accumulation_steps:
        raise ValueError(f"window_offset must be in [0, {gradient_accumulation_steps}), got {window_offset}.")
    if not 0 <= first_use < steps_per_generation * num_iterations:
        raise ValueError(f"first_use must be in [0, {steps_per_generation * num_iterations}), got {first_use}.")
    needs = []
    for i in range(steps_per_generation):
        last_use = (num_iterations - 1) * steps_per_generation + i
        needs.append(last_use >= first_use and window_offset + last_use - first_use >= gradient_accumulation_steps)
    return needs


def micro_steps_into_epoch(global_step: int, steps_in_epoch: int, gradient_accumulation_steps: int) -> int:
    """Micro-steps of the current epoch already trained after `global_step` optimizer steps.

    Mirrors how `transformers.Trainer` resumes: an epoch of `steps_in_epoch` micro-batches has
    ceil(steps_in_epoch / gradient_accumulation_steps) optimizer steps (the last window may be
    short), and a resumed run skips the first (global_step mod that) × gradient_accumulation_steps
    micro-batches of its epoch.
    """
    updates_per_epoch = max(math.ceil(steps_in_epoch / gradient_accumulation_steps), 1)
    return (global_step % updates_per_epoch) * gradient_accumulation_steps


def split_into_micro_batches(batch: dict, num_slices: int, group_size: int, generator: torch.Generator) -> list[dict]:
    """Cut a rollout batch into `num_slices` micro-batches made of whole groups, in shuffled order.

    Rows arrive group by group (`group_size` completions of one prompt in a row). Shuffling groups
    rather than rows keeps each micro-batch a set of complete groups (as verl does), so the packed
    forward processes each prompt once per micro-batch and every step sees whole groups.
    """
    size = batch["input_ids"].shape[0]
    blocks = list(torch.arange(size).split(group_size))
    order = torch.cat([blocks[i] for i in torch.randperm(len(blocks), generator=generator).tolist()])
    slices = []
    for part in order.chunk(num_slices):
        slices.append({key: None if value is None else value[part.to(value.device)] for key, value in batch.items()})
    return slices

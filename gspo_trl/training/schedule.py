"""The rollout schedule: where a rollout's micro-batches fall among optimizer steps, and which π_old each gets.

A rollout is cut into `steps_per_generation` micro-batches, and each is trained on once per pass,
for `num_iterations` passes: use number k = j · steps_per_generation + i (pass j, micro-batch i)
comes k micro-steps after the rollout was sampled. `transformers.Trainer` steps the optimizer after
every `gradient_accumulation_steps` micro-steps of an epoch (and after a shorter last window when
the epoch does not divide evenly). GSPO's ratio compares the current policy with π_old, the weights
that sampled the rollout. While no optimizer step has happened since sampling, the current weights
*are* π_old, so the loss may use old = sg[log π] (ratio exactly 1) and skip a forward pass; a
micro-batch that is also trained after an optimizer step needs π_old computed before that step.

Owns that rule (`micro_batches_needing_old_logprobs`), the micro-step position a resumed run continues from
(`micro_steps_into_epoch`) and the cut of a rollout into micro-batches in shuffled group order
(`split_into_micro_batches`), as pure functions; the one table of π_old sources (`old_logps_source`); and the
trainer's state of it all, `RolloutSchedule`: the buffered micro-batches, the window position, the rollout restored
from a checkpoint, and their checkpoint state. What it does not own: sampling and scoring (the trainer),
running the forwards (`logprobs`) and the objective (`loss`).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from trl.trainer.utils import RepeatSampler

from ..objective.sampling_correction import sampler_logprobs_as_old
from ..rollout.decoding.truncation import policy_logps
from .gather import gather_rollout
from .micro_batch import MicroBatch
from .rollout_checkpoint import RolloutState, load_rollout_state


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


def split_into_micro_batches(
    batch: MicroBatch, num_slices: int, group_size: int, generator: torch.Generator
) -> list[MicroBatch]:
    """Cut a rollout batch into `num_slices` micro-batches in shuffled group order.

    Rows arrive group by group (`group_size` completions of one prompt in a row). Shuffling groups
    rather than rows keeps each micro-batch a set of complete groups (as verl does) when its size is a
    multiple of `group_size`, so the packed forward processes each prompt once per micro-batch; otherwise
    a group at a micro-batch's edge continues in the next one. Either way each row keeps the advantage
    its whole group gave it.
    """
    blocks = list(torch.arange(batch.rows).split(group_size))
    order = torch.cat([blocks[i] for i in torch.randperm(len(blocks), generator=generator).tolist()])
    return [batch.select(part) for part in order.chunk(num_slices)]


def rollout_tokens(batch: MicroBatch, accelerator) -> torch.Tensor:
    """() the completion tokens trained on in a rollout, over every process (the token-mean losses' count)."""
    return accelerator.gather(batch.completion_mask.sum().reshape(1)).sum()


# Where a micro-batch's π_old comes from (`old_logps_source`).
SAMPLED_AHEAD = "sampled ahead"
SAMPLER = "sampler"
FORWARD = "forward"
DECODING_LOOP = "decoding loop"
CURRENT_WEIGHTS = "current weights"


def old_logps_source(micro_batch: MicroBatch, args, needed: bool) -> str:
    """Where π_old of `micro_batch` comes from; the first row whose condition holds decides.

    | condition                                                   | source            | `old_logps`               |
    |-------------------------------------------------------------|-------------------|---------------------------|
    | set already: sampled ahead by weights trained past since    | `SAMPLED_AHEAD`   | kept (`async_rollouts`)   |
    | `use_vllm` and `vllm_logprobs_as_old` (GSPO paper §5.4)     | `SAMPLER`         | the server's log-probs    |
    | `always_compute_old_logprobs`                               | `FORWARD`         | a forward, current weights|
    | not `needed`: no optimizer step before its last use         | `CURRENT_WEIGHTS` | None: sg[log π] in the loss|
    | the trained model's decoding loop recorded them             | `DECODING_LOOP`   | `sampling_logps`          |
    |   (`decode_logprobs_as_old`, checked by `logprob_check`)    |                   |                           |
    | otherwise                                                   | `FORWARD`         | a forward, current weights|

    `needed`: whether the micro-batch is trained after an optimizer step (`micro_batches_needing_old_logprobs`).
    The forward runs right after sampling, before any optimizer step, so the current weights are π_old.
    """
    if micro_batch.old_logps is not None:
        return SAMPLED_AHEAD
    if args.use_vllm and args.vllm_logprobs_as_old:
        return SAMPLER
    if args.always_compute_old_logprobs:
        return FORWARD
    if not needed:
        return CURRENT_WEIGHTS
    if micro_batch.sampled_by_policy and micro_batch.sampling_logps is not None:
        return DECODING_LOOP
    return FORWARD


def fill_old_logps(
    micro_batches: list[MicroBatch], needs_old: list[bool], args, forward: Callable[[MicroBatch], torch.Tensor]
) -> None:
    """Set each micro-batch's `old_logps` from its source (`old_logps_source`); `forward` scores one."""
    for micro_batch, needed in zip(micro_batches, needs_old, strict=True):
        source = old_logps_source(micro_batch, args, needed)
        if source == SAMPLER:
            micro_batch.old_logps = sampler_logprobs_as_old(micro_batch)
        elif source == DECODING_LOOP:
            # π_old is the policy, not the truncated distribution the loop drew from: the ratio compares it with the
            # training forward's log-probs, which are over the whole (temperature-scaled) vocabulary.
            micro_batch.old_logps = policy_logps(micro_batch.sampling_logps, micro_batch.kept_log_mass)
        elif source == FORWARD:
            micro_batch.old_logps = forward(micro_batch)


class RolloutSchedule:
    """The trainer's schedule: the rollout being trained on, cut into micro-batches, and where training stands.

    One rollout serves `steps_per_generation × num_iterations` micro-steps (uses). Per micro-step the trainer calls
    `start` (which says whether a rollout must be sampled now), `fill` after sampling one, `current` for the
    micro-batch to train on and `advance` once trained. A run resumed inside a rollout continues the one saved
    with its checkpoint (`restore`, `checkpoint_state`).
    """

    def __init__(self, args):
        self.args = args
        self.uses = args.steps_per_generation * args.num_iterations
        self.micro_batches: list[MicroBatch] | None = None
        self.step = 0  # micro-steps trained, counted from the start of the epoch on resume
        self.window_global_step: int | None = None  # the optimizer step whose accumulation window is running
        self.window_offset = 0  # micro-steps of that window done
        self.sampled_at_step = 0  # optimizer steps done when the buffered rollout was sampled
        self.micro_steps_per_epoch = 0  # the Trainer's steps_in_epoch (set with the dataloader)
        self.restored: RolloutState | None = None  # the rollout saved with the checkpoint a run resumes from
        self.shuffle_generator = torch.Generator().manual_seed(args.seed)

    def train_sampler(self, dataset) -> RepeatSampler:
        """The order of training prompts: each prompt `num_generations` times in a row, and each generation batch
        repeated for every micro-step that trains on it, so the dataloader stays aligned with the schedule."""
        args = self.args
        return RepeatSampler(
            data_source=dataset,
            mini_repeat_count=args.num_generations,
            batch_size=args.generation_batch_size // args.num_generations,
            repeat_count=self.uses,
            shuffle=args.shuffle_dataset,
            seed=args.seed,
        )

    def eval_sampler(self, dataset) -> RepeatSampler:
        """The order of evaluation prompts: each prompt `num_generations_eval` (default `num_generations`) times in a
        row, shuffled by the seed."""
        repeats = self.args.num_generations_eval or self.args.num_generations
        return RepeatSampler(data_source=dataset, mini_repeat_count=repeats, seed=self.args.seed)

    @property
    def use(self) -> int:
        """The current micro-step's use of the rollout."""
        return self.step % self.uses

    def restore(self, checkpoint: str | None, accelerator) -> RolloutState | None:
        """Start training (again): nothing buffered; a run resumed from `checkpoint` takes up the state this
        process saved there (returned, with the trainer's part of it), if any."""
        self.micro_batches, self.window_global_step, self.window_offset = None, None, 0
        restored = None
        if checkpoint is not None:
            restored = load_rollout_state(checkpoint, accelerator.process_index, accelerator.device)
        self.restored = restored
        if restored is not None:
            self.shuffle_generator.set_state(restored.shuffle_generator_state)
        return restored

    def start(self, global_step: int) -> bool:
        """Begin a micro-step after `global_step` optimizer steps; True when a rollout must be sampled for it."""
        if global_step != self.window_global_step:  # the first micro-step after an optimizer step
            self.window_global_step, self.window_offset = global_step, 0
        if self.micro_batches is None:
            # Start or resume: take up the schedule at the dataloader's position.
            ga = self.args.gradient_accumulation_steps
            self.step = micro_steps_into_epoch(global_step, self.micro_steps_per_epoch, ga)
        restored, self.restored = self.restored, None
        if self.micro_batches is None and self.use != 0 and restored is not None and restored.micro_batches:
            # Resumed inside a rollout: continue the one saved with the checkpoint (its sampling weights are gone,
            # so it could not be sampled again). From a checkpoint without one, a new rollout is sampled there and
            # trained on for its remaining uses.
            self.micro_batches = [MicroBatch.from_state(state) for state in restored.micro_batches]
            self.sampled_at_step = restored.sampled_at_step
        return self.use == 0 or self.micro_batches is None

    def needs_old_logps(self) -> list[bool]:
        """Per micro-batch of a rollout sampled now, whether an optimizer step comes before its last use."""
        args = self.args
        return micro_batches_needing_old_logprobs(
            steps_per_generation=args.steps_per_generation,
            num_iterations=args.num_iterations,
            gradient_accumulation_steps=args.gradient_accumulation_steps,
            window_offset=self.window_offset,
            first_use=self.use,
        )

    def cut(self, rollout: MicroBatch, accelerator, pad_token_id: int) -> list[MicroBatch]:
        """This process's micro-batches of a scored rollout: its share of each global micro-batch, each with the
        rollout's token count (`num_items_in_batch`).

        The rollout of all processes (its columns padded to a multiple of `pad_to_multiple_of`) is cut into
        micro-batches in one shuffled group order (the generator is seeded alike everywhere), and each
        process trains on its share of every one, so an optimizer step sees the same rows whatever the number of
        processes.
        """
        args, processes = self.args, accelerator.num_processes
        rollout.num_items_in_batch = rollout_tokens(rollout, accelerator)
        everything = rollout if processes == 1 else gather_rollout(rollout, accelerator, pad_token_id)
        everything = everything.padded_to_multiple(args.pad_to_multiple_of, pad_token_id)
        global_micro_batches = split_into_micro_batches(
            everything, args.steps_per_generation, args.num_generations, self.shuffle_generator
        )
        if processes == 1:
            return global_micro_batches
        local_rows = rollout.rows // args.steps_per_generation
        mine = slice(accelerator.process_index * local_rows, (accelerator.process_index + 1) * local_rows)
        return [batch.select(mine) for batch in global_micro_batches]

    def fill(self, micro_batches: list[MicroBatch], sampled_at_step: int) -> None:
        """Buffer a new rollout's micro-batches (π_old already set), sampled by the weights of `sampled_at_step`."""
        self.micro_batches, self.sampled_at_step = micro_batches, sampled_at_step

    def current(self) -> MicroBatch:
        return self.micro_batches[self.use % self.args.steps_per_generation]

    def advance(self) -> None:
        """One micro-step trained."""
        self.step += 1
        self.window_offset += 1

    def check_weights_unchanged(self, global_step: int) -> None:
        """Training with old = sg[log π] is only right while the weights are those that sampled the rollout."""
        if global_step != self.sampled_at_step:
            raise RuntimeError(
                f"gspo-trl schedule error: a micro-batch without π_old log-probs is trained at optimizer step "
                f"{global_step}, after its rollout was sampled at step {self.sampled_at_step}; its "
                "importance ratio would be wrong. Please report this with your GSPOConfig; "
                "always_compute_old_logprobs=True avoids it."
            )

    def checkpoint_state(self, num_tokens_seen: int, entropy_control: dict | None) -> RolloutState:
        """What a checkpoint saves to continue: the buffered rollout if training stopped inside it."""
        inside = self.step % self.uses != 0
        return RolloutState(
            micro_batches=[batch.to_state() for batch in self.micro_batches] if inside else None,
            sampled_at_step=self.sampled_at_step,
            shuffle_generator_state=self.shuffle_generator.get_state(),
            num_tokens_seen=num_tokens_seen,
            entropy_control=entropy_control,
        )

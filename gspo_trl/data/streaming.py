"""Streamed datasets (`datasets.IterableDataset`) as training and evaluation prompts.

A stream cannot be indexed, so no sampler can order it: the stream itself is reordered into the sampler's order
(each prompt `num_generations` times in a row, each generation batch once per micro-step that trains on it) by
`repeat_groups`, a batched `map`. accelerate then hands each process its own contiguous slice of every global batch
(`IterableDatasetShard`, which needs `dispatch_batches=False`), as `BatchSamplerShard` does for a map-style dataset;
one dataloader worker reads the stream, so the groups stay in order. Owns those settings (set at construction as TRL
sets them, `use_stream_settings`, and again for a stream handed to `evaluate` later) and the checks a stream takes
(`max_steps`, resuming); what it does not own: the sampler of map-style datasets (`schedule`)."""

from __future__ import annotations

import contextlib
import copy
import json
import os

import torch
from transformers.utils import logging

logger = logging.get_logger(__name__)


def is_stream(dataset) -> bool:
    """Whether `dataset` is read as a stream (`datasets.IterableDataset` subclasses torch's `IterableDataset`)."""
    return isinstance(dataset, torch.utils.data.IterableDataset)


def check_stream(dataset, name: str, args) -> None:
    """A streamed `dataset` (given as `name`) must be a `datasets.IterableDataset` (it is reordered with `map`), a
    training stream needs `max_steps`, and accelerate must not dispatch its batches from the main process."""
    if not is_stream(dataset):
        return
    if not hasattr(dataset, "map"):
        raise TypeError(
            f"{name} is a {type(dataset).__name__}, a torch IterableDataset; streamed prompts must be a "
            "datasets.IterableDataset (e.g. datasets.IterableDataset.from_generator(...)), whose rows are reordered "
            "into prompt groups."
        )
    if name == "train_dataset" and args.max_steps <= 0:
        raise ValueError(
            "train_dataset is a stream (IterableDataset) without a length, so the run's length cannot come from "
            f"num_train_epochs: set max_steps (optimizer steps) to a positive value (got {args.max_steps})."
        )
    if args.accelerator_config.dispatch_batches:
        raise ValueError(
            f"Iterable datasets require `dispatch_batches=False`: {name} is a stream (IterableDataset), which each "
            "process reads for its own prompts, and batches of text cannot be dispatched. Set accelerator_config's "
            "dispatch_batches to False, or leave it unset."
        )


def use_stream_settings(train_dataset, eval_dataset, args) -> None:
    """TRL's settings for streams, in `args` at construction (after `check_stream`): `dispatch_batches=False` when any
    dataset (or any split of a dict of evaluation datasets) is a stream, and for a training stream
    `dataloader_num_workers=0` (with a warning when it was not): several workers would each read a share of the stream
    and interleave their rows, splitting the prompt groups. An evaluation stream is read by one worker only while its
    dataloader is built (`streamed`): a map-style training dataset keeps its workers."""
    eval_datasets = list(eval_dataset.values()) if isinstance(eval_dataset, dict) else [eval_dataset]
    if not any(is_stream(dataset) for dataset in [train_dataset, *eval_datasets]):
        return
    args.accelerator_config.dispatch_batches = False
    if is_stream(train_dataset) and args.dataloader_num_workers != 0:
        logger.warning(
            f"train_dataset is a stream (IterableDataset): dataloader_num_workers={args.dataloader_num_workers} is set "
            "to 0, as TRL does. Several workers would interleave the stream's rows and split the prompt groups."
        )
        args.dataloader_num_workers = 0


def repeat_groups(batch: dict[str, list], prompts: int, group_size: int, uses: int) -> dict[str, list]:
    """A batch of `prompts` stream rows (columns of values) in the sampler's order: each row `group_size` times in a
    row, the whole batch `uses` times; a shorter (last) batch gives no rows, as the sampler drops it. Rows are copied,
    so that no two repeats share a mutable value (chat messages)."""
    columns = list(batch)
    if not columns or len(batch[columns[0]]) < prompts:
        return {column: [] for column in columns}
    repeated = {column: [] for column in columns}
    for _ in range(uses):
        for row in range(prompts):
            for _ in range(group_size):
                for column in columns:
                    repeated[column].append(copy.deepcopy(batch[column][row]))
    return repeated


def stream_in_sampler_order(dataset, training: bool, args):
    """The stream `dataset` reordered as the sampler orders map-style prompts: for training, generation batches of
    `generation_batch_size / num_generations` prompts, each repeated for every use (`steps_per_generation ×
    num_iterations`); for evaluation, each prompt `num_generations_eval` times. Shuffled in a buffer (seeded) where
    the sampler would shuffle."""
    if training:
        prompts, group = args.generation_batch_size // args.num_generations, args.num_generations
        uses = args.steps_per_generation * args.num_iterations
    else:
        prompts, group, uses = 1, args.num_generations_eval or args.num_generations, 1
    if not training or args.shuffle_dataset:
        dataset = dataset.shuffle(seed=args.seed)  # set_epoch (each epoch of Trainer) reseeds it
    arguments = dict(prompts=prompts, group_size=group, uses=uses)
    return dataset.map(repeat_groups, batched=True, batch_size=prompts, fn_kwargs=arguments)


@contextlib.contextmanager
def streamed(dataset, training: bool, args, accelerator):
    """While Trainer builds a dataloader for `dataset`: a stream in the sampler's order, read by one worker and sharded
    per process (`dispatch_batches=False`); anything else unchanged."""
    if not is_stream(dataset):
        yield dataset
        return
    workers = args.dataloader_num_workers
    if workers != 0:
        logger.warning_once(
            f"A streamed dataset is read by one dataloader worker (dataloader_num_workers={workers} is not used for "
            "it): several workers would interleave its rows and split the prompt groups."
        )
    accelerator.dataloader_config.dispatch_batches = False
    args.dataloader_num_workers = 0
    try:
        yield stream_in_sampler_order(dataset, training, args)
    finally:
        args.dataloader_num_workers = workers


def micro_steps_per_epoch(dataloader, train_dataset, args) -> int:
    """The Trainer's `steps_in_epoch`: the dataloader's length, or for a stream `max_steps ×
    gradient_accumulation_steps` (transformers' count for a dataloader without one)."""
    if is_stream(train_dataset):
        return args.max_steps * args.gradient_accumulation_steps
    return len(dataloader)


def check_stream_resume(checkpoint: str | None, train_dataset) -> None:
    """Resuming on a stream re-reads it from its start and skips the micro-batches already trained (transformers'
    `skip_first_batches`): the same prompts, if the stream gives the same rows in the same order. A run that went
    past the stream's end (a second pass: `epoch` above 1, which a single pass reaches only at its last step)
    cannot be placed again: refused."""
    if checkpoint is None or not is_stream(train_dataset):
        return
    state_file = os.path.join(checkpoint, "trainer_state.json")
    if not os.path.isfile(state_file):
        return
    with open(state_file, encoding="utf-8") as handle:
        epoch = json.load(handle).get("epoch") or 0.0
    if epoch > 1.0:
        raise ValueError(
            f"Cannot resume from {checkpoint} on a streamed train_dataset: that run read the stream to its end and "
            f"started over (epoch {epoch:.2f}), and the place to continue from cannot be found again in a stream. "
            "Resume from an earlier checkpoint, or pass a stream long enough for max_steps."
        )

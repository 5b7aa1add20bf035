"""Checks of what a user hands `GSPOTrainer`, before anything is built: a `GSPOConfig` (or the default one), a training
dataset of one split with a 'prompt' column of prompt text and enough prompts for one rollout, and evaluation
datasets (one, or several by name as TRL takes them: a dict, `DatasetDict` or `IterableDatasetDict`); once the
policy is loaded, no column or content part it cannot read (`check_dataset_modalities`). Each raises an error that
names the argument (and the row) and says what to change."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from datasets import Dataset

from ..config.gspo_config import GSPOConfig
from ..models.multimodal import IMAGE_COLUMNS
from ..rollout.types import check_prompt
from .streaming import check_stream


def trainer_config(args, model) -> GSPOConfig:
    """`args`, or without one (as TRL) the defaults writing to `<model name>-GSPO`; anything but a `GSPOConfig`
    (TRL's `GRPOConfig`) is a `TypeError` that names the replacement."""
    if args is None:
        name = model if isinstance(model, str) else getattr(model.config, "_name_or_path", "model")
        args = GSPOConfig(output_dir=f"{Path(str(name)).name}-GSPO")
    if not isinstance(args, GSPOConfig):
        raise TypeError(
            f"args must be a GSPOConfig, got {type(args).__name__}. Coming from TRL, replace GRPOConfig with "
            "gspo_trl.GSPOConfig (same field names)."
        )
    return args


def check_datasets(train_dataset, eval_dataset, args, episodes: bool) -> None:
    """The training and evaluation datasets (`check_prompt_dataset`; episodes may start from the environment's reset
    instead of a prompt), enough training prompts for a rollout, and evaluation groups episodes can be scored in.
    Without a training dataset (and no environment that owns the data: `environment_owned_prompts`) there would be
    nothing to train on: TRL's `ValueError`."""
    if train_dataset is None:
        raise ValueError(
            "`train_dataset` is required unless an environment_factory (or env_factory) is provided whose reset() "
            "returns the prompt: it holds the prompts the rollouts are sampled for. Pass "
            "train_dataset=Dataset.from_dict({'prompt': [...]})."
        )
    check_prompt_dataset(train_dataset, "train_dataset", needs_prompt=not episodes)
    check_stream(train_dataset, "train_dataset", args)
    for name, split in eval_splits(eval_dataset).items():
        check_prompt_dataset(split, name, needs_prompt=not episodes)
        check_stream(split, name, args)
    check_enough_prompts(train_dataset, args)
    if episodes and args.num_generations_eval == 1:
        raise ValueError(
            "num_generations_eval=1 is for single-turn rollouts: multi-turn episodes (env_factory, tools) are scored "
            "within groups. Set num_generations_eval >= 2."
        )
    if episodes and args.multi_objective_aggregation != "sum_then_normalize":
        raise ValueError(
            f"multi_objective_aggregation={args.multi_objective_aggregation!r} is for single-turn rollouts; "
            "multi-turn episodes (env_factory, tools) take 'sum_then_normalize'."
        )


def environment_owned_prompts(train_dataset, args, environment_factory):
    """`train_dataset`, or without one, where an environment owns the data (`environment_factory`: TRL's, or a
    gym-style `env_factory`; its reset() gives the prompt), TRL's stand-in: one rollout's rows of an empty user
    message, which the run goes through again every epoch for `max_steps` optimizer steps."""
    if train_dataset is not None or environment_factory is None:
        return train_dataset
    if isinstance(environment_factory, dict):
        raise ValueError(
            "A dict environment_factory (several environments) requires a `train_dataset` with an 'environment' column "
            "naming each row's environment. Pass such a dataset, or a single environment factory."
        )
    if args.max_steps <= 0:
        raise ValueError(
            "Without a train_dataset the environment owns the data (its reset() returns the prompt), so the run's "
            f"length cannot come from num_train_epochs: set max_steps to a positive value (got {args.max_steps})."
        )
    rows = args.generation_batch_size // args.num_generations
    return Dataset.from_dict({"prompt": [[{"role": "user", "content": ""}]] * rows})


def check_enough_prompts(dataset, args) -> None:
    """A `ValueError` unless `dataset` holds the prompts of one rollout: otherwise the sampler yields no rollout and
    Trainer ends at step 0 with only a warning."""
    if dataset is None or not hasattr(dataset, "__len__"):
        return
    needed = args.generation_batch_size // args.num_generations
    if len(dataset) < needed:
        raise ValueError(
            f"train_dataset has {len(dataset)} prompts, but one rollout takes {needed}: generation_batch_size "
            f"{args.generation_batch_size} (per_device_train_batch_size {args.per_device_train_batch_size} × "
            f"{args.world_size} processes × steps_per_generation {args.steps_per_generation}) / num_generations "
            f"{args.num_generations}. Add prompts, or lower per_device_train_batch_size or steps_per_generation."
        )


def eval_splits(eval_dataset) -> dict:
    """The evaluation datasets by the name an error gives them: `eval_dataset`, or for several (a dict, `DatasetDict`
    or `IterableDatasetDict`, which Trainer evaluates one by one under the prefix `eval_<key>_`)
    `eval_dataset['<key>']`."""
    if eval_dataset is None:
        return {}
    if isinstance(eval_dataset, dict):  # DatasetDict and IterableDatasetDict are dicts too
        return {f"eval_dataset[{key!r}]": split for key, split in eval_dataset.items()}
    return {"eval_dataset": eval_dataset}


def check_prompt_dataset(dataset, name: str, needs_prompt: bool = True) -> None:
    """A clear error for several datasets where one is read (a `DatasetDict`: the training dataset), or a dataset
    without the 'prompt' column the trainer reads (`name`: the argument it was given as)."""
    if dataset is None:
        return
    if isinstance(dataset, dict):  # a DatasetDict, an IterableDatasetDict or a dict of datasets
        raise TypeError(
            f"{name} must be a Dataset or IterableDataset, got {type(dataset).__name__} (several splits); pass one "
            f"split, e.g. {name}=dataset['train']."
        )
    column_names = getattr(dataset, "column_names", None)
    if needs_prompt and column_names is not None and "prompt" not in column_names:
        raise ValueError(
            f"{name} needs a 'prompt' column (a string, or a list of chat messages); it has {column_names}. "
            "Rename your column with dataset.rename_column(old, 'prompt')."
        )
    if column_names is not None and "prompt" in column_names and hasattr(dataset, "__len__"):
        check_prompt_values(dataset.select_columns(["prompt"]), name)


def check_prompt_values(prompts, name: str, batch_rows: int = 1024) -> None:
    """`rollout.types.check_prompt` on every prompt of a map-style dataset (None, an empty string, a number, messages
    a chat template cannot render), naming the row. Every process holds the whole dataset, so all of them refuse a
    bad prompt here, together; in a rollout only the process that drew it would (prompts are checked again as they
    are rendered: streamed datasets)."""
    for start in range(0, len(prompts), batch_rows):
        for offset, prompt in enumerate(prompts[start : start + batch_rows]["prompt"]):
            try:
                check_prompt(prompt)
            except (TypeError, ValueError) as error:
                raise type(error)(f"{name} row {start + offset}: {error}") from None


@dataclasses.dataclass(frozen=True)
class RowCollator:
    """The dataloader's collator: a batch stays a list of rows (python objects until generation: prompts may be chat
    messages). A row without 'prompt' is refused as it arrives (`needs_prompt`); a stream's columns are known only
    then. A module-level class, so that dataloader workers (`dataloader_num_workers > 0`) can pickle it whatever their
    start method (spawn and forkserver pickle the collator into each worker)."""

    needs_prompt: bool = True

    def __call__(self, rows: list[dict]) -> list[dict]:
        for row in rows:
            if self.needs_prompt and "prompt" not in row:
                raise ValueError(
                    f"A dataset row has no 'prompt' column (a string, or a list of chat messages); its columns are "
                    f"{sorted(row)}. Rename your column with dataset.rename_column(old, 'prompt')."
                )
        return list(rows)


# Columns of another modality than text and images: nothing passes them to the policy.
OTHER_MODALITY_COLUMNS = ("audio", "audios", "video", "videos")


def check_dataset_modalities(processor, train_dataset, eval_dataset) -> None:
    """A `ValueError` for a dataset column or a prompt content part the policy cannot read (`processor`: its
    multimodal processor, None for a text model): images for a text model, audio or video for any, images beside a
    plain-text prompt (the chat template places them). A column only reward functions read passes under another
    name."""
    readable = ("text", "image") if processor is not None else ("text",)
    model = "a vision-language model" if processor is not None else "a text model"
    for name, dataset in {"train_dataset": train_dataset, **eval_splits(eval_dataset)}.items():
        columns = getattr(dataset, "column_names", None)
        if not isinstance(columns, list):  # no dataset, or a stream whose columns are known only as it is read
            continue
        unread = [c for c in columns if c in OTHER_MODALITY_COLUMNS or (processor is None and c in IMAGE_COLUMNS)]
        if unread:
            raise ValueError(
                f"{name} has a {unread[0]!r} column, which the policy ({model}) never sees: it would be trained on "
                f"the prompts without it. Use a model that reads it, or rename the column (e.g. "
                f"dataset.rename_column({unread[0]!r}, 'reward_{unread[0]}')) if only reward functions read it."
            )
        if "prompt" not in columns:
            continue
        plain_text = getattr(getattr(dataset, "features", {}).get("prompt"), "dtype", None) == "string"
        if processor is not None and plain_text and any(c in columns for c in IMAGE_COLUMNS):
            raise ValueError(
                f"{name} has images but plain-text prompts: the chat template places the images, so each prompt "
                "must be a list of messages, e.g. [{'role': 'user', 'content': text}]."
            )
        if hasattr(dataset, "__len__") and not plain_text:
            check_prompt_parts(dataset.select_columns(["prompt"]), name, readable, model)


def check_prompt_parts(prompts, name: str, readable: tuple, model: str, batch_rows: int = 1024) -> None:
    """A `ValueError` naming the row of the first prompt content part of a type not in `readable`."""
    for start in range(0, len(prompts), batch_rows):
        for offset, prompt in enumerate(prompts[start : start + batch_rows]["prompt"]):
            for message in prompt if isinstance(prompt, list) else []:
                parts = message.get("content") if isinstance(message.get("content"), list) else []
                kinds = [part.get("type") for part in parts if part.get("type") not in readable]
                if kinds:
                    raise ValueError(
                        f"{name} row {start + offset}: a prompt message has a {kinds[0]!r} content part, which the "
                        f"policy ({model}) cannot read. Remove it, or train a model that reads it."
                    )

"""Checks of what a user hands `GSPOTrainer`, before anything is built: a `GSPOConfig` (or the default one), and
datasets of one split, with a 'prompt' column of prompt text and enough prompts for one rollout; once the policy is
loaded, no column or content part it cannot read (`check_dataset_modalities`). Each raises an error that names the
argument (and the row) and says what to change."""

from __future__ import annotations

from pathlib import Path

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
    instead of a prompt), enough training prompts for a rollout, and evaluation groups episodes can be scored in."""
    check_prompt_dataset(train_dataset, "train_dataset", needs_prompt=not episodes)
    check_prompt_dataset(eval_dataset, "eval_dataset", needs_prompt=not episodes)
    check_stream(train_dataset, "train_dataset", args)
    check_stream(eval_dataset, "eval_dataset", args)
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


def check_prompt_dataset(dataset, name: str, needs_prompt: bool = True) -> None:
    """A clear error for a `DatasetDict` or a dataset without the 'prompt' column the trainer reads (`name`: the
    argument it was given as)."""
    if dataset is None:
        return
    column_names = getattr(dataset, "column_names", None)
    if isinstance(column_names, dict):  # a DatasetDict
        raise TypeError(f"{name} is a DatasetDict; pass one split, e.g. {name}=dataset['train'].")
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


def collate_rows(needs_prompt: bool):
    """The dataloader's collator: a batch stays a list of rows (python objects until generation: prompts may be chat
    messages). A row without 'prompt' is refused as it arrives; a stream's columns are known only then."""

    def collate(rows: list[dict]) -> list[dict]:
        for row in rows:
            if needs_prompt and "prompt" not in row:
                raise ValueError(
                    f"A dataset row has no 'prompt' column (a string, or a list of chat messages); its columns are "
                    f"{sorted(row)}. Rename your column with dataset.rename_column(old, 'prompt')."
                )
        return list(rows)

    return collate


# Columns of another modality than text and images: nothing passes them to the policy.
OTHER_MODALITY_COLUMNS = ("audio", "audios", "video", "videos")


def check_dataset_modalities(processor, datasets: dict) -> None:
    """A `ValueError` for a dataset column or a prompt content part the policy cannot read (`processor`: its
    multimodal processor, None for a text model; `datasets`: argument name -> dataset): images for a text model,
    audio or video for any, images beside a plain-text prompt (the chat template places them). A column only reward
    functions read passes under another name."""
    readable = ("text", "image") if processor is not None else ("text",)
    model = "a vision-language model" if processor is not None else "a text model"
    for name, dataset in datasets.items():
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

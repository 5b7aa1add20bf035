"""Images of vision-language prompts: from the dataset's columns to the model's forward.

Owns telling a multimodal processor from a tokenizer, putting a row's `image`/`images` column into its
conversational prompt (TRL's convention), encoding prompts with the processor, and `VisionInputs`: the processor's
multimodal fields (`pixel_values`, `image_grid_thw`, `mm_token_type_ids`, ...) kept once per prompt, with the prompt
each row answers. A rollout's rows repeat each prompt `num_generations` times; the fields are stored once and only
`rows_inputs` builds the per-row tensors a forward needs. What it does not own: sampling (`rollout.hf`), the
forward itself (`logprobs`) and the loss, which never sees images.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import PreTrainedTokenizerBase, ProcessorMixin
from trl.data_utils import prepare_multimodal_messages

# Processor outputs aligned with the prompt's tokens (B, P): padded like the ids, zero on completion tokens.
TOKEN_ALIGNED_FIELDS = ("mm_token_type_ids", "token_type_ids")
IMAGE_COLUMNS = ("image", "images")
STATE_PREFIX = "vision."  # the checkpoint keys of a micro-batch's `VisionInputs`


def is_processor(processing_class) -> bool:
    """Whether `processing_class` is a multimodal processor (a `ProcessorMixin` holding a tokenizer)."""
    return isinstance(processing_class, ProcessorMixin) and isinstance(
        getattr(processing_class, "tokenizer", None), PreTrainedTokenizerBase
    )


def is_vision_config(config) -> bool:
    """Whether a model config is a vision-language model's (it has a vision tower's config)."""
    return getattr(config, "vision_config", None) is not None


def row_images(row: dict) -> list | None:
    """The images of a dataset row: its `images` column (a list), else its `image` column, else None."""
    if row.get("images") is not None:
        return list(row["images"])
    if row.get("image") is not None:
        return [row["image"]]
    return None


def prompts_with_images(batch: list[dict], processing_class) -> list:
    """Each row's prompt, with its images put into the prompt's image content parts (`{"type": "image"}`, or before
    the first user message's text when it has none); rows without images, and every row when `processing_class` is
    not a multimodal processor (a text model, whose image columns are only reward inputs), keep their prompt."""
    prompts = []
    vision = is_processor(processing_class)
    for row in batch:
        images = row_images(row) if vision else None
        if images is None:
            prompts.append(row["prompt"])
            continue
        if not isinstance(row["prompt"], list):
            raise ValueError(
                "A row with an 'image'/'images' column needs a conversational prompt (a list of messages), so that "
                f"the chat template places the images; got {type(row['prompt']).__name__}."
            )
        prompts.append(prepare_multimodal_messages(row["prompt"], images=images))
    return prompts


def message_images(prompt) -> list:
    """The images in a conversational prompt's content parts, in order."""
    if not isinstance(prompt, list):
        return []
    return [
        part["image"]
        for message in prompt
        if isinstance(message.get("content"), list)
        for part in message["content"]
        if isinstance(part, dict) and part.get("type") == "image" and part.get("image") is not None
    ]


@dataclass(slots=True)
class VisionInputs:
    """The processor's multimodal fields of a batch's distinct prompts, and the prompt of each row.

    `prompts[g]` maps a field name to its tensor for prompt g alone, as the processor returns it for one prompt
    (leading dimension: the prompt's images, patches or 1); token-aligned fields are (1, P) on the batch's
    left-padded prompt columns. `groups` is (B,) int64: the prompt index of each row.
    """

    prompts: list[dict[str, torch.Tensor]]
    groups: torch.Tensor  # (B,)

    def select(self, rows: torch.Tensor | slice) -> VisionInputs:
        """These rows, keeping only the prompts they answer (shared tensors, no copy)."""
        groups = self.groups[rows]
        kept, remap = torch.unique(groups, return_inverse=True)
        return VisionInputs([self.prompts[g] for g in kept.tolist()], remap)

    def to(self, device) -> VisionInputs:
        prompts = [{name: value.to(device) for name, value in fields.items()} for fields in self.prompts]
        return VisionInputs(prompts, self.groups.to(device))

    def rows_inputs(self, total_length: int) -> dict[str, torch.Tensor]:
        """The forward's multimodal keyword arguments for every row (B rows of `total_length` = P + C columns): each
        row gets its prompt's fields (the model matches image features to each row's image tokens); token-aligned
        fields are padded with zeros over the completion."""
        names = self.prompts[0].keys()
        inputs = {}
        for name in names:
            parts = [self.prompts[g][name] for g in self.groups.tolist()]
            if name in TOKEN_ALIGNED_FIELDS:
                value = torch.cat(parts)
                inputs[name] = F.pad(value, (0, total_length - value.shape[1]))
            else:
                inputs[name] = _concatenated(parts)
        return inputs

    @classmethod
    def joined(cls, parts: list[VisionInputs], prompt_length: int) -> VisionInputs:
        """The rows of `parts` one after another, as one batch whose prompts are `prompt_length` columns wide (every
        process's rollout gathered): each part's prompt indices follow the earlier parts' prompts, and its
        token-aligned fields are left-padded to the joined width, as its ids are."""
        prompts, groups = [], []
        for part in parts:
            groups.append(part.groups + len(prompts))
            for fields in part.prompts:
                aligned = {name: value for name, value in fields.items() if name in TOKEN_ALIGNED_FIELDS}
                widened = {name: F.pad(value, (prompt_length - value.shape[1], 0)) for name, value in aligned.items()}
                prompts.append({**fields, **widened})
        return cls(prompts, torch.cat(groups))

    def to_state(self) -> dict[str, torch.Tensor]:
        """Flat tensors for a checkpoint: `vision.groups`, and `vision.<prompt>.<field>` for each prompt's fields."""
        state = {f"{STATE_PREFIX}groups": self.groups}
        for index, prompt_fields in enumerate(self.prompts):
            state.update({f"{STATE_PREFIX}{index}.{name}": value for name, value in prompt_fields.items()})
        return state

    @classmethod
    def from_state(cls, state: dict) -> VisionInputs | None:
        """The inputs saved by `to_state`, their keys popped from `state`; None where it holds none."""
        keys = [key for key in state if key.startswith(STATE_PREFIX)]
        if not keys:
            return None
        saved = {key[len(STATE_PREFIX) :]: state.pop(key) for key in keys}
        groups = saved.pop("groups")
        prompts = [{} for _ in range(int(groups.max()) + 1)]
        for key, value in saved.items():
            index, name = key.split(".", 1)
            prompts[int(index)][name] = value
        return cls(prompts, groups)

    def stored_bytes(self) -> int:
        """Bytes held by the fields (each prompt once)."""
        return sum(value.numel() * value.element_size() for fields in self.prompts for value in fields.values())


def _concatenated(parts: list[torch.Tensor]) -> torch.Tensor:
    """Per-prompt tensors along their first dimension; where later dimensions differ (Idefics3's images per prompt),
    each is zero-padded to the largest, which the model reads as padding images."""
    shape = [max(part.shape[d] for part in parts) for d in range(1, parts[0].dim())]
    padded = []
    for part in parts:
        pad = []
        for d in reversed(range(1, part.dim())):
            pad += [0, shape[d - 1] - part.shape[d]]
        padded.append(F.pad(part, pad) if any(pad) else part)
    return torch.cat(padded)


def encode_prompts(
    processor, prompts: list, max_prompt_length: int | None, chat_template_kwargs=None
) -> tuple[torch.Tensor, torch.Tensor, VisionInputs | None]:
    """(prompt_ids, prompt_mask, vision): (N, P) left-padded ids of prompts rendered with the processor's chat
    template, and their multimodal fields, each distinct prompt encoded once (consecutive equal prompts, as the
    sampler repeats them, are one group). `vision` is None when no prompt holds an image."""
    groups, distinct = [], []
    for prompt in prompts:
        if not distinct or not _same_prompt(prompt, distinct[-1]):
            distinct.append(prompt)
        groups.append(len(distinct) - 1)
    encoded = [_encode_one(processor, prompt, chat_template_kwargs) for prompt in distinct]
    length = max(fields["input_ids"].shape[1] for fields in encoded)
    if max_prompt_length is not None and length > max_prompt_length:
        raise ValueError(
            f"A prompt with images is {length} tokens long, over max_prompt_length={max_prompt_length}: cutting it "
            "would cut image tokens from it. Raise max_prompt_length (or set it to None) for vision-language prompts."
        )
    pad = processor.tokenizer.pad_token_id
    ids = torch.cat([F.pad(f["input_ids"], (length - f["input_ids"].shape[1], 0), value=pad) for f in encoded])
    mask = torch.cat([F.pad(f["attention_mask"], (length - f["attention_mask"].shape[1], 0)) for f in encoded])
    index = torch.tensor(groups)
    per_prompt = []
    for fields in encoded:
        kept = {}
        for name, value in fields.items():
            if name in ("input_ids", "attention_mask"):
                continue
            kept[name] = F.pad(value, (length - value.shape[1], 0)) if name in TOKEN_ALIGNED_FIELDS else value
        per_prompt.append(kept)
    with_images = [bool(message_images(prompt)) for prompt in distinct]
    if any(with_images) and not all(with_images):
        raise ValueError(
            "A batch mixes prompts with images and prompts without: give every row of the dataset an image (its "
            "'image' or 'images' column), or none."
        )
    has_images = all(with_images)
    return ids[index], mask[index], VisionInputs(per_prompt, index) if has_images else None


def _encode_one(processor, prompt, chat_template_kwargs) -> dict[str, torch.Tensor]:
    images = message_images(prompt)
    if isinstance(prompt, list):
        text = processor.apply_chat_template(
            prompt, tokenize=False, add_generation_prompt=True, **(chat_template_kwargs or {})
        )
    else:
        text = prompt
    # Chat templates carry the special tokens already, as for text prompts.
    kwargs = {"images": [images]} if images else {}
    encoded = processor(text=[text], return_tensors="pt", add_special_tokens=False, **kwargs)
    return {name: value for name, value in encoded.items() if isinstance(value, torch.Tensor)}


def _same_prompt(a, b) -> bool:
    if a is b:
        return True
    try:
        return bool(a == b)  # PIL images compare by mode, size and pixels
    except (TypeError, ValueError):
        return False


def check_vision_support(processor, args, episodes: bool, rollout_func) -> None:
    """A `ValueError` at construction for what vision-language training does not support yet (`processor`: the
    policy's multimodal processor, None for a text model)."""
    if processor is None:
        return
    refused = {
        "use_vllm=True": args.use_vllm,
        "env_factory, environment_factory or tools (multi-turn episodes)": episodes,
        "rollout_func": rollout_func is not None,
        "async_rollouts=True": args.async_rollouts,
        "dynamic_sampling=True (extra rounds are not joined with their images)": args.dynamic_sampling,
        "pad_to_multiple_of (the images' token positions are not padded with the rows)": args.pad_to_multiple_of
        is not None,
        "padding_free=True (packed rows hold no per-row images)": args.padding_free is True,
        "FSDP (untested with images; resuming would load its sharded checkpoint as a whole one)": bool(
            getattr(args, "fsdp", None) or os.environ.get("ACCELERATE_USE_FSDP", "").lower() == "true"
        ),
    }
    for option, is_set in refused.items():
        if is_set:
            raise ValueError(
                f"A vision-language model (processing_class is a {type(processor).__name__}) cannot be trained with "
                f"{option} yet. Sampling runs on the trained model with transformers' generate, on padded rows: "
                "unset that option."
            )

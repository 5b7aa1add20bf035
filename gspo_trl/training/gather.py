"""A rollout gathered from every process into one batch, laid out as if one process had sampled every row.

It owns the padding of each part across processes (prompts on the left, completions on the right) and a
vision-language rollout's images; the collectives themselves are accelerate's.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from accelerate.utils import gather_object

from ..models.multimodal import VisionInputs
from .micro_batch import MicroBatch


def gather_rollout(batch: MicroBatch, accelerator, pad_token_id: int) -> MicroBatch:
    """Every process's rollout rows, in process order, padded as one batch would be.

    `input_ids` / `attention_mask` hold a left-padded prompt followed by a right-padded completion; the
    two parts are padded across processes separately (prompt on the left, completion on the right), so
    the result is laid out exactly as if one process had sampled all rows. Completion-aligned tensors
    (B, C) are padded on the right; per-row tensors (B,) are gathered as they are.
    """
    completion_length = batch.completion_ids.shape[1]
    prompt_length = batch.input_ids.shape[1] - completion_length

    def gathered(tensor, pad_index, pad_first):
        return accelerator.gather(
            accelerator.pad_across_processes(tensor, dim=1, pad_index=pad_index, pad_first=pad_first)
        )

    prompt_ids = gathered(batch.input_ids[:, :prompt_length], pad_token_id, True)
    prompt_mask = gathered(batch.attention_mask[:, :prompt_length], 0, True)
    completion_ids = gathered(batch.completion_ids, pad_token_id, False)
    completion_attention = gathered(batch.attention_mask[:, prompt_length:], 0, False)
    result = {
        "input_ids": torch.cat([prompt_ids, completion_ids], dim=1),
        "attention_mask": torch.cat([prompt_mask, completion_attention], dim=1),
        "completion_ids": completion_ids,
    }
    # Every process takes the same path below (the images' gather is a collective): one whose prompts have no images
    # beside one whose prompts do is refused on all of them, rather than left waiting.
    with_images = accelerator.gather(torch.tensor([batch.vision is not None], device=prompt_ids.device))
    if with_images.any() and not with_images.all():
        raise ValueError(
            "A rollout mixes processes whose prompts have images with processes whose prompts have none: give every "
            "row of the dataset an image (its 'image' or 'images' column), or none."
        )
    if batch.vision is not None:  # each prompt's images once, whatever their shapes
        result["vision"] = gather_vision(batch.vision, prompt_ids.shape[1])
    for name, value in replace(batch, vision=None).to_state().items():
        if name in result or not isinstance(value, torch.Tensor):
            result.setdefault(name, value)
        elif value.dim() == 0:  # a count over the whole rollout (num_items_in_batch)
            result[name] = value
        elif value.dim() == 2:  # completion-aligned: completion_mask, log-probs
            result[name] = gathered(value, 0, False)
        elif name == "sampling_routes":  # position-aligned like input_ids, -1 where not recorded
            prompt_routes = gathered(value[:, :prompt_length], -1, True)
            result[name] = torch.cat([prompt_routes, gathered(value[:, prompt_length:], -1, False)], dim=1)
        else:
            result[name] = accelerator.gather(value)
    return MicroBatch(**result)


def gather_vision(vision: VisionInputs, prompt_length: int) -> VisionInputs:
    """Every process's `VisionInputs` joined in process order, for rows whose prompts are padded to `prompt_length`
    columns. The fields travel as objects (through host memory): each prompt's tensors have shapes of their own."""
    parts = gather_object([vision.to("cpu")])
    return VisionInputs.joined(parts, prompt_length).to(vision.groups.device)

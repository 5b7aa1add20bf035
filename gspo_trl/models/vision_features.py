"""A forward's images through the vision tower once per prompt, their features shared by the prompt's rows.

A rollout's rows repeat each prompt `num_generations` times. transformers' vision-language models encode the images
of every row they are given, so handing them each row's `pixel_values` runs the vision tower once per completion.
`images_encoded_once` hands the model each distinct prompt's `pixel_values` once, with the per-row fields the
language model reads (Qwen's `image_grid_thw` for M-RoPE positions, `mm_token_type_ids`, Gemma 3's
`token_type_ids`), and for the duration of the call replaces the model's `get_image_features` by one that encodes
the distinct prompts and gives every row its prompt's features (`features_to_rows`). The encoding stays inside the
model's own forward (so DDP, DeepSpeed and PEFT wrappers see it), and the gradient of every row reaches the shared
features. The replacement is an attribute of the model while the context is open: a forward of the same model in
another thread meanwhile would read it too. What it does not own: which prompt each row answers
(`multimodal.VisionInputs`), the forward itself (`logprobs`, `rollout.hf`).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Iterator

import torch

from .distributed import unwrap_model
from .multimodal import VisionInputs, _concatenated

ENCODER_ONLY_FIELDS = ("pixel_values",)  # read by the vision tower alone: handed to the forward once per prompt


def features_to_rows(
    features,  # the model's pooled image features: a tensor (..., H) or a list/tuple of (tokens, H), prompt order
    row_tokens: torch.Tensor,  # (B,) the image tokens of each row
    groups: torch.Tensor,  # (B,) the prompt each row answers, 0..n-1
):
    """Each row's image features, from the features of the distinct prompts laid out one after the other (as the
    model returns them for one batch holding each prompt once): row b gets the `row_tokens[b]` feature vectors of
    prompt `groups[b]`. Returned in the container the model gave (a tensor stays a tensor, a list a one-item list),
    flat (sum(row_tokens), H), in row order: what the model scatters into the rows' image tokens. Differentiable:
    the gradients of a prompt's rows add up on its features."""
    if isinstance(features, (list, tuple)):
        flat = torch.cat([part.reshape(-1, part.shape[-1]) for part in features])
    else:
        flat = features.reshape(-1, features.shape[-1])
    prompts = int(groups.max()) + 1 if groups.numel() else 0
    prompt_tokens = torch.zeros(prompts, dtype=torch.long, device=row_tokens.device)
    prompt_tokens = prompt_tokens.scatter_reduce(0, groups, row_tokens, reduce="amax", include_self=False)
    if not torch.equal(prompt_tokens[groups], row_tokens):
        raise ValueError("Rows answering the same prompt hold different numbers of image tokens.")
    if int(prompt_tokens.sum()) != flat.shape[0]:
        raise ValueError(
            f"The vision tower gave {flat.shape[0]} image feature vectors for the batch's distinct prompts, whose rows "
            f"hold {int(prompt_tokens.sum())} image tokens: the prompts' images and image tokens do not match."
        )
    starts = torch.cumsum(prompt_tokens, 0) - prompt_tokens  # (n,) where each prompt's features begin
    row_starts = torch.cumsum(row_tokens, 0) - row_tokens  # (B,) where each row's begin in the output
    within = torch.arange(int(row_tokens.sum()), device=row_tokens.device) - row_starts.repeat_interleave(row_tokens)
    index = starts[groups].repeat_interleave(row_tokens) + within  # (sum(row_tokens),)
    rows = flat.index_select(0, index.to(flat.device))
    if isinstance(features, tuple):
        return (rows,)
    return [rows] if isinstance(features, list) else rows


def feature_owner(model: torch.nn.Module) -> torch.nn.Module:
    """The module whose forward encodes the images with its own `get_image_features`: the model's `base_model` (a
    `...ForConditionalGeneration`'s `model`), where transformers' `generate` calls it too. A `ValueError` for a
    model without one."""
    inner = unwrap_model(model)
    if hasattr(inner, "get_base_model"):  # PEFT
        inner = inner.get_base_model()
    owner = getattr(inner, "base_model", inner)
    if not callable(getattr(owner, "get_image_features", None)):
        raise ValueError(
            f"{type(inner).__name__}'s base model ({type(owner).__name__}) has no `get_image_features` method: "
            "gspo-trl encodes a vision-language prompt's images once for all its rows through it, as transformers' "
            "vision-language models define it. Use a model that has one."
        )
    return owner


def image_token_id(config) -> int:
    """The token id the model scatters image features into (`image_token_id`, LLaVA's and Gemma 3's alias
    `image_token_index`)."""
    token_id = getattr(config, "image_token_id", None)
    if token_id is None:
        token_id = getattr(config, "image_token_index", None)
    if token_id is None:
        raise ValueError(f"{type(config).__name__} names no image token id (image_token_id).")
    return int(token_id)


@contextlib.contextmanager
def images_encoded_once(model, vision: VisionInputs, input_ids: torch.Tensor) -> Iterator[dict[str, torch.Tensor]]:
    """The multimodal keyword arguments of a forward (or `generate`) of `input_ids` (B, L) whose rows answer
    `vision`'s prompts: each distinct prompt's `pixel_values` once, every other field per row. While the context is
    open, the model's `get_image_features` encodes the distinct prompts (with their own `image_grid_thw`,
    `image_sizes`, `pixel_attention_mask`: what the vision tower reads) and returns each row's features."""
    owner = feature_owner(model)
    encode = owner.get_image_features
    parameters = inspect.signature(encode).parameters
    prompts = vision.prompts
    once = {name: _concatenated([fields[name] for fields in prompts]) for name in prompts[0] if name in parameters}
    per_row = [{name: value for name, value in fields.items() if name not in ENCODER_ONLY_FIELDS} for fields in prompts]
    inputs = VisionInputs(per_row, vision.groups).rows_inputs(input_ids.shape[1])
    hidden = [name for name in ENCODER_ONLY_FIELDS if name in prompts[0] and name not in once]
    if hidden:  # the forward would run without the images
        raise ValueError(
            f"{type(owner).__name__}.get_image_features names no {hidden[0]!r} parameter: gspo-trl hands each prompt's "
            "images to it once by name, as transformers' vision-language models define it. Use a model that has one."
        )
    inputs.update({name: once[name] for name in ENCODER_ONLY_FIELDS if name in once})
    row_tokens = (input_ids == image_token_id(unwrap_model(model).config)).sum(1)  # (B,)
    groups = vision.groups.to(row_tokens.device)
    variadic = [name for name, p in parameters.items() if p.kind is inspect.Parameter.VAR_KEYWORD]

    @functools.wraps(encode)  # its signature: generate reads it to pick the encoder's inputs
    def encode_each_prompt_once(*args, **kwargs):
        arguments = inspect.signature(encode).bind_partial(*args, **kwargs).arguments
        extra = arguments.pop(variadic[0], {}) if variadic else {}
        arguments.update(once)  # the distinct prompts' fields, not the rows' the forward passes
        outputs = encode(**arguments, **extra)
        if getattr(outputs, "deepstack_features", None) is not None:  # Qwen3-VL's per-layer features
            raise ValueError(
                f"{type(owner).__name__}'s vision tower returns deepstack features (Qwen3-VL and its kin), which "
                "gspo-trl does not share among a prompt's rows yet. Supported: Qwen2-VL and Qwen2.5-VL, LLaVA, "
                "Gemma 3, Idefics3 and SmolVLM (docs/vision-language.md)."
            )
        outputs.pooler_output = features_to_rows(outputs.pooler_output, row_tokens, groups)
        return outputs

    shadowed = owner.__dict__.get("get_image_features")
    owner.get_image_features = encode_each_prompt_once
    try:
        yield inputs
    finally:
        if shadowed is None:
            del owner.get_image_features
        else:
            owner.get_image_features = shadowed

"""How many positions a model attends to, and the refusal of a prompt + completion budget past them.

A model with learned position embeddings (GPT-2, OPT) fails with an `IndexError` deep inside torch past its last
position; a RoPE model runs on, silently, at positions it was never trained on. Both are refused here: at
construction when the config's budget (`max_prompt_length` + `max_completion_length`) cannot fit, else when a
rollout's longest prompt with `max_completion_length` would not. What it does not own: truncating prompts
(`rollout.types.tokenize_prompts`).
"""

from __future__ import annotations

import torch

# The config fields different architectures name their context length with, in the order they are looked up.
POSITION_FIELDS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length", "n_ctx")
# RoPE scalings that stretch the trained positions by `factor` beyond `max_position_embeddings` when the config keeps
# the original length there (YaRN, linear, dynamic NTK); others (llama3, longrope) already state the stretched length.
STRETCHING_ROPE_TYPES = ("linear", "dynamic", "yarn")


def context_length(config) -> tuple[int, str] | None:
    """(the positions a model with this config attends to, the field that says so), or None where the config names
    none (ALiBi models, which have no hard limit)."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    for name in POSITION_FIELDS:
        value = getattr(config, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            break
    else:
        return None
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    # Models with several attention types keep one parameter set per type.
    for parameters in rope.values() if all(isinstance(v, dict) for v in rope.values()) and rope else [rope]:
        kind = parameters.get("rope_type", parameters.get("type"))
        factor = parameters.get("factor") or 1.0
        original = parameters.get("original_max_position_embeddings")
        if kind in STRETCHING_ROPE_TYPES and factor > 1 and (original is None or original >= value):
            return int(value * factor), f"{name} × rope factor {factor}"
    return value, name


def check_budget_fits(config, max_prompt_length: int | None, max_completion_length: int) -> None:
    """At construction: a `ValueError` when `max_completion_length`, or with `max_prompt_length` set the two together,
    need more positions than the model (with config `config`) attends to."""
    context = context_length(config)
    if context is None:
        return
    length, field = context
    if max_completion_length >= length:
        raise ValueError(
            f"max_completion_length={max_completion_length} leaves no room for a prompt: the model attends to "
            f"{length} positions ({field}). Set max_completion_length below {length}, with max_prompt_length at "
            "most the rest."
        )
    if max_prompt_length is not None and max_prompt_length + max_completion_length > length:
        raise ValueError(
            f"max_prompt_length + max_completion_length = {max_prompt_length} + {max_completion_length} = "
            f"{max_prompt_length + max_completion_length} positions, but the model attends to {length} ({field}). "
            f"Set max_prompt_length <= {length - max_completion_length} or lower max_completion_length."
        )


def check_prompts_fit(prompt_mask: torch.Tensor, max_new_tokens: int, context: tuple[int, str] | None) -> None:
    """At sampling: a `ValueError` naming the first row ((N, P) `prompt_mask`, 1 on its tokens) whose prompt and
    `max_new_tokens` completion tokens need more positions than the model's `context` (`context_length`)."""
    if context is None or prompt_mask.numel() == 0:
        return
    length, field = context
    lengths = prompt_mask.sum(dim=1)  # (N,) prompt tokens per row
    too_long = (lengths + max_new_tokens > length).nonzero()
    if len(too_long):
        row = int(too_long[0])
        raise ValueError(
            f"A prompt of this rollout (row {row}) has {int(lengths[row])} tokens; with {max_new_tokens} completion "
            f"tokens it needs {int(lengths[row]) + max_new_tokens} positions, but the model attends to {length} "
            f"({field}). Set max_prompt_length <= {max(length - max_new_tokens, 1)} to truncate prompts from the "
            "left, or drop the long prompts from the dataset."
        )

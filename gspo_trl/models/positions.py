"""Position ids from an attention mask: the one convention every forward of gspo-trl follows.

A row's tokens are numbered by counting its attended tokens (mask 1) from 0, so left padding and the gaps of
`prefix_sharing`'s layouts shift nothing: each token gets the position it has when its row runs alone, unpadded.
Sampling (the loops and prefill in `decoding/`) and scoring (`logprobs`) must agree on it, or a model with learned
absolute position embeddings (GPT-2) scores a left-padded row at shifted positions. What it does not
own: the packed layout's positions, which restart per completion (`packing`).
"""

from __future__ import annotations

import functools
import inspect

import torch

from .distributed import unwrap_model

# What masked positions get, as `generate` gives them; nothing attends them, so any value in range would do.
MASKED_POSITION = 1


def positions_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """(B, L) position ids of a (B, L) attention mask: cumsum − 1 on attended tokens, `MASKED_POSITION` elsewhere."""
    mask = attention_mask.long()
    return (mask.cumsum(-1) - 1).masked_fill(mask == 0, MASKED_POSITION)


def takes_position_ids(model) -> bool:
    """Whether the model's own `forward` (under DDP, DeepSpeed, FSDP or PEFT wrappers) declares `position_ids`."""
    base = unwrap_model(model)
    base = base.get_base_model() if hasattr(base, "get_base_model") else base  # a PEFT model forwards **kwargs
    return _declares_position_ids(type(base))


@functools.cache
def _declares_position_ids(model_class: type) -> bool:
    return "position_ids" in inspect.signature(model_class.forward).parameters

"""How many completion rows one decoding pass may hold, so that long rollouts fit the device.

A rollout's KV cache grows as rows × (prompt + completion) positions × what one position costs (layers × keys
and values × KV heads × head dim × bytes): for SmolLM2-1.7B in bf16, 64 rows of 4,096 tokens take 52 GB, and
the static loop (`static`) allocates it all up front. This module owns that arithmetic and the slices a
rollout is decoded in when it does not fit: as even as possible, one after another, each slice's cache freed
before the next. Pure functions, plus the one query of the device's free memory. What it does not own: the
decoding itself (`dynamic`, `static`) and the choice to slice (`rollout.hf.HFGenerateBackend`).
"""

from __future__ import annotations

import torch

# Share of the device's free memory a slice's KV cache may take: the rest is for the decoding step's activations,
# the logits, the CUDA graphs' memory pool and the allocator's fragmentation.
KV_CACHE_MEMORY_FRACTION = 0.8


def kv_bytes_per_position(config, dtype: torch.dtype) -> int | None:
    """Bytes of keys and values one sequence position takes in every layer of a model with `config` whose cache
    is in `dtype`; None when the config does not say (then nothing is sliced automatically)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    layers = getattr(text, "num_hidden_layers", None)
    heads = getattr(text, "num_attention_heads", None)
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or (text.hidden_size // heads if heads else None)
    if not (layers and kv_heads and head_dim):
        return None
    return layers * 2 * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


def rows_per_slice(rows: int, bytes_per_row: int, budget_bytes: int) -> int:
    """How many of `rows` to decode together so that one slice's cache (`bytes_per_row` each) fits
    `budget_bytes`: all of them when they fit, else the fewest slices that fit, made as even as possible (64 rows
    of which 61 fit: two slices of 32, not 61 and 3, because a slice of 3 rows takes as many steps as one of 61).
    At least one row."""
    fit = max(1, budget_bytes // max(1, bytes_per_row))
    if fit >= rows:
        return rows
    slices = -(-rows // fit)
    return -(-rows // slices)


def free_device_bytes(device: torch.device) -> int | None:
    """Memory a new allocation on `device` can use: free on the GPU plus what torch's allocator holds unused.
    None off CUDA (host memory is not sliced for)."""
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)

"""The attention of decoding steps on CPU: one new token per row over its KV cache, the query heads of each
key/value head packed together.

With grouped-query attention (SmolLM2-135M: 9 query heads over 3 key/value heads) a decoding step's query is
(rows, 9, 1, head_dim). When the step needs no mask (no left padding among the rows still decoding: a batch of one
prompt or of prompts of one length, or the rows of the longest prompt once the others have ended), transformers'
SDPA path hands it to `scaled_dot_product_attention(..., enable_gqa=True)`, and on CPU that kernel reads each
key/value head once per query head of its group: at a 4000-token context a step's attention reads the 184 MB cache
three times over. Written as (rows, 3, 3, head_dim), the query heads of a group as three query positions over their
shared key/value head, the same attention reads it once; transformers does this itself when there is a mask. On
the 2-core EPYC an unpadded one-row step over 4000 positions went from 51.4 to 47.4 ms, a four-row one from 95.1
to 83.9 (`benchmarks/decode_step.py`); at 128 positions the forms are within noise. Same softmax over the same
keys, fp32: the forms differ by summation order (about 1e-7).

Owns `packed_gqa_decoding(model)`, the context the decoding loop runs its steps in: it switches an SDPA model on
CPU to an attention function registered with transformers (`NAME`, with SDPA's masks), which packs the heads for
one-token, no-autograd steps and leaves every other call to transformers' SDPA function; and `attend`, the packed
attention itself, which `decode_forward`'s steps call too: `decode_kernel`'s compiled loop where it is built (the
cache read at about twice SDPA's speed, the result within float rounding of SDPA's), else SDPA. What it does not
own: the decoding loop (`decoding.py`), the linear layers of a step (`decode_linear.py`), the kernel's build.
"""

from __future__ import annotations

import contextlib

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from . import kernel as decode_kernel

NAME = "gspo_trl_decode_sdpa"

# Switched off by benchmarks that time transformers' own form (A/B in one process).
enabled = True


def packed_gqa_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """transformers' attention-function signature. One query token per row, grouped key/value heads, no autograd
    and nothing but a mask shared by all heads: the packed form; anything else: `sdpa_attention_forward`."""
    groups = getattr(module, "num_key_value_groups", 1)
    rows, heads, length, head_dim = query.shape
    if (
        length != 1
        or groups <= 1
        or dropout
        or torch.is_grad_enabled()
        or query.device.type != "cpu"
        or (attention_mask is not None and attention_mask.shape[1] != 1)
        or any(kwargs.get(name) for name in ("softcap", "output_attentions"))
        or any(kwargs.get(name) is not None for name in ("position_bias", "s_aux"))
    ):
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    packed = query.reshape(rows, heads // groups, groups, head_dim)  # a group's query heads as query positions
    out = attend(packed, key, value, attention_mask, scaling)
    return out.reshape(rows, 1, heads, value.shape[-1]), None  # (rows, 1, heads, head_dim), as SDPA's path returns


def attend(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None, scale: float | None
) -> torch.Tensor:
    """The packed attention of one step: query (rows, kv_heads, group, head_dim) over keys and values (rows, kv_heads,
    positions, head_dim), `mask` SDPA's. The compiled kernel where it applies (`decode_kernel`), else SDPA."""
    if scale is None:
        scale = query.shape[-1] ** -0.5  # SDPA's default
    out = decode_kernel.attention(query, keys, values, mask, scale)
    if out is None:
        out = torch.nn.functional.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=scale)
    return out


AttentionInterface.register(NAME, packed_gqa_attention)
ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, sdpa_mask)


@contextlib.contextmanager
def packed_gqa_decoding(model: torch.nn.Module):
    """While active, `model` (SDPA attention, grouped key/value heads, on CPU) attends with `packed_gqa_attention`;
    its configuration's attention implementation is restored on exit. Other models are left as they are."""
    config = getattr(model, "config", None)
    parameter = next(model.parameters(), None)
    if (
        not enabled
        or config is None
        or getattr(config, "_attn_implementation", None) != "sdpa"
        or parameter is None
        or parameter.device.type != "cpu"
        or getattr(config, "num_key_value_heads", None) in (None, getattr(config, "num_attention_heads", None))
    ):
        yield
        return
    config._attn_implementation = NAME
    try:
        yield
    finally:
        config._attn_implementation = "sdpa"

"""Activation (gradient) checkpointing that keeps each layer's attention output.

With activation checkpointing, transformers checkpoints every decoder layer: the backward pass runs the layer's
forward again, attention included. Attention is the part of a layer whose work grows with the sequence (O(L²) per
row, the products O(L)), while its output is one (tokens, hidden) tensor, the size of what checkpointing keeps per
layer already. Keeping it (PyTorch's selective checkpointing: the outputs of the attention kernel are saved, every
other operator of the layer is recomputed) takes the O(L²) forward out of the backward pass, for one more
hidden-size tensor and its log-sum-exp per layer and token. The gradients are the same bit for bit: the kept
tensors are what the recomputation would have produced. SmolLM2-135M on a 2-core CPU, one 4,096-token completion:
10.9–11.3 against 12.0–12.5 ms per token (docs/benchmarks.md, "The training phase alone").

Owns the policy and the checkpoint keyword arguments built from `GSPOConfig`; `enable_kept_attention` re-enables a
model's checkpointing with them after `Trainer.train` has enabled it with the user's. Attention implementations
that are not one fused kernel (eager, SDPA's math fallback) have nothing to keep and are recomputed as before.
"""

from __future__ import annotations

import functools

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

# SDPA's fused kernels: the CPU flash kernel, and CUDA's flash, memory-efficient and cuDNN kernels.
_ATTENTION_OP_NAMES = (
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
)
ATTENTION_OPS = frozenset(
    getattr(torch.ops.aten, name).default for name in _ATTENTION_OP_NAMES if hasattr(torch.ops.aten, name)
)
# Keys of `activation_checkpointing_kwargs` that transformers takes itself (not torch.utils.checkpoint's).
_TRANSFORMERS_KEYS = ("every_n_layers", "offload")


def keep_attention(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """Selective checkpointing's policy: the attention kernel's outputs saved, everything else recomputed."""
    return CheckpointPolicy.MUST_SAVE if op in ATTENTION_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def keeps_attention(args) -> bool:
    """Whether checkpointing under `args` keeps attention: asked for (`activation_checkpointing_keep_attention`), and
    the user's kwargs leave room for it (non-reentrant checkpointing, no `context_fn` of their own, no `offload`,
    which asks for the least device memory)."""
    kwargs = args.activation_checkpointing_kwargs or {}
    return bool(
        args.activation_checkpointing
        and args.activation_checkpointing_keep_attention
        and not kwargs.get("use_reentrant", False)
        and "context_fn" not in kwargs
        and not kwargs.get("offload", False)
    )


def checkpoint_kwargs(args) -> dict | None:
    """The keyword arguments of `torch.utils.checkpoint.checkpoint` for the model's layers: the user's
    `activation_checkpointing_kwargs` without transformers' own keys, plus the kept-attention policy where
    `keeps_attention(args)`. None where that leaves nothing (transformers' default then)."""
    kwargs = {
        key: value
        for key, value in (args.activation_checkpointing_kwargs or {}).items()
        if key not in _TRANSFORMERS_KEYS
    }
    if keeps_attention(args):
        kwargs["use_reentrant"] = False
        kwargs["context_fn"] = functools.partial(create_selective_checkpoint_contexts, keep_attention)
    return kwargs or None


def enable_kept_attention(model: torch.nn.Module, args) -> None:
    """Enable `model`'s checkpointing again, as `Trainer.train` did, with the kept-attention policy added, where
    `keeps_attention(args)`; otherwise leave it as it is."""
    if not keeps_attention(args):
        return
    user = args.activation_checkpointing_kwargs or {}
    options = {"every_n_layers": user.get("every_n_layers", 1), "offload": user.get("offload", False)}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=checkpoint_kwargs(args), **options)
    else:  # models that define only the deprecated name (transformers < 5.24, or wrappers)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=checkpoint_kwargs(args), **options)

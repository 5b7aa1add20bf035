"""gspo_trl.models.checkpointing: checkpointing that keeps attention outputs gives the same gradients bit for bit and
runs
the attention kernel once per layer instead of twice; the kwargs leave the user's choices alone."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from gspo_trl.models.checkpointing import ATTENTION_OPS, checkpoint_kwargs, keep_attention, keeps_attention


def settings(checkpointing=True, keep=True, **kwargs):
    return SimpleNamespace(
        activation_checkpointing=checkpointing,
        activation_checkpointing_keep_attention=keep,
        activation_checkpointing_kwargs=kwargs or None,
    )


class CountAttention(TorchDispatchMode):
    """Counts the calls of SDPA's fused kernels (forward and recomputation; not their backward)."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += func in ATTENTION_OPS
        return func(*args, **(kwargs or {}))


def test_the_cpu_flash_kernel_is_kept_and_products_are_recomputed():
    assert torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default in ATTENTION_OPS
    assert keep_attention(None, torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default).name == "MUST_SAVE"
    assert keep_attention(None, torch.ops.aten.mm.default).name == "PREFER_RECOMPUTE"


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16 autocast"])
def test_kept_attention_gives_the_same_gradients_with_one_attention_pass(tiny_model, bf16):
    model = tiny_model.train()
    layers = model.config.num_hidden_layers
    ids = torch.randint(3, model.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))

    def gradients(kwargs):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        model.zero_grad(set_to_none=True)
        with CountAttention() as counter, torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            model(input_ids=ids, labels=ids).loss.backward()
        return [p.grad.clone() for p in model.parameters()], counter.calls

    full, full_calls = gradients({"use_reentrant": False})
    kept, kept_calls = gradients(checkpoint_kwargs(settings()))
    assert (full_calls, kept_calls) == (2 * layers, layers)  # the recomputation left attention out
    for a, b in zip(full, kept):
        assert torch.equal(a, b)


def test_the_users_choices_are_left_alone():
    kept = checkpoint_kwargs(settings())
    assert kept["use_reentrant"] is False and kept["context_fn"].args == (keep_attention,)
    assert checkpoint_kwargs(settings(keep=False)) is None  # transformers' default
    assert checkpoint_kwargs(settings(keep=False, use_reentrant=False, every_n_layers=2)) == {"use_reentrant": False}
    # transformers' own keys stay out of torch.utils.checkpoint's kwargs, and the policy comes with them
    assert set(checkpoint_kwargs(settings(every_n_layers=2))) == {"use_reentrant", "context_fn"}
    assert checkpoint_kwargs(settings(use_reentrant=True)) == {"use_reentrant": True}
    assert checkpoint_kwargs(settings(offload=True)) is None  # transformers takes offload itself
    assert checkpoint_kwargs(settings(context_fn=print)) == {"context_fn": print}  # the user's own policy
    for user in ({"use_reentrant": True}, {"offload": True}, {"context_fn": print}):
        assert not keeps_attention(settings(**user))
    assert not keeps_attention(settings(checkpointing=False))

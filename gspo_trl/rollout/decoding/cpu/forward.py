"""The forward of a one-token decoding step on CPU for Llama, Mistral, Qwen2 and Qwen3 models, without
transformers' per-module glue.

Near the end of a rollout a few rows decode alone for thousands of steps. A step of SmolLM2-135M reads 540 MB of
weights in its 211 products, about 17 ms at the memory bandwidth of the 2-core EPYC, and transformers' forward
spent another 8 ms or so in the small operators and Python around them: module calls, the attention interface's
dispatch, the mask built again each step, `linear`'s checks and allocations per product. `StepForward`
runs the same computation with the model's own modules and weights (embedding, norms, rotary embedding,
activation), `attention`'s packed attention call and the product form `linear` chose for each weight
and row count, in the same order, so its logits equal transformers' forward bit for bit
(`tests/rollout/decoding/cpu/test_decoding_cpu_forward.py`: with and without padding, one to nine rows, each product
form, and the real SmolLM2 with the forms measured on the machine running the tests). The rotation of the query and key
and their write into the cache, about 18 small operators per layer in the model's `apply_rotary_pos_emb` and the cache's
`update`, are one call of `kernel.rotary` (with the compiled kernels on), the same arithmetic rounded the same way;
it is checked against the model's own function, bit for bit, when a `StepForward` is built, and where it differs
(or is not built) the step calls the model's function and the cache's `update`.

Applies only where that equality was checked: `LlamaForCausalLM`, `MistralForCausalLM`, `Qwen2ForCausalLM` and
`Qwen3ForCausalLM` built from transformers' own modules, full attention in every layer (no sliding window), fp32
weights on CPU, plain `nn.Linear` projections or PEFT's LoRA layers over them (the step calls those, so their own
forward runs), no hooks or replaced forwards on the modules the step does not call (accelerate's offloading,
ZeRO-3), `attention`'s packed attention in effect, no autograd or autocast, and the loop's preallocated
cache. Anything else takes the model's own forward. Owns `StepForward`; the decoding loop (`decoding.dynamic`)
decides when to call it, and `CPUKernels.step_forward` whether it may.
"""

from __future__ import annotations

import sys

import torch
from torch import nn

from . import attention as packed_attention
from . import kernel, linear

_ARCHITECTURES = {  # model class -> its decoder layer, attention and MLP classes, all by name
    name: tuple(f"{family}{part}" for part in ("DecoderLayer", "Attention", "MLP"))
    for family in ("Llama", "Mistral", "Qwen2", "Qwen3")
    for name in (f"{family}ForCausalLM",)
}


class Product:
    """One linear layer's product in a decoding step, in the form `linear` gives it in the loop."""

    def __init__(self, layer: nn.Linear, timed_forms: bool):
        self.weight, self.bias = layer.weight, layer.bias
        self.forms = linear.forms(layer) if timed_forms else {}  # row count -> form
        self.packed = linear.packed_weight(layer)
        self.one_row: linear.OneRow | None = None
        # The compiled form reads this weight as it is: its checks done once, not per product (x, this step's own
        # rows, is contiguous, and the form was chosen only for row counts the kernel computes).
        self.checked = (
            linear.COMPILED in self.forms.values()
            and kernel.linear_applies(self.weight.new_zeros(1, self.weight.shape[1]), self.weight, self.bias)
            and kernel.available()
        )

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """`layer(x)` for x (rows, in)."""
        rows = x.shape[0]
        form = self.forms.get(rows, linear.LINEAR)
        if form == linear.PACKED:
            return self.packed.linear(x, self.bias)
        if form == linear.LINEAR:
            return nn.functional.linear(x, self.weight, self.bias)
        if form == linear.COMPILED:
            out = (
                kernel.linear(x, self.weight, self.bias, checked=True) if (self.checked and x.is_contiguous()) else None
            )
            return linear.compiled_linear(x, self.weight, self.bias) if out is None else out
        if rows == 1 and self.one_row is None:
            self.one_row = linear.OneRow(self.weight)
        return linear.transposed_linear(self.weight, self.bias, x, self.one_row if rows == 1 else None)


class StepForward:
    """One-token steps of `model`'s forward, built inside the decoding loop's `fast_decode_linears` and
    `packed_gqa_decoding` contexts: the products in the forms `fast_decode_linears` gave the layers (with
    `timed_forms`; `F.linear` without), the attention by `attend` (the one `packed_gqa_decoding` yielded), the
    rotation in the compiled kernel with `compiled`. `StepForward.of(...)` is None where it does not apply."""

    def __init__(self, model: nn.Module, attend: packed_attention.Attend, timed_forms: bool, compiled: bool):
        model = _unwrapped(model)
        base = model.model
        self.embed, self.rotary, self.norm = base.embed_tokens, base.rotary_emb, base.norm
        attention = base.layers[0].self_attn
        self.rotate = sys.modules[type(attention).__module__].apply_rotary_pos_emb
        self.kv_heads = model.config.num_attention_heads // attention.num_key_value_groups
        self.groups, self.head_dim, self.scale = attention.num_key_value_groups, attention.head_dim, attention.scaling

        def product(layer: nn.Module):  # a LoRA layer is called: its forward runs, its base layer's product in it
            return Product(layer, timed_forms) if type(layer) is nn.Linear else layer

        self.attend = attend
        self.fused_rotary = compiled and _rotary_kernel_matches(
            self.rotate, model.config.num_attention_heads, self.kv_heads, self.head_dim
        )
        self.head = product(model.lm_head)
        self.layers = []  # each decoder layer's modules in the order a step runs them
        for layer in base.layers:
            q, k, v, o, gate, up, down = map(product, _projections(layer))
            q_norm, k_norm = getattr(layer.self_attn, "q_norm", None), getattr(layer.self_attn, "k_norm", None)  # Qwen3
            self.layers.append(
                (
                    layer.input_layernorm,
                    q,
                    k,
                    v,
                    o,
                    q_norm,
                    k_norm,
                    layer.post_attention_layernorm,
                    gate,
                    up,
                    down,
                    layer.mlp.act_fn,
                )
            )

    @classmethod
    def of(
        cls, model: nn.Module, attend: packed_attention.Attend, timed_forms: bool = True, compiled: bool = True
    ) -> StepForward | None:
        return cls(model, attend, timed_forms, compiled) if applies(model) else None

    def __call__(
        self, token_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor, cache
    ) -> torch.Tensor:
        """The (rows, vocab) logits of one new token per row: `token_ids` and `position_ids` (rows, 1),
        `attention_mask` (rows, cache length + 1) as the loop keeps it. Writes the token's keys and values into
        `cache` (its layers `PreallocatedLayer`s)."""
        rows, kv_heads, groups, head_dim = token_ids.shape[0], self.kv_heads, self.groups, self.head_dim
        # transformers' SDPA mask for one query token: none without padding, else the padding as a boolean mask.
        mask = None if bool(attention_mask.all()) else attention_mask.bool()[:, None, None, :]
        hidden = self.embed(token_ids)[:, 0]  # (rows, hidden)
        cos, sin = self.rotary(hidden, position_ids)  # (rows, 1, head_dim)
        flat_cos, flat_sin = cos.reshape(rows, head_dim).contiguous(), sin.reshape(rows, head_dim).contiguous()
        for (norm, q, k, v, o, q_norm, k_norm, mlp_norm, gate, up, down, act), cache_layer in zip(
            self.layers, cache.layers
        ):
            x = norm(hidden)
            query, key = q(x).view(rows, -1, 1, head_dim), k(x).view(rows, -1, 1, head_dim)
            if q_norm is not None:
                query, key = q_norm(query), k_norm(key)
            value = v(x).view(rows, -1, 1, head_dim)
            packed = query.new_empty(rows, kv_heads, groups, head_dim) if self.fused_rotary else None
            if packed is not None and _rotate_into_cache(query, key, value, flat_cos, flat_sin, packed, cache_layer):
                keys, values = cache_layer.keys, cache_layer.values
            else:
                query, key = self.rotate(query, key, cos, sin)
                keys, values = cache_layer.update(key, value)
                packed = query.reshape(rows, kv_heads, groups, head_dim)
            out = self.attend(packed, keys, values, mask, self.scale)
            hidden = hidden + o(out.reshape(rows, -1))
            x = mlp_norm(hidden)
            hidden = hidden + down(act(gate(x)) * up(x))
        return self.head(self.norm(hidden))


def _rotate_into_cache(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    packed: torch.Tensor,
    cache_layer,
) -> bool:
    """`kernel.rotary` for one step: the rotated query into `packed`, the rotated key and the value into the
    cache's next position (a `PreallocatedLayer`, advanced by one). False, with the cache as it was, where the
    kernel does not take these tensors."""
    advance = getattr(cache_layer, "advance", None)
    if advance is None:
        return False
    rows, kv_heads, _, head_dim = key.shape
    keys, values = advance(1)
    if kernel.rotary(
        query.view(rows, -1, head_dim),
        key.view(rows, kv_heads, head_dim),
        value.view(rows, kv_heads, head_dim),
        cos,
        sin,
        packed.view(rows, -1, head_dim),
        keys[:, :, -1],
        values[:, :, -1],
    ):
        return True
    cache_layer._expose(cache_layer.length - 1)
    return False


def _rotary_kernel_matches(rotate, heads: int, kv_heads: int, head_dim: int) -> bool:
    """Whether `kernel.rotary` computes what the model's own `apply_rotary_pos_emb` computes, bit for bit, on
    random inputs of the model's shapes (one row and three, of which the kernel takes any): the model's function is
    then known to be the plain rotation (no partial rotary dimensions, no other form), and the kernel is built."""
    if head_dim % 2 or not kernel.available():
        return False
    generator = torch.Generator().manual_seed(0)
    for rows in (1, 3):
        query, key = (
            torch.randn(rows, heads, 1, head_dim, generator=generator),
            torch.randn(rows, kv_heads, 1, head_dim, generator=generator),
        )
        cos, sin = (
            torch.randn(rows, 1, head_dim, generator=generator),
            torch.randn(rows, 1, head_dim, generator=generator),
        )
        expected_query, expected_key = rotate(query, key, cos, sin)
        got_query, got_key, got_value = (
            torch.empty(rows, heads, head_dim),
            torch.empty(rows, kv_heads, head_dim),
            torch.empty(rows, kv_heads, head_dim),
        )
        if not (
            kernel.rotary(
                query.view(rows, heads, head_dim),
                key.view(rows, kv_heads, head_dim),
                key.view(rows, kv_heads, head_dim),
                cos.view(rows, head_dim),
                sin.view(rows, head_dim),
                got_query,
                got_key,
                got_value,
            )
            and torch.equal(got_query, expected_query.view(rows, heads, head_dim))
            and torch.equal(got_key, expected_key.view(rows, kv_heads, head_dim))
            and torch.equal(got_value, key.view(rows, kv_heads, head_dim))
        ):
            return False
    return True


def applies(model: nn.Module) -> bool:
    """Whether `StepForward` computes `model`'s decoding steps exactly (see the module docstring)."""
    inner = _unwrapped(model)
    names = _ARCHITECTURES.get(type(inner).__name__)
    config = getattr(inner, "config", None)
    base = getattr(inner, "model", None)
    if (
        names is None
        or config is None
        or base is None
        or torch.is_grad_enabled()
        or torch.is_autocast_enabled("cpu")
        or getattr(config, "_attn_implementation", None) != packed_attention.NAME
        or any(kind != "full_attention" for kind in getattr(config, "layer_types", None) or ())
        or getattr(config, "pretraining_tp", 1) != 1
        or (type(inner).__name__ == "MistralForCausalLM" and config.sliding_window is not None)
    ):
        return False
    layer_class, attention_class, mlp_class = names
    layers = getattr(base, "layers", ())
    if not len(layers) or any(
        type(layer).__name__ != layer_class
        or type(layer.self_attn).__name__ != attention_class
        or type(layer.mlp).__name__ != mlp_class
        or getattr(layer.self_attn, "sliding_window", None)
        for layer in layers
    ):
        return False
    hooks = nn.modules.module
    if hooks._global_forward_hooks or hooks._global_forward_pre_hooks:
        return False
    # The modules a step computes without calling them must have no hooks or forwards of their own (accelerate's
    # offloading, ZeRO-3's gathering). The ones it calls (embedding, norms, rotary embedding, activation, LoRA
    # layers) run theirs, as in transformers' forward: e.g. the hook on the input embeddings that gradient
    # checkpointing adds.
    linears = [inner.lm_head] + [projection for layer in layers for projection in _projections(layer)]
    skipped = [
        model,
        *([model.base_model] if inner is not model else []),
        inner,
        base,
        *layers,
        *(layer.self_attn for layer in layers),
        *(layer.mlp for layer in layers),
    ]
    if any(
        module._forward_hooks or module._forward_pre_hooks or "forward" in module.__dict__ for module in skipped
    ) or any(layer._forward_hooks or layer._forward_pre_hooks for layer in linears):
        return False
    return all(linear.plain(layer) or _lora(layer) for layer in linears) and all(
        parameter.device.type == "cpu" and parameter.dtype == torch.float32 for parameter in model.parameters()
    )


def _unwrapped(model: nn.Module) -> nn.Module:
    """The transformers model inside a PEFT model (its LoRA layers in place), else `model`."""
    return model.get_base_model() if type(model).__name__.startswith("PeftModel") else model


def _projections(layer: nn.Module) -> tuple[nn.Module, ...]:
    attention, mlp = layer.self_attn, layer.mlp
    return (
        attention.q_proj,
        attention.k_proj,
        attention.v_proj,
        attention.o_proj,
        mlp.gate_proj,
        mlp.up_proj,
        mlp.down_proj,
    )


def _lora(layer: nn.Module) -> bool:
    """Whether `layer` is PEFT's LoRA linear layer over a plain `nn.Linear`: the step calls it (its own forward)."""
    return (
        type(layer).__name__ == "Linear"
        and type(layer).__module__.startswith("peft.tuners.lora")
        and "forward" not in layer.__dict__
        and linear.plain(getattr(layer, "base_layer", None))
    )

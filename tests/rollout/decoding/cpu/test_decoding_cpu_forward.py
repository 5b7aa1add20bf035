"""gspo_trl.rollout.decoding.cpu.forward: a decoding step's logits equal transformers' forward bit for bit (Llama,
Mistral,
Qwen2, Qwen3; with and without padding, each of `linear`'s product forms, one to nine rows, and the real SmolLM2 with
the forms measured here); the decoding loop runs its steps with it and samples what it samples without; the models
and settings it leaves to their own forward."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import force_choices, sampler_with_rows_ending_apart
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache

from gspo_trl.rollout.decoding import cpu
from gspo_trl.rollout.decoding.cpu import CPUKernels
from gspo_trl.rollout.decoding.cpu.attention import SDPA
from gspo_trl.rollout.decoding.cpu.forward import StepForward
from gspo_trl.rollout.decoding.cpu.linear import COMPILED, LINEAR, PACKED, TRANSPOSED
from gspo_trl.rollout.decoding.dynamic import PreallocatedLayer, preallocate
from gspo_trl.rollout.decoding.kv_cache import cache_kwargs

FORMS = [LINEAR, TRANSPOSED, PACKED, COMPILED]


def tiny(architecture: str, **overrides):
    torch.manual_seed(0)
    if architecture == "mistral":
        overrides = {"sliding_window": None, **overrides}  # Mistral's default window (4096) is its own case below
    values = dict(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=300,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(architecture, **{**values, **overrides})).eval()


def prefilled(model, rows: int, length: int, padded: bool, room: int = 4):
    """A cache of `length` prompt positions per row, filled by the model's own prefill (row 0 left-padded by five
    when `padded`), in the loop's preallocated layers with `room` positions ahead; and the next step's token, mask
    and positions."""
    torch.manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (rows, length))
    mask = torch.ones(rows, length, dtype=torch.long)
    if padded:
        mask[0, :5] = 0
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, position_ids=positions, **cache_kwargs(model, cache), use_cache=True)
    preallocate(cache, length + room)
    step_mask = torch.cat([mask, mask.new_ones(rows, 1)], dim=1)
    return cache, torch.randint(0, model.config.vocab_size, (rows, 1)), step_mask, positions[:, -1:] + 1


def both_steps(model, rows: int, length: int, padded: bool):
    """One step's logits from transformers' forward and from `StepForward`, each on its own copy of the cache, in
    the loop's contexts; and the two caches after the step."""
    cache, token, mask, positions = prefilled(model, rows, length, padded)
    theirs, ours = cache, copy.deepcopy(cache)
    with torch.no_grad(), cpu.accelerate(model, cpu.ALL) as step:
        assert step is not None and step.fused_rotary  # the rotary embedding and cache write in the compiled kernel
        expected = model(
            input_ids=token,
            attention_mask=mask,
            position_ids=positions,
            **cache_kwargs(model, theirs),
            use_cache=True,
            logits_to_keep=1,
        ).logits[:, -1]
        got = step(token, mask, positions, ours)
    return expected, got, theirs, ours


# qwen2: biases on the query, key and value products; qwen3: a norm over each query and key head
@pytest.mark.parametrize("architecture", ["llama", "mistral", "qwen2", "qwen3"])
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("rows,padded", [(1, False), (2, True), (5, True), (9, False)])
def test_a_step_equals_transformers_forward_bit_for_bit(architecture, form, rows, padded, monkeypatch):
    force_choices(monkeypatch, form)  # every product in one of `linear`'s forms
    model = tiny(architecture)
    expected, got, theirs, ours = both_steps(model, rows, 23, padded)
    assert got.shape == (rows, model.config.vocab_size)
    assert torch.equal(got, expected)
    for their_layer, our_layer in zip(theirs.layers, ours.layers):  # the new token's keys and values were written
        assert type(our_layer) is PreallocatedLayer and our_layer.length == 24
        assert torch.equal(our_layer.keys, their_layer.keys) and torch.equal(our_layer.values, their_layer.values)


@pytest.mark.parametrize("form", [TRANSPOSED, COMPILED])
def test_repeated_one_row_steps_keep_each_layers_output(monkeypatch, form):
    """One row reuses a buffer per layer across steps: three steps in a row still equal transformers' three, the
    cache growing on the second (room for one position ahead)."""
    force_choices(monkeypatch, form)
    model = tiny("llama")
    cache, token, mask, positions = prefilled(model, 1, 9, False, room=1)
    theirs, ours = cache, copy.deepcopy(cache)
    with torch.no_grad(), cpu.accelerate(model, cpu.ALL) as step:
        for _ in range(3):
            expected = model(
                input_ids=token,
                attention_mask=mask,
                position_ids=positions,
                **cache_kwargs(model, theirs),
                use_cache=True,
                logits_to_keep=1,
            ).logits[:, -1]
            got = step(token, mask, positions, ours)
            assert torch.equal(got, expected)
            token, positions = expected.argmax(-1, keepdim=True), positions + 1
            mask = torch.cat([mask, mask.new_ones(1, 1)], dim=1)
    for their_layer, our_layer in zip(theirs.layers, ours.layers):
        assert our_layer.length == 12 and our_layer.key_buffer.shape[2] > 10  # grew
        assert torch.equal(our_layer.keys, their_layer.keys) and torch.equal(our_layer.values, their_layer.values)


def test_another_rotary_embedding_is_left_to_the_models_function(monkeypatch):
    """`kernel.rotary` is the plain rotation of every dimension; a model module whose `apply_rotary_pos_emb`
    computes something else (here: only the first half of each head rotated) keeps its own function, bit for bit."""
    import transformers.models.llama.modeling_llama as llama

    plain = llama.apply_rotary_pos_emb

    def partial(q, k, cos, sin, *args, **kwargs):
        half = q.shape[-1] // 2
        cos, sin = cos[..., :half], sin[..., :half]
        (q_rot, q_pass), (k_rot, k_pass) = q.split(half, -1), k.split(half, -1)
        q_rot, k_rot = plain(q_rot, k_rot, cos, sin, *args, **kwargs)
        return torch.cat([q_rot, q_pass], -1), torch.cat([k_rot, k_pass], -1)

    monkeypatch.setattr(llama, "apply_rotary_pos_emb", partial)
    force_choices(monkeypatch, TRANSPOSED)
    model = tiny("llama")
    cache, token, mask, positions = prefilled(model, 2, 9, True)
    theirs, ours = cache, copy.deepcopy(cache)
    with torch.no_grad(), cpu.accelerate(model, cpu.ALL) as step:
        assert not step.fused_rotary
        expected = model(
            input_ids=token,
            attention_mask=mask,
            position_ids=positions,
            **cache_kwargs(model, theirs),
            use_cache=True,
            logits_to_keep=1,
        ).logits[:, -1]
        assert torch.equal(step(token, mask, positions, ours), expected)


@pytest.mark.parametrize("form", FORMS)
def test_the_loop_steps_with_it_and_samples_what_it_samples_without(tiny_model, tiny_tokenizer, monkeypatch, form):
    """The whole loop, rows leaving the batch down to one: the same tokens and π_old log-probs, bit for bit."""
    force_choices(monkeypatch, form)
    run, _ = sampler_with_rows_ending_apart(tiny_model, tiny_tokenizer, ["What is 2 + 3?", "Hi", "Solve: 7 - 4"] * 2)
    rows_per_step = []
    monkeypatch.setattr(
        StepForward,
        "__call__",
        lambda self, ids, *rest, call=StepForward.__call__: (
            rows_per_step.append(ids.shape[0]) or call(self, ids, *rest)
        ),
    )
    ours = run()
    assert min(rows_per_step) == 1 and max(rows_per_step) >= 3  # after the prefill step: several rows, then one
    calls = len(rows_per_step)
    theirs = run(CPUKernels(step_forward=False))
    assert len(rows_per_step) == calls  # transformers' forward throughout
    assert torch.equal(ours.completion_ids, theirs.completion_ids)
    assert torch.equal(ours.logps, theirs.logps)


@pytest.mark.slow  # the real SmolLM2
def test_the_real_model_with_the_forms_measured_on_this_machine():
    """SmolLM2-135M-Instruct, whose 425 MB of weights `linear` times on this machine: 1 to 32 rows over a
    40-position cache."""
    from gspo_trl.demo.default_model import default_model_path

    model = AutoModelForCausalLM.from_pretrained(default_model_path(), dtype=torch.float32).eval()
    for rows in (1, 3, 8, 32):
        expected, got, _, _ = both_steps(model, rows, 40, padded=rows > 1)
        assert torch.equal(got, expected), rows


def lora(model):
    """A LoRA adapter whose B matrices are random (not PEFT's zeros), so that it changes the logits."""
    from peft import LoraConfig, get_peft_model

    return get_peft_model(
        model, LoraConfig(r=2, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False)
    )


@pytest.mark.parametrize("wrapped", [True, False])  # the PEFT model, or the transformers model holding its layers
@pytest.mark.parametrize("form", FORMS)
def test_a_lora_model_steps_like_its_own_forward(wrapped, form, monkeypatch):
    """The step calls the LoRA layers themselves (their base layers in `linear`'s form): the same logits as
    the PEFT model's forward, bit for bit, and not the base model's."""
    force_choices(monkeypatch, form)
    model = lora(tiny("llama"))
    if not wrapped:
        model = model.base_model.model
    expected, got, _, _ = both_steps(model, 3, 17, padded=True)
    assert torch.equal(got, expected)
    if wrapped:  # the adapter counts: the base model alone gives other logits
        with model.disable_adapter():
            without, _, _, _ = both_steps(model, 3, 17, padded=True)
        assert not torch.allclose(without, expected)


@pytest.mark.parametrize(
    "case",
    [
        "disabled",
        "bf16",
        "hook",
        "linear's hook",
        "own forward",
        "lora's hook",
        "autograd",
        "autocast",
        "no packed heads",
        "all heads",
        "sliding window",
        "mistral's window",
        "other architecture",
    ],
)
def test_models_and_settings_it_leaves_to_their_own_forward(case, monkeypatch):
    architecture = {"sliding window": "qwen2", "mistral's window": "mistral", "other architecture": "granite"}.get(
        case, "llama"
    )  # granite: Llama's layers, scaled
    overrides = {
        "all heads": dict(num_key_value_heads=4),
        "sliding window": dict(use_sliding_window=True, sliding_window=16, max_window_layers=0),
        "mistral's window": dict(sliding_window=16),
    }
    model = tiny(architecture, **overrides.get(case, {}))
    if case == "lora's hook":
        model = lora(model)
        model.base_model.model.model.layers[0].self_attn.q_proj.register_forward_pre_hook(lambda module, args: None)
    elif case == "bf16":
        model = model.to(torch.bfloat16)
    elif case == "hook":  # what accelerate's offloading and ZeRO-3 register on the modules a step does not call
        model.model.layers[1].mlp.register_forward_pre_hook(lambda module, args: None)
    elif case == "linear's hook":
        model.model.layers[0].self_attn.k_proj.register_forward_hook(lambda module, args, output: None)
    elif case == "own forward":  # accelerate's `add_hook_to_module` replaces the instance's forward
        layer = model.model.layers[2]
        layer.forward = layer.forward
    grad = torch.enable_grad() if case == "autograd" else torch.no_grad()
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=case == "autocast")
    kernels = {"disabled": CPUKernels(step_forward=False), "no packed heads": CPUKernels(packed_attention=False)}
    with grad, autocast, cpu.accelerate(model, kernels.get(case, cpu.ALL)) as step:
        assert step is None


def test_gradient_checkpointings_hook_on_the_embeddings_runs_as_in_transformers_forward(monkeypatch):
    """Gradient checkpointing (a common setting at long completions) hooks the input embeddings: the step calls that
    module, so its hook runs there as it does in transformers' forward, and the step still applies."""
    force_choices(monkeypatch, TRANSPOSED)
    model = tiny("llama")
    model.gradient_checkpointing_enable()
    model.enable_input_require_grads()
    calls = []
    model.model.embed_tokens.register_forward_hook(lambda module, args, output: calls.append(output.shape) and None)
    expected, got, _, _ = both_steps(model, 2, 11, padded=True)
    assert torch.equal(got, expected)
    assert calls[-2:] == [(2, 1, 64), (2, 1, 64)]  # transformers' step, then ours


def test_a_plain_model_qualifies():
    """The counterpart of the cases above: the same tiny models, as the loop runs them."""
    for architecture in ("llama", "mistral", "qwen2", "qwen3"):
        model = tiny(architecture)
        with torch.no_grad(), cpu.accelerate(model, cpu.ALL) as step:
            assert step is not None
        assert StepForward.of(model, SDPA) is None  # outside the loop's no-autograd, packed-heads context

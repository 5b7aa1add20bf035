"""gspo_trl.rollout.decoding.cpu.linear: the transposed, packed and compiled products equal `F.linear`, the measured
choice,
and the context that swaps the forwards of a model's linear layers in and out (also around a whole decoding loop,
and its opt-out under `full_determinism`)."""

from __future__ import annotations

import pytest
import torch
from helpers import count_digits, force_choices, sampler_with_rows_ending_apart, small_config, text_dataset
from torch import nn

from gspo_trl import GSPOTrainer
from gspo_trl.rollout.decoding.cpu import attention as decode_attention
from gspo_trl.rollout.decoding.cpu import kernel as decode_kernel
from gspo_trl.rollout.decoding.cpu import linear as decode_linear
from gspo_trl.rollout.decoding.cpu.attention import KernelChoice
from gspo_trl.rollout.decoding.cpu.linear import (
    COMPILED,
    LINEAR,
    MAX_ROWS,
    MEASURED_ROWS,
    PACKED,
    TRANSPOSED,
    PackedWeight,
    fast_decode_linears,
    measure_choices,
)
from gspo_trl.rollout.decoding.dynamic import token_logps
from gspo_trl.rollout.decoding.truncation import policy_logps


@pytest.fixture()
def always_transposed(monkeypatch):
    force_choices(monkeypatch, TRANSPOSED)


def counting(monkeypatch, form: str) -> list:
    """The row count of each product computed in `form` (transposed, packed or compiled) from now on."""
    calls = []
    if form == COMPILED:  # counted where the kernel computed it, not where it handed the product back
        monkeypatch.setattr(
            decode_kernel,
            "linear",
            lambda x, *rest, product=decode_kernel.linear, **checked: (
                lambda out: out if out is None else calls.append(x.shape[0]) or out
            )(product(x, *rest, **checked)),
        )
    elif form == TRANSPOSED:
        monkeypatch.setattr(
            decode_linear,
            "_transposed_product",
            lambda w, x, *rest, product=decode_linear._transposed_product: (
                calls.append(x.shape[0]) or product(w, x, *rest)
            ),
        )
    else:
        monkeypatch.setattr(
            PackedWeight,
            "linear",
            lambda self, x, bias, product=PackedWeight.linear: (
                calls.append(x.numel() // x.shape[-1]) or product(self, x, bias)
            ),
        )
    return calls


@pytest.mark.parametrize("form", [TRANSPOSED, PACKED, COMPILED])
@pytest.mark.parametrize("rows", [1, 2, 3, 8, 40])
@pytest.mark.parametrize("bias", [False, True])
def test_each_form_computes_what_f_linear_computes(form, rows, bias, monkeypatch):
    force_choices(monkeypatch, form)
    calls = counting(monkeypatch, form)
    torch.manual_seed(0)
    layer = nn.Linear(48, 80, bias=bias)
    x = torch.randn(rows, 1, 48)  # (rows, one position, in): a decoding step's shape
    expected = nn.functional.linear(x, layer.weight, layer.bias)
    with torch.no_grad(), fast_decode_linears(layer):
        assert "forward" in layer.__dict__
        got = layer(x)
    # the form itself ran (the compiled one up to its 8 rows; F.linear beyond)
    assert calls == ([] if form == COMPILED and rows > decode_kernel.MAX_LINEAR_ROWS else [rows])
    assert got.shape == expected.shape and got.is_contiguous()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert "forward" not in layer.__dict__  # the class's forward again


def test_a_packed_weight_follows_in_place_changes():
    """The packed copy is made again when the weight changed in place (an optimizer step), so a product never uses
    stale weights."""
    torch.manual_seed(0)
    layer, x = nn.Linear(16, 24), torch.randn(3, 16)
    with torch.no_grad():
        packed = PackedWeight(layer.weight)
        torch.testing.assert_close(packed.linear(x, layer.bias), layer(x), rtol=1e-5, atol=1e-5)
        layer.weight.mul_(-2.0)
        torch.testing.assert_close(packed.linear(x, layer.bias), layer(x), rtol=1e-5, atol=1e-5)


def test_plain_form_where_the_transposed_one_does_not_apply(always_transposed):
    torch.manual_seed(0)
    layer = nn.Linear(32, 16)
    many = torch.randn(MAX_ROWS + 1, 32)
    with fast_decode_linears(layer):
        with torch.no_grad():  # more rows than measured: F.linear itself, bit for bit
            assert torch.equal(layer(many), nn.functional.linear(many, layer.weight, layer.bias))
            with torch.autocast("cpu", dtype=torch.bfloat16):  # autocast's bf16 product, as without the context
                assert layer(many[:2]).dtype == torch.bfloat16
        few = torch.randn(2, 32, requires_grad=True)
        layer(few).sum().backward()  # with autograd: F.linear, gradients as usual
    expected = torch.ones(2, 16) @ layer.weight
    torch.testing.assert_close(few.grad, expected)


def test_layers_it_leaves_alone(always_transposed):
    wrapped, half, shard, plain = nn.Linear(8, 8), nn.Linear(8, 8).to(torch.bfloat16), nn.Linear(8, 8), nn.Linear(8, 8)
    shard.weight = nn.Parameter(torch.empty(0))  # what a ZeRO-3 partitioned layer holds outside its forward

    def own_forward(x):  # what accelerate's hooks do: a forward of the instance's own
        return x

    wrapped.forward = own_forward
    model = nn.Sequential(wrapped, half, shard, plain)
    with fast_decode_linears(model):
        assert wrapped.forward is own_forward and "forward" in plain.__dict__
        assert "forward" not in half.__dict__ and "forward" not in shard.__dict__
    assert wrapped.forward is own_forward and "forward" not in plain.__dict__


def test_forwards_are_restored_when_the_loop_raises(always_transposed):
    layer = nn.Linear(8, 8)
    with pytest.raises(RuntimeError, match="stop"), fast_decode_linears(layer):
        raise RuntimeError("stop")
    assert "forward" not in layer.__dict__


def test_small_models_and_measured_losses_keep_f_linear(monkeypatch):
    layer = nn.Linear(64, 64)  # 16 KiB of weights: below MIN_WEIGHT_BYTES, they stay in cache
    with fast_decode_linears(layer):
        assert "forward" not in layer.__dict__
    force_choices(monkeypatch, LINEAR)
    with fast_decode_linears(layer):  # no other form was faster anywhere: nothing to swap
        assert "forward" not in layer.__dict__


def test_under_cpu_autocast_nothing_is_measured_or_packed(monkeypatch):
    """`bf16=True` on CPU samples under autocast, where every product is autocast's bf16 one: the context neither
    times the forms nor packs copies of the weights (seconds and the weights' size in memory, for nothing)."""
    calls = []
    force_choices(monkeypatch, PACKED, calls)
    monkeypatch.setattr(PackedWeight, "_pack", lambda self: calls.append("packed"))
    layer = nn.Linear(16, 16)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16), fast_decode_linears(layer):
        assert "forward" not in layer.__dict__
        assert layer(torch.randn(2, 16)).dtype == torch.bfloat16
    assert calls == []
    with torch.no_grad(), fast_decode_linears(layer):  # without autocast: measured, packed
        assert "forward" in layer.__dict__
    assert calls == [[(16, 16)], "packed"]


def test_measure_choices_times_every_shape_and_row_count(monkeypatch):
    timed = []
    monkeypatch.setattr(
        PackedWeight,
        "linear",
        lambda self, x, bias, product=PackedWeight.linear: timed.append(x.shape[0]) or product(self, x, bias),
    )
    compiled = counting(monkeypatch, COMPILED)
    weights = [torch.randn(64, 32), torch.randn(32, 64), torch.randn(64, 32)]
    choices = measure_choices(weights, repeats=1)
    assert set(choices) == {(64, 32), (32, 64)}
    assert sorted(set(timed)) == list(MEASURED_ROWS)  # the packed form was timed too, at each measured count
    # and the compiled one at each measured count it computes
    assert sorted(set(compiled)) == [rows for rows in MEASURED_ROWS if rows <= decode_kernel.MAX_LINEAR_ROWS]
    for by_rows in choices.values():
        assert sorted(by_rows) == list(range(1, MAX_ROWS + 1))
        assert set(by_rows.values()) <= {LINEAR, TRANSPOSED, PACKED, COMPILED}
        assert all(by_rows[rows] != COMPILED for rows in range(decode_kernel.MAX_LINEAR_ROWS + 1, MAX_ROWS + 1))
        for rows in range(1, MAX_ROWS + 1):  # between two measured counts: the larger one's choice
            assert by_rows[rows] == by_rows[min(m for m in MEASURED_ROWS if m >= rows)]


def test_choices_are_measured_once_per_model_shape(monkeypatch):
    calls = []
    force_choices(monkeypatch, TRANSPOSED, calls)
    first, same_shapes, other = nn.Linear(8, 4), nn.Linear(8, 4), nn.Linear(4, 8)
    for layer in (first, same_shapes, other, first):
        with fast_decode_linears(layer):
            pass
    assert calls == [[(4, 8)], [(8, 4)]]  # a snapshot of a model (same shapes) reuses the original's choices


def test_choices_without_the_compiled_form_are_measured_apart(monkeypatch):
    """A loop without the compiled kernels (`CPUKernels(compiled=False)`, as `decoding.py --loops gspo_sdpa` runs)
    must not reuse choices that name the compiled form: they are measured again without it."""
    calls = []
    force_choices(monkeypatch, TRANSPOSED, calls)
    layer = nn.Linear(8, 4)
    with fast_decode_linears(layer):
        pass
    with fast_decode_linears(layer, compiled=False):
        pass
    with fast_decode_linears(layer, packing=False, compiled=False):  # and without the packed one
        pass
    assert calls == [[(4, 8)], [(4, 8)], [(4, 8)]]


@pytest.mark.parametrize("form", [TRANSPOSED, PACKED, COMPILED])
def test_decoding_loop_in_each_form_samples_and_scores_like_f_linear(tiny_model, tiny_tokenizer, monkeypatch, form):
    """The whole loop, rows leaving the batch down to one: the same tokens, and π_old's log-probs within float
    rounding of the plain run's and of a training-style forward."""
    run, encoded = sampler_with_rows_ending_apart(
        tiny_model, tiny_tokenizer, ["What is 2 + 3?", "Hi there", "Solve: 7 - 4"] * 2
    )
    pad = tiny_tokenizer.pad_token_id

    plain = run()
    force_choices(monkeypatch, form)
    calls = counting(monkeypatch, form)
    fast = run()
    assert torch.equal(fast.completion_ids, plain.completion_ids)
    torch.testing.assert_close(fast.logps, plain.logps, rtol=0, atol=1e-5)
    assert {1, 6} <= set(calls)  # six rows, then fewer, down to the last row alone (and the prompts, as rows)
    assert all("forward" not in layer.__dict__ for layer in tiny_model.modules())
    # against a forward over each whole sequence, as training scores it
    mask = fast.completion_ids != pad
    ids = torch.cat([encoded.input_ids, fast.completion_ids], dim=1)
    attention = torch.cat([encoded.attention_mask, mask.long()], dim=1)
    positions = (attention.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = tiny_model(input_ids=ids, attention_mask=attention, position_ids=positions).logits
    width = fast.completion_ids.shape[1]
    scored = logits[:, -width - 1 : -1]
    expected = token_logps(scored.reshape(-1, scored.shape[-1]), fast.completion_ids.reshape(-1), 0.8).view_as(mask)
    # GenerationConfig's default top_k=50 truncates: the policy's log-prob is the recorded one plus the kept mass.
    policy = policy_logps(fast.logps, fast.kept_log_mass)
    torch.testing.assert_close(policy[mask], expected[mask], rtol=0, atol=2e-5)


@pytest.mark.parametrize("full_determinism", [False, True])
def test_full_determinism_keeps_f_linear_in_the_rollouts(
    tmp_path, tiny_model_dir, monkeypatch, full_determinism, determinism_flags_restored
):
    """The forms are chosen by timing, which can differ between runs and flip the last bits of a logit, hence a
    sample: with `full_determinism` the trainer's rollouts take `F.linear` throughout (and still train), and the
    attention kernel is not timed against SDPA either."""
    force_choices(monkeypatch, PACKED)
    calls = counting(monkeypatch, PACKED)
    timed_attention = []
    monkeypatch.setattr(decode_attention, "_choices", {})
    monkeypatch.setattr(
        decode_attention,
        "measure_kernel_choice",
        lambda *shape, **kwargs: timed_attention.append(shape) or KernelChoice.everywhere(),
    )
    config = small_config(tmp_path, max_steps=1, steps_per_generation=1, full_determinism=full_determinism)  # 4 rows
    trainer = GSPOTrainer(tiny_model_dir, count_digits, args=config, train_dataset=text_dataset())
    trainer.train()
    assert trainer.state.global_step == 1
    assert bool(calls) is not full_determinism
    assert bool(timed_attention) is not full_determinism

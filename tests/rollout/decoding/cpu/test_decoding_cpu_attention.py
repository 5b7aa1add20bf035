"""gspo_trl.rollout.decoding.cpu.attention: the packed-GQA attention of one-token steps equals transformers' SDPA
attention
(in SDPA and in the compiled kernel), every other call goes to transformers' own function, the context switches a
model's attention in and out (also around a whole decoding loop), and the kernel is chosen where it was timed faster
than SDPA (a fake timer), once per head shape, and everywhere without timing."""

from __future__ import annotations

import contextlib

import pytest
import torch
from helpers import force_attention_kernel, sampler_with_rows_ending_apart
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from gspo_trl.rollout.decoding import cpu
from gspo_trl.rollout.decoding.cpu import CPUKernels
from gspo_trl.rollout.decoding.cpu import attention as decode_attention
from gspo_trl.rollout.decoding.cpu import kernel as decode_kernel
from gspo_trl.rollout.decoding.cpu.attention import (
    MEASURED_POSITIONS,
    MEASURED_ROWS,
    NAME,
    SDPA,
    Attend,
    KernelChoice,
    attending,
    choose_kernel,
    measure_kernel_choice,
    packed_gqa_attention,
    packed_gqa_decoding,
)


class Attention(torch.nn.Module):
    """What transformers' attention functions read from the calling layer."""

    def __init__(self, groups: int):
        super().__init__()
        self.num_key_value_groups, self.is_causal = groups, True


def qkv(rows: int, heads: int, kv_heads: int, query_length: int, context: int, head_dim: int = 16):
    torch.manual_seed(0)
    return (
        torch.randn(rows, heads, query_length, head_dim),
        torch.randn(rows, kv_heads, context, head_dim),
        torch.randn(rows, kv_heads, context, head_dim),
    )


@contextlib.contextmanager
def recorded_kernel_calls(calls: list):
    """Whether the compiled kernel computed each packed call it was asked for, appended to `calls`."""
    kernel = decode_kernel.attention

    def recording(*args):
        out = kernel(*args)
        calls.append(out is not None)
        return out

    decode_kernel.attention = recording
    try:
        yield
    finally:
        decode_kernel.attention = kernel


@pytest.mark.parametrize("in_kernel", [False, True])  # the packed form in SDPA, or in the compiled kernel
@pytest.mark.parametrize("with_mask", [False, True])
@pytest.mark.parametrize("rows,heads,kv_heads", [(1, 9, 3), (3, 4, 2), (2, 6, 1)])
def test_one_token_steps_attend_like_transformers_sdpa(rows, heads, kv_heads, with_mask, in_kernel):
    query, key, value = qkv(rows, heads, kv_heads, 1, 37)
    mask = None
    if with_mask:  # SDPA's decoding mask: (rows, 1, 1, context), left padding masked out
        mask = torch.ones(rows, 1, 1, 37, dtype=torch.bool)
        mask[0, ..., :5] = False
    module = Attention(heads // kv_heads)
    calls = []
    attend = Attend(KernelChoice.everywhere() if in_kernel else None)
    with torch.no_grad(), attending(attend), recorded_kernel_calls(calls):
        expected, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=0.3)
        got, weights = packed_gqa_attention(module, query, key, value, mask, scaling=0.3)
    assert calls == ([True] if in_kernel else [])  # the kernel computed it (built here), or was not asked
    assert weights is None and got.shape == expected.shape == (rows, 1, heads, 16)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    with torch.no_grad(), attending(attend):  # bf16 weights (the GPU recipe's, on CPU): bf16 in, bf16 out
        half = [tensor.to(torch.bfloat16) for tensor in (query, key, value)]
        expected_half, _ = sdpa_attention_forward(module, *half, mask, scaling=0.3)
        got_half, _ = packed_gqa_attention(module, *half, mask, scaling=0.3)
    assert got_half.dtype == torch.bfloat16
    torch.testing.assert_close(got_half.float(), expected_half.float(), rtol=2e-2, atol=2e-2)
    if with_mask:  # the masked positions are out of row 0's softmax: its first query head as a hand-made softmax
        scores = (key[0, 0, 5:] @ query[0, 0, 0]) * 0.3
        torch.testing.assert_close(got[0, 0, 0], torch.softmax(scores, 0) @ value[0, 0, 5:], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("case", ["prefill", "no groups", "autograd", "per-head mask", "dropout"])
def test_other_calls_are_transformers_sdpa_bit_for_bit(case):
    heads, kv_heads = (4, 4) if case == "no groups" else (4, 2)
    query, key, value = qkv(2, heads, kv_heads, 5 if case == "prefill" else 1, 11)
    mask = torch.ones(2, heads, query.shape[2], 11, dtype=torch.bool) if case == "per-head mask" else None
    dropout = 0.5 if case == "dropout" else 0.0
    module = Attention(heads // kv_heads)
    with torch.set_grad_enabled(case == "autograd"):
        torch.manual_seed(1)
        expected, _ = sdpa_attention_forward(module, query, key, value, mask, dropout=dropout)
        torch.manual_seed(1)
        got, _ = packed_gqa_attention(module, query, key, value, mask, dropout=dropout)
    assert torch.equal(got, expected)


def test_the_context_switches_sdpa_models_on_cpu_and_restores_them(tiny_model):
    config = tiny_model.config
    assert config._attn_implementation == "sdpa" and config.num_key_value_heads < config.num_attention_heads
    with packed_gqa_decoding(tiny_model):
        assert config._attn_implementation == NAME
    assert config._attn_implementation == "sdpa"
    with pytest.raises(RuntimeError, match="stop"), packed_gqa_decoding(tiny_model):
        raise RuntimeError("stop")
    assert config._attn_implementation == "sdpa"


def test_a_lora_model_attends_packed_through_its_base_models_config(tiny_model):
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(tiny_model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    attention = model.base_model.model.model.layers[0].self_attn
    with packed_gqa_decoding(model):
        assert attention.config._attn_implementation == NAME
    assert attention.config._attn_implementation == "sdpa"


def test_models_it_leaves_alone(tiny_model, monkeypatch):
    config = tiny_model.config
    config._attn_implementation = "eager"
    with packed_gqa_decoding(tiny_model):  # not SDPA: the user's choice stands
        assert config._attn_implementation == "eager"
    config._attn_implementation = "sdpa"
    config.num_key_value_heads = config.num_attention_heads
    with packed_gqa_decoding(tiny_model):  # no grouped heads: nothing to pack
        assert config._attn_implementation == "sdpa"
    config.num_key_value_heads = 2
    with cpu.accelerate(tiny_model, CPUKernels(packed_attention=False)):  # the lever off
        assert config._attn_implementation == "sdpa"
    with cpu.accelerate(tiny_model, None):  # no accelerations at all
        assert config._attn_implementation == "sdpa"


@pytest.mark.parametrize(
    "prompts",
    [["What is 2 + 3? Reply with just the number.", "Hi", "Solve: 7 - 4"] * 2, ["Solve: 7 - 4"] * 6],
    ids=["left padding", "no padding"],
)
def test_decoding_loop_with_packed_heads_samples_and_scores_like_transformers_sdpa(
    tiny_model, tiny_tokenizer, monkeypatch, prompts
):
    """The whole loop, rows leaving the batch down to one: the same tokens, and π_old's log-probs within float
    rounding of those with transformers' SDPA attention (the packed calls computed by the compiled kernel). With left
    padding every step has a mask (transformers packs the heads itself then); without, none (transformers' own path
    reads the cache once per query head)."""
    run, encoded = sampler_with_rows_ending_apart(tiny_model, tiny_tokenizer, prompts)
    assert bool((encoded.attention_mask == 0).any()) == (len(set(prompts)) > 1)
    pad = tiny_tokenizer.pad_token_id
    packed_rows = []

    plain = run(CPUKernels(packed_attention=False))
    real = Attend.__call__

    def counting(self, query, *args, **kwargs):  # the packed form's calls: (rows, kv heads, group, head_dim) queries
        if query.shape[2] == tiny_model.config.num_attention_heads // tiny_model.config.num_key_value_heads:
            packed_rows.append(query.shape[0])
        return real(self, query, *args, **kwargs)

    monkeypatch.setattr(Attend, "__call__", counting)
    force_attention_kernel(monkeypatch)  # whatever this machine would time: the kernel computes each packed call
    kernel_used = []
    with recorded_kernel_calls(kernel_used):
        packed = run()
    assert kernel_used and all(kernel_used) and len(kernel_used) == len(packed_rows)
    assert torch.equal(packed.completion_ids, plain.completion_ids)
    torch.testing.assert_close(packed.logps, plain.logps, rtol=0, atol=1e-5)
    # every step after the prefill, each layer, with the rows still decoding (a row is in the steps before its EOS)
    lengths = (packed.completion_ids != pad).sum(1)
    live = [int((lengths > t).sum()) for t in range(1, packed.completion_ids.shape[1])]
    assert packed_rows == [rows for rows in live for _ in range(tiny_model.config.num_hidden_layers)]
    assert live[-1] == 1 and live[0] > 1
    assert tiny_model.config._attn_implementation == "sdpa"


def timings(kernel_wins: set[tuple[int, int]], ratio: float = 2.0):
    """A fake timer: at the points of `kernel_wins` the kernel takes 1 s and SDPA `ratio` s, elsewhere the reverse;
    the points it was asked for are recorded."""
    asked = []

    def timer(rows: int, positions: int) -> tuple[float, float]:
        asked.append((rows, positions))
        return (1.0, ratio) if (rows, positions) in kernel_wins else (ratio, 1.0)

    timer.asked = asked
    return timer


def test_the_kernel_is_chosen_where_it_was_timed_faster_than_sdpa():
    long_contexts = {(rows, MEASURED_POSITIONS[-1]) for rows in MEASURED_ROWS}
    timer = timings(long_contexts)
    choice = measure_kernel_choice(2, 2, 16, timer=timer)
    assert sorted(timer.asked) == sorted((r, p) for r in MEASURED_ROWS for p in MEASURED_POSITIONS)
    short, long = MEASURED_POSITIONS
    # a step takes the first measured point at or above its rows and positions, the last ones beyond them
    assert not choice.uses_kernel(1, 1) and not choice.uses_kernel(1, short)
    assert choice.uses_kernel(1, short + 1) and choice.uses_kernel(1, long) and choice.uses_kernel(1, 100 * long)
    assert choice.uses_kernel(MEASURED_ROWS[-1] * 10, long * 2) and not choice.uses_kernel(MEASURED_ROWS[-1] * 10, 2)
    # the kernel nowhere faster: SDPA everywhere; everywhere faster: the kernel everywhere
    nowhere = measure_kernel_choice(2, 2, 16, timer=timings(set()))
    assert not any(nowhere.uses_kernel(r, p) for r in (1, 5, 100) for p in (1, 300, 9000))
    all_points = {(r, p) for r in MEASURED_ROWS for p in MEASURED_POSITIONS}
    everywhere = measure_kernel_choice(2, 2, 16, timer=timings(all_points))
    assert all(everywhere.uses_kernel(r, p) for r in (1, 5, 100) for p in (1, 300, 9000))


def test_close_timings_keep_sdpa():
    """The kernel must be `MIN_SPEEDUP` times faster: a hair faster is noise, and SDPA is the reference."""
    point = (MEASURED_ROWS[0], MEASURED_POSITIONS[0])
    speedup = decode_attention.MIN_SPEEDUP
    assert not choose_kernel({point: (1.0, speedup * 0.99)}).uses_kernel(*point)
    assert choose_kernel({point: (1.0, speedup)}).uses_kernel(*point)


def test_the_real_timer_gives_a_choice_for_every_point():
    """The timer the loop uses runs both forms at each point (what it chooses depends on this machine)."""
    choice = measure_kernel_choice(2, 2, 16)
    assert set(choice.by_point) == {(r, p) for r in MEASURED_ROWS for p in MEASURED_POSITIONS}
    assert all(type(chosen) is bool for chosen in choice.by_point.values())


def test_the_kernel_is_timed_once_per_head_shape_and_not_without_timing(tiny_model, monkeypatch):
    measured = []
    monkeypatch.setattr(decode_attention, "_choices", {})
    monkeypatch.setattr(
        decode_attention,
        "measure_kernel_choice",
        lambda *shape, **kwargs: measured.append(shape) or choose_kernel({}),
    )
    config = tiny_model.config
    group = config.num_attention_heads // config.num_key_value_heads
    for _ in range(2):
        with packed_gqa_decoding(tiny_model) as attend:
            assert attend.kernel_choice is not None
    assert measured == [(config.num_key_value_heads, group, config.hidden_size // config.num_attention_heads)]
    with packed_gqa_decoding(tiny_model, timed=False) as attend:  # full_determinism: no timing, the kernel throughout
        assert attend.kernel_choice.by_point is None and attend.kernel_choice.uses_kernel(64, 10_000)
    with packed_gqa_decoding(tiny_model, compiled=False) as attend:  # without the compiled kernels: SDPA
        assert attend.kernel_choice is None
    assert len(measured) == 1
    query, keys, values = torch.randn(2, 2, 2, 16), torch.randn(2, 2, 9, 16), torch.randn(2, 2, 9, 16)
    with torch.no_grad():
        assert torch.equal(SDPA(query, keys, values, None, 0.25), sdpa_reference(query, keys, values, 0.25))


def sdpa_reference(query, keys, values, scale):
    return torch.nn.functional.scaled_dot_product_attention(query, keys, values, scale=scale)

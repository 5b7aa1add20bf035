"""gspo_trl.decode_attention: the packed-GQA attention of one-token steps equals transformers' SDPA attention, every
other call goes to transformers' own function, and the context switches a model's attention in and out (also around
a whole decoding loop)."""

from __future__ import annotations

import pytest
import torch
from helpers import sampler_with_rows_ending_apart
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from gspo_trl.decoding.cpu import attention as decode_attention
from gspo_trl.decoding.cpu import kernel as decode_kernel
from gspo_trl.decoding.cpu.attention import NAME, packed_gqa_attention, packed_gqa_decoding


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


@pytest.mark.parametrize("with_mask", [False, True])
@pytest.mark.parametrize("rows,heads,kv_heads", [(1, 9, 3), (3, 4, 2), (2, 6, 1)])
def test_one_token_steps_attend_like_transformers_sdpa(rows, heads, kv_heads, with_mask):
    query, key, value = qkv(rows, heads, kv_heads, 1, 37)
    mask = None
    if with_mask:  # SDPA's decoding mask: (rows, 1, 1, context), left padding masked out
        mask = torch.ones(rows, 1, 1, 37, dtype=torch.bool)
        mask[0, ..., :5] = False
    module = Attention(heads // kv_heads)
    with torch.no_grad():
        expected, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=0.3)
        got, weights = packed_gqa_attention(module, query, key, value, mask, scaling=0.3)
    assert weights is None and got.shape == expected.shape == (rows, 1, heads, 16)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    with torch.no_grad():  # bf16 weights (the GPU recipe's, on CPU): bf16 in, bf16 out, within bf16 rounding
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
    monkeypatch.setattr(decode_attention, "enabled", False)
    with packed_gqa_decoding(tiny_model):
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
    rounding of those with transformers' SDPA attention (the packed calls computed by `decode_kernel`). With left
    padding every step has a mask (transformers packs the heads itself then); without, none (transformers' own path
    reads the cache once per query head)."""
    run, encoded = sampler_with_rows_ending_apart(tiny_model, tiny_tokenizer, prompts)
    assert bool((encoded.attention_mask == 0).any()) == (len(set(prompts)) > 1)
    pad = tiny_tokenizer.pad_token_id
    packed_rows = []

    monkeypatch.setattr(decode_attention, "enabled", False)
    plain = run()
    monkeypatch.setattr(decode_attention, "enabled", True)
    real = decode_attention.attend

    def counting(query, *args, **kwargs):  # the packed form's calls: (rows, kv heads, group, head_dim) queries
        if query.shape[2] == tiny_model.config.num_attention_heads // tiny_model.config.num_key_value_heads:
            packed_rows.append(query.shape[0])
        return real(query, *args, **kwargs)

    monkeypatch.setattr(decode_attention, "attend", counting)
    kernel_used, kernel = [], decode_kernel.attention

    def recording(*args):  # whether the compiled kernel computed each packed call (it is built on this machine)
        out = kernel(*args)
        kernel_used.append(out is not None)
        return out

    monkeypatch.setattr(decode_kernel, "attention", recording)
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

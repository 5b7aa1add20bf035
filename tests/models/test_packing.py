"""Shared-prefix packing: the layout by hand, then log-probs and gradients against padded rows."""

from __future__ import annotations

import pytest
import torch
from torch.utils.checkpoint import checkpoint
from transformers import AutoConfig, AutoModelForCausalLM

from gspo_trl.models.packing import (
    pack_shared_prefix,
    padding_free_unsupported_reason,
    plan_forwards,
    relative_attention_cost,
)
from gspo_trl.training import logprobs
from gspo_trl.training.logprobs import completion_logprobs

PAD = 0


def test_two_completions_share_one_prompt():
    # Prompt [5, 6, 7] (left-padded by one) with completions [10, 11, 12] and [20, 21] (+ one padding).
    prompt_ids = torch.tensor([[PAD, 5, 6, 7], [PAD, 5, 6, 7]])
    prompt_mask = torch.tensor([[0, 1, 1, 1], [0, 1, 1, 1]])
    completion_ids = torch.tensor([[10, 11, 12], [20, 21, PAD]])
    completion_mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    packed = pack_shared_prefix(prompt_ids, prompt_mask, completion_ids, completion_mask)

    # The last scored token of each completion is never an input: nothing is predicted from it.
    assert packed.input_ids.tolist() == [[5, 6, 7, 10, 11, 20]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 3, 4, 3]]
    # Token 10 and token 20 are predicted by the last prompt token (position 2), 11 by 10, 12 by 11, 21 by 20.
    assert packed.score_index.tolist() == [2, 3, 4, 2, 5]
    allowed = packed.attention_mask[0, 0].int().tolist()
    assert allowed == [
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0],
        [1, 1, 1, 1, 0, 0],
        [1, 1, 1, 1, 1, 0],
        [1, 1, 1, 0, 0, 1],  # token 20 sees the prompt and itself, not the other completion
    ]
    assert packed.num_real_tokens == 6 and packed.num_padding_tokens == 0


def test_rows_are_grouped_by_prompt_in_any_order_and_unscored_rows_drop_out():
    prompt_ids = torch.tensor([[1, 2], [3, 4], [1, 2], [3, 4]])
    prompt_mask = torch.ones_like(prompt_ids)
    completion_ids = torch.tensor([[7, 8], [9, 9], [6, 6], [5, 5]])
    completion_mask = torch.tensor([[1, 1], [1, 0], [1, 1], [0, 0]])
    packed = pack_shared_prefix(prompt_ids, prompt_mask, completion_ids, completion_mask)
    # Prompt [1, 2] with completions 0 and 2 (inputs [7] and [6]); prompt [3, 4] with completion 1 (no input:
    # its only scored token comes from the prompt); row 3 scores nothing and adds no tokens.
    assert packed.input_ids.tolist() == [[1, 2, 7, 6, 3, 4]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 2, 0, 1]]
    assert packed.score_index.tolist() == [1, 2, 5, 1, 3]
    mask = packed.attention_mask[0, 0]
    assert not mask[4, :4].any() and mask[5, 4:6].all()  # the second prompt does not see the first unit


def test_row_cap_splits_groups_repeats_the_prompt_and_pads_only_row_ends():
    prompt_ids = torch.tensor([[1, 2, 3]] * 3)
    prompt_mask = torch.ones_like(prompt_ids)
    completion_ids = torch.arange(10, 25).reshape(3, 5)
    completion_mask = torch.ones_like(completion_ids)
    packed = pack_shared_prefix(
        prompt_ids, prompt_mask, completion_ids, completion_mask, max_row_tokens=8, pad_token_id=PAD
    )
    # Each unit is the prompt plus one 4-token completion input: 7 tokens, so one unit per row.
    assert packed.input_ids.shape == (3, 7)
    assert packed.num_padding_tokens == 0
    assert all(row[:3] == [1, 2, 3] for row in packed.input_ids.tolist())

    completion_mask[2, 2:] = 0  # the last completion's input is now one token: it joins a row with room
    packed = pack_shared_prefix(
        prompt_ids, prompt_mask, completion_ids, completion_mask, max_row_tokens=8, pad_token_id=PAD
    )
    assert packed.input_ids.tolist() == [[1, 2, 3, 10, 11, 12, 13, 20], [1, 2, 3, 15, 16, 17, 18, PAD]]
    assert packed.num_padding_tokens == 1


def test_rows_are_balanced_longest_completion_first():
    # Completion inputs of 6, 6, 2 and 2 tokens after a 2-token prompt, rows capped at 10: two rows of
    # prompt + 6 + 2 = 10 positions each, no padding (cutting the group in order would need three rows).
    prompt_ids = torch.tensor([[1, 2]] * 4)
    completion_ids = torch.arange(10, 38).reshape(4, 7)
    completion_mask = torch.tensor([[1] * 7, [1] * 7, [1] * 3 + [0] * 4, [1] * 3 + [0] * 4])
    packed = pack_shared_prefix(
        prompt_ids, torch.ones_like(prompt_ids), completion_ids, completion_mask, max_row_tokens=10
    )
    assert packed.input_ids.shape == (2, 10) and packed.num_padding_tokens == 0


def test_groups_that_fit_one_row_take_a_row_each_when_the_dense_attention_costs_more():
    # Two prompts of 2 tokens, each with completion inputs of 3 and 3 tokens: 16 positions in all. As one row,
    # 16 × (1 + c·16); as a row per prompt, 2 × 8 × (1 + c·8), no padding. With c = 0.1: 41.6 against 28.8
    # (completion by completion into 4 rows repeats each prompt: 4 × 5 × 1.5 = 30).
    prompt_ids = torch.tensor([[1, 2], [1, 2], [3, 4], [3, 4]])
    completion_ids = torch.arange(10, 26).reshape(4, 4)
    completion_mask = torch.ones_like(completion_ids)
    packed = pack_shared_prefix(
        prompt_ids, torch.ones_like(prompt_ids), completion_ids, completion_mask, attention_pair_cost=0.1
    )
    assert packed.input_ids.tolist() == [[1, 2, 10, 11, 12, 14, 15, 16], [3, 4, 18, 19, 20, 22, 23, 24]]
    assert packed.num_padding_tokens == 0
    # The second prompt's completion inputs shrink to 1 token each: 12 positions as one row; every split pads a row
    # or repeats a prompt, so with attention free (c = 0) the single row wins.
    completion_mask[2:, 2:] = 0
    packed = pack_shared_prefix(
        prompt_ids, torch.ones_like(prompt_ids), completion_ids, completion_mask, attention_pair_cost=0.0
    )
    assert packed.input_ids.shape == (1, 12) and packed.num_padding_tokens == 0


def test_a_completion_longer_than_the_row_cap_makes_room_in_every_row():
    # Completion inputs of 12, 2, 2 and 2 tokens after a 2-token prompt, rows capped at 6: the long one needs a row of
    # 14 positions and every row is padded to 14, so the short ones share a second row (not three rows of their own).
    prompt_ids = torch.tensor([[1, 2]] * 4)
    completion_ids = torch.arange(10, 62).reshape(4, 13)
    completion_mask = torch.tensor([[1] * 13] + [[1] * 3 + [0] * 10] * 3)
    packed = pack_shared_prefix(
        prompt_ids, torch.ones_like(prompt_ids), completion_ids, completion_mask, max_row_tokens=6, pad_token_id=PAD
    )
    assert packed.input_ids.tolist() == [
        [1, 2] + list(range(10, 22)),
        [1, 2, 23, 24, 36, 37, 49, 50] + [PAD] * 6,
    ]
    assert packed.num_padding_tokens == 6 and packed.attention_mask is not None


def test_nothing_scored_gives_none():
    ids = torch.ones(2, 3, dtype=torch.long)
    assert pack_shared_prefix(ids, ids, ids, torch.zeros_like(ids)) is None


def test_float_mask_is_additive_bias():
    ids = torch.tensor([[5, 6]] * 2)
    packed = pack_shared_prefix(ids, torch.ones_like(ids), torch.tensor([[7, 8], [9, 10]]), torch.ones(2, 2))
    bias = packed.float_attention_mask(torch.float32)[0, 0]
    assert bias[1, 0] == 0 and bias[0, 1] == torch.finfo(torch.float32).min


def test_rows_of_one_completion_need_no_mask_and_count_positions_through_their_padding():
    prompt_ids = torch.tensor([[1, 2, 3]] * 2)
    completion_ids = torch.arange(10, 20).reshape(2, 5)
    completion_mask = torch.tensor([[1] * 5, [1, 1, 0, 0, 0]])
    packed = pack_shared_prefix(
        prompt_ids, torch.ones_like(prompt_ids), completion_ids, completion_mask, max_row_tokens=1, pad_token_id=PAD
    )
    assert packed.attention_mask is None and packed.float_attention_mask(torch.float32) is None
    assert packed.input_ids.tolist() == [[1, 2, 3, 10, 11, 12, 13], [1, 2, 3, 15, PAD, PAD, PAD]]
    assert packed.position_ids.tolist() == [list(range(7))] * 2  # one sequence per row, as the model reads it


def group_batch(vocab_size, groups=3, group_size=4, completion_length=9, seed=0):
    """Left-padded prompts of different lengths, each repeated group_size times, with ragged completions."""
    generator = torch.Generator().manual_seed(seed)
    prompt_length = 7
    prompt_ids, prompt_mask = [], []
    for g in range(groups):
        real = 3 + 2 * g  # 3, 5, 7 tokens
        ids = torch.randint(5, vocab_size, (prompt_length,), generator=generator)
        mask = (torch.arange(prompt_length) >= prompt_length - real).long()
        prompt_ids += [ids * mask] * group_size
        prompt_mask += [mask] * group_size
    prompt_ids, prompt_mask = torch.stack(prompt_ids), torch.stack(prompt_mask)
    rows = groups * group_size
    completion_ids = torch.randint(5, vocab_size, (rows, completion_length), generator=generator)
    lengths = torch.randint(1, completion_length + 1, (rows,), generator=generator)
    attended = (torch.arange(completion_length) < lengths.unsqueeze(1)).long()  # up to EOS
    completion_ids = completion_ids * attended
    completion_mask = attended.clone()
    completion_mask[1] = 0  # a masked-out (e.g. truncated) completion
    completion_mask[2, 0] = 0  # a loss mask that is not a prefix
    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
    attention_mask = torch.cat([prompt_mask, attended], dim=1)
    return input_ids, attention_mask, completion_ids, completion_mask


def logps_and_grads(model, inputs, **kwargs):
    model.zero_grad()
    weights = torch.linspace(-1, 1, inputs[2].numel()).reshape(inputs[2].shape)
    logps, entropy, _ = completion_logprobs(model, *inputs, temperature=0.8, **kwargs)
    (logps * weights).sum().backward()
    return logps.detach(), entropy, {name: p.grad.clone() for name, p in model.named_parameters()}


# One row for everything / groups spread over rows / rows as long as the longest prompt + completion.
@pytest.mark.parametrize("max_row_tokens", [1024, 12, 1])
@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_packed_forward_matches_padded_rows(tiny_model, max_row_tokens, attention):
    tiny_model.config._attn_implementation = attention
    try:
        inputs = group_batch(tiny_model.config.vocab_size)
        padded_logps, padded_entropy, padded_grads = logps_and_grads(tiny_model, inputs, chunk_size=5)
        packed_logps, packed_entropy, packed_grads = logps_and_grads(
            tiny_model, inputs, chunk_size=5, padding_free=True, max_row_tokens=max_row_tokens
        )
    finally:
        tiny_model.config._attn_implementation = "sdpa"
    assert (padded_logps[inputs[3] == 1] != 0).all()
    torch.testing.assert_close(packed_logps, padded_logps, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(packed_entropy, padded_entropy, atol=1e-5, rtol=1e-5)
    for name, grad in padded_grads.items():
        torch.testing.assert_close(packed_grads[name], grad, atol=1e-5, rtol=1e-4, msg=name)


def test_rows_of_one_completion_match_padded_rows_without_a_mask(tiny_model):
    # Completions of nearly the same length: each row holds one, so the model runs its causal kernel, no mask.
    input_ids, attention_mask, completion_ids, _ = group_batch(tiny_model.config.vocab_size, groups=2, group_size=2)
    completion_mask = torch.ones_like(completion_ids)
    completion_mask[1, -1] = 0
    attention_mask[:, -completion_ids.shape[1] :] = 1
    inputs = (input_ids, attention_mask, completion_ids, completion_mask)
    prompt_length = input_ids.shape[1] - completion_ids.shape[1]
    packed = pack_shared_prefix(
        input_ids[:, :prompt_length],
        attention_mask[:, :prompt_length],
        completion_ids,
        completion_mask,
        max_row_tokens=1,
    )
    assert packed.input_ids.shape[0] == 4 and packed.attention_mask is None
    padded_logps, padded_entropy, padded_grads = logps_and_grads(tiny_model, inputs, chunk_size=5)
    packed_logps, packed_entropy, packed_grads = logps_and_grads(
        tiny_model, inputs, chunk_size=5, padding_free=True, max_row_tokens=1
    )
    torch.testing.assert_close(packed_logps, padded_logps, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(packed_entropy, padded_entropy, atol=1e-5, rtol=1e-5)
    for name, grad in padded_grads.items():
        torch.testing.assert_close(packed_grads[name], grad, atol=1e-5, rtol=1e-4, msg=name)


def test_attention_holes_in_completions_fall_back_to_padded_rows(tiny_model):
    input_ids, attention_mask, completion_ids, completion_mask = group_batch(tiny_model.config.vocab_size)
    attention_mask[0, -completion_ids.shape[1]] = 0  # a completion token hidden from attention
    inputs = (input_ids, attention_mask, completion_ids, completion_mask)
    padded, _, _ = completion_logprobs(tiny_model, *inputs)
    packed, _, _ = completion_logprobs(tiny_model, *inputs, padding_free=True)
    torch.testing.assert_close(packed, padded, atol=1e-5, rtol=1e-5)


def test_packed_forward_processes_fewer_tokens(tiny_model):
    input_ids, attention_mask, completion_ids, completion_mask = group_batch(tiny_model.config.vocab_size)
    prompt_length = input_ids.shape[1] - completion_ids.shape[1]
    packed = pack_shared_prefix(
        input_ids[:, :prompt_length], attention_mask[:, :prompt_length], completion_ids, completion_mask
    )
    assert packed.num_positions < input_ids.numel() / 2


def tiny_config(model_type, **overrides):
    values = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=64,
    )
    values.update(overrides)
    return AutoConfig.for_model(model_type, **values)


def test_supported_models_and_reasons_for_the_rest():
    llama = AutoModelForCausalLM.from_config(tiny_config("llama"), attn_implementation="sdpa")
    assert padding_free_unsupported_reason(llama) is None
    qwen2 = AutoModelForCausalLM.from_config(tiny_config("qwen2", use_sliding_window=False, sliding_window=4096))
    assert padding_free_unsupported_reason(qwen2) is None  # a window that is switched off does not count
    mistral = AutoModelForCausalLM.from_config(tiny_config("mistral", sliding_window=16))
    assert "sliding-window" in padding_free_unsupported_reason(mistral)
    llama.config._attn_implementation = "flash_attention_2"
    assert "flash_attention_2" in padding_free_unsupported_reason(llama)


def test_relative_attention_cost_by_hand():
    config = tiny_config("llama", hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2)
    # weights per layer: q, o 64×64 each, k, v 64×32 each (12,288) + gate, up, down 3×64×128 (24,576);
    # a pair costs 4·heads·head_dim = 256 FLOPs against 2 × 36,864 for a token.
    assert relative_attention_cost(config) == pytest.approx(256 / (2 * 36864))


def test_an_empty_prompt_is_a_clear_error():
    prompt_ids = torch.tensor([[PAD, PAD], [5, 6]])
    prompt_mask = torch.tensor([[0, 0], [1, 1]])
    completion = torch.tensor([[7, 8], [7, 8]])
    with pytest.raises(ValueError, match="row 0 has an empty prompt"):
        pack_shared_prefix(prompt_ids, prompt_mask, completion, torch.ones_like(completion))


def test_packing_is_the_default_on_cpu_only():
    from gspo_trl.models.packing import packing_pays_on

    assert packing_pays_on("cpu")
    assert not packing_pays_on("cuda") and not packing_pays_on("xpu")


def test_plan_forwards_cuts_the_long_completion_from_the_short_ones_by_hand():
    # One completion input of 39 tokens and three of 2, after a 2-token prompt, rows capped at 6 tokens.
    # One forward: every row is padded to 41, so two rows of 41 (cost 2 × 41 × (1 + 41 / 3000) ≈ 83.1).
    # Two forwards: one row of 41 (≈ 41.6) + the short ones in rows of 6 and 4, padded to 6 (2 × 6 × 1.002 ≈ 12.0).
    prompt_ids = torch.tensor([[1, 2]] * 4)
    completion_ids = torch.arange(10, 170).reshape(4, 40)
    completion_mask = torch.tensor([[1] * 40] + [[1] * 3 + [0] * 37] * 3)
    forwards = plan_forwards(
        prompt_ids,
        torch.ones_like(prompt_ids),
        completion_ids,
        completion_mask,
        max_row_tokens=6,
        attention_pair_cost=1 / 3000,
    )
    assert [rows.tolist() for rows in forwards] == [[0], [1, 2, 3]]
    # The saving must reach min_saving (here 53.6 / 83.1 saves 36%).
    assert (
        len(
            plan_forwards(
                prompt_ids,
                torch.ones_like(prompt_ids),
                completion_ids,
                completion_mask,
                max_row_tokens=6,
                attention_pair_cost=1 / 3000,
                min_saving=0.5,
            )
        )
        == 1
    )


def test_plan_forwards_keeps_one_forward_for_similar_lengths_and_never_an_unscored_side():
    prompt_ids = torch.tensor([[1, 2]] * 4)
    completion_ids = torch.arange(10, 170).reshape(4, 40)
    similar = torch.tensor([[1] * 40, [1] * 38 + [0] * 2, [1] * 35 + [0] * 5, [1] * 31 + [0] * 9])
    assert len(plan_forwards(prompt_ids, torch.ones_like(prompt_ids), completion_ids, similar, max_row_tokens=6)) == 1
    unscored = torch.tensor([[1] * 40] + [[0] * 40] * 3)  # the short side would score nothing
    assert len(plan_forwards(prompt_ids, torch.ones_like(prompt_ids), completion_ids, unscored, max_row_tokens=6)) == 1


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_long_and_short_completions_in_two_forwards_match_padded_rows(tiny_model, attention):
    input_ids, attention_mask, completion_ids, completion_mask = group_batch(
        tiny_model.config.vocab_size, groups=2, group_size=4, completion_length=48, seed=3
    )
    attention_mask[0, -48:] = 1
    completion_mask[0] = 1  # one 48-token completion; the others end within 48 tokens at random
    short = torch.arange(48) < 4
    for row in range(1, 8):
        attention_mask[row, -48:] *= short
        completion_mask[row] *= short
        completion_ids[row] *= short
    inputs = (input_ids, attention_mask, completion_ids, completion_mask)
    prompt_length = input_ids.shape[1] - completion_ids.shape[1]
    forwards = plan_forwards(
        input_ids[:, :prompt_length],
        attention_mask[:, :prompt_length],
        completion_ids,
        completion_mask,
        max_row_tokens=16,
        attention_pair_cost=relative_attention_cost(tiny_model.config),
    )
    assert len(forwards) == 2 and forwards[0].tolist() == [0]
    calls = []
    hook = tiny_model.register_forward_hook(lambda module, args, output: calls.append(1))
    tiny_model.config._attn_implementation = attention
    try:
        padded_logps, padded_entropy, padded_grads = logps_and_grads(tiny_model, inputs, chunk_size=5)
        padded_calls = len(calls)
        packed_logps, packed_entropy, packed_grads = logps_and_grads(
            tiny_model, inputs, chunk_size=5, padding_free=True, max_row_tokens=16
        )
    finally:
        tiny_model.config._attn_implementation = "sdpa"
        hook.remove()
    assert padded_calls == 1 and len(calls) - padded_calls >= 2  # the short side may be cut again
    assert (padded_logps[completion_mask == 1] != 0).all()
    torch.testing.assert_close(packed_logps, padded_logps, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(packed_entropy, padded_entropy, atol=1e-5, rtol=1e-5)
    for name, grad in padded_grads.items():
        torch.testing.assert_close(packed_grads[name], grad, atol=1e-5, rtol=1e-4, msg=name)


def test_forwards_cut_from_one_micro_batch_share_the_kept_logits(tiny_model, monkeypatch):
    # The long and short forwards stay alive until one backward pass: their kept logits together stay within the budget.
    input_ids, attention_mask, completion_ids, completion_mask = group_batch(
        tiny_model.config.vocab_size, groups=2, group_size=4, completion_length=48, seed=3
    )
    attention_mask[0, -48:] = 1
    completion_mask[0] = 1
    short = torch.arange(48) < 4
    for row in range(1, 8):
        attention_mask[row, -48:] *= short
        completion_mask[row] *= short
        completion_ids[row] *= short
    recomputed = []

    def counting_checkpoint(function, *args, **kwargs):
        recomputed.append(args[0].shape[0])
        return checkpoint(function, *args, **kwargs)

    monkeypatch.setattr(logprobs, "checkpoint", counting_checkpoint)
    budget_tokens = 20
    kept_mb = budget_tokens * 4 * tiny_model.config.vocab_size / 2**20
    scores = completion_logprobs(
        tiny_model,
        input_ids,
        attention_mask,
        completion_ids,
        completion_mask,
        chunk_size=5,
        padding_free=True,
        max_row_tokens=16,
        kept_logits_mb=kept_mb,
    )
    scores.logps.sum().backward()
    kept = int(completion_mask.sum()) - sum(recomputed)
    assert 0 < kept <= budget_tokens


def test_the_float_mask_takes_the_queries_dtype(tiny_model):
    from gspo_trl.models.packing import attention_mask_dtype
    from gspo_trl.models.precision import cast_lm_head_to_fp32

    assert attention_mask_dtype(tiny_model) == torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert attention_mask_dtype(tiny_model) == torch.bfloat16  # autocast computes the queries in bf16
    half = tiny_model.to(torch.bfloat16)
    half.config.tie_word_embeddings = True
    half.tie_weights()
    cast_lm_head_to_fp32(half)  # a tied head cast to float32 takes the input embedding with it
    assert half.get_input_embeddings().weight.dtype == torch.float32
    assert attention_mask_dtype(half) == torch.bfloat16  # the layers, hence the queries, stay bf16

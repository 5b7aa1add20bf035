"""gspo_trl.rollout.decoding.static: the static-cache loop samples what `dynamic.sample` and a one-row no-cache
reference
sample (windows growing, finished rows compacted away), and says when it cannot run. The CUDA-graph replay
itself needs a GPU: `benchmarks/static_decoding_gpu.py` checks it there (docs/benchmarks.md)."""

from __future__ import annotations

import pytest
import torch
from test_decoding_dynamic import SETTINGS, FavourEos, reference_decode
from transformers import DynamicCache, GenerationConfig, LogitsProcessorList
from transformers.generation.logits_process import TemperatureLogitsWarper

from gspo_trl.rollout import completion_mask_from_eos, keyed_uniform, stream_keys
from gspo_trl.rollout.decoding import dynamic, static
from gspo_trl.rollout.decoding.cpu.attention import NAME as DENSE_MASKED_CUSTOM_ATTENTION
from gspo_trl.rollout.decoding.prefix_sharing import prefill, prefill_shared_prompts
from gspo_trl.training.logprobs import completion_logprobs

PROMPTS = ["What is 2 + 3?"] * 4 + ["Hi there"] * 4 + ["Solve: 7 - 4"] * 4


def encode(tokenizer, prompts=PROMPTS):
    encoded = tokenizer(prompts, return_tensors="pt", padding=True, padding_side="left")
    return encoded.input_ids, encoded.attention_mask


@pytest.mark.parametrize(
    "window_block, check_every, attention", [(4, 2, "sdpa"), (256, 8, "sdpa"), (3, 1, "sdpa"), (4, 2, "eager")]
)
def test_static_loop_samples_what_the_reference_and_the_dynamic_loop_sample(
    tiny_model, tiny_tokenizer, window_block, check_every, attention
):
    # Windows of 4 and 3 positions grow every few steps; checks every 1 or 2 steps compact the batch. Eager attention
    # adds the 4-D mask to its scores: the padding and the window's unwritten slots must be masked there too.
    tiny_model.set_attn_implementation(attention)
    eos, pad = tiny_tokenizer.eos_token_id, tiny_tokenizer.pad_token_id
    ids, mask = encode(tiny_tokenizer)
    keys = stream_keys(3, torch.arange(len(PROMPTS)))
    processors = LogitsProcessorList(
        [FavourEos(eos), *dynamic.logits_processors(GenerationConfig(do_sample=True, **SETTINGS))]
    )

    def uniforms(rows, t):
        return keyed_uniform(keys[rows], t, 1).squeeze(1)

    batch_sizes = []
    hook = tiny_model.model.embed_tokens.register_forward_hook(lambda m, i, o: batch_sizes.append(o.shape[0]))
    try:
        from_static = static.sample(
            tiny_model,
            ids,
            mask,
            max_new_tokens=12,
            eos_token_ids=[eos],
            pad_token_id=pad,
            processors=processors,
            cache=prefill(tiny_model, ids, mask),
            uniforms=uniforms,
            graphs=False,
            window_block=window_block,
            check_every=check_every,
        ).completion_ids
    finally:
        hook.remove()
    from_dynamic = dynamic.sample(
        tiny_model,
        ids,
        mask,
        max_new_tokens=12,
        eos_token_ids=[eos],
        pad_token_id=pad,
        processors=processors,
        uniforms=uniforms,
    ).completion_ids
    assert torch.equal(from_static, from_dynamic)
    lengths = []
    for row, prompt in enumerate(PROMPTS):
        expected = reference_decode(
            tiny_model, torch.tensor(tiny_tokenizer(prompt).input_ids), processors, keys[row], 12, eos
        )
        assert from_static[row, : len(expected)].tolist() == expected, row
        assert (from_static[row, len(expected) :] == pad).all()
        lengths.append(len(expected))
    assert from_static.shape[1] == max(lengths) and len(set(lengths)) > 2
    # The batch shrank once at most half the rows were live, at a check: never before a row had finished.
    steps = batch_sizes[1:]  # after the prefill
    assert steps[0] == len(PROMPTS) and (check_every > 2 or min(steps) < len(PROMPTS))
    for t, size in enumerate(steps):
        assert size >= sum(length > t for length in lengths)


def test_static_loop_runs_under_bf16_weights_and_autocast(tiny_model_dir, tiny_tokenizer):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16)
    eos, pad = tiny_tokenizer.eos_token_id, tiny_tokenizer.pad_token_id
    ids, mask = encode(tiny_tokenizer)
    keys = stream_keys(5, torch.arange(len(PROMPTS)))
    kwargs = dict(
        max_new_tokens=8,
        eos_token_ids=[eos],
        pad_token_id=pad,
        processors=LogitsProcessorList([FavourEos(eos)]),
        uniforms=lambda rows, t: keyed_uniform(keys[rows], t, 1).squeeze(1),
    )
    with torch.autocast("cpu", dtype=torch.bfloat16):
        from_static = static.sample(
            model,
            ids,
            mask,
            cache=prefill_shared_prompts(model, ids, mask),
            graphs=False,
            window_block=4,
            check_every=1,
            **kwargs,
        ).completion_ids
        from_dynamic = dynamic.sample(model, ids, mask, **kwargs).completion_ids
    assert from_static.shape == from_dynamic.shape
    # bf16 sums over windows of different sizes may round differently: nearly every token agrees.
    assert (from_static == from_dynamic).float().mean() > 0.9


def test_unsupported_reason_names_what_the_static_loop_needs(tiny_model, tiny_tokenizer):
    ids, mask = encode(tiny_tokenizer)
    cache = prefill(tiny_model, ids, mask)
    assert static.unsupported_reason(tiny_model, cache) is None
    short_ids, short_mask = encode(tiny_tokenizer, ["Hi there", "x"])  # a row of one token: nothing to prefill
    with pytest.raises(ValueError, match="at least two tokens"):
        static.sample(
            tiny_model,
            short_ids,
            short_mask,
            max_new_tokens=2,
            eos_token_ids=[0],
            pad_token_id=0,
            processors=LogitsProcessorList(),
        )
    assert "no prefilled prompt cache" in static.unsupported_reason(tiny_model, None)
    assert "full attention" in static.unsupported_reason(tiny_model, DynamicCache(config=tiny_model.config))
    tiny_model.config._attn_implementation = DENSE_MASKED_CUSTOM_ATTENTION  # registered with SDPA's dense masks
    assert static.unsupported_reason(tiny_model, cache) is None
    for attention in ("flex_attention", "flash_attention_2"):  # block masks; 2-D padding masks or none
        tiny_model.config._attn_implementation = attention
        assert f"attn_implementation={attention!r}" in static.unsupported_reason(tiny_model, cache)


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_static_loop_continues_rows_laid_out_with_gaps(tiny_model, tiny_tokenizer, attention):
    # Later turns of episodes: rows share a prompt, then differ; `prefill_shared_prefixes` lays them out
    # [prefix | gap | tail | last token]. The processors (repetition penalty here) see the left-padded rows.
    tiny_model.set_attn_implementation(attention)
    from gspo_trl.rollout import left_pad
    from gspo_trl.rollout.decoding.prefix_sharing import prefill_shared_prefixes

    eos, pad = tiny_tokenizer.eos_token_id, tiny_tokenizer.pad_token_id
    torch.manual_seed(0)
    prompt = torch.randint(5, 200, (30,)).tolist()
    rows = [prompt + [7, 8, 9], prompt + [12], prompt + [14, 15, 16, 17, 18], prompt + [22, 23]]
    keys = stream_keys(11, torch.arange(len(rows)))
    processors = LogitsProcessorList(
        [FavourEos(eos), *dynamic.logits_processors(GenerationConfig(do_sample=True, **SETTINGS))]
    )
    history, _ = left_pad(rows, pad)
    seen = []
    processors.append(lambda input_ids, scores: seen.append(input_ids.clone()) or scores)
    kwargs = dict(
        max_new_tokens=10,
        eos_token_ids=[eos],
        pad_token_id=pad,
        processors=processors,
        history=history,
        uniforms=lambda r, t: keyed_uniform(keys[r], t, 1).squeeze(1),
    )
    ids, mask, cache = prefill_shared_prefixes(tiny_model, rows, pad)
    assert not bool(mask.cumprod(1).eq(mask).all())  # there are gaps after the first token of some row
    from_static = static.sample(
        tiny_model, ids, mask, cache=cache, graphs=False, window_block=4, check_every=100, **kwargs
    ).completion_ids
    assert torch.equal(seen[0], history)  # the processors see the left-padded rows, not the gapped layout
    assert torch.equal(seen[from_static.shape[1]], torch.cat([history, from_static], dim=1))
    seen.clear()
    ids, mask, cache = prefill_shared_prefixes(tiny_model, rows, pad)
    from_dynamic = dynamic.sample(tiny_model, ids, mask, cache=cache, **kwargs).completion_ids
    assert torch.equal(from_static, from_dynamic)
    for row, tokens in enumerate(rows):
        expected = reference_decode(tiny_model, torch.tensor(tokens), processors, keys[row], 10, eos)
        assert from_static[row, : len(expected)].tolist() == expected, row


@pytest.mark.parametrize("check_every", [1, 3, 100])
def test_static_loop_keeps_the_states_the_dynamic_loop_keeps(tiny_model, tiny_tokenizer, check_every):
    # The turn cache of episodes: each row that ended with an EOS leaves its KV cache (prompt and completion, the
    # EOS excepted), copied out before compaction drops the row; None for rows cut at the length cap.
    eos, pad = tiny_tokenizer.eos_token_id, tiny_tokenizer.pad_token_id
    ids, mask = encode(tiny_tokenizer)
    keys = stream_keys(13, torch.arange(len(PROMPTS)))
    kwargs = dict(
        max_new_tokens=6,
        eos_token_ids=[eos],
        pad_token_id=pad,
        processors=LogitsProcessorList([FavourEos(eos)]),
        uniforms=lambda rows, t: keyed_uniform(keys[rows], t, 1).squeeze(1),
        keep_states=True,
    )
    static_result = static.sample(
        tiny_model, ids, mask, graphs=False, window_block=4, check_every=check_every, **kwargs
    )
    dynamic_result = dynamic.sample(
        tiny_model, ids, mask, cache=prefill_shared_prompts(tiny_model, ids, mask), **kwargs
    )
    from_static, static_states = static_result.completion_ids, static_result.states
    from_dynamic, dynamic_states = dynamic_result.completion_ids, dynamic_result.states
    assert torch.equal(from_static, from_dynamic)
    ended = [eos in row for row in from_static.tolist()]
    assert 0 < sum(ended) < len(PROMPTS)  # some rows ended with an EOS, some were cut at 6 tokens
    for row, (a, b) in enumerate(zip(static_states, dynamic_states)):
        assert (a is None) == (b is None) == (not ended[row]), row
        if a is not None:
            assert a.length == b.length == int(mask[row].sum()) + from_static[row].tolist().index(eos)
            for (keys_a, values_a), (keys_b, values_b) in zip(a.layers, b.layers):
                torch.testing.assert_close(keys_a, keys_b, rtol=1e-5, atol=1e-5)
                torch.testing.assert_close(values_a, values_b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("settings", ["a processor", "temperature alone"])
def test_static_loop_records_the_logps_the_dynamic_loop_records(tiny_model, tiny_tokenizer, settings):
    # decode_logprobs_as_old on a GPU: the same log-probs as the dynamic loop, 0 after each row's end (a finished row
    # keeps drawing pad tokens until compaction; those draws are not log-probs of the completion). With the
    # temperature alone both loops take them from the sampling weights; rows then end at a twentieth of the ids.
    eos, pad = tiny_tokenizer.eos_token_id, tiny_tokenizer.pad_token_id
    ids, mask = encode(tiny_tokenizer)
    keys = stream_keys(17, torch.arange(len(PROMPTS)))
    ends, processors = [eos], LogitsProcessorList([FavourEos(eos)])
    if settings == "temperature alone":
        ends, processors = (
            [eos] + list(range(3, tiny_model.config.vocab_size, 20)),
            LogitsProcessorList([TemperatureLogitsWarper(0.8)]),
        )
    kwargs = dict(
        max_new_tokens=10,
        eos_token_ids=ends,
        pad_token_id=pad,
        processors=processors,
        logp_temperature=0.8,
        uniforms=lambda rows, t: keyed_uniform(keys[rows], t, 1).squeeze(1),
    )
    from_static = static.sample(tiny_model, ids, mask, graphs=False, window_block=4, check_every=3, **kwargs)
    from_dynamic = dynamic.sample(tiny_model, ids, mask, cache=prefill_shared_prompts(tiny_model, ids, mask), **kwargs)
    assert torch.equal(from_static.completion_ids, from_dynamic.completion_ids)
    ended = torch.isin(from_static.completion_ids, torch.tensor(ends)).any(1)
    assert 0 < int(ended.sum()) < len(PROMPTS)
    completion_mask, _ = completion_mask_from_eos(from_static.completion_ids, ends)
    assert (from_static.logps[completion_mask == 0] == 0).all() and (from_static.logps[completion_mask == 1] < 0).all()
    torch.testing.assert_close(from_static.logps, from_dynamic.logps, atol=1e-5, rtol=0)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_static_loop_records_the_logps_a_scoring_forward_gives(tiny_model, tiny_tokenizer, family, attention):
    # The recorded log-probs are π_old (decode_logprobs_as_old): they must be what training scores, under either
    # attention (eager adds the mask to its scores: a boolean mask there masked nothing, 1.1 nats off on Llama) and
    # for learned absolute positions (GPT-2: the static loop's positions count each row from its first token).
    from conftest import build_tiny_gpt2

    model = tiny_model if family == "llama" else build_tiny_gpt2(tiny_tokenizer).eval()
    model.set_attn_implementation(attention)
    eos, pad = tiny_tokenizer.eos_token_id, tiny_tokenizer.pad_token_id
    ids, mask = encode(tiny_tokenizer)
    keys = stream_keys(19, torch.arange(len(PROMPTS)))
    kwargs = dict(
        max_new_tokens=10,
        eos_token_ids=[eos],
        pad_token_id=pad,
        processors=LogitsProcessorList([FavourEos(eos)]),
        logp_temperature=0.8,
        uniforms=lambda rows, t: keyed_uniform(keys[rows], t, 1).squeeze(1),
    )
    from_static = static.sample(model, ids, mask, graphs=False, window_block=4, check_every=3, **kwargs)
    from_dynamic = dynamic.sample(model, ids, mask, cache=prefill_shared_prompts(model, ids, mask), **kwargs)
    assert torch.equal(from_static.completion_ids, from_dynamic.completion_ids)
    completion_mask, _ = completion_mask_from_eos(from_static.completion_ids, [eos])
    scored = completion_logprobs(
        model,
        torch.cat([ids, from_static.completion_ids], dim=1),
        torch.cat([mask, completion_mask], dim=1),
        from_static.completion_ids,
        completion_mask,
        temperature=0.8,
    ).logps
    torch.testing.assert_close(from_static.logps, scored, atol=1e-5, rtol=0)

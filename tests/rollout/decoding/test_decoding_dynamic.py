"""gspo_trl.rollout.decoding.dynamic: the sampler, the logits processors against `generate`'s, and the loop against a
one-row, no-cache reference decoder (finished rows leave the batch; nothing else changes)."""

from __future__ import annotations

import pytest
import torch
from helpers import frequency_tolerance
from transformers import DynamicCache, GenerationConfig, LogitsProcessor, LogitsProcessorList
from transformers.cache_utils import DynamicLayer

from gspo_trl import GSPOConfig
from gspo_trl.rollout import HFGenerateBackend, keyed_uniform, stream_keys
from gspo_trl.rollout.decoding import dynamic
from gspo_trl.rollout.decoding.dynamic import (
    PreallocatedLayer,
    drop_rows,
    inverse_cdf_sample,
    logits_processors,
    only_scales,
    sample,
    supports,
    token_logps,
    unsupported_settings,
)
from gspo_trl.rollout.decoding.prefix_sharing import prefill_shared_prefixes, prefill_shared_prompts
from gspo_trl.rollout.decoding.truncation import policy_logps

SETTINGS = dict(temperature=0.7, top_k=40, top_p=0.9, min_p=0.02, repetition_penalty=1.3)


@pytest.mark.parametrize("block", [256, 3, 2])  # one block; blocks with padding; a block of zero mass
def test_inverse_cdf_sample_by_hand(block):
    probs = torch.tensor([[0.0, 0.5, 0.25, 0.25]]).expand(5, 4)
    scores = probs.log()  # -inf for the impossible token 0
    uniforms = torch.tensor([0.0, 0.4999, 0.5001, 0.7499, 0.9999999])
    # token 0 is never drawn, even at u = 0
    assert inverse_cdf_sample(scores, uniforms, block=block).tolist() == [1, 1, 2, 2, 3]
    zero_block = torch.tensor([[0.0, 0.0, 0.5, 0.5]]).log().expand(2, 4)
    assert inverse_cdf_sample(zero_block, torch.tensor([0.0, 0.9999]), block=2).tolist() == [2, 3]


@pytest.mark.parametrize("block", [256, 2])
def test_inverse_cdf_sample_frequencies_match_the_probabilities(block):
    torch.manual_seed(0)
    rows = 200_000
    logits = torch.tensor([1.0, 0.0, -1.0, 2.0, float("-inf")])
    tokens = inverse_cdf_sample(logits.expand(rows, 5), torch.rand(rows, dtype=torch.float64), block=block)
    frequencies = torch.bincount(tokens, minlength=5).double() / rows
    expected = torch.softmax(logits.double(), 0)
    # 0.005 is 4.7 standard errors sqrt(p (1 - p) / rows) of the likeliest token's frequency (p = 0.64) and 5.3 or
    # more of the others': a random seed fails it with probability 3e-6 per case (normal tails, exact enough at these
    # counts). The seed is fixed and torch's CPU generator gives the same uniforms on every machine.
    torch.testing.assert_close(frequencies, expected, atol=0.005, rtol=0)
    assert frequencies[4] == 0


def test_supports_only_what_the_loop_implements():
    base = dict(do_sample=True, max_new_tokens=8, **SETTINGS)
    assert supports(GenerationConfig(**base, eos_token_id=2, pad_token_id=3))
    assert not supports(GenerationConfig(**{**base, "do_sample": False}))
    assert not supports(GenerationConfig(**base, no_repeat_ngram_size=2))
    assert not supports(GenerationConfig(**base, suppress_tokens=[5]))
    assert not supports(GenerationConfig(**base, cache_implementation="static"))
    assert unsupported_settings(GenerationConfig(**base, no_repeat_ngram_size=2, suppress_tokens=[5])) == [
        "no_repeat_ngram_size",
        "suppress_tokens",
    ]


def test_settings_the_loop_lacks_fall_back_to_generate_with_a_warning(tmp_path, tiny_model, tiny_tokenizer, caplog):
    with caplog.at_level("WARNING"):
        backend = HFGenerateBackend(
            lambda: tiny_model,
            tiny_tokenizer,
            GSPOConfig(output_dir=str(tmp_path), use_cpu=True, generation_kwargs={"no_repeat_ngram_size": 2}),
        )
    assert not backend.use_decode_loop
    assert "does not implement no_repeat_ngram_size" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING"):  # asking for generate is not worth a warning
        backend = HFGenerateBackend(
            lambda: tiny_model,
            tiny_tokenizer,
            GSPOConfig(output_dir=str(tmp_path), use_cpu=True, decode_loop="generate"),
        )
    assert not backend.use_decode_loop and "does not implement" not in caplog.text
    with pytest.raises(ValueError, match="decode_loop must be one of"):
        GSPOConfig(output_dir=str(tmp_path), use_cpu=True, decode_loop="vllm")


@pytest.mark.parametrize("settings", [{}, SETTINGS], ids=["plain", "all_warpers"])
def test_processed_scores_equal_generates(tiny_model, tiny_tokenizer, settings):
    # generate's own processed scores (output_scores) for two steps; ours applied to the same ids and logits.
    config = GenerationConfig(
        do_sample=True,
        max_new_tokens=2,
        eos_token_id=tiny_tokenizer.eos_token_id,
        pad_token_id=tiny_tokenizer.pad_token_id,
        **settings,
    )
    prompt = tiny_tokenizer(["What is 2 + 3? What is"], return_tensors="pt")
    torch.manual_seed(0)
    out = tiny_model.generate(**prompt, generation_config=config, output_scores=True, return_dict_in_generate=True)
    processors = logits_processors(config)
    for step, expected in enumerate(out.scores):
        ids = out.sequences[:, : prompt.input_ids.shape[1] + step]
        logits = tiny_model(input_ids=ids).logits[:, -1, :]
        torch.testing.assert_close(processors(ids, logits.float()), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.slow  # thousands of samples
def test_first_token_frequencies_match_generate(tmp_path, tiny_model, tiny_tokenizer):
    # One prompt, many rows: the first token's distribution is fixed. Both samplers' frequencies must match the
    # probabilities generate samples from (softmax of its processed scores).
    rows = 6000
    args = GSPOConfig(output_dir=str(tmp_path), max_completion_length=1, use_cpu=True, **SETTINGS)
    backend = HFGenerateBackend(lambda: tiny_model, tiny_tokenizer, args)
    assert backend.use_decode_loop
    prompt = tiny_tokenizer(["What is 2 + 3? What is"], return_tensors="pt")
    torch.manual_seed(0)
    scored = tiny_model.generate(
        **prompt, generation_config=backend.generation_config, output_scores=True, return_dict_in_generate=True
    )
    probs = torch.softmax(scored.scores[0][0].double(), 0)  # (V,)
    assert (probs > 0).sum() > 3  # the warpers leave several tokens

    def frequencies(completion_ids):
        return torch.bincount(completion_ids[:, 0], minlength=probs.numel()).double() / rows

    torch.manual_seed(1)
    ours = frequencies(backend.generate(["What is 2 + 3? What is"] * rows).completion_ids)
    backend.use_decode_loop = False
    torch.manual_seed(2)
    theirs = frequencies(backend.generate(["What is 2 + 3? What is"] * rows).completion_ids)
    # Two samplers, each with every kept token's frequency within a bound that a correct sampler exceeds anywhere
    # with probability 5e-5 (Bernstein, a union bound over the tokens): 1e-4 for the test, about 5.4 standard errors
    # per token here. An error in the warpers moves a probability by far more.
    tolerance = frequency_tolerance(probs, rows, failure_rate=5e-5)
    assert ((ours - probs).abs() <= tolerance).all() and ((theirs - probs).abs() <= tolerance).all()
    assert ours[probs == 0].sum() == 0


class FavourEos(LogitsProcessor):
    """Raises the EOS logit so that rows finish at different steps (a random tiny model rarely ends)."""

    def __init__(self, eos):
        self.eos = eos

    def __call__(self, input_ids, scores):
        scores = scores.clone()
        scores[:, self.eos] += 2.5
        return scores


def reference_decode(model, prompt_ids, processors, key, max_new_tokens, eos):
    """One row, no KV cache, no padding: the whole sequence re-run at every step."""
    ids = prompt_ids.unsqueeze(0)
    out = []
    for t in range(max_new_tokens):
        logits = model(input_ids=ids).logits[:, -1, :]
        token = inverse_cdf_sample(processors(ids, logits.float()), keyed_uniform(key.view(1), t, 1).squeeze(1))
        out.append(int(token))
        ids = torch.cat([ids, token.view(1, 1)], dim=1)
        if int(token) == eos:
            break
    return out


@pytest.mark.parametrize("prefill", ["shared prompts", "shared prefixes", "none"])
def test_loop_samples_what_a_one_row_reference_samples(tiny_model, tiny_tokenizer, prefill):
    eos, pad = tiny_tokenizer.eos_token_id, tiny_tokenizer.pad_token_id
    prompts = ["What is 2 + 3?"] * 4 + ["Hi there"] * 4 + ["Solve: 7 - 4"] * 4
    if prefill == "shared prefixes":  # later turns of episodes: a group's prompt, then each row's own tokens
        prompts = [prompt + " ok" * (row % 3) + " Again?" * (row % 2) for row, prompt in enumerate(prompts)]
    encoded = tiny_tokenizer(prompts, return_tensors="pt", padding=True, padding_side="left")
    keys = stream_keys(3, torch.arange(len(prompts)))
    processors = LogitsProcessorList([FavourEos(eos), *logits_processors(GenerationConfig(do_sample=True, **SETTINGS))])

    batch_sizes = []
    hook = tiny_model.model.embed_tokens.register_forward_hook(lambda m, i, o: batch_sizes.append(o.shape[0]))
    ids, mask, cache = encoded.input_ids, encoded.attention_mask, None
    try:
        if prefill == "shared prompts":
            cache = prefill_shared_prompts(tiny_model, ids, mask)
        elif prefill == "shared prefixes":  # a layout with gaps between each row's prefix and its tail
            rows = [row_ids[row_mask.bool()].tolist() for row_ids, row_mask in zip(ids, mask)]
            ids, mask, cache = prefill_shared_prefixes(tiny_model, rows, pad)
            assert (mask[:, :-1].diff(dim=1) < 0).any()
            assert batch_sizes == [3, len(prompts)]  # each question's prefix once, then every row's tail
            batch_sizes = batch_sizes[1:]  # the tails' forward stays first, as the prefill
        completions = sample(
            tiny_model,
            ids,
            mask,
            max_new_tokens=10,
            eos_token_ids=[eos],
            pad_token_id=pad,
            processors=processors,
            uniforms=lambda rows, t: keyed_uniform(keys[rows], t, 1).squeeze(1),
            cache=cache,
            history=encoded.input_ids,
        ).completion_ids
    finally:
        hook.remove()
    lengths = []
    for row, prompt in enumerate(prompts):
        expected = reference_decode(
            tiny_model, torch.tensor(tiny_tokenizer(prompt).input_ids), processors, keys[row], 10, eos
        )
        got = completions[row].tolist()
        assert got[: len(expected)] == expected, row
        assert all(token == pad for token in got[len(expected) :])
        lengths.append(len(expected))
    assert completions.shape[1] == max(lengths)
    assert len(set(lengths)) > 2  # rows finished at different steps ...
    decode_steps = batch_sizes if prefill == "none" else batch_sizes[1:]
    assert decode_steps[0] == len(prompts)
    # ... and each decoding step ran only the rows still unfinished.
    assert decode_steps == [sum(length > t for length in lengths) for t in range(max(lengths))]


def test_preallocated_layer_holds_what_a_dynamic_layer_holds_and_grows_by_doubling(monkeypatch):
    monkeypatch.setattr(dynamic, "INITIAL_ROOM", 2)
    torch.manual_seed(0)
    keys, values = torch.randn(3, 2, 5, 4), torch.randn(3, 2, 5, 4)  # (rows, heads, prompt positions, dim)
    reference, seed = DynamicLayer(), DynamicLayer()
    reference.update(keys, values)
    seed.update(keys, values)
    layer = PreallocatedLayer.from_layer(seed, capacity=20)
    sizes = [layer.key_buffer.shape[-2]]
    for step in range(20):
        new_keys, new_values = torch.randn(len(layer.keys), 2, 1, 4), torch.randn(len(layer.keys), 2, 1, 4)
        expected, got = reference.update(new_keys, new_values), layer.update(new_keys, new_values)
        assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
        sizes.append(layer.key_buffer.shape[-2])
        if step == 8:  # a row finishes and leaves the batch
            kept = torch.tensor([2, 0])
            reference.keys, reference.values = reference.keys[kept], reference.values[kept]
            layer.reorder_cache(kept)
            assert torch.equal(layer.keys, reference.keys) and torch.equal(layer.values, reference.values)
    assert layer.keys.shape == (2, 2, 25, 4)
    # 5 prompt positions + 2 of room, then doubling up to the capacity of 20, then one at a time past it.
    assert sorted(set(sizes)) == [7, 14, 20, 21, 22, 23, 24, 25]


@pytest.mark.parametrize(
    "finished, keep",
    [
        ([0, 1, 0, 1, 0, 0], [0, 4, 2, 5]),  # the last rows fill the finished rows' slots
        ([0, 0, 1, 1], [0, 1]),  # finished rows at the end: nothing moves
        ([1, 1, 0, 1], [2]),
    ],
)
def test_drop_rows_moves_only_the_rows_past_the_new_batch(finished, keep):
    torch.manual_seed(0)
    n = len(finished)
    keys, values = torch.randn(n, 2, 5, 4), torch.randn(n, 2, 5, 4)
    cache = DynamicCache()
    cache.update(keys, values, 0)
    cache.update(keys + 1, values + 1, 1)
    cache.layers[0] = PreallocatedLayer.from_layer(cache.layers[0], capacity=9)  # the other layer stays dynamic
    buffer = cache.layers[0].key_buffer
    got = drop_rows(cache, torch.tensor(finished, dtype=torch.bool))
    assert got.tolist() == keep
    for layer, shift in zip(cache.layers, (0, 1)):
        assert torch.equal(layer.keys, keys[got] + shift) and torch.equal(layer.values, values[got] + shift)
    assert cache.layers[0].key_buffer.data_ptr() == buffer.data_ptr()  # in place, no new buffer
    step = torch.randn(len(keep), 2, 1, 4)
    updated_keys, _ = cache.layers[0].update(step, step)  # the next step writes after the kept rows' tokens
    assert torch.equal(updated_keys, torch.cat([keys[got], step], dim=2))


def test_loop_samples_the_same_whatever_room_the_cache_starts_with(tiny_model, tiny_tokenizer, monkeypatch):
    eos, pad = tiny_tokenizer.eos_token_id, tiny_tokenizer.pad_token_id
    encoded = tiny_tokenizer(["What is 2 + 3?", "Hi there"] * 3, return_tensors="pt", padding=True, padding_side="left")
    keys = stream_keys(5, torch.arange(6))
    processors = LogitsProcessorList([FavourEos(eos), *logits_processors(GenerationConfig(do_sample=True, **SETTINGS))])

    def run():
        return sample(
            tiny_model,
            encoded.input_ids,
            encoded.attention_mask,
            max_new_tokens=24,
            eos_token_ids=[eos],
            pad_token_id=pad,
            processors=processors,
            uniforms=lambda rows, t: keyed_uniform(keys[rows], t, 1).squeeze(1),
        ).completion_ids

    roomy = run()
    monkeypatch.setattr(dynamic, "INITIAL_ROOM", 1)  # a growth at the first step and then at every doubling
    assert torch.equal(run(), roomy)


def test_token_logps_by_hand():
    logits = torch.tensor([[0.0, torch.log(torch.tensor(3.0))], [5.0, 5.0]])  # softmax: (1/4, 3/4), (1/2, 1/2)
    tokens = torch.tensor([1, 0])
    torch.testing.assert_close(token_logps(logits, tokens, 1.0), torch.tensor([0.75, 0.5]).log())
    # temperature 2 halves the logits: (1, √3) / (1 + √3) for the first row
    root3 = torch.tensor(3.0).sqrt()
    torch.testing.assert_close(
        token_logps(logits, tokens, 2.0), torch.stack([(root3 / (1 + root3)).log(), torch.tensor(0.5).log()])
    )


def test_sampling_weights_give_the_token_logps():
    # with_logps: the same draws, and log softmax(scores) at them from the sampling weights' total
    torch.manual_seed(0)
    scores = torch.randn(6, 1000) * 4
    scores[0, :500] = float("-inf")  # a row with a block of zero mass
    uniforms = torch.rand(6, dtype=torch.float64)
    tokens, logps = inverse_cdf_sample(scores, uniforms, with_logps=True)
    assert torch.equal(tokens, inverse_cdf_sample(scores, uniforms))
    assert logps.dtype == torch.float32
    torch.testing.assert_close(logps, token_logps(scores, tokens, 1.0), atol=1e-5, rtol=0)


def test_only_scales_is_true_for_temperature_alone():
    def processors(**settings):
        return logits_processors(GenerationConfig(do_sample=True, **settings))

    assert only_scales(processors(temperature=1.0, top_k=0, top_p=1.0), 1.0)
    assert not only_scales(processors(temperature=1.0, top_k=0, top_p=1.0), 0.7)
    assert only_scales(processors(temperature=0.7, top_k=0, top_p=1.0), 0.7)
    assert not only_scales(processors(temperature=0.7, top_k=0, top_p=1.0), 1.0)
    assert not only_scales(processors(temperature=0.7, top_k=40), 0.7)
    assert not only_scales(processors(temperature=1.0, top_k=0, repetition_penalty=1.3), 1.0)


@pytest.mark.parametrize("prefill", ["prompt", "shared prefixes"])
@pytest.mark.parametrize("settings", ["sampling settings", "temperature alone"])
def test_recorded_logps_are_the_policy_logps_training_computes(tiny_model, tiny_tokenizer, prefill, settings):
    # What decode_logprobs_as_old takes as π_old: each sampled token's log-prob under softmax(logits / T), the
    # distribution training scores (`completion_logprobs`); 0 after a row's end. Where top-k / top-p / min-p cut the
    # distribution, the loop records the truncated, renormalised log-probs it drew with and the kept log-mass, and
    # π_old is their sum (`truncation.policy_logps`). Equal to a training forward up to float32 rounding. With the
    # temperature alone, the loop takes the normaliser from its sampling weights (`only_scales`) and cuts nothing;
    # rows then end at any of a twentieth of the vocabulary's ids.
    from gspo_trl.rollout import completion_mask_from_eos
    from gspo_trl.training.logprobs import completion_logprobs

    eos, pad = tiny_tokenizer.eos_token_id, tiny_tokenizer.pad_token_id
    ends, processors = (
        [eos],
        LogitsProcessorList([FavourEos(eos), *logits_processors(GenerationConfig(do_sample=True, **SETTINGS))]),
    )
    if settings == "temperature alone":
        ends = [eos] + list(range(3, tiny_model.config.vocab_size, 20))
        processors = logits_processors(
            GenerationConfig(do_sample=True, temperature=SETTINGS["temperature"], top_k=0, top_p=1.0)
        )
        assert only_scales(processors, SETTINGS["temperature"])
    encoded = tiny_tokenizer(
        ["What is 2 + 3?", "Hi there", "Solve: 7 - 4"] * 2, return_tensors="pt", padding=True, padding_side="left"
    )
    ids, mask, cache = encoded.input_ids, encoded.attention_mask, None
    if prefill == "shared prefixes":
        rows = [row_ids[row_mask.bool()].tolist() for row_ids, row_mask in zip(ids, mask)]
        ids, mask, cache = prefill_shared_prefixes(tiny_model, rows, pad)
    torch.manual_seed(0)
    decoded = sample(
        tiny_model,
        ids,
        mask,
        max_new_tokens=16,
        eos_token_ids=ends,
        pad_token_id=pad,
        cache=cache,
        processors=processors,
        history=encoded.input_ids,
        logp_temperature=SETTINGS["temperature"],
    )
    completions, logps = decoded.completion_ids, policy_logps(decoded.logps, decoded.kept_log_mass)
    completion_mask, _ = completion_mask_from_eos(completions, ends)
    if settings == "temperature alone":
        assert decoded.kept_log_mass is None
    else:  # top_k=40 of a ~400-token vocabulary cuts mass at every step; nothing after a row's end
        assert (decoded.kept_log_mass[completion_mask == 1] < 0).all()
        assert (decoded.kept_log_mass[completion_mask == 0] == 0).all()
        assert (decoded.logps[completion_mask == 1] > logps[completion_mask == 1]).all()  # log μ > log p on kept
    assert logps.shape == completions.shape and 0 < completion_mask.sum() < completion_mask.numel()  # rows end early
    assert (logps[completion_mask == 0] == 0).all()
    scored = completion_logprobs(
        tiny_model,
        torch.cat([encoded.input_ids, completions], dim=1),
        torch.cat([encoded.attention_mask, completion_mask], dim=1),
        completions,
        completion_mask,
        temperature=SETTINGS["temperature"],
    ).logps
    valid = completion_mask.bool()
    torch.testing.assert_close(logps[valid], scored[valid], atol=2e-5, rtol=0)
    assert (logps[valid] < 0).all()


def test_the_loop_records_no_logps_unless_asked(tiny_model, tiny_tokenizer):
    encoded = tiny_tokenizer(["Hi there"], return_tensors="pt")
    decoded = sample(
        tiny_model,
        encoded.input_ids,
        encoded.attention_mask,
        max_new_tokens=3,
        eos_token_ids=[tiny_tokenizer.eos_token_id],
        pad_token_id=tiny_tokenizer.pad_token_id,
        processors=LogitsProcessorList(),
    )
    assert decoded.logps is None and decoded.states is None and decoded.completion_ids.shape[0] == 1

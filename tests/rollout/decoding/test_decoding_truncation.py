"""gspo_trl.rollout.decoding.truncation: the mass top-k / top-p / min-p keep and the log-probs the sampler draws with,
on a
hand-built distribution; the correction weight π_old / μ those give equals the kept mass; both decoding loops record
the same truncated log-probs; without truncation nothing changes."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import GenerationConfig, LogitsProcessorList
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from gspo_trl.objective.sampling_correction import sampling_correction
from gspo_trl.rollout import completion_mask_from_eos, keyed_uniform, stream_keys
from gspo_trl.rollout.decoding import dynamic, static
from gspo_trl.rollout.decoding.prefix_sharing import prefill_shared_prompts
from gspo_trl.rollout.decoding.truncation import (
    kept_log_mass,
    policy_logps,
    truncated_at,
    truncated_logps,
    truncated_mass,
    truncates,
)
from gspo_trl.training.logprobs import completion_logprobs

# p = (1/2, 1/4, 1/8, 1/8): top-p 0.7 keeps {0, 1} (the smallest set holding ≥ 0.7: 0.75), top-k 1 keeps {0} (0.5),
# min-p 0.3 keeps the tokens with p ≥ 0.3 × 1/2 = 0.15, {0, 1} (0.75).
PROBS = torch.tensor([[0.5, 0.25, 0.125, 0.125]])
CASES = [
    (TopPLogitsWarper(top_p=0.7), [True, True, False, False], 0.75),
    (TopKLogitsWarper(top_k=1), [True, False, False, False], 0.5),
    (MinPLogitsWarper(min_p=0.3), [True, True, False, False], 0.75),
]


@pytest.mark.parametrize("warper, kept, mass", CASES)
@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_kept_mass_and_renormalised_logps_by_hand(warper, kept, mass, temperature):
    # Logits T·log p: after dividing by T the policy is exactly PROBS. float32 logs of powers of two and of 3/4: the
    # bound 1e-6 is a few ulp of the values (all below 3 in magnitude).
    logits = temperature * PROBS.log()
    scaled = logits / temperature
    scores = warper(torch.zeros((1, 1), dtype=torch.long), TemperatureLogitsWarper(temperature)(None, logits.clone()))
    assert torch.isfinite(scores[0]).tolist() == kept
    log_mass = kept_log_mass(scaled, scores)
    torch.testing.assert_close(log_mass, torch.tensor([math.log(mass)]), atol=1e-6, rtol=0)
    # μ(0) = p(0) / Z: 1/2 / 3/4 = 2/3 under top-p and min-p, 1 under top-k.
    sampled = truncated_logps(PROBS[:, 0].log(), log_mass)
    torch.testing.assert_close(sampled, torch.tensor([math.log(0.5 / mass)]), atol=1e-6, rtol=0)
    torch.testing.assert_close(policy_logps(sampled, log_mass), PROBS[:, 0].log(), atol=1e-6, rtol=0)
    # The sampler's own distribution: log_softmax of the scores it drew from.
    torch.testing.assert_close(sampled, torch.log_softmax(scores, dim=-1)[:, 0], atol=1e-6, rtol=0)


def test_nothing_cut_is_a_kept_mass_of_one_and_leaves_the_logps_alone():
    scaled = PROBS.log()
    assert kept_log_mass(scaled, scaled).item() == 0.0  # clamped: rounding cannot make it positive
    logps = torch.tensor([[-0.5, -1.25]])
    assert policy_logps(logps, None) is logps  # bit for bit: the very tensor
    assert not truncates(LogitsProcessorList([TemperatureLogitsWarper(0.7), RepetitionPenaltyLogitsProcessor(1.3)]))
    assert truncates(dynamic.logits_processors(GenerationConfig(do_sample=True, top_p=0.9, top_k=0)))
    assert truncates(dynamic.logits_processors(GenerationConfig(do_sample=True, top_k=5, top_p=1.0)))
    assert truncates(dynamic.logits_processors(GenerationConfig(do_sample=True, top_k=0, top_p=1.0, min_p=0.1)))
    assert not truncates(dynamic.logits_processors(GenerationConfig(do_sample=True, top_k=0, top_p=1.0)))
    # The temperature the kept mass is measured at: the recorded log-probs', else the processors' own, else 1.
    warped = dynamic.logits_processors(GenerationConfig(do_sample=True, temperature=0.7, top_k=5, top_p=1.0))
    assert (truncated_at(warped, 0.9), truncated_at(warped), truncated_at(LogitsProcessorList([CASES[0][0]]))) == (
        0.9,
        0.7,
        1.0,
    )
    assert truncated_at(LogitsProcessorList([TemperatureLogitsWarper(0.7)]), 0.7) is None


def test_truncated_mass_is_the_mean_cut_over_masked_tokens():
    log_mass = torch.tensor([[math.log(0.75), math.log(0.5), 0.0], [0.0, math.log(0.9), -7.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]])
    # (0.25 + 0.5 + 0 + 0.1) / 4; the third column (padding) is left out. float32: 1e-6 covers expm1's rounding.
    torch.testing.assert_close(truncated_mass(log_mass, mask), torch.tensor(0.85 / 4), atol=1e-6, rtol=0)
    assert truncated_mass(log_mass, torch.zeros_like(mask)).item() == 0.0


@pytest.mark.parametrize("warper, kept, mass", CASES[:2])  # top-p 0.7 (Z = 3/4) and top-k 1 (Z = 1/2)
def test_the_correction_weight_is_the_kept_mass(warper, kept, mass):
    # π_old = p, the sampler μ = p / Z on the kept tokens: w = π_old / μ = Z per token, and the sequence weight (the
    # geometric mean over tokens) of steps that kept 3/4 and 1/2 is sqrt(3/8). The tokens are drawn by `draw` from
    # PROBS at two steps: the first step under the warper, the second under top-k 1 (Z = 1/2).
    logits = PROBS.log().expand(2, 4).clone()
    first = LogitsProcessorList([warper])
    second = LogitsProcessorList([TopKLogitsWarper(top_k=1)])
    steps = []
    for processors in (first, second):
        scores = processors(None, logits.clone())
        tokens, logps, log_mass = dynamic.draw(
            scores, logits, torch.tensor([0.1, 0.6]), 1.0, False, truncated_at(processors, 1.0)
        )
        assert torch.isfinite(scores.gather(1, tokens.unsqueeze(1))).all()  # drawn from the kept set
        steps.append((tokens, logps, log_mass))
    old = torch.stack([PROBS[0].log()[tokens] for tokens, _, _ in steps], dim=1)  # (2, 2) log p of the drawn tokens
    sampling = torch.stack([logps for _, logps, _ in steps], dim=1)  # (2, 2) log μ
    mask = torch.ones((2, 2))
    weights, stats = sampling_correction(old, sampling, mask, "token_truncate", None, None)
    expected = torch.tensor([[mass, 0.5], [mass, 0.5]])
    torch.testing.assert_close(weights, expected, atol=1e-6, rtol=0)  # float32 exp of exact logs: a few ulp
    sequence_weights, _ = sampling_correction(old, sampling, mask, "sequence_truncate", None, None)
    torch.testing.assert_close(sequence_weights, torch.full((2, 2), math.sqrt(mass * 0.5)), atol=1e-6, rtol=0)
    torch.testing.assert_close(
        torch.stack([log_mass for _, _, log_mass in steps], dim=1).exp(), expected, atol=1e-6, rtol=0
    )


def test_draw_without_truncation_is_unchanged():
    # top_p=1, top_k=0, min_p=None: the same tokens and log-probs as the policy's, no kept mass (bit for bit).
    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    processors = LogitsProcessorList([TemperatureLogitsWarper(0.7), RepetitionPenaltyLogitsProcessor(1.3)])
    history = torch.randint(0, 50, (3, 4))
    scores = processors(history, logits.clone())
    uniforms = torch.rand(3, dtype=torch.float64)
    tokens, logps, log_mass = dynamic.draw(scores, logits, uniforms, 0.7, False, truncated_at(processors, 0.7))
    assert log_mass is None
    assert torch.equal(tokens, dynamic.inverse_cdf_sample(scores, uniforms))
    assert torch.equal(logps, dynamic.token_logps(logits, tokens, 0.7))


@pytest.mark.parametrize("settings", [dict(top_p=0.8, top_k=0), dict(top_k=20, top_p=1.0), dict(top_k=0, min_p=0.5)])
def test_both_loops_record_the_truncated_logps_and_the_weight_is_the_kept_mass(tiny_model, tiny_tokenizer, settings):
    # The tiny random model is near uniform: min-p 0.5 (of the top token's probability) is what cuts some of it.
    # The static loop (eagerly on CPU, as on a GPU without graphs) and the dynamic one draw the same tokens and
    # record the same log μ and log Z; a scoring forward's π_old over the loop's log μ is Z, token by token.
    eos, pad = tiny_tokenizer.eos_token_id, tiny_tokenizer.pad_token_id
    prompts = ["What is 2 + 3?", "Hi there", "Solve: 7 - 4"] * 2
    encoded = tiny_tokenizer(prompts, return_tensors="pt", padding=True, padding_side="left")
    ids, mask = encoded.input_ids, encoded.attention_mask
    keys = stream_keys(23, torch.arange(len(prompts)))
    ends = [eos] + list(range(3, tiny_model.config.vocab_size, 20))  # rows end at different lengths
    processors = dynamic.logits_processors(GenerationConfig(do_sample=True, temperature=0.8, **settings))
    kwargs = dict(
        max_new_tokens=8,
        eos_token_ids=ends,
        pad_token_id=pad,
        processors=processors,
        logp_temperature=0.8,
        uniforms=lambda rows, t: keyed_uniform(keys[rows], t, 1).squeeze(1),
    )
    from_static = static.sample(tiny_model, ids, mask, graphs=False, window_block=4, check_every=3, **kwargs)
    from_dynamic = dynamic.sample(tiny_model, ids, mask, cache=prefill_shared_prompts(tiny_model, ids, mask), **kwargs)
    assert torch.equal(from_static.completion_ids, from_dynamic.completion_ids)
    completion_mask, _ = completion_mask_from_eos(from_static.completion_ids, ends)
    valid = completion_mask.bool()
    assert 0 < int(valid.sum()) < valid.numel()
    for decoded in (from_static, from_dynamic):
        assert (decoded.kept_log_mass[~valid] == 0).all() and (decoded.kept_log_mass[valid] <= 0).all()
        assert (decoded.kept_log_mass[valid] < 0).any()
    # The two loops' logits differ by float32 rounding of their attention (1e-5 bounds it, as for their log-probs).
    torch.testing.assert_close(from_static.logps, from_dynamic.logps, atol=1e-5, rtol=0)
    torch.testing.assert_close(from_static.kept_log_mass, from_dynamic.kept_log_mass, atol=1e-5, rtol=0)
    old = completion_logprobs(
        tiny_model,
        torch.cat([ids, from_static.completion_ids], dim=1),
        torch.cat([mask, completion_mask], dim=1),
        from_static.completion_ids,
        completion_mask,
        temperature=0.8,
    ).logps
    weights, _ = sampling_correction(old, from_static.logps, completion_mask, "token_truncate", None, None)
    # log w − log Z = log p_forward − log p_loop, ≤ 2e-5 (the loop and a training forward agree to float32 rounding,
    # test_decoding_dynamic); w ≤ 1, so the same bound holds for w − Z up to a factor e^2e-5.
    torch.testing.assert_close(weights[valid], from_static.kept_log_mass.exp()[valid], atol=3e-5, rtol=0)

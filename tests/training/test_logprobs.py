"""completion_logprobs against a plain full-logits reference, with and without gradients."""

from __future__ import annotations

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from gspo_trl.training import logprobs
from gspo_trl.training.logprobs import completion_logprobs


def reference_logps(model, input_ids, attention_mask, completion_ids, completion_mask, temperature):
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits.float()
    length = completion_ids.shape[1]
    logps = (logits[:, -length - 1 : -1] / temperature).log_softmax(-1)
    return logps.gather(-1, completion_ids.unsqueeze(-1)).squeeze(-1) * completion_mask


def batch(vocab_size):
    torch.manual_seed(0)
    input_ids = torch.randint(5, vocab_size, (3, 14))
    attention_mask = torch.ones_like(input_ids)
    attention_mask[0, :4] = 0  # left padding in the prompt
    completion_ids = input_ids[:, -6:]
    completion_mask = torch.ones_like(completion_ids)
    completion_mask[1, 2:] = 0  # an early EOS
    completion_mask[2] = 0  # a fully masked row
    return input_ids, attention_mask, completion_ids, completion_mask


def test_matches_full_logits_for_every_chunk_size(tiny_model):
    inputs = batch(tiny_model.config.vocab_size)
    expected = reference_logps(tiny_model, *inputs, temperature=0.7)
    for chunk_size in (1, 3, 1024):
        logps, entropy, _ = completion_logprobs(tiny_model, *inputs, temperature=0.7, chunk_size=chunk_size)
        torch.testing.assert_close(logps, expected, atol=1e-5, rtol=1e-5)
        assert (entropy[inputs[3] == 0] == 0).all() and (entropy[inputs[3] == 1] > 0).all()


# Chunks of 2 scored tokens (8 in all, so 4 chunks): every chunk recomputed in backward, the first one's logits
# kept, or all of them kept.
@pytest.mark.parametrize("kept_chunks", [0, 1, 4])
def test_gradient_matches_full_logits(tiny_model, monkeypatch, kept_chunks):
    inputs = batch(tiny_model.config.vocab_size)
    weights = torch.randn(inputs[2].shape)
    (reference_logps(tiny_model, *inputs, temperature=1.0) * weights).sum().backward()
    expected = {n: p.grad.clone() for n, p in tiny_model.named_parameters()}
    tiny_model.zero_grad()
    checkpointed = []

    def counting_checkpoint(function, *args, **kwargs):
        checkpointed.append(args[0].shape[0])
        return checkpoint(function, *args, **kwargs)

    monkeypatch.setattr(logprobs, "checkpoint", counting_checkpoint)
    kept_mb = kept_chunks * 2 * 4 * tiny_model.config.vocab_size / 2**20  # fp32 logits of kept_chunks chunks of 2
    logps, _, _ = completion_logprobs(tiny_model, *inputs, chunk_size=2, kept_logits_mb=kept_mb)
    (logps * weights).sum().backward()
    assert checkpointed == [2, 2, 2, 2][kept_chunks:]
    for name, parameter in tiny_model.named_parameters():
        torch.testing.assert_close(parameter.grad, expected[name], atol=1e-5, rtol=1e-4, msg=name)


def test_no_chunk_is_checkpointed_without_gradients(tiny_model, monkeypatch):
    monkeypatch.setattr(logprobs, "checkpoint", lambda *args, **kwargs: pytest.fail("checkpointed without grad"))
    with torch.no_grad():
        completion_logprobs(tiny_model, *batch(tiny_model.config.vocab_size), chunk_size=2, kept_logits_mb=0)


def test_entropy_is_the_distribution_entropy(tiny_model):
    inputs = batch(tiny_model.config.vocab_size)
    _, entropy, _ = completion_logprobs(tiny_model, *inputs)
    logits = tiny_model(input_ids=inputs[0], attention_mask=inputs[1]).logits[:, -7:-1].float()
    expected = -(logits.softmax(-1) * logits.log_softmax(-1)).sum(-1) * inputs[3]
    torch.testing.assert_close(entropy, expected.detach(), atol=1e-4, rtol=1e-4)


def test_entropy_gradient_matches_full_logits_when_asked_for(tiny_model):
    inputs = batch(tiny_model.config.vocab_size)
    _, entropy, _ = completion_logprobs(tiny_model, *inputs, chunk_size=2)
    assert not entropy.requires_grad  # by default entropies are for logging only
    logits = tiny_model(input_ids=inputs[0], attention_mask=inputs[1]).logits[:, -7:-1].float() / 0.9
    (-(logits.softmax(-1) * logits.log_softmax(-1)).sum(-1) * inputs[3]).sum().backward()
    expected = {n: p.grad.clone() for n, p in tiny_model.named_parameters()}
    tiny_model.zero_grad()
    _, entropy, _ = completion_logprobs(tiny_model, *inputs, temperature=0.9, chunk_size=2, entropy_grad=True)
    entropy.sum().backward()
    for name, parameter in tiny_model.named_parameters():
        torch.testing.assert_close(parameter.grad, expected[name], atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize("padding_free", [False, True])
def test_only_the_last_hidden_state_is_requested_with_or_without_grad(tiny_model, padding_free):
    inputs = batch(tiny_model.config.vocab_size)
    expected = reference_logps(tiny_model, *inputs, temperature=1.0).detach()
    forward, calls = tiny_model.forward, []
    tiny_model.forward = lambda *args, **kwargs: calls.append(kwargs) or forward(*args, **kwargs)
    try:
        with_grad, _, _ = completion_logprobs(tiny_model, *inputs, padding_free=padding_free)
        with torch.no_grad():
            without, _, _ = completion_logprobs(tiny_model, *inputs, padding_free=padding_free)
    finally:
        tiny_model.forward = forward
    assert len(calls) == 2 and not any(call.get("output_hidden_states") for call in calls)
    assert all(call["logits_to_keep"] == 1 for call in calls)
    torch.testing.assert_close(with_grad.detach(), expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(without, with_grad.detach(), atol=1e-6, rtol=1e-6)


def test_all_masked_batch_is_zero_and_differentiable(tiny_model):
    input_ids, attention_mask, completion_ids, completion_mask = batch(tiny_model.config.vocab_size)
    logps, _, _ = completion_logprobs(
        tiny_model, input_ids, attention_mask, completion_ids, torch.zeros_like(completion_mask)
    )
    assert (logps == 0).all()
    logps.sum().backward()  # no error: still connected to the graph


def test_an_adapter_on_the_lm_head_is_applied(tiny_model):
    # The head is called as a module, so a LoRA adapter on lm_head counts (reading head.weight would not).
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(tiny_model, LoraConfig(r=4, target_modules=["lm_head", "q_proj"], init_lora_weights=False))
    inputs = batch(tiny_model.config.vocab_size)
    expected = reference_logps(model, *inputs, temperature=1.0)
    logps, _, _ = completion_logprobs(model, *inputs)
    torch.testing.assert_close(logps, expected, atol=1e-5, rtol=1e-5)
    with model.disable_adapter():
        assert not torch.allclose(reference_logps(model, *inputs, temperature=1.0), expected, atol=1e-3)


@pytest.mark.parametrize("model_type,scaling", [("cohere", {"logit_scale": 0.5}), ("granite", {"logits_scaling": 4.0})])
def test_architectures_that_scale_their_logits(tiny_tokenizer, model_type, scaling):
    # Cohere multiplies the head's output by logit_scale, Granite divides it by logits_scaling, inside their
    # forward: the chunked projection must do the same to give the model's own log-probabilities.
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model(
        model_type,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=len(tiny_tokenizer),
        max_position_embeddings=128,
        **scaling,
    )
    model = AutoModelForCausalLM.from_config(config).eval()
    inputs = batch(config.vocab_size)
    expected = reference_logps(model, *inputs, temperature=0.7)
    logps, _, _ = completion_logprobs(model, *inputs, temperature=0.7, chunk_size=4)
    torch.testing.assert_close(logps, expected, atol=1e-5, rtol=1e-5)


def row_alone_logps(model, input_ids, attention_mask, completion_ids, completion_mask, temperature):
    """Each row run alone, unpadded, at its own positions 0, 1, ...: the log-probs the model gives it."""
    length = completion_ids.shape[1]
    logps = torch.zeros(completion_ids.shape)
    for row in range(input_ids.shape[0]):
        ids = input_ids[row][attention_mask[row].bool()]
        logits = model(input_ids=ids[None]).logits[0, -length - 1 : -1].float() / temperature
        logps[row] = logits.log_softmax(-1).gather(-1, completion_ids[row].unsqueeze(-1)).squeeze(-1)
    return logps * completion_mask


@pytest.mark.parametrize("padding_free", [False, True])
def test_learned_positions_score_a_padded_row_as_the_row_alone(tiny_tokenizer, monkeypatch, padding_free):
    # GPT-2 adds a learned embedding per position: a left-padded row must be scored at the positions it was sampled
    # with (counted from its first token), not counted from its first pad.
    from conftest import build_tiny_gpt2

    model = build_tiny_gpt2(tiny_tokenizer).eval()
    inputs = batch(model.config.vocab_size)  # row 0 has 4 pads
    expected = row_alone_logps(model, *inputs, temperature=0.7)
    logps, _, _ = completion_logprobs(model, *inputs, temperature=0.7, padding_free=padding_free)
    torch.testing.assert_close(logps, expected, atol=1e-5, rtol=1e-5)
    monkeypatch.setattr(logprobs, "takes_position_ids", lambda model: False)  # positions from the first pad
    shifted, _, _ = completion_logprobs(model, *inputs, temperature=0.7)
    assert (shifted[0] - expected[0]).abs().max() > 1e-2  # the padded row is off
    torch.testing.assert_close(shifted[1:], expected[1:], atol=1e-5, rtol=1e-5)  # rows without padding are not

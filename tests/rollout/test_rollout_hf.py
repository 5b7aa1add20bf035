"""The HF backend: sampling on the trained model, left padding, slices of rows, the choice of decoding loop."""

from __future__ import annotations

import pytest
import torch

from gspo_trl import GSPOConfig
from gspo_trl.rollout import HFGenerateBackend, completion_mask_from_eos
from gspo_trl.rollout.decoding.prefix_sharing import prefill_shared_prompts


def test_generate_shapes_padding_and_masks(tmp_path, tiny_model, tiny_tokenizer):
    args = GSPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=8, max_completion_length=7, use_cpu=True)
    backend = HFGenerateBackend(lambda: tiny_model, tiny_tokenizer, args)
    tiny_model.train()
    prompts = ["What is 1 + 1?", "Hi"] * 2
    rollout = backend.generate(prompts)
    assert tiny_model.training  # mode restored after sampling in eval mode
    assert rollout.prompt_ids.shape[0] == 4 and rollout.completion_ids.shape == (4, 7)
    # left padding: the short prompt's mask starts with zeros, real tokens end at the right edge
    assert rollout.prompt_mask[1, 0] == 0 and rollout.prompt_mask[:, -1].all()
    expected_mask, expected_truncated = completion_mask_from_eos(rollout.completion_ids, [tiny_tokenizer.eos_token_id])
    assert torch.equal(rollout.completion_mask, expected_mask)
    assert torch.equal(rollout.is_truncated, expected_truncated)
    assert (rollout.completion_ids[rollout.completion_mask == 0] == tiny_tokenizer.pad_token_id).all()


def test_generate_stops_at_eos(tmp_path, tiny_model, tiny_tokenizer):
    # generation_kwargs reach GenerationConfig: suppressing every other token makes each completion one EOS.
    others = [i for i in range(len(tiny_tokenizer)) if i != tiny_tokenizer.eos_token_id]
    args = GSPOConfig(
        output_dir=str(tmp_path),
        per_device_train_batch_size=8,
        max_completion_length=5,
        use_cpu=True,
        generation_kwargs={"suppress_tokens": others},
    )
    rollout = HFGenerateBackend(lambda: tiny_model, tiny_tokenizer, args).generate(["a", "b"])
    assert rollout.completion_mask.sum(1).tolist() == [1, 1]
    assert not rollout.is_truncated.any()


def test_max_prompt_length_truncates_from_the_left(tmp_path, tiny_model, tiny_tokenizer):
    args = GSPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=8, max_prompt_length=3, use_cpu=True)
    backend = HFGenerateBackend(lambda: tiny_model, tiny_tokenizer, args)
    ids, _ = backend.tokenize_prompts(["one two three four five six"])
    full = tiny_tokenizer("one two three four five six", add_special_tokens=False).input_ids
    assert ids[0].tolist() == full[-3:]


def test_shared_prompt_prefill_samples_what_plain_generate_samples(tmp_path, tiny_model, tiny_tokenizer):
    args = GSPOConfig(
        output_dir=str(tmp_path),
        per_device_train_batch_size=8,
        max_completion_length=6,
        use_cpu=True,
    )
    args.generation_kwargs = {"do_sample": False}  # greedy, which GSPOConfig refuses: both paths give the same tokens
    backend = HFGenerateBackend(lambda: tiny_model, tiny_tokenizer, args)
    prompts = ["What is 1 + 1?"] * 3 + ["Hi"] * 3
    prompt_ids, prompt_mask = backend.tokenize_prompts(prompts)
    expected = tiny_model.generate(
        input_ids=prompt_ids, attention_mask=prompt_mask, generation_config=backend.generation_config
    )

    batch_sizes = []
    hook = tiny_model.model.embed_tokens.register_forward_hook(
        lambda module, inputs, output: batch_sizes.append(output.shape[:2])
    )
    try:
        rollout = backend.generate(prompts)
    finally:
        hook.remove()
    assert batch_sizes[0] == (2, prompt_ids.shape[1] - 1)  # the prefill ran once per distinct prompt
    assert all(shape == (6, 1) for shape in batch_sizes[1:])  # then one token per row per step
    assert torch.equal(
        rollout.completion_ids[rollout.completion_mask.bool()],
        expected[:, prompt_ids.shape[1] :][rollout.completion_mask.bool()],
    )


def test_prefill_is_skipped_when_no_prompt_repeats(tiny_model, tiny_tokenizer):
    encoded = tiny_tokenizer(["one two", "three"], return_tensors="pt", padding=True, padding_side="left")
    assert prefill_shared_prompts(tiny_model, encoded["input_ids"], encoded["attention_mask"]) is None


def test_keyed_streams_sample_the_same_completion_in_any_batch(tmp_path, tiny_model, tiny_tokenizer):
    from gspo_trl.rollout import stream_keys

    args = GSPOConfig(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=8,
        use_cpu=True,
        temperature=0.9,
        top_p=0.95,
    )
    backend = HFGenerateBackend(lambda: tiny_model, tiny_tokenizer, args)
    keys = stream_keys(0, 7, 0, torch.arange(4))
    together = backend.generate(["What is 1 + 1?", "What is 1 + 1?", "Hi", "Hi"], keys)
    alone = backend.generate(["Hi", "Hi"], keys[2:])  # another batch: other padding, other rows around
    assert together.prompt_ids.shape[1] > alone.prompt_ids.shape[1]
    assert torch.equal(together.completion_ids[2:], alone.completion_ids)
    assert not torch.equal(together.completion_ids[2], together.completion_ids[3])  # each row its own stream
    again = backend.generate(["What is 1 + 1?", "What is 1 + 1?", "Hi", "Hi"], keys)
    assert torch.equal(together.completion_ids, again.completion_ids)


@pytest.mark.parametrize("decode_loop", ["gspo", "generate"])
def test_decode_max_rows_decodes_in_slices_that_sample_the_same_completions(
    tmp_path, tiny_model, tiny_tokenizer, decode_loop
):
    # A rollout decoded a few rows at a time (each slice's KV cache gone before the next) samples, with per-row
    # streams, the completions, masks and truncation flags of all rows decoded together.
    from test_decoding_dynamic import FavourEos
    from transformers import LogitsProcessorList

    from gspo_trl.rollout import stream_keys

    def backend_with(max_rows):
        args = GSPOConfig(
            output_dir=str(tmp_path),
            per_device_train_batch_size=8,
            num_generations=2,
            max_completion_length=16,
            use_cpu=True,
            temperature=0.9,
            decode_loop=decode_loop,
            decode_max_rows=max_rows,
        )
        backend = HFGenerateBackend(lambda: tiny_model, tiny_tokenizer, args)
        if decode_loop == "gspo":  # rows end at different steps, so slices end at different widths
            backend.processors = LogitsProcessorList(
                [FavourEos(tiny_tokenizer.eos_token_id)] * 2 + list(backend.processors)
            )
        return backend

    prompts = ["What is 1 + 1?"] * 3 + ["Hi"] * 3 + ["one two three"] * 2
    keys = stream_keys(0, 3, torch.arange(len(prompts)))
    whole = backend_with(None).generate(prompts, keys)
    batch_rows = []
    hook = tiny_model.model.embed_tokens.register_forward_hook(lambda m, i, o: batch_rows.append(o.shape[0]))
    try:
        sliced = backend_with(3).generate(prompts, keys)
    finally:
        hook.remove()
    assert max(batch_rows) == 3  # never more than 3 rows in a forward (8 rows: slices of 3, 3, 2)
    for name in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "is_truncated"):
        assert torch.equal(getattr(sliced, name), getattr(whole, name)), name
    if decode_loop == "gspo":
        lengths = whole.completion_mask.sum(1)
        assert len(set(lengths.tolist())) > 2 and not whole.is_truncated.all()


def test_on_a_gpu_the_rows_that_fit_the_free_memory_are_decoded_together(
    tmp_path, tiny_model, tiny_tokenizer, monkeypatch, caplog
):
    # decode_max_rows=None: the KV cache of all rows is measured against the device's free memory (only CUDA has
    # a figure; faked here at the one query). Rows × (prompt + completion) positions × 2·layers·KV heads·head dim.
    from gspo_trl.rollout import stream_keys
    from gspo_trl.rollout.decoding import memory

    args = GSPOConfig(
        output_dir=str(tmp_path),
        per_device_train_batch_size=8,
        num_generations=2,
        max_completion_length=10,
        use_cpu=True,
    )
    backend = HFGenerateBackend(lambda: tiny_model, tiny_tokenizer, args)
    prompts = ["What is 1 + 1?"] * 4 + ["Hi"] * 4
    keys = stream_keys(0, 4, torch.arange(len(prompts)))
    whole = backend.generate(prompts, keys)  # on CPU: all rows at once
    prompt_length = whole.prompt_ids.shape[1]
    per_row = (prompt_length + 10) * 2 * 2 * 2 * 16 * 4  # 2 layers, 2 KV heads of 16 dims, fp32
    # Room for 5 rows: two even slices of 4.
    monkeypatch.setattr(memory, "free_device_bytes", lambda device: int(5.5 * per_row / 0.8))
    batch_rows = []
    hook = tiny_model.model.embed_tokens.register_forward_hook(lambda m, i, o: batch_rows.append(o.shape[0]))
    try:
        with caplog.at_level("WARNING"):
            sliced = backend.generate(prompts, keys)
    finally:
        hook.remove()
    assert max(batch_rows) == 4 and batch_rows.count(4) >= 2
    assert "decoding in slices of 4 rows" in caplog.text and "decode_max_rows" in caplog.text
    assert torch.equal(sliced.completion_ids, whole.completion_ids)
    # Room for every row: nothing sliced.
    monkeypatch.setattr(memory, "free_device_bytes", lambda device: int(9 * per_row / 0.8))
    batch_rows.clear()
    hook = tiny_model.model.embed_tokens.register_forward_hook(lambda m, i, o: batch_rows.append(o.shape[0]))
    try:
        backend.generate(prompts, keys)
    finally:
        hook.remove()
    assert max(batch_rows) == 8


def test_decoded_logprobs_are_pi_old_only_in_full_precision(tiny_model):
    # decode_logprobs_as_old unset: on for float32 sampling; off under bf16/fp16 autocast, TF32 or low-precision
    # weights.
    from types import SimpleNamespace

    from gspo_trl.rollout import records_decode_logprobs

    def args(**overrides):
        return SimpleNamespace(
            **{"decode_logprobs_as_old": None, "bf16": False, "fp16": False, "tf32": None, **overrides}
        )

    assert records_decode_logprobs(args(), tiny_model)
    for overrides in (dict(bf16=True), dict(fp16=True), dict(tf32=True), dict(decode_logprobs_as_old=False)):
        assert not records_decode_logprobs(args(**overrides), tiny_model), overrides
    assert records_decode_logprobs(args(bf16=True, decode_logprobs_as_old=True), tiny_model)  # asked for: recorded
    assert not records_decode_logprobs(args(), tiny_model.to(torch.bfloat16))


def test_a_truncating_rollout_records_the_kept_mass_across_slices(tmp_path, tiny_model, tiny_tokenizer):
    # top-p: the rollout carries the log of the kept mass per token (0 on padding) beside the renormalised log-probs,
    # the same whether the rows are decoded together or two at a time (slices of other widths, padded).
    from gspo_trl.rollout import stream_keys

    def rollout(max_rows):
        args = GSPOConfig(
            output_dir=str(tmp_path),
            per_device_train_batch_size=4,
            num_generations=2,
            max_completion_length=8,
            use_cpu=True,
            temperature=0.9,
            top_p=0.6,
            decode_max_rows=max_rows,
        )
        backend = HFGenerateBackend(lambda: tiny_model, tiny_tokenizer, args)
        return backend.generate(["What is 1 + 1?", "What is 1 + 1?", "Hi", "Hi"], stream_keys(0, 3, 0, torch.arange(4)))

    together, sliced = rollout(None), rollout(2)
    assert torch.equal(together.completion_ids, sliced.completion_ids) and together.sampled_by_policy
    mask = together.completion_mask.bool()
    assert (together.kept_log_mass[mask] < 0).all() and (together.kept_log_mass[~mask] == 0).all()
    # Slices run other batch shapes: float32 rounding of the logits, 1e-5 as for the loops' log-probs.
    torch.testing.assert_close(together.kept_log_mass, sliced.kept_log_mass, atol=1e-5, rtol=0)
    torch.testing.assert_close(together.sampling_logps, sliced.sampling_logps, atol=1e-5, rtol=0)

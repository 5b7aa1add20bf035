"""micro_batch: the typed record, cutting rows and columns out of it, and its checkpoint form (old key names too)."""

from __future__ import annotations

import pytest
import torch

from gspo_trl.training.micro_batch import MicroBatch


def batch(**fields) -> MicroBatch:
    prompt = torch.tensor([[0, 7], [8, 9], [0, 6]])  # (B, P) left-padded
    completion_ids = torch.arange(12).reshape(3, 4)  # (B, C)
    completion_mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]])
    return MicroBatch(
        input_ids=torch.cat([prompt, completion_ids], 1),
        attention_mask=torch.cat([(prompt > 0).long(), completion_mask], 1),
        completion_ids=completion_ids,
        completion_mask=completion_mask,
        **fields,
    )


def test_a_misspelled_field_is_an_error_not_none():
    record = batch()
    with pytest.raises(AttributeError):
        record.old_per_token_logps  # noqa: B018 (the name of the earlier dict key)
    with pytest.raises(AttributeError):
        record.old_logp = torch.zeros(3, 4)
    with pytest.raises(TypeError):
        batch(ref_per_token_logps=torch.zeros(3, 4))


def test_select_takes_rows_and_cuts_completion_columns_only():
    record = batch(
        old_logps=-torch.ones(3, 4),
        advantages=torch.tensor([0.5, -1.0, 0.25]),
        turn_ids=None,
        kept_log_mass=-torch.arange(12.0).reshape(3, 4),
    )
    part = record.select(torch.tensor([2, 0]), completion_width=2)
    assert part.input_ids.tolist() == [[0, 6, 8, 9], [0, 7, 0, 1]]  # prompt whole, completion cut at 2
    assert part.completion_ids.shape == part.old_logps.shape == (2, 2) and part.turn_ids is None
    assert part.kept_log_mass.tolist() == [[-8.0, -9.0], [0.0, -1.0]]
    assert part.advantages.tolist() == [0.25, 0.5]
    rows = record.select(slice(1, 3))  # a process's share
    assert rows.rows == 2 and torch.equal(rows.completion_mask, record.completion_mask[1:])
    assert record.rows == 3  # the record cut from is unchanged


def test_engine_logps_are_another_engines_only():
    logps = torch.zeros(3, 4)
    assert batch(sampling_logps=logps).engine_logps is logps  # a vLLM server's: the sampling correction's input
    assert batch(sampling_logps=logps, sampled_by_policy=True).engine_logps is None  # the trained model's own


def test_the_checkpoint_form_round_trips_and_reads_the_earlier_key_names():
    record = batch(
        sampling_logps=torch.zeros(3, 4),
        sampled_by_policy=True,
        old_logps=torch.ones(3, 4),
        kept_log_mass=torch.full((3, 4), -0.5),
    )
    again = MicroBatch.from_state(record.to_state())
    assert again.sampled_by_policy and torch.equal(again.old_logps, record.old_logps)
    assert torch.equal(again.kept_log_mass, record.kept_log_mass)
    plain = {name: getattr(record, name) for name in ("input_ids", "attention_mask", "completion_ids")}
    earlier = {
        **plain,
        "completion_mask": record.completion_mask,
        "advantages": torch.ones(3),
        "old_per_token_logps": torch.ones(3, 4),
        "ref_per_token_logps": None,
        "sampling_per_token_logps": None,
        "decoding_per_token_logps": torch.full((3, 4), -1.0),  # the decoding loop's (decode_logprobs_as_old)
        "turn_ids": None,
        "num_items_in_batch": torch.tensor(7),
    }
    loaded = MicroBatch.from_state(earlier)
    assert loaded.sampled_by_policy and torch.equal(loaded.sampling_logps, earlier["decoding_per_token_logps"])
    assert torch.equal(loaded.old_logps, torch.ones(3, 4)) and loaded.ref_logps is None
    assert loaded.num_items_in_batch.item() == 7
    engine = {**earlier, "sampling_per_token_logps": torch.full((3, 4), -2.0), "decoding_per_token_logps": None}
    loaded = MicroBatch.from_state(engine)
    assert not loaded.sampled_by_policy and torch.equal(loaded.engine_logps, engine["sampling_per_token_logps"])


def test_padded_to_multiple_pads_prompts_left_and_completions_right():
    # P = 2, C = 4; multiple 3 → P' = 3 (one column on the left), C' = 6 (two on the right); pad id 99
    record = batch(old_logps=-torch.ones(3, 4), advantages=torch.tensor([0.5, -1.0, 0.25]))
    padded = record.padded_to_multiple(3, pad_token_id=99)
    assert padded.input_ids.tolist()[0] == [99, 0, 7, 0, 1, 2, 3, 99, 99]
    assert padded.attention_mask.tolist()[0] == [0, 0, 1, 1, 1, 0, 0, 0, 0]
    assert padded.completion_ids.tolist()[1] == [4, 5, 6, 7, 99, 99]
    assert padded.completion_mask.tolist()[1] == [1, 1, 1, 1, 0, 0]
    assert padded.old_logps.tolist()[2] == [-1.0, -1.0, -1.0, -1.0, 0.0, 0.0]
    assert torch.equal(padded.advantages, record.advantages)  # per row: unchanged
    assert record.padded_to_multiple(2, 99) is record  # 2 and 4 fit already
    assert record.padded_to_multiple(None, 99) is record


def test_select_cuts_the_sampling_routes_like_the_input_ids_and_the_checkpoint_keeps_them():
    # (B, P + C, L=1, k=1): each position's route is its token id, so a cut shows as the same columns as input_ids.
    record = batch()
    record.sampling_routes = record.input_ids.to(torch.int8).view(3, 6, 1, 1)
    part = record.select(torch.tensor([2, 0]), completion_width=2)
    assert torch.equal(part.sampling_routes[..., 0, 0], part.input_ids.to(torch.int8))
    again = MicroBatch.from_state(record.to_state())
    assert again.sampling_routes.dtype == torch.int8 and torch.equal(again.sampling_routes, record.sampling_routes)


def test_padded_to_multiple_pads_the_routes_with_not_recorded():
    # P = 2, C = 4, multiple 3: one route column on the left, two on the right, each -1 (not recorded)
    record = batch()
    record.sampling_routes = record.input_ids.to(torch.int8).view(3, 6, 1, 1)
    padded = record.padded_to_multiple(3, pad_token_id=99)
    assert padded.sampling_routes.shape == (3, 9, 1, 1) and padded.old_routes is None
    assert padded.sampling_routes[0, :, 0, 0].tolist() == [-1, *record.input_ids[0].tolist(), -1, -1]

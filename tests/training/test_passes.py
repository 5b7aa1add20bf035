"""passes: which rows go into each training pass, and what a pass holds."""

from __future__ import annotations

import pytest
import torch

from gspo_trl import GSPOConfig
from gspo_trl.training.micro_batch import MicroBatch
from gspo_trl.training.passes import (
    DEFAULT_CUDA_PASS_TOKENS,
    padded_positions,
    passes_unsupported_reason,
    plan_passes,
    resolve_max_tokens_per_pass,
    take_pass,
)


def test_the_default_budget_applies_on_cuda_only_and_zero_means_no_limit():
    assert resolve_max_tokens_per_pass(None, "cuda") == DEFAULT_CUDA_PASS_TOKENS == 8192
    assert resolve_max_tokens_per_pass(None, "cpu") is None
    assert resolve_max_tokens_per_pass(0, "cuda") is None
    assert resolve_max_tokens_per_pass(100, "cpu") == 100


def test_terms_over_the_whole_micro_batch_keep_it_one_pass():
    assert passes_unsupported_reason(1.0, router_aux_loss=False) is None
    assert "top_entropy_quantile" in passes_unsupported_reason(0.2, router_aux_loss=False)
    assert "load-balancing" in passes_unsupported_reason(1.0, router_aux_loss=True)


def test_a_negative_budget_is_refused(tmp_path):
    with pytest.raises(ValueError, match="max_tokens_per_pass"):
        GSPOConfig(output_dir=str(tmp_path), max_tokens_per_pass=-1)


def test_padded_positions_count_the_prompt_columns_and_the_completion_to_its_last_trained_token():
    attention_mask = torch.tensor(
        [[0, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1], [0, 0, 1, 0, 0, 0]]
    )  # prompt 3 + completion 3
    completion_mask = torch.tensor([[1, 0, 0], [1, 1, 1], [0, 0, 0]])
    assert padded_positions(attention_mask, completion_mask).tolist() == [4, 6, 3]


def test_passes_sort_rows_by_length_and_keep_each_within_the_budget():
    positions = torch.tensor([10, 40, 20, 40, 5, 30])
    passes = plan_passes(positions, max_tokens=60)
    assert sorted(torch.cat(passes).tolist()) == list(range(6))  # every row exactly once
    assert [positions[rows].tolist() for rows in passes] == [[5, 10], [20, 30], [40], [40]]
    for rows in passes:  # rows × longest row
        assert rows.numel() * int(positions[rows].max()) <= 60


def test_passes_follow_another_process_count_and_never_go_below_one_row():
    positions = torch.tensor([8, 8, 8, 8])
    assert len(plan_passes(positions, None)) == 1
    assert len(plan_passes(positions, 32)) == 1
    assert [rows.numel() for rows in plan_passes(positions, 32, min_passes=2)] == [2, 2]
    assert [rows.numel() for rows in plan_passes(positions, 1)] == [1, 1, 1, 1]  # a row longer than the budget


def test_a_pass_keeps_its_rows_cut_to_their_longest_completion_and_the_micro_batch_counts():
    prompt = torch.tensor([[0, 7], [8, 9], [0, 6]])
    completion_mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]])
    completion_ids = torch.arange(12).reshape(3, 4)
    batch = MicroBatch(
        input_ids=torch.cat([prompt, completion_ids], 1),
        attention_mask=torch.cat([(prompt > 0).long(), completion_mask], 1),
        completion_ids=completion_ids,
        completion_mask=completion_mask,
        old_logps=-torch.ones(3, 4),
        ref_logps=None,
        advantages=torch.tensor([0.5, -1.0, 0.5]),
        num_items_in_batch=torch.tensor(40),
    )
    part = take_pass(batch, torch.tensor([2, 0]), last=False)
    assert part.input_ids.tolist() == [[0, 6, 8, 9], [0, 7, 0, 1]]  # prompt columns whole, completion cut at 2
    assert part.completion_mask.tolist() == [[1, 0], [1, 1]]
    assert part.old_logps.shape == (2, 2) and part.ref_logps is None
    assert part.advantages.tolist() == [0.5, 0.5]
    assert part.num_items_in_batch.item() == 40  # the rollout's count, not a row's
    assert (part.micro_batch_rows, part.micro_batch_tokens.item(), part.last_pass) == (3, 7, False)
    assert take_pass(batch, torch.tensor([1]), last=True).completion_ids.shape == (1, 4)
    assert batch.micro_batch_rows is None and batch.last_pass  # the micro-batch itself is left as it was


def test_a_pass_keeps_a_multiple_of_pad_to_multiple_of_completion_columns():
    completion_mask = torch.tensor([[1, 1, 0, 0, 0, 0], [1, 1, 1, 1, 1, 0]])
    completion_ids = torch.arange(12).reshape(2, 6)
    batch = MicroBatch(
        input_ids=torch.cat([torch.ones(2, 2, dtype=torch.long), completion_ids], 1),
        attention_mask=torch.cat([torch.ones(2, 2, dtype=torch.long), completion_mask], 1),
        completion_ids=completion_ids,
        completion_mask=completion_mask,
    )
    assert take_pass(batch, torch.tensor([0]), last=False, multiple=4).completion_ids.shape == (1, 4)  # 2 → 4
    assert take_pass(batch, torch.tensor([1]), last=True, multiple=4).completion_ids.shape == (1, 6)  # 5 → 8, all 6
    assert take_pass(batch, torch.tensor([0]), last=False).completion_ids.shape == (1, 2)

"""gspo_trl/models/moe/drift.py: the route mismatch and expert-load imbalance of recorded routes, against counts by
hand."""

from __future__ import annotations

import torch

from gspo_trl.models.moe.drift import load_imbalance, route_mismatch


def routes(*rows):
    """(B, C, L, k) from nested lists."""
    return torch.tensor(rows, dtype=torch.int8)


def test_route_mismatch_compares_expert_sets_per_layer_on_masked_tokens_only():
    # One row of 3 tokens, 2 layers, k = 2.
    first = routes([[[0, 1], [2, 3]], [[0, 1], [2, 3]], [[0, 1], [2, 3]]])
    second = routes(
        [
            [[1, 0], [2, 3]],  # same sets, another order: no mismatch
            [[0, 2], [2, 3]],  # layer 0 differs
            [[3, 2], [0, 1]],  # both layers differ, but this token is masked out
        ]
    )
    per_layer, any_layer = route_mismatch(first, second, torch.tensor([[1, 1, 0]]))
    # 2 tokens counted: layer 0 differs on 1 of them, layer 1 on none; one token differs at some layer.
    assert per_layer.tolist() == [0.5, 0.0]
    assert any_layer.item() == 0.5
    per_layer, any_layer = route_mismatch(first, second, torch.tensor([[1, 1, 1]]))
    assert torch.allclose(per_layer, torch.tensor([2 / 3, 1 / 3])) and abs(any_layer.item() - 2 / 3) < 1e-7


def test_route_mismatch_of_no_tokens_is_zero():
    first = routes([[[0, 1]]])
    per_layer, any_layer = route_mismatch(first, routes([[[2, 3]]]), torch.zeros(1, 1))
    assert per_layer.tolist() == [0.0] and any_layer.item() == 0.0


def test_load_imbalance_is_max_over_mean_load_per_layer():
    # 4 experts, k = 2, 2 tokens (4 selections, mean load 1 per expert).
    # layer 0: experts 0,1 and 2,3: loads (1, 1, 1, 1) -> 1. layer 1: both tokens to 0,1: loads (2, 2, 0, 0) -> 2 = E/k.
    selected = routes([[[0, 1], [0, 1]], [[2, 3], [0, 1]], [[3, 3], [3, 3]]])  # the third token is masked out
    imbalance = load_imbalance(selected, torch.tensor([[1, 1, 0]]), num_experts=4)
    assert imbalance.tolist() == [1.0, 2.0]


def test_load_imbalance_of_no_tokens_is_one():
    assert load_imbalance(routes([[[0, 1]]]), torch.zeros(1, 1), num_experts=4).tolist() == [1.0]

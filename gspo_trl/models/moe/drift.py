"""Router drift: how often two forwards of the same tokens route them to different experts, and how evenly a routing
loads its experts. Pure functions of recorded routes (`routing.RouteRecorder`), (B, C, L, k) expert indices.

A token's route at a layer is the *set* of its k experts: two forwards that pick the same experts in another order
agree. Owns the metrics' arithmetic; what it does not own: recording the routes and logging the values."""

from __future__ import annotations

import torch


def route_mismatch(first: torch.Tensor, second: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(per layer (L,), any layer ()) the fraction of the tokens of `mask` (B, C) whose expert set differs between
    the routes `first` and `second` (B, C, L, k): at that layer, and at one layer at least. 0 where `mask` is empty."""
    differs = (first.sort(dim=-1).values != second.sort(dim=-1).values).any(dim=-1)  # (B, C, L)
    valid = mask.bool()
    tokens = max(int(valid.sum()), 1)
    per_layer = differs[valid].sum(dim=0, dtype=torch.float32) / tokens  # (L,)
    any_layer = differs[valid].any(dim=-1).sum(dtype=torch.float32) / tokens
    return per_layer, any_layer


def load_imbalance(routes: torch.Tensor, mask: torch.Tensor, num_experts: int) -> torch.Tensor:
    """(L,) each layer's max expert load over its mean load, over the tokens of `mask` (B, C) routed by `routes`
    (B, C, L, k): 1 when every expert takes as many tokens, E/k when every token goes to the same k experts.
    1 where `mask` is empty."""
    selected = routes[mask.bool()].long()  # (N, L, k)
    layers = routes.shape[-2]
    if selected.shape[0] == 0:
        return torch.ones(layers)
    offsets = torch.arange(layers, device=selected.device).view(1, layers, 1) * num_experts
    loads = torch.bincount((selected + offsets).flatten(), minlength=layers * num_experts).view(layers, num_experts)
    loads = loads.float()
    return loads.amax(dim=1) / loads.mean(dim=1)

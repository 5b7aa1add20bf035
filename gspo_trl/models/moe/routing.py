"""Router adapters of the Mixture-of-Experts families transformers builds, and recording or replaying their choice.

A router maps each token's hidden state to logits over E experts, selects k of them and weighs the selected experts'
outputs by gate weights. The families differ in how (arXiv 2507.18071 §4–5 and the R3 paper replay the selection and
recompute the weights):

| style           | families                    | selection                | gate weights of the k selected            |
|-----------------|-----------------------------|--------------------------|-------------------------------------------|
| `softmax_topk`  | Qwen2/3-MoE, OLMoE, Mixtral | top-k of softmax(logits) | their softmax probabilities, renormalised |
|                 |                             |                          | where the family does (`norm_topk_prob`;  |
|                 |                             |                          | always for Mixtral)                       |
| `topk_softmax`  | GPT-OSS                     | top-k of the logits      | softmax over the k logits                 |
| `sigmoid_group` | DeepSeek-V3                 | top-k of sigmoid + bias, | sigmoid(logits), renormalised             |
|                 |                             | in the best groups       | (`norm_topk_prob`), × scaling             |

Replaying given experts keeps the router differentiable: the gate weights of the *replayed* experts are recomputed
from the current logits, by the family's own formula (`gate_weights`). The router's logits are returned unchanged,
so the load-balancing loss still sees the current router.

Owns the adapters (found by the router module's class), the routes' layout and dtype, and the contexts that patch
each router's `forward` for the duration of a forward pass (`RouteRecorder`, `routing_replayed`), restoring it on
exit. What it does not own: when a rollout records or replays (the trainer's wiring) and the drift metrics (`drift`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn


def softmax_topk_weights(logits: torch.Tensor, experts: torch.Tensor, normalize: bool) -> torch.Tensor:
    """(N, k) float32: the softmax probabilities of `experts` (N, k) under `logits` (N, E), divided by their sum
    when `normalize` (Qwen-MoE and OLMoE with `norm_topk_prob`, Mixtral always)."""
    weights = torch.softmax(logits.float(), dim=-1).gather(-1, experts)
    return weights / weights.sum(dim=-1, keepdim=True) if normalize else weights


def topk_softmax_weights(logits: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """(N, k) in the logits' dtype: softmax over the k selected logits (GPT-OSS)."""
    return torch.softmax(logits.gather(-1, experts), dim=-1, dtype=logits.dtype)


def sigmoid_weights(logits: torch.Tensor, experts: torch.Tensor, normalize: bool, scaling: float) -> torch.Tensor:
    """(N, k) float32: sigmoid(logits) of `experts`, divided by their sum (+1e-20, as DeepSeek-V3 does) when
    `normalize`, times `scaling` (`routed_scaling_factor`). The selection bias does not enter the weights."""
    weights = logits.float().sigmoid().gather(-1, experts)
    if normalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scaling


@dataclass(frozen=True)
class RouterAdapter:
    """How one family's router weighs given experts: `gate_weights(router, logits, experts)` -> (N, k), in the
    dtype the family's own forward returns."""

    style: str
    gate_weights: Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]


def _qwen_weights(router: nn.Module, logits: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    return softmax_topk_weights(logits, experts, router.norm_topk_prob).to(logits.dtype)


def _mixtral_weights(router: nn.Module, logits: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    return softmax_topk_weights(logits, experts, normalize=True)  # Mixtral keeps them in float32


def _gpt_oss_weights(router: nn.Module, logits: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    return topk_softmax_weights(logits, experts)


def _deepseek_weights(router: nn.Module, logits: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    return sigmoid_weights(logits, experts, router.norm_topk_prob, router.routed_scaling_factor)


# Router module class name -> adapter. A family is added here once its router's forward is read and its
# replayed forward tested equal to its own (tests/models/moe/test_moe_routing.py).
ADAPTERS: dict[str, RouterAdapter] = {
    "Qwen2MoeTopKRouter": RouterAdapter("softmax_topk", _qwen_weights),
    "Qwen3MoeTopKRouter": RouterAdapter("softmax_topk", _qwen_weights),
    "OlmoeTopKRouter": RouterAdapter("softmax_topk", _qwen_weights),
    "MixtralTopKRouter": RouterAdapter("softmax_topk", _mixtral_weights),
    "GptOssTopKRouter": RouterAdapter("topk_softmax", _gpt_oss_weights),
    "DeepseekV3TopkRouter": RouterAdapter("sigmoid_group", _deepseek_weights),
}

# Class-name marks of a Mixture-of-Experts block whose router has no adapter: refused rather than left unrecorded.
_MOE_MARKS = ("Router", "SparseMoe", "MoE", "Experts")


def moe_routers(model: nn.Module) -> list[nn.Module]:
    """The routers of `model` in layer order (empty for a dense model). A Mixture-of-Experts block without an
    adapter here is a `ValueError` naming the model's class and the module's."""
    routers = [module for module in model.modules() if type(module).__name__ in ADAPTERS]
    if not routers:
        for name, module in model.named_modules():
            kind = type(module).__name__
            if any(mark in kind for mark in _MOE_MARKS):
                raise ValueError(
                    f"{type(model).__name__} is a Mixture-of-Experts model whose router ({kind} at '{name}') gspo-trl "
                    f"cannot record or replay: supported routers are {', '.join(sorted(ADAPTERS))}. "
                    "Leave routing_replay='none' for this model."
                )
    return routers


def routes_dtype(num_experts: int) -> torch.dtype:
    """The smallest integer dtype that holds an expert index: int8 up to 128 experts, else int16."""
    return torch.int8 if num_experts <= 128 else torch.int16


def _num_experts(router: nn.Module) -> int:
    return int(getattr(router, "num_experts", None) or router.weight.shape[0])


@contextlib.contextmanager
def _routers_patched(routers: list[nn.Module], wrap) -> Iterator[None]:
    """Each router's `forward` replaced by `wrap(layer, router, forward)` for the duration; the instance's own
    attribute (if any, e.g. an offloading hook's) is put back on exit."""
    saved = [router.__dict__.get("forward") for router in routers]
    try:
        for layer, router in enumerate(routers):
            router.forward = wrap(layer, router, router.forward)
        yield
    finally:
        for router, own in zip(routers, saved):
            if own is None:
                router.__dict__.pop("forward", None)
            else:
                router.forward = own


class RouteRecorder:
    """The experts each router selects in the forwards run inside `recording()`: `take()` returns those of the
    forwards since the last take as (N, L, k) indices, N the tokens in the order the model saw them (batch-major,
    (B, T) flattened), L the routed layers, k the experts per token; int8 up to 128 experts, else int16.

    With `replay` set (a callable returning the (N, k) experts to use at a layer, or None), the recorded experts
    are still the router's own choice: what it would have selected, for the drift metrics."""

    def __init__(self, model: nn.Module):
        self.routers = moe_routers(model)
        self.dtype = routes_dtype(max((_num_experts(router) for router in self.routers), default=0))
        self._seen: list[list[torch.Tensor]] = [[] for _ in self.routers]

    @property
    def num_layers(self) -> int:
        return len(self.routers)

    @contextlib.contextmanager
    def recording(self) -> Iterator[RouteRecorder]:
        def wrap(layer: int, router: nn.Module, forward):
            def recorded(hidden_states, *args, **kwargs):
                outputs = forward(hidden_states, *args, **kwargs)
                self.add(layer, outputs[2])
                return outputs

            return recorded

        with _routers_patched(self.routers, wrap):
            yield self

    def clear(self) -> None:
        self._seen = [[] for _ in self.routers]

    def add(self, layer: int, experts: torch.Tensor) -> None:
        """Note the (N, k) experts a router selected in one forward."""
        self._seen[layer].append(experts.detach().to(self.dtype))

    def take(self) -> torch.Tensor:
        """(N, L, k) the experts selected since the last take, forwards concatenated along N."""
        if any(not seen for seen in self._seen):
            raise RuntimeError("RouteRecorder.take: a router ran no forward since the last take.")
        layers = [torch.cat(seen) for seen in self._seen]
        self.clear()
        return torch.stack(layers, dim=1)


@contextlib.contextmanager
def routing_replayed(model: nn.Module, routes: torch.Tensor, recorder: RouteRecorder | None = None) -> Iterator[None]:
    """Inside, the model's next forward routes each token to the experts of `routes` ((B, T, L, k) or (N, L, k),
    N = B·T tokens in the order of the forward's inputs; -1: the router's own choice for that token and layer)
    instead of its own selection; the gate weights of those
    experts are recomputed from the current router logits (`RouterAdapter.gate_weights`), so they keep their
    gradient. With `recorder`, the routers' own selections are recorded too (`RouteRecorder.take`)."""
    routers = moe_routers(model)
    flat = routes.reshape(-1, *routes.shape[-2:])  # (N, L, k)
    if flat.shape[1] != len(routers):
        raise ValueError(f"routes hold {flat.shape[1]} routed layers, but {type(model).__name__} has {len(routers)}.")

    def wrap(layer: int, router: nn.Module, forward):
        adapter = ADAPTERS[type(router).__name__]

        def replayed(hidden_states, *args, **kwargs):
            logits, _, own = forward(hidden_states, *args, **kwargs)
            if recorder is not None:
                recorder.add(layer, own)
            if own.shape[0] != flat.shape[0]:
                raise ValueError(
                    f"routing replay: the forward routes {own.shape[0]} tokens, the replayed routes hold "
                    f"{flat.shape[0]}: the routes must cover the forward's tokens in its layout."
                )
            experts = flat[:, layer].to(device=own.device, dtype=own.dtype)
            experts = torch.where((experts >= 0).all(dim=-1, keepdim=True), experts, own)  # -1: not recorded
            return logits, adapter.gate_weights(router, logits, experts), experts

        return replayed

    with _routers_patched(routers, wrap):
        yield

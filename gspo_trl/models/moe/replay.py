"""Routing replay in the trainer's forwards, and the routing metrics of each training forward.

The decoding loop records the experts of every token it runs (`rollout_routes`: the prompt's at prefill, then each
sampled token's), and the rollout carries them to the micro-batches as `sampling_routes` (B, P + C, L, k), aligned
with `input_ids`, -1 where nothing was recorded. With `routing_replay="rollout"` (R3) every forward on the rollout
(π_old, reference and training forwards) routes its tokens to those experts (`routing.routing_replayed`); with
"old" (R2) the π_old pass records `old_routes` and the training forwards replay them. Training forwards of a
Mixture-of-Experts policy always record the router's own choice, which gives the drift metrics:

- `moe/route_mismatch`: the fraction of completion tokens whose expert set differs, at one layer at least, between
  the sampling forward and the training forward's own choice; `moe/route_mismatch/layer_<l>` per routed layer.
- `moe/load_imbalance`: the training forward's max expert load over the mean load, averaged over layers
  (`moe/load_imbalance_max`: the worst layer), over the completion tokens.

Owns building a rollout's routes from the decoding loop's, what each forward replays and records (`ForwardRouting`)
and the metrics' names. What it does not own: the adapters (`routing`), the metrics' arithmetic (`drift`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from .drift import load_imbalance, route_mismatch
from .routing import RouteRecorder, routing_replayed

NOT_RECORDED = -1  # a position whose route was not recorded: a replaying forward lets the router choose there


def route_recorder_for(model: nn.Module) -> RouteRecorder | None:
    """A recorder of `model`'s routes; None for a dense model, and for a Mixture-of-Experts model whose router has
    no adapter (nothing is recorded for it; `routing_replay` refuses it when the trainer is built)."""
    try:
        recorder = RouteRecorder(model)
    except ValueError:
        return None
    return recorder if recorder.num_layers else None


def rollout_routes(prompt_routes: torch.Tensor | None, step_routes: torch.Tensor, prompt_width: int) -> torch.Tensor:
    """(N, P + C, L, k) the routes of a rollout's positions (prompt then completion, as `input_ids`): the prefill's
    `prompt_routes` (N, P, L, k) where recorded, and `step_routes` (N, C, L, k), the routes of the forward that
    sampled completion token t, at position P - 1 + t (the last prompt token's for t = 0, the previous sampled
    token's after). The last completion token is sampled, never run: -1 there, and wherever nothing was recorded."""
    rows, width, layers, k = step_routes.shape
    routes = step_routes.new_full((rows, prompt_width + width, layers, k), NOT_RECORDED)
    if prompt_routes is not None:
        routes[:, :prompt_width] = prompt_routes
    routes[:, prompt_width - 1 : prompt_width - 1 + width] = step_routes
    return routes


def pad_routes(routes: torch.Tensor, width: int) -> torch.Tensor:
    """(N, width, L, k): `routes` (N, W, L, k) with -1 columns on the right."""
    return F.pad(routes, (0, 0, 0, 0, 0, width - routes.shape[1]), value=NOT_RECORDED)


def scoring_positions(routes: torch.Tensor, completion_mask: torch.Tensor) -> torch.Tensor:
    """(N, L, k) the routes (B, P + C, L, k) of the positions that score the N tokens of `completion_mask` (B, C):
    completion token t is scored from position P - 1 + t."""
    width = completion_mask.shape[1]
    return routes[:, routes.shape[1] - width - 1 : routes.shape[1] - 1][completion_mask.bool().to(routes.device)]


def routing_metrics(own: torch.Tensor, sampling: torch.Tensor | None, num_experts: int) -> dict[str, float]:
    """The routing metrics of one forward over N scored tokens: `own` (N, L, k) the router's choices, `sampling`
    (N, L, k) the rollout's routes there (-1 where not recorded), or None."""
    everything = torch.ones(1, own.shape[0], dtype=torch.bool)
    imbalance = load_imbalance(own.unsqueeze(0), everything, num_experts)
    metrics = {"moe/load_imbalance": imbalance.mean().item(), "moe/load_imbalance_max": imbalance.max().item()}
    if sampling is not None:
        sampling = sampling.to(own.device)
        recorded = (sampling >= 0).all(dim=-1).all(dim=-1).unsqueeze(0)  # (1, N)
        if bool(recorded.any()):
            per_layer, any_layer = route_mismatch(own.unsqueeze(0), sampling.unsqueeze(0), recorded)
            metrics["moe/route_mismatch"] = any_layer.item()
            for layer, value in enumerate(per_layer.tolist()):
                metrics[f"moe/route_mismatch/layer_{layer}"] = value
    return metrics


class ForwardRouting:
    """What one forward on a (B, P + C) batch replays (`replay`, (B, P + C, L, k), or None: the router's own choice)
    and records (`recorder`, for `log`: the routing metrics against the rollout's `sampling` routes)."""

    def __init__(
        self,
        replay: torch.Tensor | None,
        recorder: RouteRecorder | None = None,
        sampling: torch.Tensor | None = None,
        completion_mask: torch.Tensor | None = None,
        log: Callable[[str, float], None] | None = None,
        keep: Callable[[torch.Tensor], None] | None = None,
    ):
        self.replay, self.recorder, self.sampling = replay, recorder, sampling
        self.completion_mask, self.log, self.keep = completion_mask, log, keep

    def rows(self, rows: slice) -> ForwardRouting:
        """The replay of these rows only, and what `keep` keeps of them (the no-gradient passes, a few rows per
        forward); no metrics."""
        keep = None if self.keep is None else (lambda routes: self.keep(rows, routes))
        return ForwardRouting(None if self.replay is None else self.replay[rows], self.recorder, keep=keep)

    @property
    def pads_rows(self) -> bool:
        """Whether the forward must run on padded rows: the layout of the routes it replays or keeps."""
        return self.replay is not None or self.keep is not None

    @contextlib.contextmanager
    def applied(self, model: nn.Module, batch_shape: torch.Size, score_index: torch.Tensor | None = None):
        """Replay and record around one forward on `batch_shape` (B, P + C) padded rows, or with `score_index` (the
        packed layout's `packing.PackedBatch.score_index`) on packed rows, where it records only (no replay)."""
        recorder = self.recorder if self.log is not None or self.keep is not None else None
        if recorder is not None:
            recorder.clear()  # nothing left over from a forward that raised
        if self.replay is not None:
            if tuple(self.replay.shape[:2]) != tuple(batch_shape):
                raise ValueError(
                    f"routing replay: the routes cover {tuple(self.replay.shape[:2])} positions, the forward "
                    f"{tuple(batch_shape)}."
                )
            context = routing_replayed(model, self.replay, recorder)
        else:
            context = recorder.recording() if recorder is not None else contextlib.nullcontext()
        with context:
            yield
        if recorder is not None and self.keep is not None:
            own = recorder.take()
            self.keep(own.view(*batch_shape, *own.shape[1:]))
        elif recorder is not None:
            own = recorder.take()  # (tokens of the forward, L, k)
            if score_index is None:
                own = scoring_positions(own.view(*batch_shape, *own.shape[1:]), self.completion_mask)
            else:
                own = own[score_index.to(own.device)]
            sampling = None if self.sampling is None else scoring_positions(self.sampling, self.completion_mask)
            experts = max(int(getattr(router, "num_experts", router.weight.shape[0])) for router in recorder.routers)
            for name, value in routing_metrics(own, sampling, experts).items():
                self.log(name, value)


class RoutingReplay:
    """The trainer's routing: the `routing_replay` setting and the policy's route recorder (None: a dense model)."""

    def __init__(self, setting: str, model: nn.Module):
        self.setting = setting
        self.recorder = route_recorder_for(model)
        self._old_pass_batch = None  # the micro-batch whose π_old pass is running (`old_pass`)
        if setting != "none" and self.recorder is None:
            RouteRecorder(model)  # an unsupported router: its ValueError names it
            raise ValueError(
                f"routing_replay={setting!r} is set, but {type(model).__name__} is not a Mixture-of-Experts model: "
                "there are no routes to replay. Set routing_replay='none'."
            )

    def replayed(self, batch) -> torch.Tensor | None:
        """(B, P + C, L, k) the routes forwards on `batch` (a `MicroBatch`) replay, or None.

        "rollout": the sampler's. "old": π_old's, recorded by the π_old pass (`old_routes`); where π_old is the
        decoding loop's log-probs, the sampler's; where the weights still are the sampling ones (no `old_logps`),
        none: the router's own choice is π_old's."""
        if self.setting == "none" or self.recorder is None:
            return None
        if self.setting == "old":
            if batch.old_routes is not None or batch.old_logps is None:
                return batch.old_routes
        if batch.sampling_routes is None:
            raise ValueError(
                f"routing_replay={self.setting!r} needs the experts the decoding loop chose while sampling, but this "
                "rollout has none: multi-turn episodes, rollout_func and transformers' generate record no routes. "
                "Set routing_replay='none' for them."
            )
        return batch.sampling_routes

    def old_pass(self, score: Callable, model: nn.Module, batch) -> torch.Tensor:
        """π_old's log-probs of `batch`, `score(model, batch)`: with routing_replay='old', its forwards record their
        routes as the batch's `old_routes` (`without_grad`)."""
        self._old_pass_batch = batch
        try:
            return score(model, batch)
        finally:
            self._old_pass_batch = None

    def without_grad(self, batch) -> ForwardRouting | None:
        """The routing of a forward without a gradient on `batch`: the reference's, or inside `old_pass` π_old's, which
        with routing_replay='old' records its routes as the batch's `old_routes`."""
        if batch is self._old_pass_batch and self.setting == "old" and self.recorder is not None:

            def keep(rows: slice, routes: torch.Tensor) -> None:
                if batch.old_routes is None:
                    batch.old_routes = routes.new_full((batch.rows, *routes.shape[1:]), NOT_RECORDED)
                batch.old_routes[rows] = routes

            return ForwardRouting(None, self.recorder, keep=keep)
        replay = None if self.setting == "old" else self.replayed(batch)
        return None if replay is None else ForwardRouting(replay)

    def training(self, batch, log: Callable[[str, float], None]) -> ForwardRouting | None:
        """The routing of a training forward on `batch`: replay where set, and the routing metrics through `log`."""
        if self.recorder is None:
            return None
        return ForwardRouting(self.replayed(batch), self.recorder, batch.sampling_routes, batch.completion_mask, log)

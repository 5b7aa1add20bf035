"""Mixture-of-Experts routing: which experts each token went to, replaying a recorded choice, and how far it drifts.

`routing` owns the per-family router adapters and the record/replay contexts around a forward; `drift` the pure
metrics comparing two routings (mismatch per layer, expert-load imbalance). What it does not own: when a rollout
records or replays (the trainer's wiring) and the experts' own computation (transformers')."""

from .drift import load_imbalance, route_mismatch
from .routing import RouteRecorder, moe_routers, routes_dtype, routing_replayed

__all__ = ["RouteRecorder", "load_imbalance", "moe_routers", "route_mismatch", "routes_dtype", "routing_replayed"]

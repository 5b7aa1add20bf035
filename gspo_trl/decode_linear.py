"""The linear layers of decoding steps on CPU: the product `x @ Wᵀ` for a few rows, in the form MKL runs fastest.

A decoding step multiplies every weight matrix by one vector per row still decoding, so near the end of a rollout
it reads the whole model for one to a few rows and should run at the memory bandwidth. `F.linear(x, W)` hands MKL
a GEMM whose small dimension is the rows' N; on the AMD EPYC machines this project runs on, MKL's fp32 kernel for
that shape reads the weights at a third of the bandwidth (SmolLM2-135M's 30 blocks, 425 MB: 35 ms for one row, 45
for four, where a plain sum over as many bytes takes 12). The same product written `(W @ xᵀ)ᵀ`, the rows as the
small M, takes 15 and 20 ms. Which form is faster depends on the processor, the MKL build and the row count (on
that EPYC the plain form wins at 10 to 15 rows, on an Intel Xeon one row already runs at the bandwidth), so it is
measured, not guessed: the first decoding loop of a model times both forms for each weight shape and row count up
to `MAX_ROWS` on the model's own weights, and those choices hold for the rest of the process. One row is padded to two in the transposed form (MKL takes a single
column as a matrix-vector product, the slow path again). Both forms are IEEE fp32 products of the same numbers;
they differ in summation order, by about 1e-6 relative, as `F.linear` itself differs between row counts. A timing
can come out differently from one run to the next, so the trainer turns this off under `full_determinism`
(`decoding.sample(timed_forms=False)`).

Owns `fast_decode_linears(model)`, the context the decoding loop runs its steps in, the per-process table of
measured choices, and the transposed product itself (`transposed_linear`, with `OneRow` buffers for a caller that
keeps them across steps, as `decode_forward` does). Applies only where it was measured to matter: plain `nn.Linear`
layers with fp32 weights on CPU, without autograd or autocast, up to `MAX_ROWS` rows. What it does not own: the
decoding loop (`decoding.py`), the step's forward around the products (`decode_forward.py`).
"""

from __future__ import annotations

import contextlib
import threading
import time

import torch
from torch import nn
from transformers.utils import logging

logger = logging.get_logger(__name__)

# Row counts up to this are measured; more rows always take `F.linear` (there the gap is 10-20% of a step on the
# EPYC, not worth the seconds its measurement would take at every start).
MAX_ROWS = 8
# Models with fewer bytes of linear weights than this keep `F.linear`: their weights stay in the CPU caches, where a
# decoding step is not bound by memory.
MIN_WEIGHT_BYTES = 24 * 2**20
# The transposed form is chosen only when it is at least this much faster: close timings keep `F.linear`.
MIN_SPEEDUP = 1.1

# Switched off by benchmarks that time the plain form (A/B in one process).
enabled = True

Choices = dict[tuple[int, int], dict[int, bool]]  # weight shape (out, in) -> row count -> transposed form?


@torch.no_grad()
def measure_choices(weights: list[torch.Tensor], repeats: int = 2) -> Choices:
    """For each weight shape among `weights` and each row count from 1 to `MAX_ROWS`, whether the transposed form
    is at least `MIN_SPEEDUP` times faster than `F.linear` on this machine. Timed on the weights themselves, in
    their order, as a decoding step reads them (from memory, not from cache): per row count, passes over all of
    them alternate between the forms, one untimed pass each, then the least of `repeats` timed passes per shape
    (about 1.5 s for SmolLM2-135M)."""
    forms = (lambda w, x: nn.functional.linear(x, w), _transposed_product)
    shapes = {tuple(weight.shape) for weight in weights}
    choices: Choices = {shape: {} for shape in shapes}
    for rows in range(1, MAX_ROWS + 1):
        inputs = {in_features: torch.full((rows, in_features), 0.5) for _, in_features in shapes}
        best = [dict.fromkeys(shapes, float("inf")) for _ in forms]
        for repeat in range(repeats + 1):
            for form, fastest in zip(forms, best):
                seconds = dict.fromkeys(shapes, 0.0)
                for weight in weights:
                    start = time.perf_counter()
                    form(weight, inputs[weight.shape[1]])
                    seconds[tuple(weight.shape)] += time.perf_counter() - start
                if repeat:
                    for shape in shapes:
                        fastest[shape] = min(fastest[shape], seconds[shape])
        for shape in shapes:
            choices[shape][rows] = best[1][shape] * MIN_SPEEDUP <= best[0][shape]
    return choices


# The choices measured in this process, by the shapes of a model's linear layers in order (a snapshot of the model
# shares those of the original).
_choices: dict[tuple, Choices] = {}
_choices_lock = threading.Lock()


class OneRow:
    """Buffers of one weight's one-row transposed product, kept across decoding steps: the row padded with zeros to
    two, the (out, 2) product, and the views a step uses."""

    def __init__(self, weight: torch.Tensor):
        padded, self.product = weight.new_zeros(2, weight.shape[1]), weight.new_empty(weight.shape[0], 2)
        self.row, self.columns, self.result = padded[:1], padded.t(), self.product[:, :1].t()


def _transposed_product(weight: torch.Tensor, x: torch.Tensor, buffers: OneRow | None = None) -> torch.Tensor:
    """(rows, out) x @ weightᵀ computed as (weight @ xᵀ)ᵀ, for x (rows, in). For one row, `buffers` saves the
    padded row's and the product's allocations."""
    if x.shape[0] > 1:
        return torch.mm(weight, x.t()).t().contiguous()
    if buffers is None:
        return torch.mm(weight, torch.cat([x, x.new_zeros(1, x.shape[1])]).t())[:, :1].t().contiguous()
    buffers.row.copy_(x)
    torch.mm(weight, buffers.columns, out=buffers.product)
    return buffers.result.contiguous()


def transposed_linear(weight: torch.Tensor, bias: torch.Tensor | None, x: torch.Tensor,
                      buffers: OneRow | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` for x (rows, in) in the transposed form."""
    out = _transposed_product(weight, x, buffers)
    if bias is not None:
        out += bias
    return out


def plain(layer: nn.Module) -> bool:
    """Whether `layer` is a plain fp32 `nn.Linear` on CPU with its whole weight (not a ZeRO-3 shard), its forward
    transformers' own or the one `fast_decode_linears` gave it."""
    weight = getattr(layer, "weight", None)
    forward = layer.__dict__.get("forward")
    return (type(layer) is nn.Linear and (forward is None or hasattr(forward, "transposed_rows"))
            and type(weight) in (torch.Tensor, nn.Parameter) and weight.device.type == "cpu"
            and weight.dtype == torch.float32 and weight.dim() == 2 and weight.numel() > 0)


def _applies(layer: nn.Module) -> bool:
    return plain(layer) and "forward" not in layer.__dict__  # no hook wraps its forward already


def transposed_rows(layer: nn.Module) -> dict[int, bool]:
    """For each row count, whether `layer` computes the transposed form while `fast_decode_linears` is active ({}
    for a layer it left as it is)."""
    return getattr(layer.__dict__.get("forward"), "transposed_rows", {})


def _forward(layer: nn.Linear, transposed: dict[int, bool], x: torch.Tensor) -> torch.Tensor:
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if (not transposed.get(rows) or x.dtype != torch.float32 or torch.is_grad_enabled()
            or torch.is_autocast_enabled("cpu") or type(layer.weight) not in (torch.Tensor, nn.Parameter)):
        return nn.functional.linear(x, layer.weight, layer.bias)
    out = transposed_linear(layer.weight, layer.bias, x.reshape(rows, x.shape[-1]))
    return out.view(*x.shape[:-1], out.shape[-1])


@contextlib.contextmanager
def fast_decode_linears(model: nn.Module):
    """While active, the fp32 CPU `nn.Linear` layers of `model` compute products of up to `MAX_ROWS` rows without
    autograd in whichever form was measured faster for that row count. Their forwards are restored on exit."""
    layers = [layer for layer in model.modules() if _applies(layer)] if enabled else []
    if sum(layer.weight.numel() * 4 for layer in layers) < MIN_WEIGHT_BYTES:
        yield
        return
    key = tuple(tuple(layer.weight.shape) for layer in layers)
    with _choices_lock:
        if key not in _choices:
            start = time.perf_counter()
            _choices[key] = measure_choices([layer.weight for layer in layers])
            logger.info(f"decode_linear: measured in {time.perf_counter() - start:.1f} s; row counts that take the "
                        f"transposed form, by weight shape: "
                        + "; ".join(f"{out}x{inp}: {[rows for rows, yes in by_rows.items() if yes]}"
                                    for (out, inp), by_rows in _choices[key].items()))
    choices = _choices[key]
    layers = [layer for layer in layers if any(choices[tuple(layer.weight.shape)].values())]
    forwards = []
    for layer in layers:
        layer.forward = forward = _bound(layer, choices[tuple(layer.weight.shape)])
        forwards.append(forward)
    try:
        yield
    finally:
        for layer, forward in zip(layers, forwards):
            if layer.__dict__.get("forward") is forward:
                del layer.forward


def _bound(layer: nn.Linear, transposed: dict[int, bool]):
    def forward(x: torch.Tensor) -> torch.Tensor:
        return _forward(layer, transposed, x)
    forward.transposed_rows = transposed
    return forward

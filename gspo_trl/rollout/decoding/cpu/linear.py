"""The linear layers of decoding steps on CPU: the product `x @ Wᵀ` for a few rows, in the form MKL or oneDNN runs
fastest.

A decoding step multiplies every weight matrix by one vector per row still decoding, so near the end of a rollout
it reads the whole model for one to a few rows and should run at the memory bandwidth. `F.linear(x, W)` hands MKL
a GEMM whose small dimension is the rows' N; on the AMD EPYC machines this project runs on, MKL's fp32 kernel for
that shape reads the weights at a third of the bandwidth (SmolLM2-135M's 30 blocks, 425 MB: 35 ms for one row, 45
for four, where a plain sum over as many bytes takes 12). Three forms of the same product:

- `linear`: `F.linear` itself.
- `transposed`: `(W @ xᵀ)ᵀ`, the rows as the small M (15 and 20 ms there). One row is padded to two (MKL takes a
  single column as a matrix-vector product, the slow path again).
- `packed`: oneDNN's matmul over a copy of the weight reordered into its blocked layout once per decoding loop
  (`PackedWeight`). With 4 to 64 rows, the steps most of a rollout takes, MKL's GEMM reads weights that are not in
  the CPU caches at 40-75% of the matmul peak; over SmolLM2-135M's layers the packed form took 29-35 ms for 16
  rows where `F.linear` took 59-79, and 81-93 for 64 rows against 124-162 (2-core EPYC, 2026-11-26).
- `compiled`: `kernel`'s C loop for one to eight rows, each weight row read once at about the memory
  bandwidth (the 30 blocks for one or two rows: 11-12 ms, against 16 transposed; where no C compiler is found, the
  other forms).

Which form is faster depends on the processor, the MKL and oneDNN builds and the row count, so it is measured, not
guessed: the first decoding loop of a model times the forms for each weight shape at each row count of
`MEASURED_ROWS` on the model's own weights, and those choices hold for the rest of the process (a row count between
two measured ones takes the larger one's choice). All forms are IEEE fp32 products of the same numbers; they differ
in summation order, by about 1e-6 relative, as `F.linear` itself differs between row counts. A timing can come out
differently from one run to the next, so the trainer turns this off under `full_determinism`
(`CPUKernels.timed`).

Owns `fast_decode_linears(model)`, the context the decoding loop runs its steps in, the per-process table of
measured choices, and the products themselves (`transposed_linear`, with `OneRow` buffers for a caller that keeps
them across steps, as `forward` does; `PackedWeight`; `compiled_linear`). Applies only where it was measured
to matter: plain `nn.Linear` layers with fp32 weights on CPU, without autograd or autocast, up to `MAX_ROWS` rows.
What it does not own: the decoding loop (`decoding.dynamic`), the step's forward around the products
(`forward.py`), the compiled loop itself and its build (`kernel.py`), which forms are on offer (`CPUKernels`).
"""

from __future__ import annotations

import contextlib
import threading
import time

import torch
from torch import nn
from transformers.utils import logging

from . import kernel

logger = logging.get_logger(__name__)

LINEAR, TRANSPOSED, PACKED, COMPILED = "linear", "transposed", "packed", "compiled"
# The row counts whose forms are timed; any other count up to the last takes the next larger one's choice, and more
# rows (prefills) always take `F.linear`.
MEASURED_ROWS = (1, 2, 3, 4, 5, 6, 7, 8, 16, 32, 64)
MAX_ROWS = MEASURED_ROWS[-1]
# Models with fewer bytes of linear weights than this keep `F.linear`: their weights stay in the CPU caches, where a
# decoding step is not bound by memory.
MIN_WEIGHT_BYTES = 24 * 2**20
# Another form is chosen only when it is at least this much faster than `F.linear`: close timings keep `F.linear`.
MIN_SPEEDUP = 1.1
# The row count oneDNN lays a packed weight out for (any count runs on it; this one is the largest measured).
PACK_ROWS = MAX_ROWS

Choices = dict[tuple[int, int], dict[int, str]]  # weight shape (out, in) -> row count (1..MAX_ROWS) -> form


class PackedWeight:
    """A copy of `weight` in oneDNN's blocked layout, for `linear`. Made again if the weight changed in place since
    (its version counter moved), so the product is always the current weight's."""

    def __init__(self, weight: torch.Tensor):
        self.weight = weight
        self._pack()

    def _pack(self) -> None:
        self.version = self.weight._version
        self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), PACK_ROWS)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """`F.linear(x, weight, bias)` for fp32 x (..., in) without autograd."""
        if self.weight._version != self.version:
            self._pack()
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, bias, "none", [], "")


_packing: bool | None = None


def packing_available() -> bool:
    """Whether this torch build runs oneDNN's packed fp32 linear on CPU (checked once, on a small product)."""
    global _packing
    if _packing is None:
        try:
            weight, x = torch.randn(24, 16), torch.randn(3, 16)
            _packing = bool(torch.backends.mkldnn.is_available()) and torch.allclose(
                PackedWeight(weight).linear(x, None), nn.functional.linear(x, weight), rtol=1e-4, atol=1e-5
            )
        except (AttributeError, RuntimeError, NotImplementedError):
            _packing = False
    return _packing


@torch.no_grad()
def measure_choices(
    weights: list[torch.Tensor], repeats: int = 2, packing: bool = True, compiled: bool = True
) -> Choices:
    """For each weight shape among `weights` and each row count from 1 to `MAX_ROWS`, the form to compute it in:
    the fastest of `transposed`, `packed` (with `packing`, when oneDNN runs here) and `compiled` (with `compiled`, up
    to its `MAX_LINEAR_ROWS`, when `kernel` is built here) if it is at least `MIN_SPEEDUP` times faster than
    `F.linear`, else `linear`.
    Timed at the row counts of `MEASURED_ROWS` on the weights themselves, in their order, as a decoding step reads
    them (from memory, not from cache): per row count, passes over all of them alternate between the forms, one
    untimed pass each, then the least of `repeats` timed passes per shape (about 5 s for SmolLM2-135M on 2 cores)."""
    products = {
        LINEAR: lambda index, x: nn.functional.linear(x, weights[index]),
        TRANSPOSED: lambda index, x: _transposed_product(weights[index], x),
    }
    if packing and packing_available():
        packed = [PackedWeight(weight) for weight in weights]
        products[PACKED] = lambda index, x: packed[index].linear(x, None)
    if compiled and kernel.available():
        products[COMPILED] = lambda index, x: kernel.linear(x, weights[index], None)
    shapes = {tuple(weight.shape) for weight in weights}
    measured: dict[tuple[int, int], dict[int, str]] = {shape: {} for shape in shapes}
    for rows in MEASURED_ROWS:
        inputs = {in_features: torch.full((rows, in_features), 0.5) for _, in_features in shapes}
        timed = {
            form: product for form, product in products.items() if form != COMPILED or rows <= kernel.MAX_LINEAR_ROWS
        }
        best = {form: dict.fromkeys(shapes, float("inf")) for form in timed}
        for repeat in range(repeats + 1):
            for form, product in timed.items():
                seconds = dict.fromkeys(shapes, 0.0)
                for index, weight in enumerate(weights):
                    start = time.perf_counter()
                    product(index, inputs[weight.shape[1]])
                    seconds[tuple(weight.shape)] += time.perf_counter() - start
                if repeat:
                    for shape in shapes:
                        best[form][shape] = min(best[form][shape], seconds[shape])
        for shape in shapes:
            fastest = min((form for form in timed if form != LINEAR), key=lambda form: best[form][shape])
            measured[shape][rows] = fastest if best[fastest][shape] * MIN_SPEEDUP <= best[LINEAR][shape] else LINEAR
    return {
        shape: {rows: by_rows[min(m for m in MEASURED_ROWS if m >= rows)] for rows in range(1, MAX_ROWS + 1)}
        for shape, by_rows in measured.items()
    }


# The choices measured in this process, by the forms on offer and the shapes of a model's linear layers in order (a
# snapshot of the model shares those of the original).
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


def transposed_linear(
    weight: torch.Tensor, bias: torch.Tensor | None, x: torch.Tensor, buffers: OneRow | None = None
) -> torch.Tensor:
    """`F.linear(x, weight, bias)` for x (rows, in) in the transposed form."""
    out = _transposed_product(weight, x, buffers)
    if bias is not None:
        out += bias
    return out


def compiled_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` for x (rows, in) in the compiled form (x made contiguous: e.g. the last position
    of a prefill); `F.linear` itself where the kernel does not take these tensors (more rows than it computes)."""
    out = kernel.linear(x.contiguous(), weight, bias)
    return nn.functional.linear(x, weight, bias) if out is None else out


def plain(layer: nn.Module) -> bool:
    """Whether `layer` is a plain fp32 `nn.Linear` on CPU with its whole weight (not a ZeRO-3 shard), its forward
    transformers' own or the one `fast_decode_linears` gave it."""
    weight = getattr(layer, "weight", None)
    forward = layer.__dict__.get("forward")
    return (
        type(layer) is nn.Linear
        and (forward is None or hasattr(forward, "forms"))
        and type(weight) in (torch.Tensor, nn.Parameter)
        and weight.device.type == "cpu"
        and weight.dtype == torch.float32
        and weight.dim() == 2
        and weight.numel() > 0
    )


def _applies(layer: nn.Module) -> bool:
    return plain(layer) and "forward" not in layer.__dict__  # no hook wraps its forward already


def forms(layer: nn.Module) -> dict[int, str]:
    """For each row count, the form `layer` computes in while `fast_decode_linears` is active ({} for a layer it left
    as it is: `F.linear` throughout)."""
    return getattr(layer.__dict__.get("forward"), "forms", {})


def packed_weight(layer: nn.Module) -> PackedWeight | None:
    """The `PackedWeight` of `layer` while `fast_decode_linears` is active and some row count takes that form."""
    return getattr(layer.__dict__.get("forward"), "packed", None)


def _forward(layer: nn.Linear, by_rows: dict[int, str], packed: PackedWeight | None, x: torch.Tensor) -> torch.Tensor:
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    form = by_rows.get(rows, LINEAR)
    if (
        form == LINEAR
        or x.dtype != torch.float32
        or torch.is_grad_enabled()
        or torch.is_autocast_enabled("cpu")
        or type(layer.weight) not in (torch.Tensor, nn.Parameter)
    ):
        return nn.functional.linear(x, layer.weight, layer.bias)
    if form == PACKED and packed.weight is layer.weight:
        return packed.linear(x, layer.bias)
    if form == PACKED:  # the layer was given another weight tensor while the context was active
        return nn.functional.linear(x, layer.weight, layer.bias)
    if form == COMPILED:
        out = compiled_linear(x.reshape(rows, x.shape[-1]), layer.weight, layer.bias)
        return out.view(*x.shape[:-1], out.shape[-1])
    out = transposed_linear(layer.weight, layer.bias, x.reshape(rows, x.shape[-1]))
    return out.view(*x.shape[:-1], out.shape[-1])


@contextlib.contextmanager
def fast_decode_linears(model: nn.Module, packing: bool = True, compiled: bool = True):
    """While active, the fp32 CPU `nn.Linear` layers of `model` compute products of up to `MAX_ROWS` rows without
    autograd in whichever form was measured fastest for that row count, among `F.linear`, the transposed form, the
    packed one (with `packing`) and the compiled one (with `compiled`). Their forwards are restored, and the packed
    copies of their weights dropped, on exit. Entered under CPU autocast (`bf16=True` on CPU), where every product is
    autocast's own, it leaves the layers alone: no measurement, no packed copies."""
    autocast = torch.is_autocast_enabled("cpu")
    layers = [layer for layer in model.modules() if _applies(layer)] if not autocast else []
    if not layers or sum(layer.weight.numel() * 4 for layer in layers) < MIN_WEIGHT_BYTES:
        yield
        return
    # The forms on offer are part of the key: a loop without the compiled one (`CPUKernels.compiled`) gets choices
    # measured without it.
    compiled = compiled and kernel.available()
    key = (packing, compiled, *(tuple(layer.weight.shape) for layer in layers))
    with _choices_lock:
        if key not in _choices:
            start = time.perf_counter()
            _choices[key] = measure_choices([layer.weight for layer in layers], packing=packing, compiled=compiled)
            logger.info(
                f"cpu.linear: measured in {time.perf_counter() - start:.1f} s; the form of each row "
                "count, by weight shape: "
                + "; ".join(f"{out}x{inp}: {describe_forms(by_rows)}" for (out, inp), by_rows in _choices[key].items())
            )
    choices = _choices[key]
    layers = [layer for layer in layers if set(choices[tuple(layer.weight.shape)].values()) != {LINEAR}]
    forwards = []
    with torch.no_grad():
        for layer in layers:
            layer.forward = forward = _bound(layer, choices[tuple(layer.weight.shape)])
            forwards.append(forward)
    try:
        yield
    finally:
        for layer, forward in zip(layers, forwards):
            if layer.__dict__.get("forward") is forward:
                del layer.forward


def describe_forms(by_rows: dict[int, str]) -> str:
    """The measured row counts that take each form other than `linear`, e.g. "transposed [1, 2], packed [3, 4]"."""
    return (
        ", ".join(
            f"{form} {[rows for rows in MEASURED_ROWS if by_rows[rows] == form]}"
            for form in (TRANSPOSED, PACKED, COMPILED)
            if form in by_rows.values()
        )
        or LINEAR
    )


def _bound(layer: nn.Linear, by_rows: dict[int, str]):
    packed = PackedWeight(layer.weight) if PACKED in by_rows.values() else None

    def forward(x: torch.Tensor) -> torch.Tensor:
        return _forward(layer, by_rows, packed, x)

    forward.forms, forward.packed = by_rows, packed
    return forward

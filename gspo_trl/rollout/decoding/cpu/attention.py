"""The attention of decoding steps on CPU: one new token per row over its KV cache, the query heads of each
key/value head packed together.

With grouped-query attention (SmolLM2-135M: 9 query heads over 3 key/value heads) a decoding step's query is
(rows, 9, 1, head_dim). When the step needs no mask (no left padding among the rows still decoding: a batch of one
prompt or of prompts of one length, or the rows of the longest prompt once the others have ended), transformers'
SDPA path hands it to `scaled_dot_product_attention(..., enable_gqa=True)`, and on CPU that kernel reads each
key/value head once per query head of its group: at a 4000-token context a step's attention reads the 184 MB cache
three times over. Written as (rows, 3, 3, head_dim), the query heads of a group as three query positions over their
shared key/value head, the same attention reads it once; transformers does this itself when there is a mask. On
the 2-core EPYC an unpadded one-row step over 4000 positions went from 51.4 to 47.4 ms, a four-row one from 95.1
to 83.9 (`benchmarks/decode_step.py`); at 128 positions the forms are within noise. Same softmax over the same
keys, fp32: the forms differ by summation order (about 1e-7).

The packed attention itself runs in `kernel`'s compiled loop or in SDPA, whichever is faster here: the loop read
the cache at about twice SDPA's speed on the 2-core EPYC (the result within float rounding of SDPA's), but that
depends on the processor, the row count and the context, so the first decoding loop of a model times the two on the
model's head shapes at the points of `MEASURED_ROWS` x `MEASURED_POSITIONS` (`measure_kernel_choice`, well under a
second), and a step takes the kernel only where it was at least `MIN_SPEEDUP` times faster there. On the 2-core
EPYC (2026-11-27), SmolLM2-135M's heads (3 x 3, head_dim 64) took the kernel at 2,048 positions (1.4-1.6x faster)
and at 8 rows over 256 (1.35x), SDPA at one row over 256 (a tie); a test model's heads of 16 dimensions took SDPA
everywhere (the kernel 1.2-1.5x slower). Without timing (`full_determinism`: a timing may differ between runs) the
kernel computes every packed call it takes.

Owns `packed_gqa_decoding(model, ...)`, the context the decoding loop runs its steps in: it switches an SDPA model on
CPU to an attention function registered with transformers (`NAME`, with SDPA's masks), which packs the heads for
one-token, no-autograd steps and leaves every other call to transformers' SDPA function, and yields the `Attend` of
the loop (the packed attention with its kernel choice), which `forward`'s steps call too; and the per-process table
of measured kernel choices. What it does not own: the decoding loop (`decoding.dynamic`), the linear layers of a step
(`linear.py`), the kernel and its build (`kernel.py`).
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
import time
from collections.abc import Callable

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask
from transformers.utils import logging

from . import kernel

logger = logging.get_logger(__name__)

NAME = "gspo_trl_decode_sdpa"

# The (rows, positions) points where the compiled attention is timed against SDPA: a step takes the choice of the
# first measured row count and context length at or above its own (the last ones beyond them).
MEASURED_ROWS = (1, 8)
MEASURED_POSITIONS = (256, 2048)
# The kernel is chosen at a point only when it is at least this much faster than SDPA there: close timings keep SDPA.
MIN_SPEEDUP = 1.1
REPEATS = 3  # timed calls per form and point, after an untimed one; the least counts


class KernelChoice:
    """Where a step's packed attention runs in the compiled kernel: by (rows, positions) point, measured
    (`measure_kernel_choice`), or everywhere (`KernelChoice.everywhere()`, no timing)."""

    def __init__(self, by_point: dict[tuple[int, int], bool] | None):
        self.by_point = by_point  # (rows, positions) of MEASURED_ROWS x MEASURED_POSITIONS -> kernel; None: always

    @classmethod
    def everywhere(cls) -> KernelChoice:
        return cls(None)

    def uses_kernel(self, rows: int, positions: int) -> bool:
        if self.by_point is None:
            return True
        point_rows = next((measured for measured in MEASURED_ROWS if measured >= rows), MEASURED_ROWS[-1])
        point_positions = next(
            (measured for measured in MEASURED_POSITIONS if measured >= positions), MEASURED_POSITIONS[-1]
        )
        return self.by_point[point_rows, point_positions]

    def describe(self) -> str:
        if self.by_point is None:
            return "the kernel everywhere"
        kernel_points = [point for point, chosen in self.by_point.items() if chosen]
        return f"the kernel at (rows, positions) {kernel_points}, SDPA elsewhere" if kernel_points else "SDPA"


def choose_kernel(seconds: dict[tuple[int, int], tuple[float, float]]) -> KernelChoice:
    """The choice from timings: (rows, positions) -> (the kernel's seconds, SDPA's seconds)."""
    return KernelChoice({point: ours * MIN_SPEEDUP <= sdpa for point, (ours, sdpa) in seconds.items()})


PointTimer = Callable[[int, int], tuple[float, float]]  # (rows, positions) -> (kernel seconds, SDPA seconds)


def time_point(kv_heads: int, group: int, head_dim: int) -> PointTimer:
    """The timer `measure_kernel_choice` uses: both forms on random fp32 inputs of these head shapes, alternating,
    one untimed call each, then the least of `REPEATS` timed ones."""

    @torch.no_grad()
    def seconds(rows: int, positions: int) -> tuple[float, float]:
        generator = torch.Generator().manual_seed(0)
        query = torch.randn(rows, kv_heads, group, head_dim, generator=generator)
        keys, values = (torch.randn(rows, kv_heads, positions, head_dim, generator=generator) for _ in range(2))
        scale = head_dim**-0.5
        forms = (
            lambda: kernel.attention(query, keys, values, None, scale),
            lambda: torch.nn.functional.scaled_dot_product_attention(query, keys, values, scale=scale),
        )
        best = [float("inf")] * len(forms)
        for repeat in range(REPEATS + 1):
            for index, form in enumerate(forms):
                start = time.perf_counter()
                form()
                if repeat:
                    best[index] = min(best[index], time.perf_counter() - start)
        return best[0], best[1]

    return seconds


def measure_kernel_choice(kv_heads: int, group: int, head_dim: int, timer: PointTimer | None = None) -> KernelChoice:
    """The kernel against SDPA at every point of `MEASURED_ROWS` x `MEASURED_POSITIONS` for these head shapes (the
    kernel built here: `kernel.available()`). `timer`: `time_point`'s by default; a test passes its own."""
    timer = timer or time_point(kv_heads, group, head_dim)
    return choose_kernel(
        {(rows, positions): timer(rows, positions) for rows in MEASURED_ROWS for positions in MEASURED_POSITIONS}
    )


# The choices measured in this process, by (kv_heads, group, head_dim).
_choices: dict[tuple[int, int, int], KernelChoice] = {}
_choices_lock = threading.Lock()


class Attend:
    """The packed attention of one decoding loop's steps: `kernel_choice` None (SDPA throughout), or where the
    compiled kernel computes it."""

    def __init__(self, kernel_choice: KernelChoice | None):
        self.kernel_choice = kernel_choice

    def __call__(
        self,
        query: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        mask: torch.Tensor | None,
        scale: float | None,
    ) -> torch.Tensor:
        """Query (rows, kv_heads, group, head_dim) over keys and values (rows, kv_heads, positions, head_dim), `mask`
        SDPA's: the compiled kernel where it was chosen and applies, else SDPA."""
        if scale is None:
            scale = query.shape[-1] ** -0.5  # SDPA's default
        out = None
        if self.kernel_choice is not None and self.kernel_choice.uses_kernel(query.shape[0], keys.shape[2]):
            out = kernel.attention(query, keys, values, mask, scale)
        if out is None:
            out = torch.nn.functional.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=scale)
        return out


SDPA = Attend(None)  # the packed form in SDPA alone
# The `Attend` of the innermost `packed_gqa_decoding` context (the registered attention function has no other way
# to reach it); SDPA outside one.
_attend: contextvars.ContextVar[Attend] = contextvars.ContextVar("gspo_trl_packed_attend", default=SDPA)


def packed_gqa_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """transformers' attention-function signature. One query token per row, grouped key/value heads, no autograd
    and nothing but a mask shared by all heads: the packed form; anything else: `sdpa_attention_forward`."""
    groups = getattr(module, "num_key_value_groups", 1)
    rows, heads, length, head_dim = query.shape
    if (
        length != 1
        or groups <= 1
        or dropout
        or torch.is_grad_enabled()
        or query.device.type != "cpu"
        or (attention_mask is not None and attention_mask.shape[1] != 1)
        or any(kwargs.get(name) for name in ("softcap", "output_attentions"))
        or any(kwargs.get(name) is not None for name in ("position_bias", "s_aux"))
    ):
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    packed = query.reshape(rows, heads // groups, groups, head_dim)  # a group's query heads as query positions
    out = _attend.get()(packed, key, value, attention_mask, scaling)
    return out.reshape(rows, 1, heads, value.shape[-1]), None  # (rows, 1, heads, head_dim), as SDPA's path returns


@contextlib.contextmanager
def attending(attend: Attend):
    """While active, `packed_gqa_attention` computes the packed form with `attend` (in this thread)."""
    token = _attend.set(attend)
    try:
        yield attend
    finally:
        _attend.reset(token)


AttentionInterface.register(NAME, packed_gqa_attention)
ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, sdpa_mask)


def kernel_choice(config, timed: bool) -> KernelChoice | None:
    """Where the packed attention of a model with this configuration runs in the compiled kernel: None where it is
    not built; with `timed`, measured once per process and head shape; without, everywhere."""
    if not kernel.available():
        return None
    if not timed:
        return KernelChoice.everywhere()
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    shape = (kv_heads, heads // kv_heads, head_dim)
    with _choices_lock:
        if shape not in _choices:
            start = time.perf_counter()
            _choices[shape] = measure_kernel_choice(*shape)
            logger.info(
                f"cpu.attention: measured in {time.perf_counter() - start:.2f} s for (kv heads, group, head_dim) "
                f"{shape}: {_choices[shape].describe()}"
            )
    return _choices[shape]


@contextlib.contextmanager
def packed_gqa_decoding(model: torch.nn.Module, compiled: bool = True, timed: bool = True):
    """While active, `model` (SDPA attention, grouped key/value heads, on CPU) attends with `packed_gqa_attention`,
    in the compiled kernel (with `compiled`) where it was timed faster than SDPA (with `timed`; without, wherever
    it takes the tensors); its configuration's attention implementation is restored on exit. Yields the loop's
    `Attend`, or None for other models, which are left as they are."""
    config = getattr(model, "config", None)
    parameter = next(model.parameters(), None)
    if (
        config is None
        or getattr(config, "_attn_implementation", None) != "sdpa"
        or parameter is None
        or parameter.device.type != "cpu"
        or getattr(config, "num_key_value_heads", None) in (None, getattr(config, "num_attention_heads", None))
    ):
        yield None
        return
    with attending(Attend(kernel_choice(config, timed) if compiled else None)) as attend:
        config._attn_implementation = NAME
        try:
            yield attend
        finally:
            config._attn_implementation = "sdpa"

"""gspo-trl's accelerations of one-token decoding steps on CPU, behind one switch.

Near the end of a rollout a few rows decode alone for thousands of steps, and on CPU such a step is bound by memory:
it reads every weight and the whole KV cache for a handful of rows. Four parts bring it near the memory bandwidth
(docs/design/performance.md): `linear`, each product in the form timed fastest here for its weight shape and row
count; `attention`, the query heads of a key/value head packed into one attention call, in the compiled kernel where
it was timed faster than SDPA; `forward`, the step's forward without transformers' per-module glue; `kernel`, the
compiled C loops (attention, few-row products, rotary embedding) and their build. Each leaves PyTorch's own operators
wherever it does not apply (another device, dtype, architecture, autograd or autocast), and the results are
transformers' within float rounding (the step's forward bit for bit).

Owns `CPUKernels`, which of these a decoding loop uses (`GSPOConfig.cpu_decoding_kernels` through `for_setting`, or
a benchmark's own), and `accelerate(model, kernels)`, the one call the decoding loop (`decoding.dynamic`) makes.
What it does not own: the loop itself, the sampling, the cache.
"""

from __future__ import annotations

import contextlib
import functools
import os
from dataclasses import dataclass

import torch
from torch import nn
from transformers.utils import logging

from .attention import packed_gqa_decoding
from .forward import StepForward
from .linear import fast_decode_linears

logger = logging.get_logger(__name__)

SETTINGS = ("auto", "on", "off")  # GSPOConfig.cpu_decoding_kernels


@dataclass(frozen=True)
class CPUKernels:
    """The accelerations a decoding loop's CPU steps use; each lever off keeps PyTorch's own form of that part.
    Benchmarks switch one off to time the loop without it."""

    linear_forms: bool = True  # each product in the form timed fastest (`linear`); False: `F.linear` throughout
    packing: bool = True  # oneDNN's packed weights among the product forms timed
    compiled: bool = True  # the compiled kernels (`kernel`): a product form, the attention, the rotary embedding
    packed_attention: bool = True  # the grouped query heads packed (`attention`); False: transformers' attention
    step_forward: bool = True  # `StepForward` (needs the packed attention); False: transformers' forward
    # Choices by timing on this machine. False (`full_determinism`: a timing can differ between runs, and the forms
    # in the last bits of the samples): `F.linear` for every product, the compiled attention wherever it applies.
    timed: bool = True


ALL = CPUKernels()  # every acceleration, each chosen by timing where it is timed


def for_setting(setting: str, device: torch.device | str, full_determinism: bool = False) -> CPUKernels | None:
    """The kernels `GSPOConfig.cpu_decoding_kernels` asks for when the policy samples on `device`: "auto", all of
    them on CPU and none elsewhere; "on", all of them (they apply to CPU tensors only); "off", none (None). Under
    `full_determinism`, no choice by timing (`CPUKernels.timed`)."""
    if setting not in SETTINGS:
        raise ValueError(f"cpu_decoding_kernels must be one of {SETTINGS}, got {setting!r}.")
    if "GSPO_TRL_DECODE_KERNEL" in os.environ:
        _environment_variable_ignored()
    if setting == "off" or (setting == "auto" and torch.device(device).type != "cpu"):
        return None
    return CPUKernels(timed=False) if full_determinism else ALL


@functools.cache
def _environment_variable_ignored() -> None:
    logger.warning(
        "GSPO_TRL_DECODE_KERNEL is no longer read: set GSPOConfig.cpu_decoding_kernels ('auto', 'on' or 'off') instead."
    )


@contextlib.contextmanager
def accelerate(model: nn.Module, kernels: CPUKernels | None):
    """While active, `model`'s decoding steps on CPU run with `kernels` (None: none of them): its linear layers in
    their timed forms and its attention packed, both restored on exit. Yields the `StepForward` the loop calls for
    its one-token steps, or None where there is none (every step then runs the model's own forward)."""
    if kernels is None:
        yield None
        return
    timed_forms = kernels.linear_forms and kernels.timed
    with contextlib.ExitStack() as contexts:
        if timed_forms:
            contexts.enter_context(fast_decode_linears(model, packing=kernels.packing, compiled=kernels.compiled))
        attend = None
        if kernels.packed_attention:
            attend = contexts.enter_context(packed_gqa_decoding(model, compiled=kernels.compiled, timed=kernels.timed))
        step_forward = None
        if kernels.step_forward and attend is not None:
            step_forward = StepForward.of(model, attend, timed_forms=timed_forms, compiled=kernels.compiled)
        yield step_forward

"""Per-row random streams: sampling whose randomness belongs to each completion, not to the batch.

A row's key (`stream_keys`, from the seed, the step and the row's global index) and a token position give
its uniforms (`keyed_uniform`), so a completion samples the same tokens in any batch, on any number of
processes, and while training overlaps sampling. `KeyedGumbelSampler` brings the same streams to
transformers' `generate`. What it does not own: the decoding loops that draw from them (`decoding/`).
"""

from __future__ import annotations

import torch
from transformers import LogitsProcessor
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

_GOLDEN = 0x9E3779B97F4A7C15


def _signed(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


def _shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> sign-extends)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def _mix64(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser on int64 tensors (multiplication wraps modulo 2^64)."""
    x = (x ^ _shift_right(x, 30)) * _signed(0xBF58476D1CE4E5B9)
    x = (x ^ _shift_right(x, 27)) * _signed(0x94D049BB133111EB)
    return x ^ _shift_right(x, 31)


def stream_keys(seed: int, *ids: torch.Tensor | int) -> torch.Tensor:
    """One int64 key per row from a seed and row identifiers (e.g. step, mode, global row index)."""
    key = _mix64(torch.tensor(seed, dtype=torch.int64))
    for value in ids:
        value = torch.as_tensor(value, dtype=torch.int64)
        key = _mix64(key ^ (value + _signed(_GOLDEN)))
    return key


def keyed_uniform(keys: torch.Tensor, position: int, vocab_size: int) -> torch.Tensor:
    """(N, V) float64 uniforms in (0, 1), a pure function of (key, position, token)."""
    step_keys = _mix64(keys ^ _mix64(torch.tensor(position, dtype=torch.int64, device=keys.device)))  # (N,)
    tokens = torch.arange(vocab_size, device=keys.device, dtype=torch.int64)
    bits = _mix64(step_keys.unsqueeze(1) ^ _mix64(tokens + _signed(_GOLDEN)).unsqueeze(0))  # (N, V)
    return (_shift_right(bits, 11).double() + 0.5) * 2.0**-53


class KeyedGumbelSampler(LogitsProcessor):
    """Sampling whose randomness belongs to each row: argmax(warped scores + Gumbel noise) is an exact
    sample of softmax(warped scores) (the Gumbel-max trick), and the noise is a function of the row's
    key, the completion position and the token, not of the batch or the process the row is in."""

    def __init__(self, keys, prompt_length, temperature, top_k, top_p, min_p):
        self.keys, self.prompt_length = keys, prompt_length
        self.warpers = []
        if temperature is not None and temperature != 1.0:
            self.warpers.append(TemperatureLogitsWarper(temperature))
        if top_k:
            self.warpers.append(TopKLogitsWarper(top_k))
        if top_p is not None and top_p < 1.0:
            self.warpers.append(TopPLogitsWarper(top_p))
        if min_p is not None:
            self.warpers.append(MinPLogitsWarper(min_p))

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        for warper in self.warpers:
            scores = warper(input_ids, scores)
        uniform = keyed_uniform(self.keys, input_ids.shape[1] - self.prompt_length, scores.shape[1])
        gumbel = -torch.log(-torch.log(uniform))
        return (scores.double() + gumbel).to(scores.dtype)

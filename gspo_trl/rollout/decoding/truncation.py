"""The sampler's truncation of the policy (top-k, top-p, min-p): the mass it keeps and the log-probs it samples with.

With top-k, top-p or min-p the decoding loop does not sample from the policy p = softmax(logits / T) but from the
truncated, renormalised distribution μ(y) = p(y) / Z on the kept tokens, Z = Σ_{v kept} p(v): log μ(y) = log p(y) −
log Z. The loop records log μ as the sampler's log-probs (`sampling_logps`, what the importance-sampling correction
divides by) and log Z (`kept_log_mass`), so that log p = log μ + log Z, the policy's own log-prob that training
scores, can be recovered as π_old (`policy_logps`). Pure functions: tensors in, tensors out. What this module does
not own: the warpers themselves (transformers'), the sampling step (`dynamic.draw`).
"""

from __future__ import annotations

import torch
from transformers import LogitsProcessorList
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

TRUNCATING_WARPERS = (TopKLogitsWarper, TopPLogitsWarper, MinPLogitsWarper)


def truncates(processors: LogitsProcessorList) -> bool:
    """Whether `processors` cut tokens out of the distribution (a top-k, top-p or min-p warper)."""
    return any(isinstance(processor, TRUNCATING_WARPERS) for processor in processors)


def truncated_at(processors: LogitsProcessorList, temperature: float | None = None) -> float | None:
    """The temperature of the policy whose kept mass a loop sampling with `processors` measures: `temperature` (the
    one its log-probs are recorded at) or else the processors' own (1 without a temperature warper); None where the
    processors cut nothing."""
    if not truncates(processors):
        return None
    if temperature is not None:
        return temperature
    scaling = [processor.temperature for processor in processors if isinstance(processor, TemperatureLogitsWarper)]
    return scaling[0] if scaling else 1.0


def kept_log_mass(scaled_logits: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    """(n,) float32 log Z: the log of the mass p = softmax(`scaled_logits`) (n, V) puts on the tokens the sampler
    kept, those whose processed `scores` (n, V) are not -inf. 0 where nothing was cut; ≤ 0 always."""
    scaled = scaled_logits.float()
    kept = torch.isfinite(scores)
    total = torch.logsumexp(scaled, dim=-1)  # (n,)
    on_kept = torch.logsumexp(scaled.masked_fill(~kept, -torch.inf), dim=-1)  # (n,)
    return (on_kept - total).clamp(max=0.0)  # rounding can put the full kept set a hair above the total


def truncated_logps(logps: torch.Tensor, log_mass: torch.Tensor) -> torch.Tensor:
    """log μ(y) = log p(y) − log Z: the sampler's log-probs of tokens whose policy log-probs are `logps`, under a
    truncation that kept mass exp(`log_mass`) (same shapes)."""
    return logps - log_mass


def policy_logps(sampling_logps: torch.Tensor, log_mass: torch.Tensor | None) -> torch.Tensor:
    """log p(y) = log μ(y) + log Z: the policy's log-probs of the sampled tokens, the truncation undone; the
    recorded `sampling_logps` themselves (the same tensor) where the sampler did not truncate (`log_mass` None).
    After a truncation it is exact to float32 rounding of the two additions (a few ulp of |log μ| + |log Z|)."""
    return sampling_logps if log_mass is None else sampling_logps + log_mass


def truncated_mass(log_mass: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """() the mean over the tokens of `mask` (same shape as `log_mass`) of the mass the sampler cut away, 1 − Z;
    0 without any."""
    cut = -torch.expm1(log_mass.float())  # 1 - Z, accurate for Z near 1
    valid = mask.bool()
    return torch.where(valid, cut, torch.zeros_like(cut)).sum() / valid.sum().clamp(min=1)

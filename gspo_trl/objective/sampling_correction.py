"""Correcting for the gap between the engine that sampled a rollout and the trainer's own model.

A vLLM engine samples y ~ π_sampler, while GSPO's ratio is taken against π_old, the trainer's log-probs of
the same weights. Kernels, precision and batching make the two differ, so the loss is reweighted by
w = π_old / π_sampler (truncated or masked importance sampling, Yao et al., "Your efficient RL framework
secretly brings you off-policy RL training", 2025), with TRL's mode names:

* ``"token_truncate"``:    w_t = min(max(π_old(y_t) / π_sampler(y_t), C_min), C_max)   per token (TIS).
* ``"token_mask"``:        w_t = π_old(y_t) / π_sampler(y_t), set to 0 outside [C_min, C_max] (MIS).
* ``"sequence_truncate"``: one w_i for the whole sequence, truncated to [C_min, C_max].
* ``"sequence_mask"``:     one w_i for the whole sequence, the sequence dropped outside [C_min, C_max].

The sequence weight is **length-normalised**, w_i = exp((1/|y_i|) Σ_t log(π_old(y_t) / π_sampler(y_t))), the
geometric mean of the token ratios: the same normalisation as GSPO's own ratio (paper Eq. 7). TRL sums the
log-ratios over the sequence instead, a product that drifts away from 1 as completions get longer, so a fixed
C_max masks or truncates long completions far more often than short ones.

Pure functions: tensors in, tensors out. The weights are detached; the loss multiplies its per-token terms by them.
"""

from __future__ import annotations

import math

import torch

from ..rollout.decoding.truncation import truncated_mass

CORRECTION_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


def sampling_log_ratio(old_logps: torch.Tensor, sampling_logps: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(B, T) log(π_old / π_sampler) on valid tokens, 0 elsewhere and where the engine gave no log-prob (NaN)."""
    diff = (old_logps - sampling_logps).detach()
    return torch.where(mask.bool() & ~torch.isnan(diff), diff, torch.zeros_like(diff))


def sampling_correction(
    old_logps: torch.Tensor,
    sampling_logps: torch.Tensor,
    mask: torch.Tensor,
    mode: str = "sequence_mask",
    clip_min: float | None = None,
    clip_max: float | None = 3.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The (B, T) detached weights w that correct a rollout sampled by π_sampler towards π_old, and statistics.

    Args:
        old_logps: (B, T) the trainer's log-probs of the sampled tokens (π_old).
        sampling_logps: (B, T) the engine's log-probs of the same tokens; NaN where it gave none (weight 1 there).
        mask: (B, T) nonzero on completion tokens.
        mode: one of `CORRECTION_MODES`.
        clip_min, clip_max: C_min and C_max; None leaves that side open.

    Returns:
        ``(weights, stats)``; weights are 0 on padding. Stats are taken before truncation or masking:
        ``sampling_logp_difference_mean``/``max`` (|log π_old − log π_sampler| over tokens),
        ``mismatch_kl`` (k3 estimate of KL(π_sampler ‖ π_old) per token, the samples being π_sampler's),
        ``ratio_min``/``mean``/``max`` of w over the mode's units (tokens or sequences), and
        ``corrected_fraction``, the share of units truncated or masked.
    """
    if mode not in CORRECTION_MODES:
        raise ValueError(f"vllm_importance_sampling_mode must be one of {CORRECTION_MODES}, got {mode!r}")
    if clip_min is not None and clip_max is not None and clip_min > clip_max:
        raise ValueError(f"importance sampling bounds are crossed: clip_min {clip_min} > clip_max {clip_max}")
    valid = mask.bool() & ~torch.isnan(sampling_logps)  # (B, T): tokens the engine scored
    log_ratio = sampling_log_ratio(old_logps, sampling_logps, mask)  # (B, T)
    if mode.startswith("sequence"):
        # log w_i = mean over the sequence's scored tokens: the geometric mean of the token ratios.
        counts = valid.sum(dim=1, keepdim=True)  # (B, 1)
        unit_log_ratio = log_ratio.sum(dim=1, keepdim=True) / counts.clamp(min=1)  # (B, 1)
        units = mask.bool().any(dim=1, keepdim=True)  # (B, 1): sequences with a completion token
    else:
        unit_log_ratio, units = log_ratio, valid  # (B, T)
    ratio = torch.exp(unit_log_ratio.clamp(max=20.0))  # (B, 1) or (B, T)

    low = -math.inf if clip_min is None else clip_min
    high = math.inf if clip_max is None else clip_max
    outside = (ratio < low) | (ratio > high)
    if mode.endswith("truncate"):
        corrected = ratio if clip_min is None and clip_max is None else ratio.clamp(min=clip_min, max=clip_max)
    else:
        corrected = ratio.masked_fill(outside, 0.0)
    weights = torch.where(mask.bool(), corrected.expand_as(log_ratio), torch.zeros_like(log_ratio))  # (B, T)

    with torch.no_grad():
        token_count = valid.sum().clamp(min=1)
        abs_diff = log_ratio.abs()
        wide = log_ratio.double()  # k3 ~ d^2 / 2 vanishes in fp32 for the ~1e-5 gaps of fp32 engines
        k3 = (torch.expm1(wide) - wide).to(log_ratio.dtype)  # 0 where not scored
        unit_count = units.sum().clamp(min=1)
        any_unit = units.any()  # without one, ratios report a neutral 1 instead of ±inf (no host sync)
        one = torch.ones((), dtype=ratio.dtype, device=ratio.device)
        inf = torch.full_like(ratio, math.inf)
        stats = {
            "sampling_logp_difference_mean": abs_diff.sum() / token_count,
            "sampling_logp_difference_max": abs_diff.amax(),
            "mismatch_kl": k3.sum() / token_count,
            "ratio_min": torch.where(any_unit, torch.where(units, ratio, inf).amin(), one),
            "ratio_mean": torch.where(any_unit, torch.where(units, ratio, 0.0).sum() / unit_count, one),
            "ratio_max": torch.where(any_unit, torch.where(units, ratio, -inf).amax(), one),
            "corrected_fraction": (outside & units).sum() / unit_count,
        }
    return weights.detach(), stats


def sampler_logprobs_as_old(micro_batch) -> torch.Tensor:
    """π_old taken from the engine that sampled (GSPO paper §5.4), which must have scored every completion token."""
    sampling = micro_batch.engine_logps
    if torch.isnan(sampling[micro_batch.completion_mask.bool()]).any():
        raise RuntimeError(
            "vllm_logprobs_as_old=True, but the vLLM server returned no log-prob for some sampled "
            "tokens; set vllm_logprobs_as_old=False to compute π_old on the trainer."
        )
    return sampling


def correction_for(micro_batch, logps: torch.Tensor, args) -> tuple[torch.Tensor | None, dict]:
    """(the weights `sampling_weights` or None, stats) correcting a micro-batch sampled by another engine towards
    π_old: its `old_logps`, or, where none were computed (the weights still are the sampling ones), the current
    `logps`. Without `vllm_importance_sampling_correction` only the stats are kept. Where the trained model's own
    decoding loop truncated (top-k, top-p, min-p), the stats hold ``truncated_mass`` (the mean over completion tokens
    of the policy's mass cut away) and there are no weights: that loop's π_old is the policy itself."""
    engine_logps = micro_batch.engine_logps
    if engine_logps is None:
        if micro_batch.kept_log_mass is None:
            return None, {}
        return None, {"truncated_mass": truncated_mass(micro_batch.kept_log_mass, micro_batch.completion_mask)}
    old = micro_batch.old_logps if micro_batch.old_logps is not None else logps
    weights, stats = sampling_correction(
        old,
        engine_logps,
        micro_batch.completion_mask,
        args.vllm_importance_sampling_mode,
        args.vllm_importance_sampling_clip_min,
        args.vllm_importance_sampling_clip_max,
    )
    return (weights if args.vllm_importance_sampling_correction else None), stats

"""Which completion tokens the policy term learns from, beyond the completion mask.

Two selections that TRL offers and practitioners combine with any objective:

* Off-policy sequence masking (DeepSeek-V3.2, arXiv 2512.02556, Eq. 9): a sequence with a negative
  advantage whose mean per-token KL(pi_sampler || pi_theta), estimated as
  mean_t (log pi_sampler - log pi_theta), exceeds delta is dropped: pushing down a sample the policy
  has already moved away from teaches little and destabilises training.
* High-entropy tokens (Beyond the 80/20 Rule, arXiv 2506.01939): only the top-rho quantile of tokens
  by entropy keep their policy gradient; the quantile is taken over every valid token of the
  micro-batch on every process (the caller gathers them).

Both are pure: tensors in, a (B, 1) or (B, T) 0/1 mask out. Masked tokens still count in the
aggregation's denominators, as in TRL. `learned_tokens` applies the second to a micro-batch across processes.
"""

from __future__ import annotations

import torch

from ..models.distributed import gather_ragged


def off_policy_sequence_mask(
    advantages: torch.Tensor,  # (B, T) or (B, 1)
    logps: torch.Tensor,  # (B, T) current policy
    sampling_logps: torch.Tensor,  # (B, T) the policy that sampled the tokens
    mask: torch.Tensor,  # (B, T)
    threshold: float,
) -> torch.Tensor:
    """1 where a sequence is kept: A >= 0, or its mean log(pi_sampler / pi_theta) is <= threshold."""
    with torch.no_grad():
        # A token the sampler could not score (NaN) is no evidence of drift.
        drift = torch.nan_to_num(sampling_logps - logps.detach(), nan=0.0)
        mean_drift = (drift * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1.0)  # (B, 1)
        return ((advantages >= 0) | (mean_drift <= threshold)).to(logps.dtype)


def entropy_quantile_mask(
    per_token_entropy: torch.Tensor,  # (B, T)
    mask: torch.Tensor,  # (B, T)
    quantile: float,
    all_valid_entropies: torch.Tensor | None = None,  # (N,) the valid entropies of every process
) -> torch.Tensor:
    """1 on valid tokens whose entropy is at or above the `quantile` quantile (in [0, 1]) of all valid tokens."""
    with torch.no_grad():
        valid = mask.bool()
        pool = per_token_entropy[valid] if all_valid_entropies is None else all_valid_entropies
        if pool.numel() == 0:
            return torch.zeros_like(per_token_entropy)
        threshold = torch.quantile(pool.float(), quantile)
        return ((per_token_entropy >= threshold) & valid).to(per_token_entropy.dtype)


def high_entropy_token_mask(
    per_token_entropy: torch.Tensor,  # (B, T)
    mask: torch.Tensor,  # (B, T)
    top_quantile: float,
    all_valid_entropies: torch.Tensor | None = None,  # (N,) the valid entropies of every process
) -> torch.Tensor:
    """1 on valid tokens whose entropy is at or above the (1 - top_quantile) quantile of all valid tokens."""
    return entropy_quantile_mask(per_token_entropy, mask, 1.0 - top_quantile, all_valid_entropies)


def learned_tokens(
    entropy: torch.Tensor,  # (B, T)
    mask: torch.Tensor,  # (B, T)
    top_entropy_quantile: float,
    accelerator,
    counted: bool,
    micro_batch_tokens: torch.Tensor | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
    """(the top-entropy token mask or None, the (B, T) tokens the policy term learns from, and with `counted` their
    count per process over every process, for the entropy bonus's mean, else None). The quantile spans every
    process's tokens (a collective), and the count the whole micro-batch (`micro_batch_tokens` on a training pass;
    passes need top_entropy_quantile = 1)."""
    policy_token_mask = None
    if top_entropy_quantile < 1.0:
        everyones = gather_ragged(entropy[mask.bool()], accelerator)
        policy_token_mask = high_entropy_token_mask(entropy, mask, top_entropy_quantile, everyones)
    learned = mask.bool() if policy_token_mask is None else mask.bool() & policy_token_mask.bool()
    entropy_normalizer = None
    if counted:
        count = learned.sum() if micro_batch_tokens is None else micro_batch_tokens
        entropy_normalizer = accelerator.reduce(count, "sum") / accelerator.num_processes
    return policy_token_mask, learned, entropy_normalizer

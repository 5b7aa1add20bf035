"""The policy terms of the GSPO family: one small pure function per objective, chosen by `loss_type`.

Each function turns the importance weights of one batch into a per-token loss (to minimise) and
the statistics that describe what it did (how much was clipped, gated or down-weighted). What it
does not own: the ratio itself (`loss.importance_weights`), the KL term, which tokens are kept and
how the per-token losses are averaged (all in `loss`). Notation: w is the importance weight of the
level in use (GSPO's s_i, GSPO-token's s_i,t or GRPO's r_i,t), A the advantage, sg stop-gradient.

* ``clipped``  GSPO (arXiv 2507.18071, Eq. 5) / GRPO: -min(w A, clip(w, 1-eps, 1+eps_high) A); with
  ``delta`` the unclipped w is also capped at delta (two-sided clipping, INTELLECT-2, arXiv 2505.07291).
* ``sapo``     SAPO (arXiv 2511.20347): -f(w) A with the soft gate f(w) = 4/tau sigmoid(tau (w - 1)),
  tau = tau_pos for A > 0 and tau_neg otherwise: f'(1) = 1, and the gradient fades smoothly off-policy.
* ``cispo``    CISPO (MiniMax-M1, arXiv 2506.13585): -sg[min(w, eps_max)] A log pi. The weight is
  capped, never zeroed, so every token keeps a gradient.
* ``vespo``    VESPO (arXiv 2602.10693): -sg[phi(W)] A log pi with phi(W) = e^lam W^k e^(-lam W) on the
  un-normalised sequence ratio W = prod_t pi/pi_old; (k, lam) by the sign of A; phi(1) = 1.

All tensors are (B, T) with padded positions already zeroed by the caller.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

# VESPO works on the product of token ratios: its log is clamped to [log 1e-8, 20] as in the authors' code.
VESPO_LOG_WEIGHT_MIN = math.log(1e-8)
VESPO_LOG_WEIGHT_MAX = 20.0

Reduce = Callable[[torch.Tensor], torch.Tensor]  # (B, T) -> 0-dim mean over the level's units


def clipped(ratio, advantages, logps, *, epsilon, epsilon_high, delta=None, reduce: Reduce, **_):
    """GSPO / GRPO pessimistic clipping; ``delta`` adds INTELLECT-2's cap on the unclipped term."""
    clipped_ratio = ratio.clamp(1.0 - epsilon, 1.0 + epsilon_high)
    capped_ratio = ratio if delta is None else ratio.clamp(max=delta)
    per_token_loss = -torch.minimum(capped_ratio * advantages, clipped_ratio * advantages)
    with torch.no_grad():
        # The min picked the clipped (flat) term: below the range with A < 0, above it with A > 0.
        is_low = (ratio < 1.0 - epsilon) & (advantages < 0)
        is_high = (ratio > 1.0 + epsilon_high) & (advantages > 0)
        stats = {
            "clip_fraction_low": reduce(is_low.to(ratio.dtype)),
            "clip_fraction_high": reduce(is_high.to(ratio.dtype)),
            "clip_fraction": reduce((is_low | is_high).to(ratio.dtype)),
        }
    return per_token_loss, stats


def sapo(ratio, advantages, logps, *, sapo_temperature_pos, sapo_temperature_neg, reduce: Reduce, **_):
    """SAPO's soft gate f(w) = 4/tau * sigmoid(tau (w - 1)) in place of the hard clip."""
    temperature = torch.where(
        advantages > 0, ratio.new_tensor(sapo_temperature_pos), ratio.new_tensor(sapo_temperature_neg)
    )
    gate = torch.sigmoid(temperature * (ratio - 1.0))
    per_token_loss = -(4.0 / temperature) * gate * advantages
    with torch.no_grad():
        # df/dw = 4 sigma (1 - sigma): the weight of w's gradient, 1 on-policy, -> 0 far off-policy.
        stats = {"sapo_gate_weight": reduce(4.0 * gate * (1.0 - gate))}
    return per_token_loss, stats


def cispo(ratio, advantages, logps, *, epsilon_high, reduce: Reduce, **_):
    """CISPO: REINFORCE with the importance weight capped at eps_max (``epsilon_high``) and detached."""
    capped_weight = ratio.detach().clamp(max=epsilon_high)
    per_token_loss = -capped_weight * advantages * logps
    with torch.no_grad():
        stats = {"cispo_clip_fraction": reduce(((ratio > epsilon_high) & (advantages > 0)).to(ratio.dtype))}
    return per_token_loss, stats


def vespo_weight(token_log_ratio, advantages, mask, *, k_pos, lambda_pos, k_neg, lambda_neg):
    """phi(W) = e^lam W^k e^(-lam W) per sequence, (B, 1), detached; (k, lam) chosen by A >= 0 or A < 0."""
    with torch.no_grad():
        sequence_log_ratio = (token_log_ratio.clamp(-20.0, 20.0) * mask).sum(-1, keepdim=True)  # (B, 1): log W
        log_w = sequence_log_ratio.clamp(VESPO_LOG_WEIGHT_MIN, VESPO_LOG_WEIGHT_MAX)
        sequence_advantage = advantages[:, :1]  # (B, 1): VESPO's advantages are per sequence
        non_negative = sequence_advantage >= 0
        k = torch.where(non_negative, log_w.new_tensor(k_pos), log_w.new_tensor(k_neg))
        lam = torch.where(non_negative, log_w.new_tensor(lambda_pos), log_w.new_tensor(lambda_neg)).clamp(min=1e-4)
        log_phi = lam + k * log_w - lam * log_w.exp()
        return log_phi.exp().nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


def vespo(
    ratio,
    advantages,
    logps,
    *,
    token_log_ratio,
    mask,
    valid_sequences,
    vespo_k_pos,
    vespo_lambda_pos,
    vespo_k_neg,
    vespo_lambda_neg,
    **_,
):
    """VESPO: REINFORCE weighted by the detached gamma kernel of the whole-sequence ratio."""
    phi = vespo_weight(
        token_log_ratio,
        advantages,
        mask,
        k_pos=vespo_k_pos,
        lambda_pos=vespo_lambda_pos,
        k_neg=vespo_k_neg,
        lambda_neg=vespo_lambda_neg,
    )  # (B, 1)
    per_token_loss = -phi * advantages * logps
    valid = valid_sequences.to(phi.dtype)
    stats = {"vespo_weight_mean": (phi.squeeze(1) * valid).sum() / valid.sum().clamp(min=1.0)}
    return per_token_loss, stats


# Objectives whose own weight takes the sampling-engine correction (`sampling_correction`) into its ratio, as TRL
# does for VESPO: W becomes prod_t pi/pi_old * w_t. Every other objective multiplies its per-token loss by w_t.
CORRECTION_IN_RATIO = ("vespo",)

# loss_type -> the policy term it uses. The aggregation of the per-token losses is `loss.AGGREGATIONS`.
POLICY_TERMS = {
    "grpo": clipped,
    "bnpo": clipped,
    "dr_grpo": clipped,
    "dapo": clipped,
    "luspo": clipped,
    "sapo": sapo,
    "cispo": cispo,
    "vespo": vespo,
}

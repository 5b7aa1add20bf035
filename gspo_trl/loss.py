"""GSPO policy loss (Zheng et al., 2025, arXiv 2507.18071).

This module owns the per-batch loss and nothing else: the importance ratio, the pessimistic clipped
objective, the optional k3 KL penalty and the clipping statistics. Three importance-sampling levels:

* ``"sequence"`` (GSPO): s_i = (pi(y_i|x) / pi_old(y_i|x))^(1/|y_i|)            (Eq. 7), objective Eq. 5.
* ``"sequence_token"`` (GSPO-token): s_i,t = sg[s_i] * pi(y_i,t) / sg[pi(y_i,t)]  (Eq. 14), objective Eq. 13.
* ``"token"`` (GRPO): r_i,t = pi(y_i,t) / pi_old(y_i,t), clipped per token        (Eq. 2).

All functions are pure: tensors in, tensors out, no trainer state.
"""

from __future__ import annotations

import torch

IMPORTANCE_SAMPLING_LEVELS = ("sequence", "sequence_token", "token")

# exp(+-20) ~ 4.9e8 / 2.1e-9: far outside any useful clip range (epsilon ~ 1e-4 .. 0.3), yet finite in
# fp32/bf16 so that the loss and its gradient stay finite for absurd log-ratios (e.g. +-1e4). A log-ratio
# beyond the bound gets zero gradient, which only affects samples that are numerically meaningless anyway.
LOG_RATIO_CLAMP = 20.0


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of ``values`` over positions where ``mask`` is true; 0 (not NaN) where nothing is valid."""
    mask = mask.bool()
    total = torch.where(mask, values, torch.zeros_like(values)).sum(dim=dim)
    count = mask.sum(dim=dim).to(total.dtype)
    return total / count.clamp(min=1.0)


def _validate(per_token_logps, old_per_token_logps, advantages, completion_mask, ref_per_token_logps,
              importance_sampling_level, epsilon, epsilon_high, beta) -> None:
    if importance_sampling_level not in IMPORTANCE_SAMPLING_LEVELS:
        raise ValueError(
            f"importance_sampling_level must be one of {IMPORTANCE_SAMPLING_LEVELS}, got {importance_sampling_level!r}"
        )
    if per_token_logps.dim() != 2:
        raise ValueError(f"per_token_logps must have shape (B, T), got {tuple(per_token_logps.shape)}")
    shape = per_token_logps.shape
    for name, tensor in (("old_per_token_logps", old_per_token_logps), ("completion_mask", completion_mask),
                         ("ref_per_token_logps", ref_per_token_logps)):
        if tensor is not None and tensor.shape != shape:
            raise ValueError(f"{name} must have the shape of per_token_logps {tuple(shape)}, got {tuple(tensor.shape)}")
    if advantages.shape not in (shape[:1], shape):
        raise ValueError(f"advantages must have shape (B,) = {tuple(shape[:1])} or (B, T) = {tuple(shape)}, "
                         f"got {tuple(advantages.shape)}")
    if importance_sampling_level == "sequence" and advantages.dim() == 2:
        raise ValueError("advantages of shape (B, T) are per-token; importance_sampling_level='sequence' needs (B,) "
                         "advantages. Use importance_sampling_level='sequence_token' (GSPO-token) for per-token ones.")
    if epsilon < 0:
        raise ValueError(f"epsilon must be >= 0, got {epsilon}")
    if epsilon >= 1:
        raise ValueError(f"epsilon must be < 1 (the lower clip bound is 1 - epsilon), got {epsilon}")
    if epsilon_high < 0:
        raise ValueError(f"epsilon_high must be >= 0, got {epsilon_high}")
    if beta < 0:
        raise ValueError(f"beta must be >= 0, got {beta}")
    if beta > 0 and ref_per_token_logps is None:
        raise ValueError("ref_per_token_logps is required when beta > 0 (the KL penalty needs the reference policy)")


def policy_loss(
    per_token_logps: torch.Tensor,
    old_per_token_logps: torch.Tensor | None,
    advantages: torch.Tensor,
    completion_mask: torch.Tensor,
    *,
    importance_sampling_level: str = "sequence",
    epsilon: float = 3e-4,
    epsilon_high: float = 4e-4,
    beta: float = 0.0,
    ref_per_token_logps: torch.Tensor | None = None,
    use_bias_correction_kl: bool = True,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped GSPO / GSPO-token / GRPO loss (to minimise) and detached statistics.

    Args:
        per_token_logps: (B, T) log pi_theta(y_t | x, y_<t); carries the gradient.
        old_per_token_logps: (B, T) behaviour-policy log-probs, or None for on-policy (old = sg[logp]: the
            ratio is exactly 1 while its gradient is ratio * d logp).
        advantages: (B,) per sequence, or (B, T) per token (only with ``"sequence_token"`` or ``"token"``).
        completion_mask: (B, T), nonzero where a token is trained on. Padded positions of every other tensor
            may hold garbage (NaN, -inf); it never reaches the loss or the gradient.
        importance_sampling_level: ``"sequence"`` (GSPO), ``"sequence_token"`` (GSPO-token) or ``"token"`` (GRPO).
        epsilon, epsilon_high: the ratio is clipped to [1 - epsilon, 1 + epsilon_high].
        beta: weight of the k3 KL penalty to ``ref_per_token_logps``; 0 disables it.
        use_bias_correction_kl: multiply the per-token KL by the (non-detached) importance ratio.

    Returns:
        ``(loss, stats)``. ``loss`` is the mean over the B sequences of each sequence's mean per-token loss
        over its valid tokens (TRL's ``loss_type="grpo"``); a fully masked row adds 0 but still counts in B.
        ``stats`` holds detached scalars:
        ``clip_fraction_low`` / ``clip_fraction_high`` / ``clip_fraction`` (the min picked the clipped term:
        low = ratio < 1 - epsilon and A < 0, high = ratio > 1 + epsilon_high and A > 0, either),
        ``ratio_mean`` / ``ratio_min`` / ``ratio_max``, ``log_ratio_abs_mean`` (before the safety clamp), and
        ``kl_mean`` (mean of the uncorrected k3 over valid tokens; 0 when beta == 0). For ``"sequence"`` the
        clip and ratio stats are over sequences with >= 1 valid token; for the token-level modes they are over
        valid tokens. With nothing valid, the fractions are 0 and the ratios 1.
    """
    _validate(per_token_logps, old_per_token_logps, advantages, completion_mask, ref_per_token_logps,
              importance_sampling_level, epsilon, epsilon_high, beta)
    mask = completion_mask.bool()  # (B, T)
    zeros = torch.zeros_like(per_token_logps)

    # Sanitise first: padded garbage becomes 0 through torch.where, whose backward sends 0 (not 0 * NaN) there.
    logps = torch.where(mask, per_token_logps, zeros)  # (B, T)
    old_logps = logps.detach() if old_per_token_logps is None else torch.where(mask, old_per_token_logps, zeros)
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1).expand_as(logps)  # (B, T), one value per sequence
    advantages = torch.where(mask, advantages.to(logps.dtype), zeros)  # (B, T)

    log_ratio = logps - old_logps  # (B, T), 0 on padding
    lengths = mask.sum(dim=1)  # (B,)
    valid_seq = lengths > 0  # (B,)

    if importance_sampling_level == "token":
        # GRPO: one ratio per token, r_i,t = pi / pi_old.
        log_is_weight = log_ratio  # (B, T)
    else:
        # Eq. 7: log s_i = (1/|y_i|) sum_t log(pi / pi_old), the length-normalised sequence log-ratio.
        sequence_log_ratio = masked_mean(log_ratio, mask, dim=1)  # (B,)
        if importance_sampling_level == "sequence":
            log_is_weight = sequence_log_ratio.unsqueeze(1).expand_as(logps)  # (B, T), broadcast s_i
        else:
            # Eq. 14: s_i,t = sg[s_i] * pi(y_t) / sg[pi(y_t)]: value s_i, gradient only through token t.
            log_is_weight = sequence_log_ratio.detach().unsqueeze(1) + logps - logps.detach()  # (B, T)
    ratio = torch.exp(log_is_weight.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))  # (B, T)
    clipped_ratio = ratio.clamp(1.0 - epsilon, 1.0 + epsilon_high)  # (B, T)

    # Eq. 5 / Eq. 13 / GRPO: pessimistic bound min(w A, clip(w) A); the loss is its negative.
    per_token_loss = -torch.minimum(ratio * advantages, clipped_ratio * advantages)  # (B, T)

    per_token_kl = None
    if beta > 0:
        # k3 estimator of KL(pi || pi_ref): exp(d) - d - 1 with d = log pi_ref - log pi, d clamped so exp stays finite.
        ref_logps = torch.where(mask, ref_per_token_logps, zeros)
        d = (ref_logps - logps).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)  # (B, T)
        per_token_kl = torch.exp(d) - d - 1.0  # (B, T)
        # Samples come from pi_old: weighting by the ratio makes k3 an estimate under pi (TRL 1.16 semantics).
        kl_term = per_token_kl * ratio if use_bias_correction_kl else per_token_kl
        per_token_loss = per_token_loss + beta * kl_term

    # Sequence mean over valid tokens, then mean over all B sequences (masked rows add 0).
    per_token_loss = torch.where(mask, per_token_loss, zeros)
    loss = masked_mean(per_token_loss, mask, dim=1).mean()

    with torch.no_grad():
        is_low = (ratio < 1.0 - epsilon) & (advantages < 0)  # (B, T)
        is_high = (ratio > 1.0 + epsilon_high) & (advantages > 0)  # (B, T)
        abs_log_ratio = log_is_weight.abs()  # (B, T)
        if importance_sampling_level == "sequence":
            # Values are constant along T, so column 0 is the per-sequence value; count valid sequences only.
            stat_mask = valid_seq  # (B,)
            is_low, is_high, ratio_s, abs_log_ratio = is_low[:, 0], is_high[:, 0], ratio[:, 0], abs_log_ratio[:, 0]
        else:
            stat_mask, ratio_s = mask, ratio
        # No host sync (no .item(), no boolean indexing): empty selections fall back to ratio 1.
        one = torch.ones((), dtype=ratio.dtype, device=ratio.device)
        any_valid = stat_mask.any()
        inf = torch.full_like(ratio_s, float("inf"))
        stats = {
            "clip_fraction_low": masked_mean(is_low.to(ratio.dtype), stat_mask),
            "clip_fraction_high": masked_mean(is_high.to(ratio.dtype), stat_mask),
            "clip_fraction": masked_mean((is_low | is_high).to(ratio.dtype), stat_mask),
            "ratio_mean": torch.where(any_valid, masked_mean(ratio_s, stat_mask), one),
            "ratio_min": torch.where(any_valid, torch.where(stat_mask, ratio_s, inf).amin(), one),
            "ratio_max": torch.where(any_valid, torch.where(stat_mask, ratio_s, -inf).amax(), one),
            "log_ratio_abs_mean": masked_mean(abs_log_ratio, stat_mask),
            "kl_mean": masked_mean(per_token_kl, mask) if per_token_kl is not None else torch.zeros_like(one),
        }
    return loss, {k: v.detach() for k, v in stats.items()}

"""The policy loss of one batch: GSPO (Zheng et al., 2025, arXiv 2507.18071) and its family.

This module owns the importance ratio, the KL penalty, which tokens count, how per-token losses are
averaged, and the statistics; the policy terms themselves (clipped GSPO/GRPO, SAPO, CISPO, VESPO)
are one function each in `objectives`. Four importance-sampling levels:

* ``"sequence"`` (GSPO): s_i = (pi(y_i|x) / pi_old(y_i|x))^(1/|y_i|)            (Eq. 7), objective Eq. 5.
* ``"sequence_token"`` (GSPO-token): s_i,t = sg[s_i] * pi(y_i,t) / sg[pi(y_i,t)]  (Eq. 14), objective Eq. 13.
* ``"token"`` (GRPO): r_i,t = pi(y_i,t) / pi_old(y_i,t), clipped per token        (Eq. 2).
* ``"turn"`` (multi-turn GSPO): s_i,k = (pi(y_i,k|.) / pi_old(y_i,k|.))^(1/|y_i,k|), Eq. 7 applied to each
  assistant turn k of an episode on its own and clipped per turn; with one turn it is ``"sequence"``. Each turn's
  term covers its tokens, so under the default aggregation a turn weighs its share of the episode's tokens and every
  token's gradient has the same 1/|y_i| weight, as at the sequence level.

All functions are pure: tensors in, tensors out, no trainer state. The hyperparameters travel in an
`Objective`; `policy_loss` also accepts them as keywords.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch

from .loss_masks import off_policy_sequence_mask
from .objectives import CORRECTION_IN_RATIO, POLICY_TERMS, VESPO_LOG_WEIGHT_MIN

IMPORTANCE_SAMPLING_LEVELS = ("sequence", "sequence_token", "token", "turn")

# How each loss_type averages its per-token losses l_i,t over a batch of B sequences (TRL's names):
#   grpo, sapo:         (1/B) sum_i (1/|y_i|) sum_t l_i,t    each sequence weighs the same (GSPO's Eq. 5)
#   luspo:              (1/B) sum_i sum_t l_i,t              each sequence weighs its length (LUSPO)
#   bnpo:               sum_i,t l_i,t / sum_i |y_i|          token mean of this micro-batch
#   dr_grpo:            sum_i,t l_i,t / (B * max_completion_length)
#   dapo, cispo, vespo: sum_i,t l_i,t / token_normalizer     token mean of the whole optimizer step
AGGREGATIONS = {
    "grpo": "sequence_mean",
    "sapo": "sequence_mean",
    "luspo": "sequence_sum",
    "bnpo": "token_mean",
    "dr_grpo": "constant",
    "dapo": "global_token_mean",
    "cispo": "global_token_mean",
    "vespo": "global_token_mean",
}
LOSS_TYPES = tuple(POLICY_TERMS)

# exp(+-20) ~ 4.9e8 / 2.1e-9: far outside any useful clip range (epsilon ~ 1e-4 .. 0.3), yet finite in
# fp32/bf16 so that the loss and its gradient stay finite for absurd log-ratios (e.g. +-1e4). A log-ratio
# beyond the bound gets zero gradient, which only affects samples that are numerically meaningless anyway.
LOG_RATIO_CLAMP = 20.0


@dataclass(frozen=True)
class Objective:
    """The hyperparameters of the loss, with TRL's names and the GSPO paper's defaults."""

    loss_type: str = "grpo"
    importance_sampling_level: str = "sequence"
    epsilon: float = 3e-4
    epsilon_high: float = 4e-4
    delta: float | None = None
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0
    beta: float = 0.0
    use_bias_correction_kl: bool = True
    off_policy_mask_threshold: float | None = None
    max_completion_length: int | None = None  # dr_grpo's constant denominator

    def __post_init__(self):
        # The single check of the loss fields: `GSPOConfig` builds an Objective to run it (config_checks).
        if self.loss_type not in LOSS_TYPES:
            raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {self.loss_type!r}. 'grpo' is GSPO's.")
        if self.importance_sampling_level not in IMPORTANCE_SAMPLING_LEVELS:
            raise ValueError(
                f"importance_sampling_level must be one of {IMPORTANCE_SAMPLING_LEVELS}, got "
                f"{self.importance_sampling_level!r}. Use 'sequence' for GSPO."
            )
        # The clip range [1 - epsilon, 1 + epsilon_high] must hold 1, the ratio of every on-policy sample, strictly
        # inside: epsilon = 0 or epsilon_high = 0 clips one side at 1 itself (no gradient past pi_old on that side;
        # for cispo, a weight cap of 0 zeroes the whole loss), and epsilon >= 1 leaves no lower bound above 0.
        if not 0 < self.epsilon < 1:
            raise ValueError(f"epsilon must be in (0, 1), got {self.epsilon}. The paper uses 3e-4.")
        if not self.epsilon_high > 0:
            raise ValueError(f"epsilon_high must be > 0, got {self.epsilon_high}. The paper uses 4e-4.")
        if self.delta is not None and not self.delta > 1:
            raise ValueError(
                f"delta caps the importance ratio and must be > 1 (e.g. 1 + 2 * epsilon_high), got {self.delta}"
            )
        for name in ("sapo_temperature_pos", "sapo_temperature_neg"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not (self.beta >= 0 and math.isfinite(self.beta)):
            raise ValueError(f"beta must be a finite number >= 0, got {self.beta}.")
        if self.off_policy_mask_threshold is not None and not self.off_policy_mask_threshold >= 0:
            raise ValueError(f"off_policy_mask_threshold must be >= 0 or None, got {self.off_policy_mask_threshold}")
        if self.loss_type == "dr_grpo" and not (self.max_completion_length or 0) >= 1:
            raise ValueError("loss_type='dr_grpo' divides by max_completion_length; pass it (>= 1)")

    @classmethod
    def from_config(cls, args) -> Objective:
        """The objective a `GSPOConfig` (or anything with the same field names) describes."""
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls)})


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of ``values`` over positions where ``mask`` is true; 0 (not NaN) where nothing is valid."""
    mask = mask.bool()
    total = torch.where(mask, values, torch.zeros_like(values)).sum(dim=dim)
    count = mask.sum(dim=dim).to(total.dtype)
    return total / count.clamp(min=1.0)


def segment_mean(values: torch.Tensor, mask: torch.Tensor, segment_ids: torch.Tensor) -> torch.Tensor:
    """(B, T): at each position, the mean of ``values`` over the masked positions of the same row and segment.

    ``segment_ids`` (B, T) holds integers in [0, T) where ``mask`` is set (e.g. the assistant turn of each token); other
    positions may hold anything. A segment without masked positions has mean 0.
    """
    mask = mask.bool()
    ids = torch.where(mask, segment_ids, torch.zeros_like(segment_ids)).long()  # (B, T)
    num_segments = max(values.shape[1], 1)  # a row has at most T segments; no host sync to count them
    masked_values = torch.where(mask, values, torch.zeros_like(values))
    totals = values.new_zeros(values.shape[0], num_segments).scatter_add(1, ids, masked_values)  # (B, K)
    counts = values.new_zeros(values.shape[0], num_segments).scatter_add(1, ids, mask.to(values.dtype))  # (B, K)
    return (totals / counts.clamp(min=1.0)).gather(1, ids)  # (B, T)


def importance_weights(
    logps: torch.Tensor, old_logps: torch.Tensor, mask: torch.Tensor, level: str, turn_ids: torch.Tensor | None = None
) -> torch.Tensor:
    """log of the importance weight of each token's loss, (B, T): Eq. 7, Eq. 14, GRPO's per-token ratio, or Eq. 7
    per assistant turn (``turn_ids`` (B, T): each token's turn; None: the whole completion is one turn)."""
    log_ratio = logps - old_logps  # (B, T), 0 on padding
    if level == "token":
        return log_ratio  # GRPO: r_i,t = pi / pi_old
    if level == "turn" and turn_ids is not None:
        # log s_i,k = (1/|y_i,k|) sum_{t in turn k} log(pi / pi_old), broadcast over the turn's tokens.
        return segment_mean(log_ratio, mask, turn_ids)
    # Eq. 7: log s_i = (1/|y_i|) sum_t log(pi / pi_old), the length-normalised sequence log-ratio.
    sequence_log_ratio = masked_mean(log_ratio, mask, dim=1).unsqueeze(1)  # (B, 1)
    if level in ("sequence", "turn"):
        return sequence_log_ratio.expand_as(logps)  # s_i broadcast over the sequence
    # Eq. 14: s_i,t = sg[s_i] * pi(y_t) / sg[pi(y_t)]: value s_i, gradient only through token t.
    return sequence_log_ratio.detach() + logps - logps.detach()


def aggregate(
    per_token_loss, mask, objective: Objective, token_normalizer=None, num_sequences=None, num_tokens=None
) -> torch.Tensor:
    """One number from the (B, T) per-token losses, as `AGGREGATIONS` describes.

    ``num_sequences`` and ``num_tokens`` are the B and the valid tokens the means divide by when this batch is a row
    slice of a larger one (a training pass): the slices' numbers then add up to the larger batch's.
    """
    total_per_sequence = torch.where(mask, per_token_loss, torch.zeros_like(per_token_loss)).sum(-1)  # (B,)
    rows = mask.shape[0] if num_sequences is None else num_sequences
    tokens = mask.sum() if num_tokens is None else torch.as_tensor(num_tokens, device=mask.device)
    rule = AGGREGATIONS[objective.loss_type]
    if rule == "sequence_mean":
        return (total_per_sequence / mask.sum(-1).clamp(min=1)).sum() / rows
    if rule == "sequence_sum":
        return total_per_sequence.sum() / rows
    if rule == "constant":
        return total_per_sequence.sum() / (rows * objective.max_completion_length)
    if rule == "global_token_mean" and token_normalizer is not None:
        return total_per_sequence.sum() / torch.as_tensor(token_normalizer).clamp(min=1.0)
    return total_per_sequence.sum() / tokens.clamp(min=1)  # token mean of this batch


def _validate_tensors(logps, advantages, objective: Objective, beta_needs_ref, **tensors) -> None:
    if logps.dim() != 2:
        raise ValueError(f"logps must have shape (B, T), got {tuple(logps.shape)}")
    shape = logps.shape
    for name, tensor in tensors.items():
        if tensor is not None and tensor.shape != shape:
            raise ValueError(f"{name} must have the shape of logps {tuple(shape)}, got {tuple(tensor.shape)}")
    if advantages.shape not in (shape[:1], shape):
        raise ValueError(
            f"advantages must have shape (B,) = {tuple(shape[:1])} or (B, T) = {tuple(shape)}, "
            f"got {tuple(advantages.shape)}"
        )
    if advantages.dim() == 2 and objective.importance_sampling_level == "sequence":
        raise ValueError(
            "advantages of shape (B, T) are per-token; importance_sampling_level='sequence' needs (B,) "
            "advantages. Use importance_sampling_level='sequence_token' (GSPO-token) for per-token ones, 'turn' for "
            "per-turn ones."
        )
    if advantages.dim() == 2 and objective.loss_type == "vespo":
        raise ValueError("loss_type='vespo' weighs whole sequences and needs (B,) advantages, got (B, T)")
    if beta_needs_ref:
        raise ValueError("ref_logps is required when beta > 0 (the KL penalty needs the reference policy)")


# The log-prob arguments under their earlier (TRL's) names, and their names here: one name per quantity, as the
# trainer's `MicroBatch` carries them.
RENAMED_ARGUMENTS = {
    "per_token_logps": "logps",
    "old_per_token_logps": "old_logps",
    "ref_per_token_logps": "ref_logps",
    "sampling_per_token_logps": "sampling_logps",
}


def token_normalizer(
    num_items_in_batch: torch.Tensor | None, num_processes: int, micro_batches_per_step: int
) -> torch.Tensor | None:
    """What the token-mean losses (dapo, cispo, vespo) divide a micro-batch's sum by: the completion tokens per
    process and optimizer step, averaged over the rollout (TRL's definition): the rollout's tokens over every
    process (`num_items_in_batch`) / processes / micro-batches per optimizer step (`steps_per_generation` in
    training, 1 in evaluation). Trainer then divides by the accumulation steps, and DDP averages over processes."""
    if num_items_in_batch is None:
        return None
    return num_items_in_batch / num_processes / micro_batches_per_step


def policy_loss(
    logps: torch.Tensor,
    old_logps: torch.Tensor | None,
    advantages: torch.Tensor,
    completion_mask: torch.Tensor,
    *,
    ref_logps: torch.Tensor | None = None,
    sampling_logps: torch.Tensor | None = None,
    sampling_weights: torch.Tensor | None = None,
    policy_token_mask: torch.Tensor | None = None,
    turn_ids: torch.Tensor | None = None,
    token_normalizer: torch.Tensor | float | None = None,
    per_token_entropy: torch.Tensor | None = None,
    entropy_coef: float = 0.0,
    entropy_normalizer: torch.Tensor | float | None = None,
    num_sequences: int | None = None,
    num_tokens: torch.Tensor | int | None = None,
    objective: Objective | None = None,
    **hyperparameters,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The loss to minimise for one batch of sampled completions, and detached statistics.

    Args:
        logps: (B, T) log pi_theta(y_t | x, y_<t); carries the gradient.
        old_logps: (B, T) behaviour-policy log-probs, or None for on-policy (old = sg[logp]: the
            ratio is exactly 1 while its gradient is ratio * d logp).
        advantages: (B,) per sequence, or (B, T) per token (with ``"sequence_token"``, ``"token"`` or ``"turn"``;
            per-turn advantages are (B, T) constant over each turn's tokens).
        completion_mask: (B, T), nonzero where a token is trained on. Padded positions of every other tensor
            may hold garbage (NaN, -inf); it never reaches the loss or the gradient.
        ref_logps: (B, T) reference-policy log-probs; required when beta > 0.
        sampling_logps: (B, T) log-probs of the engine that sampled the tokens, for
            ``off_policy_mask_threshold``; defaults to the old log-probs.
        sampling_weights: (B, T) detached correction weights pi_old / pi_sampler for a rollout sampled by another
            engine (`sampling_correction.sampling_correction`): they multiply each token's policy loss (before the
            KL term, as in TRL), or, for ``vespo``, enter its sequence ratio.
        policy_token_mask: (B, T) extra 0/1 selection of the tokens the policy term learns from (e.g.
            `loss_masks.high_entropy_token_mask`); masked tokens still count in the denominators.
        turn_ids: (B, T) integer assistant turn (0, 1, ...) of each token, for ``"turn"``; None: one turn per row.
        token_normalizer: the number of completion tokens the ``dapo``/``cispo``/``vespo`` sum is divided by
            (the optimizer step's tokens per process); defaults to this batch's.
        per_token_entropy: (B, T) token entropies carrying a gradient, for ``entropy_coef``.
        entropy_coef: subtract entropy_coef * (mean entropy over the tokens the policy term learns from).
        entropy_normalizer: the token count that mean divides by (the micro-batch's learned tokens per process,
            so that averaging over processes gives the mean over all of them); defaults to this batch's.
        num_sequences, num_tokens: the rows and valid completion tokens of the whole batch when this one is a row
            slice of it (one training pass of a micro-batch): the loss then is this slice's share, and the slices'
            losses add up to the whole batch's. Default: this batch's own.
        objective: the hyperparameters (an `Objective`); or give them as keywords (``epsilon=...``).

    Returns:
        ``(loss, stats)``. With the default ``loss_type="grpo"``, ``loss`` is the mean over the B sequences of
        each sequence's mean per-token loss (a fully masked row adds 0 but still counts in B); other loss types
        aggregate as `AGGREGATIONS` says. ``stats`` holds detached scalars: ``ratio_mean``/``min``/``max`` and
        ``log_ratio_abs_mean`` (before the safety clamp) of the importance weight, ``kl_mean`` (uncorrected k3 over
        valid tokens; 0 when beta == 0), the policy term's own (``clip_fraction_low``/``high``/``clip_fraction``
        for the clipped ones: the min picked the clipped term), ``off_policy_masked_fraction`` when off-policy
        masking is on, and ``loss_without_entropy_bonus`` (``loss`` before the ``entropy_coef`` term). For
        ``"sequence"`` they are over sequences with >= 1 valid token, otherwise over valid tokens; with nothing
        valid, fractions are 0 and ratios 1.
    """
    renamed = [name for name in hyperparameters if name in RENAMED_ARGUMENTS]
    if renamed:
        raise TypeError(f"policy_loss: {renamed[0]} is now called {RENAMED_ARGUMENTS[renamed[0]]}")
    objective = objective if objective is not None else Objective(**hyperparameters)
    _validate_tensors(
        logps,
        advantages,
        objective,
        beta_needs_ref=objective.beta > 0 and ref_logps is None,
        old_logps=old_logps,
        completion_mask=completion_mask,
        ref_logps=ref_logps,
        sampling_logps=sampling_logps,
        sampling_weights=sampling_weights,
        turn_ids=turn_ids,
        policy_token_mask=policy_token_mask,
        per_token_entropy=per_token_entropy,
    )
    mask = completion_mask.bool()  # (B, T)
    zeros = torch.zeros_like(logps)

    # Sanitise first: padded garbage becomes 0 through torch.where, whose backward sends 0 (not 0 * NaN) there.
    logps = torch.where(mask, logps, zeros)  # (B, T)
    old_logps = logps.detach() if old_logps is None else torch.where(mask, old_logps, zeros)
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1).expand_as(logps)  # (B, T), one value per sequence
    advantages = torch.where(mask, advantages.to(logps.dtype), zeros)  # (B, T)
    valid_sequences = mask.any(dim=1)  # (B,)
    level = objective.importance_sampling_level

    log_is_weight = importance_weights(logps, old_logps, mask, level, turn_ids)  # (B, T)
    ratio = torch.exp(log_is_weight.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))  # (B, T)

    def reduce(values: torch.Tensor) -> torch.Tensor:  # mean over the level's units: sequences or tokens
        if level == "sequence":
            return masked_mean(values[:, 0], valid_sequences)
        return masked_mean(values, mask)

    token_log_ratio = logps - old_logps  # (B, T)
    correction_in_ratio = sampling_weights is not None and objective.loss_type in CORRECTION_IN_RATIO
    if correction_in_ratio:  # log w_t joins the log-ratio (a masked-out w_t = 0 becomes log 1e-8, as in TRL)
        log_weights = torch.log(sampling_weights.detach()).clamp(VESPO_LOG_WEIGHT_MIN, LOG_RATIO_CLAMP)
        token_log_ratio = token_log_ratio + torch.where(mask, log_weights, zeros)
    policy_term = POLICY_TERMS[objective.loss_type]
    per_token_loss, term_stats = policy_term(
        ratio,
        advantages,
        logps,
        **{f.name: getattr(objective, f.name) for f in fields(objective)},
        token_log_ratio=token_log_ratio,
        mask=mask,
        valid_sequences=valid_sequences,
        reduce=reduce,
    )  # (B, T)

    stats = {}
    if objective.off_policy_mask_threshold is not None:
        sampling = old_logps if sampling_logps is None else torch.where(mask, sampling_logps, zeros)
        keep = off_policy_sequence_mask(advantages, logps, sampling, mask, objective.off_policy_mask_threshold)
        per_token_loss = per_token_loss * keep
        stats["off_policy_masked_fraction"] = masked_mean(1.0 - keep[:, 0], valid_sequences)
    if policy_token_mask is not None:
        per_token_loss = per_token_loss * policy_token_mask.to(per_token_loss.dtype)
    if sampling_weights is not None and not correction_in_ratio:
        per_token_loss = per_token_loss * torch.where(mask, sampling_weights.detach(), zeros)

    per_token_kl = None
    if objective.beta > 0:
        # k3 estimator of KL(pi || pi_ref): exp(d) - d - 1 with d = log pi_ref - log pi, d clamped so exp stays finite.
        ref_logps = torch.where(mask, ref_logps, zeros)
        d = (ref_logps - logps).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)  # (B, T)
        per_token_kl = torch.exp(d) - d - 1.0  # (B, T)
        # Samples come from pi_old: weighting by the ratio makes k3 an estimate under pi (TRL 1.16 semantics).
        kl_term = per_token_kl * ratio if objective.use_bias_correction_kl else per_token_kl
        per_token_loss = per_token_loss + objective.beta * kl_term

    loss = aggregate(per_token_loss, mask, objective, token_normalizer, num_sequences, num_tokens)
    stats["loss_without_entropy_bonus"] = loss  # TRL's `policy_loss`

    if entropy_coef != 0.0:
        if per_token_entropy is None:
            raise ValueError("entropy_coef != 0 needs per_token_entropy (with a gradient)")
        learned = mask if policy_token_mask is None else mask & policy_token_mask.bool()
        entropy_sum = torch.where(learned, per_token_entropy, torch.zeros_like(per_token_entropy)).sum()
        count = learned.sum() if entropy_normalizer is None else torch.as_tensor(entropy_normalizer)
        loss = loss - entropy_coef * entropy_sum / count.clamp(min=1.0)

    with torch.no_grad():
        one = torch.ones((), dtype=ratio.dtype, device=ratio.device)
        if level == "sequence":  # values are constant along T: column 0 is the per-sequence value
            stat_mask, ratio_units = valid_sequences, ratio[:, 0]
        else:
            stat_mask, ratio_units = mask, ratio
        # No host sync (no .item(), no boolean indexing): empty selections fall back to ratio 1.
        any_valid = stat_mask.any()
        inf = torch.full_like(ratio_units, float("inf"))
        stats.update(term_stats)
        stats.update(
            {
                "ratio_mean": torch.where(any_valid, masked_mean(ratio_units, stat_mask), one),
                "ratio_min": torch.where(any_valid, torch.where(stat_mask, ratio_units, inf).amin(), one),
                "ratio_max": torch.where(any_valid, torch.where(stat_mask, ratio_units, -inf).amax(), one),
                "log_ratio_abs_mean": reduce(log_is_weight.abs()),
                "kl_mean": masked_mean(per_token_kl, mask) if per_token_kl is not None else torch.zeros_like(one),
            }
        )
    return loss, {k: v.detach() for k, v in stats.items()}

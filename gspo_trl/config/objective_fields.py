"""The objective fields of `GSPOConfig`: importance ratios, clipping, KL, loss aggregation, rewards and entropy.

A mixin dataclass that `GSPOConfig` inherits; `loss.Objective` is where their bounds are checked.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ObjectiveFields:
    """`GSPOConfig`'s fields for the loss and the advantages (see docs/objective.md)."""

    # --- Objective ---------------------------------------------------------------------------
    importance_sampling_level: str | None = field(
        default=None,
        metadata={
            "help": "'sequence' (GSPO), 'sequence_token' (GSPO-token, per-token advantages), 'token' (GRPO's ratio) or "
            "'turn' (one ratio per assistant turn). None: 'sequence' for loss_type grpo, sapo and luspo, 'token' for "
            "the others."
        },
    )
    epsilon: float | None = field(
        default=None,
        metadata={
            "help": "Lower clipping range, in (0, 1): ratios below 1 − epsilon are clipped. None: 3e-4 (the paper's) "
            "for sequence-level ratios, 0.2 (TRL's) for importance_sampling_level='token'."
        },
    )
    epsilon_high: float | None = field(
        default=None,
        metadata={
            "help": "Upper clipping range: ratios above 1 + epsilon_high are clipped (for 'cispo', the cap on the "
            "weight). None: 5.0 for 'cispo', 4e-4 with epsilon unset and a non-token level, else epsilon."
        },
    )
    delta: float | None = field(
        default=None,
        metadata={
            "help": "Two-sided clipping (INTELLECT-2): cap the unclipped ratio at delta (> 1, best > 1 + epsilon_high) "
            "to bound the loss of negative-advantage samples; None: off. See "
            "docs/objective.md#options-that-combine-with-any-loss_type."
        },
    )
    sapo_temperature_pos: float = field(
        default=1.0,
        metadata={"help": "SAPO's gate temperature for positive advantages (loss_type='sapo')."},
    )
    sapo_temperature_neg: float = field(
        default=1.05,
        metadata={"help": "SAPO's gate temperature for zero or negative advantages (loss_type='sapo')."},
    )
    vespo_k_pos: float = field(
        default=2.0,
        metadata={"help": "VESPO's power k for advantages >= 0: how fast weights of sequence ratios below 1 fall."},
    )
    vespo_lambda_pos: float = field(
        default=3.0,
        metadata={"help": "VESPO's decay λ for advantages >= 0: how fast weights of sequence ratios above 1 fall."},
    )
    vespo_k_neg: float = field(
        default=3.0,
        metadata={"help": "VESPO's power k for negative advantages."},
    )
    vespo_lambda_neg: float = field(
        default=2.0,
        metadata={"help": "VESPO's decay λ for negative advantages."},
    )
    beta: float = field(
        default=0.0,
        metadata={
            "help": "KL coefficient against the reference model (k3 estimator). 0.0, the paper's setting, loads no "
            "reference model and skips its forward pass."
        },
    )
    sync_ref_model: bool = field(
        default=False,
        metadata={
            "help": "TR-DPO: every ref_model_sync_steps optimizer steps, move the reference model towards the policy, "
            "ref ← α·π + (1 − α)·ref. Needs beta > 0 and full fine-tuning (as in TRL)."
        },
    )
    ref_model_mixup_alpha: float = field(
        default=0.6,
        metadata={"help": "TR-DPO's α in [0, 1]: the policy's share of the synced reference model (sync_ref_model)."},
    )
    ref_model_sync_steps: int = field(
        default=512,
        metadata={"help": "TR-DPO's τ: optimizer steps between two syncs of the reference model (sync_ref_model)."},
    )
    use_bias_correction_kl: bool = field(
        default=True,
        metadata={
            "help": "Multiply the per-token KL by the importance ratio (TRL's default and meaning). Used when beta > 0."
        },
    )
    loss_type: str = field(
        default="grpo",
        metadata={
            "help": "'grpo' (GSPO's clipped objective, each sequence weighing the same), 'sapo', 'cispo', 'vespo', "
            "'luspo', or the token-summed 'dapo', 'bnpo' and 'dr_grpo'. See "
            "docs/objective.md#the-gspo-family-loss_type."
        },
    )
    scale_rewards: str = field(
        default="group",
        metadata={
            "help": "Advantage scaling: 'group' divides by each group's reward std, 'batch' by the batch std, "
            "'none' does not scale (True and False mean 'group' and 'none')."
        },
    )
    reward_weights: list[float] | None = field(
        default=None,
        metadata={"help": "One weight per reward function; None weights every function 1.0."},
    )
    multi_objective_aggregation: str = field(
        default="sum_then_normalize",
        metadata={
            "help": "'sum_then_normalize': weighted sum of the rewards, then advantages per scale_rewards; "
            "'normalize_then_sum' (GDPO): each function normalised within its group, summed, then scaled by the "
            "batch std (scale_rewards unused). See docs/migrating-from-trl.md#reward-functions-same-convention."
        },
    )
    skip_rollouts_without_rewards: bool = field(
        default=False,
        metadata={
            "help": "Where every reward function returns None for every completion of a rollout, skip that rollout "
            "with a warning (it trains on nothing) instead of raising. See "
            "docs/migrating-from-trl.md#reward-functions-same-convention."
        },
    )
    mask_truncated_completions: bool = field(
        default=False,
        metadata={
            "help": "Exclude completions cut off at max_completion_length from the loss (DAPO's overlong filtering)."
        },
    )

    off_policy_mask_threshold: float | None = field(
        default=None,
        metadata={
            "help": "Off-policy sequence masking (DeepSeek-V3.2): drop negative-advantage sequences whose mean "
            "per-token log(π_sampler / π_θ) exceeds this (e.g. 0.5); None: off. See "
            "docs/objective.md#options-that-combine-with-any-loss_type."
        },
    )
    top_entropy_quantile: float = field(
        default=1.0,
        metadata={
            "help": "Keep the policy gradient only on this top quantile of completion tokens by entropy, over all "
            "processes (0.2 in Beyond the 80/20 Rule). In [0, 1]; 1.0 keeps every token."
        },
    )
    entropy_coef: float = field(
        default=0.0,
        metadata={
            "help": "Entropy bonus: subtract entropy_coef × the mean entropy of the tokens the policy term learns "
            "from; with use_adaptive_entropy, the starting coefficient. 0.0: off."
        },
    )
    use_adaptive_entropy: bool = field(
        default=False,
        metadata={
            "help": "Skywork-OR1's adaptive entropy control: after each optimizer step, raise entropy_coef by "
            "entropy_coef_delta when the mean entropy is at or below entropy_target, else lower it. See "
            "docs/objective.md#options-that-combine-with-any-loss_type."
        },
    )
    entropy_coef_min: float = field(default=0.0, metadata={"help": "Lower bound of the adaptive entropy_coef."})
    entropy_coef_max: float = field(default=1.0, metadata={"help": "Upper bound of the adaptive entropy_coef."})
    entropy_coef_delta: float = field(
        default=0.005, metadata={"help": "Change of the adaptive entropy_coef per optimizer step."}
    )
    entropy_target: float = field(
        default=0.2,
        metadata={
            "help": "Mean per-token entropy (nats) at or below which adaptive control applies the bonus. Set it near "
            "the entropy you see early in training (often 1–3 nats)."
        },
    )
    router_aux_loss_coef: float | None = field(
        default=None,
        metadata={
            "help": "Weight of a Mixture-of-Experts model's load-balancing loss, added to the loss and logged as "
            "aux_loss. None: the model config's own coefficient (0 without one)."
        },
    )
    routing_replay: str = field(
        default="none",
        metadata={
            "help": "Mixture-of-Experts routing replay: 'rollout' routes every forward on a rollout to the experts the "
            "decoding loop chose (R3), 'old' the training forwards to π_old's (R2); 'none' lets the router choose. "
            "See docs/moe.md."
        },
    )

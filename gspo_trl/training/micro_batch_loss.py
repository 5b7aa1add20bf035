"""One micro-batch's loss from its scores: the objective, the sampling correction, entropy and aux terms.

`compute_loss` scores the micro-batch (the forward pass); this module turns those scores and the micro-batch's
rollout fields into the scalar to backpropagate and the metrics to log. The math lives in `loss` (the policy loss),
`loss_masks` (which tokens learn), `sampling_correction` (the sampler mismatch) and `entropy_control`.
"""

from __future__ import annotations

import torch

from ..objective.loss import masked_mean, policy_loss, token_normalizer
from ..objective.loss_masks import learned_tokens
from ..objective.sampling_correction import correction_for
from ..reporting.metrics import loss_metrics, metric_counts, sampling_metrics
from .micro_batch import MicroBatch


def micro_batch_loss(scores, inputs: MicroBatch, trainer, mode: str) -> tuple[torch.Tensor, dict, dict]:
    """(loss, metrics, metric counts) of `inputs` scored as `scores` (a `logprobs.Scores`), under `trainer`'s
    objective, entropy coefficient, aux-loss coefficient, config and accelerator; in `mode` "train" the adaptive
    entropy coefficient observes this micro-batch's entropy, and at an optimizer step's end the coefficient goes to
    `trainer._metrics` as `entropy_coef` (TRL's: once per step, so not a per-micro-batch metric)."""
    args, accelerator = trainer.args, trainer.accelerator
    entropy_coefficient = trainer.entropy_coefficient
    mask = inputs.completion_mask
    per_step = args.steps_per_generation if mode == "train" else 1  # micro-batches per optimizer step
    policy_token_mask, learned, entropy_normalizer = learned_tokens(
        scores.entropy.detach(),
        mask,
        args.top_entropy_quantile,
        accelerator,
        counted=entropy_coefficient.enabled,
        micro_batch_tokens=inputs.micro_batch_tokens,
    )
    entropy_coef = entropy_coefficient.to_apply()
    sampling_weights, sampling_stats = correction_for(inputs, scores.logps.detach(), args)
    loss, stats = policy_loss(
        scores.logps,
        inputs.old_logps,
        inputs.advantages,
        mask,
        objective=trainer.objective,
        ref_logps=inputs.ref_logps,
        sampling_logps=inputs.engine_logps,
        sampling_weights=sampling_weights,
        policy_token_mask=policy_token_mask,
        turn_ids=inputs.turn_ids,
        token_normalizer=token_normalizer(inputs.num_items_in_batch, accelerator.num_processes, per_step),
        per_token_entropy=scores.entropy,
        entropy_coef=entropy_coef,
        entropy_normalizer=entropy_normalizer,
        num_sequences=inputs.micro_batch_rows,  # set on a pass: its loss is its share of the micro-batch's
        num_tokens=inputs.micro_batch_tokens,
    )
    metrics = loss_metrics(stats, masked_mean(scores.entropy.detach(), mask), args.beta)
    metrics.update(sampling_metrics(sampling_stats))
    if scores.router_aux_loss is not None:
        loss = loss + trainer.router_aux_loss_coef * scores.router_aux_loss
        metrics["aux_loss"] = scores.router_aux_loss.detach()
    if inputs.skipped:  # skip_rollouts_without_rewards: a zero gradient, every parameter still in the graph
        loss = loss * 0.0
    if entropy_coefficient.enabled:  # TRL's keys: the loss before the entropy bonus, and the coefficient
        metrics["policy_loss"] = stats["loss_without_entropy_bonus"] * (0.0 if inputs.skipped else 1.0)
        if mode == "train" and entropy_coefficient.adaptive:
            entropy_coefficient.observe(scores.entropy.detach(), learned, accelerator)
        if mode == "train" and accelerator.sync_gradients:  # once per optimizer step, after the adaptive update
            trainer._metrics.add(mode, "entropy_coef", entropy_coefficient.coefficient)
    counts = metric_counts(mask, trainer.objective.importance_sampling_level, args.vllm_importance_sampling_mode)
    return loss, metrics, counts

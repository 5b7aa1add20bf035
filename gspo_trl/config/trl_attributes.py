"""TRL's public `GRPOTrainer` attributes that copy its config, and its two mask helpers, on `GSPOTrainer`, so that
code reading or setting `trainer.beta` or calling `GRPOTrainer.get_off_policy_mask` keeps working after the import
changes.

Reading one gives the value the run uses. Setting one works as in TRL where TRL reads it at every step: the new
value is checked like the config field and used from the next step on (`LIVE`). Where the run was built around the
value at construction (the sampler, the batch layout, the engine: `FIXED`), setting another value raises an
`AttributeError` that says so rather than being ignored; setting the same value is allowed. docs/migrating-from-trl.md
lists the TRL attributes that do not exist here, and tests/test_docs.py checks both lists against TRL's
`GRPOTrainer`. What it does not own: the config and its checks (`gspo_config`, `checks`), the masks' math
(`objective.loss_masks`).
"""

from __future__ import annotations

import copy
import math

import torch

from ..models.distributed import gather_ragged
from ..objective.loss import Objective
from ..objective.loss_masks import entropy_quantile_mask, off_policy_sequence_mask
from . import checks

# TRL attribute → the `GSPOConfig` field it copies (TRL's own assignment, `self.<name> = args.<field>`), for the
# attributes TRL reads at every step: setting one sets the field, checked as the config checks it.
LIVE = {
    name: name
    for name in (
        "beta",
        "epsilon_high",
        "importance_sampling_level",
        "log_completions",
        "log_unique_prompts",
        "loss_type",
        "mask_truncated_completions",
        "multi_objective_aggregation",
        "num_completions_to_print",
        "off_policy_mask_threshold",
        "pad_to_multiple_of",
        "scale_rewards",
        "shuffle_dataset",
        "top_entropy_quantile",
        "use_adaptive_entropy",
        "vllm_importance_sampling_clip_max",
        "vllm_importance_sampling_clip_min",
        "vllm_importance_sampling_correction",
        "vllm_importance_sampling_mode",
    )
} | {"epsilon_low": "epsilon"}

# The attributes whose value the run was built around, each with what was built from it.
_SAMPLER = "the sampler was built with it at construction (and completions are scored with the same value)"
_LAYOUT = "the batch layout and the rollout schedule were checked and built from it at construction"
_ENGINE = "the sampling engine was set up with it at construction"
FIXED = {
    "max_completion_length": _SAMPLER,
    "temperature": _SAMPLER,
    "top_p": _SAMPLER,
    "top_k": _SAMPLER,
    "min_p": _SAMPLER,
    "repetition_penalty": _SAMPLER,
    "generation_kwargs": _SAMPLER,
    "chat_template_kwargs": "the prompts' rendering was set up with it at construction",
    "max_tool_calling_iterations": "the episode runner was built with it at construction",
    "num_generations": _LAYOUT,
    "num_generations_eval": _LAYOUT,
    "num_iterations": _LAYOUT,
    "use_vllm": _ENGINE,
    "vllm_mode": _ENGINE,
    "vllm_gpu_memory_utilization": _ENGINE,
    "vllm_tensor_parallel_size": _ENGINE,
}
# What TRL's attribute reads when it is not the field itself.
_READ = {
    "num_generations_eval": lambda args: args.num_generations_eval or args.num_generations,
    "chat_template_kwargs": lambda args: args.chat_template_kwargs or {},
    "generation_kwargs": lambda args: args.generation_kwargs or {},
}

_BOOLEANS = (
    "log_completions",
    "log_unique_prompts",
    "mask_truncated_completions",
    "shuffle_dataset",
    "use_adaptive_entropy",
    "vllm_importance_sampling_correction",
)


def set_live_field(trainer, field: str, value) -> None:
    """Set `trainer.args.<field>` to `value` after checking a copy of the config with it (the checks the config
    ran at construction, which name the field), then rebuild what the run derives from it."""
    candidate = copy.copy(trainer.args)
    if field == "scale_rewards":
        value = checks.scale_rewards_option(value)  # TRL's True/False spellings
    if field == "pad_to_multiple_of":
        value = checks.pad_to_multiple_of(value)
    if field in _BOOLEANS and not isinstance(value, bool):
        raise TypeError(f"{field} must be True or False, got {value!r}")
    if field == "num_completions_to_print" and value is not None and (isinstance(value, bool) or value < 0):
        raise ValueError(f"num_completions_to_print must be an int >= 0 or None, got {value!r}")
    setattr(candidate, field, value)
    checks.check_objective(candidate)
    checks.check_dynamic_sampling(candidate)
    if field.startswith("vllm_") or field == "loss_type":
        checks.check_vllm(candidate)
    checks.check_logging(candidate)
    _check_with_run(trainer, field, value)
    setattr(trainer.args, field, value)
    trainer.objective = Objective.from_config(trainer.args)
    if field == "use_adaptive_entropy":
        trainer.entropy_coefficient.adaptive = value
    if field == "log_completions":
        _switch_completion_log(trainer, value)


def _check_with_run(trainer, field: str, value) -> None:
    """What a new value cannot do with the run as it was built."""
    if field == "beta" and value > 0 and trainer.ref_model is None and not hasattr(_unwrapped(trainer), "peft_config"):
        raise AttributeError(
            f"trainer.beta = {value}: the trainer was built with beta=0.0, so no reference model was loaded for "
            "the KL term; set beta > 0 in GSPOConfig instead"
        )
    if field == "top_entropy_quantile" and value < 1.0 and trainer.max_tokens_per_pass is not None:
        raise AttributeError(
            f"trainer.top_entropy_quantile = {value}: this run trains a micro-batch in several passes "
            "(max_tokens_per_pass), and the quantile is taken over the whole micro-batch; set it in GSPOConfig "
            "with max_tokens_per_pass=0"
        )


def _unwrapped(trainer):
    return trainer.accelerator.unwrap_model(trainer.model)


def _switch_completion_log(trainer, on: bool) -> None:
    from ..reporting.completion_logs import CompletionLog

    if on and trainer.completion_log is None:
        trainer.completion_log = CompletionLog(trainer.args, trainer.accelerator)
        trainer.add_callback(trainer.completion_log)
    elif not on and trainer.completion_log is not None:
        trainer.remove_callback(trainer.completion_log)
        trainer.completion_log = None


def _live(name: str, field: str) -> property:
    def read(trainer):
        return getattr(trainer.args, field)

    def write(trainer, value):
        set_live_field(trainer, field, value)

    return property(read, write, doc=f"`args.{field}` (TRL's attribute); setting it takes effect from the next step.")


def _fixed(name: str, reason: str) -> property:
    read = _READ.get(name, lambda args: getattr(args, name))

    def write(trainer, value):
        if value != read(trainer.args):
            raise AttributeError(
                f"trainer.{name} cannot be changed after construction: {reason}. Set {name} in GSPOConfig instead."
            )

    return property(lambda trainer: read(trainer.args), write, doc=f"`args.{name}` (TRL's attribute), fixed.")


class TRLAttributes:
    """TRL's `GRPOTrainer` attributes and mask helpers, mixed into `GSPOTrainer`."""

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        overridden = [name for name in ("get_off_policy_mask", "get_high_entropy_mask") if name in vars(cls)]
        if overridden:
            raise TypeError(
                f"{cls.__name__} overrides {overridden[0]}, which the loss does not call here: gspo-trl computes its "
                "masks in gspo_trl.objective.loss_masks (see docs/migrating-from-trl.md); call the method instead "
                "of overriding it"
            )

    @staticmethod
    def get_off_policy_mask(
        advantages: torch.Tensor,
        per_token_logps: torch.Tensor,
        sampling_per_token_logps: torch.Tensor,
        mask: torch.Tensor,
        off_policy_threshold: float,
    ) -> torch.Tensor:
        """TRL's off-policy sequence mask (DeepSeek-V3.2): (B, 1), 1 where a sequence is kept (advantage >= 0, or
        its mean log(pi_sampler / pi_theta) over `mask` <= `off_policy_threshold`), in `mask`'s dtype."""
        keep = off_policy_sequence_mask(
            advantages, per_token_logps, sampling_per_token_logps, mask, off_policy_threshold
        )
        return keep.to(mask.dtype)

    def get_high_entropy_mask(self, entropies: torch.Tensor, mask: torch.Tensor, threshold: float) -> torch.Tensor:
        """TRL's high-entropy token mask: a (B, T) bool mask of the valid tokens whose entropy is at or above the
        `threshold` quantile of every process's valid tokens (a collective: every process calls it)."""
        everyones = gather_ragged(entropies[mask.bool()].float(), self.accelerator)
        return entropy_quantile_mask(entropies, mask, threshold, everyones).bool()

    @property
    def reward_func_names(self) -> list[str]:
        """Each reward function's name, as the metrics `rewards/<name>/*` use it (TRL's attribute); setting the list
        renames them from the next rollout on."""
        return [reward_func.name for reward_func in self.reward_funcs]

    @reward_func_names.setter
    def reward_func_names(self, names) -> None:
        names = list(names)
        if len(names) != len(self.reward_funcs) or not all(isinstance(name, str) for name in names):
            raise ValueError(f"reward_func_names must be {len(self.reward_funcs)} strings, one per reward function")
        for reward_func, name in zip(self.reward_funcs, names):
            reward_func.name = name

    @property
    def entropy_coef(self) -> float:
        """The entropy-bonus coefficient, as adaptive control has set it (TRL's attribute); setting it applies the
        new coefficient from the next step (adaptive control goes on from it)."""
        return self.entropy_coefficient.coefficient

    @entropy_coef.setter
    def entropy_coef(self, value: float) -> None:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"entropy_coef must be a finite number, got {value!r}")
        self.entropy_coefficient.coefficient = float(value)

    @property
    def aux_loss_enabled(self) -> bool:
        """Whether the MoE load-balancing loss is added (TRL's attribute); setting False drops it from the next
        step on."""
        return self.router_aux_loss_coef != 0.0

    @aux_loss_enabled.setter
    def aux_loss_enabled(self, enabled: bool) -> None:
        if enabled and self.router_aux_loss_coef == 0.0:
            raise AttributeError(
                "trainer.aux_loss_enabled = True: there is no load-balancing coefficient (router_aux_loss_coef is 0 "
                "or the model is not a Mixture-of-Experts model); set router_aux_loss_coef in GSPOConfig instead"
            )
        if not enabled:
            self.router_aux_loss_coef = 0.0


for _name, _field in LIVE.items():
    setattr(TRLAttributes, _name, _live(_name, _field))
for _name, _reason in FIXED.items():
    setattr(TRLAttributes, _name, _fixed(_name, _reason))

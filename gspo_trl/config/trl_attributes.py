"""TRL's public `GRPOTrainer` attributes that are copies of its config, on `GSPOTrainer`, so that code reading
`trainer.num_generations` or `trainer.beta` keeps working after the import changes.

Each is a read-only property over `trainer.args` (or the trainer's own parts): assigning one raises an
`AttributeError` instead of being ignored, since the run reads `args`. docs/migrating-from-trl.md lists the TRL
attributes that do not exist here, and tests/test_docs.py checks both lists against TRL's `GRPOTrainer`. What it does
not own: the config itself (`config`).
"""

from __future__ import annotations

# TRL attribute → the `GSPOConfig` field it copies (TRL's own assignment, `self.<name> = args.<field>`).
CONFIG_COPIES = {
    name: name
    for name in (
        "beta",
        "epsilon_high",
        "importance_sampling_level",
        "log_completions",
        "log_unique_prompts",
        "loss_type",
        "mask_truncated_completions",
        "max_completion_length",
        "max_tool_calling_iterations",
        "min_p",
        "multi_objective_aggregation",
        "num_completions_to_print",
        "num_generations",
        "num_iterations",
        "off_policy_mask_threshold",
        "pad_to_multiple_of",
        "repetition_penalty",
        "scale_rewards",
        "shuffle_dataset",
        "temperature",
        "top_entropy_quantile",
        "top_k",
        "top_p",
        "use_adaptive_entropy",
        "use_vllm",
        "vllm_gpu_memory_utilization",
        "vllm_importance_sampling_clip_max",
        "vllm_importance_sampling_clip_min",
        "vllm_importance_sampling_correction",
        "vllm_importance_sampling_mode",
        "vllm_mode",
        "vllm_tensor_parallel_size",
    )
} | {"epsilon_low": "epsilon"}


def _config_copy(field: str) -> property:
    return property(lambda trainer: getattr(trainer.args, field), doc=f"`args.{field}` (TRL's attribute).")


class TRLAttributes:
    """Read-only copies of TRL's `GRPOTrainer` attributes, mixed into `GSPOTrainer`."""

    @property
    def num_generations_eval(self) -> int:
        """The evaluation group size: `args.num_generations_eval`, or `num_generations` (TRL's attribute)."""
        return self.args.num_generations_eval or self.args.num_generations

    @property
    def chat_template_kwargs(self) -> dict:
        """`args.chat_template_kwargs`, or {} (TRL's attribute)."""
        return self.args.chat_template_kwargs or {}

    @property
    def generation_kwargs(self) -> dict:
        """`args.generation_kwargs`, or {} (TRL's attribute)."""
        return self.args.generation_kwargs or {}

    @property
    def reward_func_names(self) -> list[str]:
        """Each reward function's name, as the metrics `rewards/<name>/*` use it (TRL's attribute)."""
        return [reward_func.name for reward_func in self.reward_funcs]

    @property
    def entropy_coef(self) -> float:
        """The entropy-bonus coefficient, as adaptive control has set it (TRL's attribute)."""
        return self.entropy_coefficient.coefficient

    @property
    def aux_loss_enabled(self) -> bool:
        """Whether the MoE load-balancing loss is added (TRL's attribute)."""
        return self.router_aux_loss_coef != 0.0


for _name, _field in CONFIG_COPIES.items():
    setattr(TRLAttributes, _name, _config_copy(_field))

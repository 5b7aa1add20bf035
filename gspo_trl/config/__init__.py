"""What a run is told: `GSPOConfig` and its checks.

`gspo_config` holds `GSPOConfig` (transformers' `TrainingArguments` plus GSPO's fields), which inherits the objective's
fields (`objective_fields`) and the vLLM fields (`vllm_fields`); `checks` holds the checks and derived defaults run
when a config is built, one function per section; `trl_attributes` the attributes of TRL's `GRPOTrainer` that copy
the config.
"""

from .gspo_config import GSPOConfig

__all__ = ["GSPOConfig"]

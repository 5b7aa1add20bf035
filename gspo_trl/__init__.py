"""gspo-trl: Group Sequence Policy Optimization (arXiv 2507.18071) on top of transformers and TRL.

The public names load on first use, so that a process without TRL (a vLLM server loading
`gspo_trl.vllm.worker_extension`) can import a submodule without pulling in the trainer.

The modules sit in one folder per stage (CONTRIBUTING.md maps them). The flat names of earlier releases
(`gspo_trl.loss`, `gspo_trl.default_model`, ...) still import, with a FutureWarning naming the new place: the
same module object, so patching one patches the other.
"""

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

__version__ = "0.2.0"

__all__ = ["GSPOConfig", "GSPOTrainer", "policy_loss", "__version__"]

_PUBLIC = {"GSPOConfig": "config", "GSPOTrainer": "trainer", "policy_loss": "objective.loss"}

# Earlier flat module -> its place now (a moved package's submodules follow it).
_MOVED = {
    "advantages": "scoring.advantages",
    "async_rollouts": "training.async_rollouts",
    "checkpointing": "models.checkpointing",
    "cli": "demo.cli",
    "completion_logs": "reporting.completion_logs",
    "config_checks": "config.checks",
    "config_objective": "config.objective_fields",
    "config_vllm": "config.vllm_fields",
    "cpu_memory": "training.cpu_memory",
    "dataset_checks": "data.checks",
    "decoding": "rollout.decoding",
    "default_model": "demo.default_model",
    "distributed": "models.distributed",
    "dynamic_sampling": "scoring.dynamic_sampling",
    "entropy_control": "objective.entropy_control",
    "environments": "rollout.environments",
    "environments.calculator": "demo.calculator",
    "environments.retry": "demo.retry",
    "logprob_check": "training.logprob_check",
    "logprobs": "training.logprobs",
    "loss": "objective.loss",
    "loss_masks": "objective.loss_masks",
    "metrics": "reporting.metrics",
    "micro_batch": "training.micro_batch",
    "micro_batch_loss": "training.micro_batch_loss",
    "model_card": "reporting.model_card",
    "moe": "models.moe",
    "multimodal": "models.multimodal",
    "objectives": "objective.objectives",
    "packing": "models.packing",
    "passes": "training.passes",
    "plotting": "reporting.plotting",
    "positions": "models.positions",
    "precision": "models.precision",
    "quantization": "models.quantization",
    "reference_sync": "training.reference_sync",
    "rewards": "scoring.rewards",
    "rollout_checkpoint": "training.rollout_checkpoint",
    "sampling_correction": "objective.sampling_correction",
    "schedule": "training.schedule",
    "streaming": "data.streaming",
    "tasks": "demo.tasks",
    "trl_compat": "config.trl_attributes",
    "vision_features": "models.vision_features",
    "vision_tasks": "demo.vision_tasks",
}


def moved_to(name: str) -> str | None:
    """The module an earlier flat name (`gspo_trl.loss`, `gspo_trl.decoding.cpu`) lives at now, or None."""
    relative = name.removeprefix(f"{__name__}.")
    if relative == name:
        return None
    parts = relative.split(".")
    for end in range(len(parts), 0, -1):
        if ".".join(parts[:end]) in _MOVED:
            return ".".join([__name__, _MOVED[".".join(parts[:end])], *parts[end:]])
    return None


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Answers an earlier name with the module now at its new place (one object under both names)."""

    def find_spec(self, fullname, path=None, target=None):
        return importlib.util.spec_from_loader(fullname, self) if moved_to(fullname) else None

    def create_module(self, spec):
        new = moved_to(spec.name)
        warnings.warn(f"{spec.name} moved to {new}; import it from there.", FutureWarning, stacklevel=2)
        return importlib.import_module(new)

    def exec_module(self, module):
        pass  # the module ran under its new name


if not any(isinstance(finder, _MovedModules) for finder in sys.meta_path):
    sys.meta_path.insert(0, _MovedModules())


def __getattr__(name):
    if name in _PUBLIC:
        return getattr(importlib.import_module(f".{_PUBLIC[name]}", __name__), name)
    raise AttributeError(f"module 'gspo_trl' has no attribute {name!r}")

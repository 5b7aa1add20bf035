"""gspo-trl: Group Sequence Policy Optimization (arXiv 2507.18071) on top of transformers and TRL.

The public names load on first use, so that a process without TRL (a vLLM server loading
`gspo_trl.vllm.worker_extension`) can import a submodule without pulling in the trainer.
"""

__version__ = "0.2.0"

__all__ = ["GSPOConfig", "GSPOTrainer", "policy_loss", "__version__"]

_PUBLIC = {"GSPOConfig": "config", "GSPOTrainer": "trainer", "policy_loss": "loss"}


def __getattr__(name):
    if name in _PUBLIC:
        import importlib

        return getattr(importlib.import_module(f".{_PUBLIC[name]}", __name__), name)
    raise AttributeError(f"module 'gspo_trl' has no attribute {name!r}")

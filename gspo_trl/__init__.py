"""gspo-trl: Group Sequence Policy Optimization (arXiv 2507.18071) on top of transformers and TRL."""

__version__ = "0.1.0"

from .config import GSPOConfig  # noqa: E402
from .loss import policy_loss  # noqa: E402
from .trainer import GSPOTrainer  # noqa: E402

__all__ = ["GSPOConfig", "GSPOTrainer", "policy_loss", "__version__"]

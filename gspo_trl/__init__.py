"""gspo-trl: Group Sequence Policy Optimization (arXiv 2507.18071) on top of transformers and TRL."""

__version__ = "0.1.0"

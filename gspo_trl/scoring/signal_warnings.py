"""Warnings for training rollouts that carry no signal although every setting is legal.

Two ways a step can train on nothing: every completion truncated while `mask_truncated_completions=True` masks
truncated ones out of the loss, and sampling so narrow (a very low temperature, a tiny top_p) that every group's
completions are identical, so no group has an advantage. Either gives `grad_norm` 0 and nothing else says why.
Each is warned about once, with the figures, counted over all processes. What it does not own: refusing settings
(`config.checks`) and the advantages themselves (`scoring.advantages`).
"""

from __future__ import annotations

import torch
from transformers.utils import logging

from ..rollout.types import Rollout

logger = logging.get_logger(__name__)


def rollout_signal_counts(rollout: Rollout, group_size: int) -> torch.Tensor:
    """(4,) int64: rows, truncated rows, groups, groups whose completions are all the same (rows are grouped by
    consecutive `group_size`, as the trainer lays them out)."""
    rows = rollout.completion_ids.shape[0]
    groups = rollout.completion_ids.view(rows // group_size, group_size, -1)  # (G, group_size, C)
    identical = (groups == groups[:, :1]).all(dim=2).all(dim=1)  # (G,) completions padded alike after their EOS
    counts = [rows, int(rollout.is_truncated.sum()), groups.shape[0], int(identical.sum())]
    return torch.tensor(counts, dtype=torch.long)


class SignalWarnings:
    """Checks every training rollout; warns about each way of training on nothing the first time it happens."""

    def __init__(self, args):
        self.args = args
        self.warned: set[str] = set()

    def check(self, rollout: Rollout, group_size: int, accelerator) -> None:
        """Every process calls it on its part of a training rollout (the counts are gathered)."""
        if len(self.warned) == 2:
            return
        counts = rollout_signal_counts(rollout, group_size).to(accelerator.device)
        rows, truncated, groups, identical = accelerator.gather(counts.reshape(1, 4)).sum(dim=0).tolist()
        args = self.args
        if args.mask_truncated_completions and rows and truncated == rows and "truncated" not in self.warned:
            self.warned.add("truncated")
            logger.warning(
                f"Every completion of this rollout ({truncated} of {rows}) reached max_completion_length="
                f"{args.max_completion_length} without an EOS, and mask_truncated_completions=True leaves them all "
                "out of the loss: this step trains on nothing (grad_norm 0). Raise max_completion_length, or set "
                "mask_truncated_completions=False."
            )
        if groups and identical == groups and "identical" not in self.warned:
            self.warned.add("identical")
            logger.warning(
                f"Every group of this rollout ({identical} of {groups}) has {group_size} identical completions "
                f"(temperature={args.temperature}, top_p={args.top_p}, top_k={args.top_k}): no group has an advantage, "
                "so the policy loss of this step is zero. Sample more broadly, e.g. with a temperature near 1."
            )

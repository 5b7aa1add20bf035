"""scoring.signal_warnings: rollouts that train on nothing are counted over all processes and warned about once."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from gspo_trl.rollout.types import Rollout
from gspo_trl.scoring.signal_warnings import SignalWarnings, rollout_signal_counts


def rollout(completion_ids, is_truncated) -> Rollout:
    ids = torch.tensor(completion_ids)
    ones = torch.ones_like(ids)
    return Rollout(ones[:, :1], ones[:, :1], ids, ones, torch.tensor(is_truncated))


class OneProcess:
    """The accelerator's part SignalWarnings uses, for one process (gather is the identity)."""

    device = torch.device("cpu")

    @staticmethod
    def gather(tensor):
        return tensor


def test_counts_rows_truncated_rows_groups_and_groups_of_identical_completions():
    # Two groups of two: the first identical (padded alike after EOS 9), the second not.
    sampled = rollout([[5, 9, 0], [5, 9, 0], [5, 6, 9], [5, 7, 9]], [False, False, True, False])
    assert rollout_signal_counts(sampled, group_size=2).tolist() == [4, 1, 2, 1]


def test_each_warning_comes_once_with_the_figures(caplog):
    args = SimpleNamespace(
        mask_truncated_completions=True, max_completion_length=3, temperature=0.01, top_p=1.0, top_k=0
    )
    warnings = SignalWarnings(args)
    all_truncated_and_identical = rollout([[5, 6, 7], [5, 6, 7]], [True, True])
    with caplog.at_level("WARNING"):
        warnings.check(rollout([[5, 9, 0], [5, 6, 9]], [False, False]), 2, OneProcess())  # signal: no warning
        assert caplog.text == ""
        warnings.check(all_truncated_and_identical, 2, OneProcess())
        warnings.check(all_truncated_and_identical, 2, OneProcess())
    assert caplog.text.count("Every completion of this rollout (2 of 2) reached max_completion_length=3") == 1
    assert caplog.text.count("Every group of this rollout (1 of 1) has 2 identical completions (temperature=0.01") == 1
    caplog.clear()
    args.mask_truncated_completions = False  # truncated completions train: nothing to say about them
    with caplog.at_level("WARNING"):
        SignalWarnings(args).check(rollout([[5, 6, 7], [5, 6, 8]], [True, True]), 2, OneProcess())
    assert caplog.text == ""

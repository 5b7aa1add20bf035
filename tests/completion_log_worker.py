"""Run under `torchrun --nproc_per_node 2` by test_completion_logs.py: one rollout of 16 completions (8 per process)
with log_completions on, whose reward function logs a `rank` column on rank 1 only, a metric `per_rank` (1 once on
rank 0, 4 twice on rank 1) and a metric `rank_1_only`. Each rank writes <out>/rank<R>.json: the prompts its reward
function saw (in order), whether it printed the completions, the generation batch size and the log history; the main
process also writes <out>/out/completions/*.parquet."""

from __future__ import annotations

import contextlib
import io
import json
import sys
from pathlib import Path

import torch
from helpers import count_digits, leave_worker, small_config, text_dataset

from gspo_trl import GSPOTrainer


def main(model_dir: str, out: str) -> None:
    seen: list = []

    def digits_and_rank(prompts, completions, log_extra, log_metric, **kwargs):
        if not seen:
            seen.extend(prompts)
        if torch.distributed.get_rank() == 1:
            log_extra("rank", ["1"] * len(completions))
            log_metric("per_rank", 4.0)  # rank 1 logs twice, rank 0 once
            log_metric("per_rank", 4.0)
            log_metric("rank_1_only", 5.0)
        else:
            log_metric("per_rank", 1.0)
        return count_digits(completions)

    digits_and_rank.__name__ = "count_digits"
    config = small_config(
        Path(out) / "out",
        per_device_train_batch_size=2,
        steps_per_generation=4,
        log_completions=True,
        num_completions_to_print=2,
    )
    trainer = GSPOTrainer(model_dir, digits_and_rank, args=config, train_dataset=text_dataset())
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        trainer.train()
    rank = torch.distributed.get_rank()
    result = {
        "prompts": seen,
        "printed": "--- completions at step" in printed.getvalue(),
        "generation_batch_size": config.generation_batch_size,
        "log_history": trainer.state.log_history,
    }
    (Path(out) / f"rank{rank}.json").write_text(json.dumps(result))
    leave_worker()


if __name__ == "__main__":
    main(*sys.argv[1:3])

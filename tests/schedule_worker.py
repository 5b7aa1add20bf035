"""Run under `torchrun --nproc_per_node 2` by test_schedule.py: the old-log-prob shortcut against the
reference mode on two gloo processes, for a schedule whose rollouts start inside accumulation windows.
Rank 0 writes both runs' per-step logs and a weight checksum as JSON to argv[2]."""

from __future__ import annotations

import json
import sys

import torch
from datasets import Dataset
from helpers import count_digits, leave_worker, length_reward

from gspo_trl import GSPOConfig, GSPOTrainer


def run(model_dir: str, out_dir: str, reference: bool) -> dict:
    config = GSPOConfig(
        output_dir=out_dir,
        per_device_train_batch_size=2,
        num_generations=2,
        max_completion_length=6,
        gradient_accumulation_steps=2,
        steps_per_generation=3,
        max_steps=4,
        learning_rate=5e-3,
        epsilon=0.2,
        epsilon_high=0.2,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        seed=0,
        always_compute_old_logprobs=reference,
        decode_logprobs_as_old=False,  # the π_old pass's schedule is tested
    )
    dataset = Dataset.from_dict({"prompt": [f"What is {i} + {i + 1}?" for i in range(12)]})
    trainer = GSPOTrainer(model_dir, [count_digits, length_reward], args=config, train_dataset=dataset)
    trainer.train()
    logs = [
        {k: e[k] for k in ("loss", "ratio/min", "ratio/max", "reward") if k in e}
        for e in trainer.state.log_history
        if "loss" in e
    ]
    weights = [p.detach().double().sum().item() for p in trainer.model.parameters()]
    return {"world_size": trainer.accelerator.num_processes, "logs": logs, "weights": weights}


if __name__ == "__main__":
    model_dir, result_path = sys.argv[1], sys.argv[2]
    results = {mode: run(model_dir, f"{result_path}.{mode}", mode == "reference") for mode in ("shortcut", "reference")}
    if torch.distributed.get_rank() == 0:
        with open(result_path, "w", encoding="utf-8") as handle:
            json.dump(results, handle)
    leave_worker()

"""Run under `torchrun --nproc_per_node 2` by test_moe_replay.py: routing_replay='rollout' on two gloo processes,
whose rollouts are gathered (prompts padded on the left, completions on the right) before each process takes its
share. Rank 0 writes each rank's per-step routing metrics, whether its routes sit on their tokens, and the steps'
ratio bounds as JSON to argv[2]."""

from __future__ import annotations

import json
import sys

import torch
from datasets import Dataset
from helpers import count_digits, leave_worker, small_config

from gspo_trl import GSPOTrainer

if __name__ == "__main__":
    model_dir, result_path = sys.argv[1], sys.argv[2]
    config = small_config(f"{result_path}.run", max_completion_length=8, routing_replay="rollout")
    # Prompts of different lengths, so that the two processes' rollouts are padded to different widths.
    prompts = [f"What is {i} + {i + 1}?" + " Think." * (i % 3) for i in range(16)]
    trainer = GSPOTrainer(model_dir, count_digits, args=config, train_dataset=Dataset.from_dict({"prompt": prompts}))
    metrics = []

    def keep(mode, name, value, add=trainer._metrics.add):  # this process's own values, before any averaging
        if name.startswith("moe/"):
            metrics.append((name, float(value)))
        add(mode, name, value)

    trainer._metrics.add = keep
    trainer.train()
    # Every real prompt token, and every position that sampled a completion token, has its recorded route in the
    # micro-batches of the last rollout (padding that moved against the tokens would put -1 there).
    aligned = []
    for batch in trainer.schedule.micro_batches:
        prompt_width = batch.input_ids.shape[1] - batch.completion_ids.shape[1]
        recorded = (batch.sampling_routes >= 0).all(-1).all(-1)  # (B, P + C)
        scoring = recorded[:, prompt_width - 1 : -1][batch.completion_mask.bool()]
        aligned.append(bool(recorded[:, :prompt_width][batch.attention_mask[:, :prompt_width].bool()].all()))
        aligned.append(bool(scoring.all()))
    everyone = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(everyone, (metrics, aligned))
    if torch.distributed.get_rank() == 0:
        with open(result_path, "w", encoding="utf-8") as handle:
            logs = [entry for entry in trainer.state.log_history if "loss" in entry]
            ratios = [(entry["ratio/min"], entry["ratio/max"]) for entry in logs]
            result = {"world_size": trainer.accelerator.num_processes, "ratios": ratios}
            result.update(metrics=[metrics for metrics, _ in everyone], aligned=[aligned for _, aligned in everyone])
            json.dump(result, handle)
    leave_worker()

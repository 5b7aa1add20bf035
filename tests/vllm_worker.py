"""Run under `torchrun --nproc_per_node 2` by test_rollout_vllm_server.py: a short GSPO run sampling on a real vLLM
server, under `ddp` or `zero3` (every parameter partitioned, so the weight sync gathers module by module on both ranks),
`+http` / `+shared_dir` sending the weights over HTTP / through a snapshot, else through the server's
weight-transfer engine; `url` may name several servers, comma-separated.
After training, one more sync; then every rank scores a fixed text through the trained (wrapped) model and rank 0
asks every server for the same log-probs. Each rank writes <out>.rank<R>.json."""

from __future__ import annotations

import json
import sys

import torch
from datasets import Dataset
from distributed_worker import DEEPSPEED
from helpers import count_digits, leave_worker

from gspo_trl import GSPOConfig, GSPOTrainer
from gspo_trl.training.logprobs import completion_logprobs

FIXED_TEXT = [5, 17, 40, 99, 120, 7, 33, 250, 12, 64, 3, 81]


def main(model_dir: str, mode: str, url: str, out: str) -> None:
    config = GSPOConfig(
        output_dir=f"{out}.output",
        per_device_train_batch_size=4,
        num_generations=4,
        steps_per_generation=2,
        max_steps=4,
        max_completion_length=8,
        learning_rate=1e-2,
        logging_steps=1,
        report_to="none",
        seed=0,
        use_cpu=True,
        save_strategy="no",
        deepspeed=DEEPSPEED.get(mode.split("+")[0]),
        use_vllm=True,
        vllm_server_base_url=url,
        vllm_weight_transport=mode.split("+")[1] if "+" in mode else "auto",
        vllm_weight_chunk_mb=0.05,
    )
    dataset = Dataset.from_dict({"prompt": [f"What is {i} + {i + 1}?" for i in range(16)]})
    trainer = GSPOTrainer(model_dir, count_digits, args=config, train_dataset=dataset)
    trainer.train()
    backend = trainer.rollout_backend
    backend.update_weights(trainer.model_wrapped, -1)  # the final weights, through the same collective path
    ids = torch.tensor([FIXED_TEXT])
    with torch.no_grad():
        ours = completion_logprobs(
            trainer.model_wrapped, ids, torch.ones_like(ids), ids[:, 1:], torch.ones_like(ids[:, 1:])
        ).logps[0]
    rank = torch.distributed.get_rank()
    record = {
        "transport": backend.transport.name,
        "syncs": len(backend.sync_seconds),
        "world_size": trainer.accelerator.num_processes,
        "partitioned": any(hasattr(p, "ds_id") for p in trainer.accelerator.unwrap_model(trainer.model).parameters()),
        "logs": [
            {k: e[k] for k in ("step", "loss", "reward", "sampling/mismatch_kl") if k in e}
            for e in trainer.state.log_history
            if "loss" in e
        ],
    }
    if rank == 0:  # every server's error (`url` may name several, comma-separated)
        served = [torch.tensor(link.client.prompt_logprobs(FIXED_TEXT)) for link in backend.servers]
        record["max_error"] = max((server - ours).abs().max().item() for server in served)
        record["servers"] = len(served)
    with open(f"{out}.rank{rank}.json", "w", encoding="utf-8") as handle:
        json.dump(record, handle)


if __name__ == "__main__":
    main(*sys.argv[1:5])
    leave_worker()

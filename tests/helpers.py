"""Toy rewards, prompts and a small-run config shared by the trainer tests and the torchrun workers
(importable as `helpers`: pytest and torchrun both put tests/ on sys.path)."""

from __future__ import annotations

import os
import sys

import torch
from datasets import Dataset

from gspo_trl import GSPOConfig


def count_digits(completions, **kwargs):
    """A dense toy reward: the fraction of characters that are digits."""
    texts = [c if isinstance(c, str) else c[0]["content"] for c in completions]
    return [sum(ch.isdigit() for ch in t) / max(len(t), 1) for t in texts]


def length_reward(completion_ids, **kwargs):
    return [len(ids) / 16 for ids in completion_ids]


def text_dataset(n=8):
    return Dataset.from_dict({"prompt": [f"What is {i} + {i + 1}?" for i in range(n)], "answer": [str(2 * i + 1) for i in range(n)]})


def small_config(output_dir, **overrides) -> GSPOConfig:
    """A run of a few seconds on the tiny model: CPU, no saving, no logging backend, a log every step."""
    values = dict(
        output_dir=str(output_dir),
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=12,
        max_steps=2,
        learning_rate=1e-3,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        seed=0,
    )
    values.update(overrides)
    return GSPOConfig(**values)


def worker_env() -> dict:
    """The environment a test launches torchrun workers in: this process's, with Python's fault handler on (a rank
    that aborts prints every thread's Python stack)."""
    return {**os.environ, "PYTHONFAULTHANDLER": "1"}


def leave_worker() -> None:
    """End a torchrun worker whose results are written: every rank together, the process group destroyed, then out
    without the interpreter's teardown. In full-suite runs a rank has aborted in that teardown, after its results
    were written ("terminate called without an active exception": a C++ thread still joinable while the process
    exits; seen three times, in ddp+scripted, ddp+seeded and the schedule worker, never in 54 reruns of those alone),
    which failed a finished run. The launchers set PYTHONFAULTHANDLER, so an abort before this point shows its stack."""
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)

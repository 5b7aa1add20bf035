"""Crash-safe resume: the rollout in progress travels with each checkpoint, and only complete
checkpoints are resumed from.

A GSPO rollout is trained on for several optimizer steps, so a checkpoint usually falls inside one.
Its micro-batches (completions, advantages, π_old log-probs) were sampled by weights that no longer
exist after the next update: a resumed run cannot sample them again. Each process saves its share
next to Trainer's files, before Trainer writes `trainer_state.json`, the file it writes last; a
checkpoint without that file, or without every process's rollout file, was cut off while being
written and is never resumed from. What it does not own: the schedule (`schedule`, the trainer) and
Trainer's own model / optimizer / RNG files.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any

import torch

TRAINER_STATE_FILE = "trainer_state.json"  # transformers writes it last in a checkpoint
_CHECKPOINT_NAME = re.compile(r"^checkpoint-(\d+)$")


@dataclass
class RolloutState:
    """What one process needs to continue the rollout it was training on."""

    micro_batches: list[dict[str, Any]] | None  # the buffered rollout, or None between rollouts
    sampled_at_step: int  # optimizer steps done when it was sampled
    shuffle_generator_state: torch.Tensor  # the generator that orders groups into micro-batches
    num_tokens_seen: int
    entropy_control: dict | None = None  # the adaptive entropy coefficient's state


def rollout_file(checkpoint_dir: str, process_index: int) -> str:
    return os.path.join(checkpoint_dir, f"gspo_rollout_rank{process_index}.pt")


def save_rollout_state(checkpoint_dir: str, process_index: int, state: RolloutState) -> None:
    os.makedirs(checkpoint_dir, exist_ok=True)
    micro_batches = None
    if state.micro_batches is not None:
        micro_batches = [
            {key: value.cpu() if isinstance(value, torch.Tensor) else value for key, value in batch.items()}
            for batch in state.micro_batches
        ]
    path = rollout_file(checkpoint_dir, process_index)
    torch.save({**state.__dict__, "micro_batches": micro_batches}, path + ".tmp")
    os.replace(path + ".tmp", path)  # never a half-written rollout file under the final name


def load_rollout_state(checkpoint_dir: str, process_index: int, device: torch.device) -> RolloutState | None:
    """The state saved by this process, or None for a checkpoint written before rollouts were saved."""
    path = rollout_file(checkpoint_dir, process_index)
    if not os.path.exists(path):
        return None
    saved = torch.load(path, map_location="cpu", weights_only=False)
    if saved["micro_batches"] is not None:
        saved["micro_batches"] = [
            {key: value.to(device) if isinstance(value, torch.Tensor) else value for key, value in batch.items()}
            for batch in saved["micro_batches"]
        ]
    return RolloutState(**saved)


def is_complete_checkpoint(checkpoint_dir: str, num_processes: int) -> bool:
    if not os.path.isfile(os.path.join(checkpoint_dir, TRAINER_STATE_FILE)):
        return False
    return all(os.path.isfile(rollout_file(checkpoint_dir, rank)) for rank in range(num_processes))


def last_complete_checkpoint(output_dir: str, num_processes: int) -> tuple[str | None, list[str]]:
    """(the newest complete checkpoint under `output_dir`, the newer ones skipped as incomplete)."""
    if not os.path.isdir(output_dir):
        return None, []
    numbered = sorted(
        ((int(match.group(1)), name) for name in os.listdir(output_dir) if (match := _CHECKPOINT_NAME.match(name))),
        reverse=True,
    )
    skipped = []
    for _, name in numbered:
        path = os.path.join(output_dir, name)
        if os.path.isdir(path) and is_complete_checkpoint(path, num_processes):
            return path, skipped
        skipped.append(path)
    return None, skipped

"""Crash-safe resume: the rollout in progress travels with each checkpoint, and only complete
checkpoints are resumed from.

A GSPO rollout is trained on for several optimizer steps, so a checkpoint usually falls inside one.
Its micro-batches (completions, advantages, π_old log-probs) were sampled by weights that no longer
exist after the next update: a resumed run cannot sample them again. Each process saves its share
next to Trainer's files, before Trainer writes `trainer_state.json`, the file it writes last; a
checkpoint without that file, or without every process's rollout file, was cut off while being
written and is never resumed from. What it does not own: the schedule (`schedule`, the trainer) and
Trainer's own model / optimizer / RNG files.

The files hold no pickle: the tensors go to `gspo_rollout_rank{i}.safetensors`, everything else to
`gspo_rollout_rank{i}.json` (written second, so it marks a whole pair), and resuming runs no code from them. A
checkpoint of the earlier format (`gspo_rollout_rank{i}.pt`, a pickle) is read with `torch.load(weights_only=True)`,
which loads tensors and plain values only.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from typing import Any

import torch
from safetensors.torch import load_file, save_file

TRAINER_STATE_FILE = "trainer_state.json"  # transformers writes it last in a checkpoint
_CHECKPOINT_NAME = re.compile(r"^checkpoint-(\d+)$")


@dataclass
class RolloutState:
    """What one process needs to continue the rollout it was training on."""

    micro_batches: list[dict[str, Any]] | None  # the buffered rollout (`MicroBatch.to_state`), None between rollouts
    sampled_at_step: int  # optimizer steps done when it was sampled
    shuffle_generator_state: torch.Tensor  # the generator that orders groups into micro-batches
    num_tokens_seen: int
    entropy_control: dict | None = None  # the adaptive entropy coefficient's state


FORMAT_VERSION = 1


def rollout_file(checkpoint_dir: str, process_index: int) -> str:
    """The file whose presence marks this process's rollout as saved whole (the JSON, written after the tensors)."""
    return os.path.join(checkpoint_dir, f"gspo_rollout_rank{process_index}.json")


def _tensor_file(checkpoint_dir: str, process_index: int) -> str:
    return os.path.join(checkpoint_dir, f"gspo_rollout_rank{process_index}.safetensors")


def _legacy_file(checkpoint_dir: str, process_index: int) -> str:
    return os.path.join(checkpoint_dir, f"gspo_rollout_rank{process_index}.pt")


def _plain(value: Any, where: str) -> Any:
    """`value` if JSON writes it back as it is (None, bool, int, float, str, and lists/dicts of them)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_plain(item, where) for item in value]
    if isinstance(value, dict) and all(isinstance(key, str) for key in value):
        return {key: _plain(item, where) for key, item in value.items()}
    raise TypeError(
        f"save_rollout_state: {where} is a {type(value).__name__}; a saved rollout holds tensors and plain "
        "values (None, numbers, strings, lists and dicts of them)"
    )


def save_rollout_state(checkpoint_dir: str, process_index: int, state: RolloutState) -> None:
    os.makedirs(checkpoint_dir, exist_ok=True)
    # Copies: safetensors refuses tensors that share storage (views of one buffer).
    tensors = {"shuffle_generator_state": state.shuffle_generator_state.detach().cpu().clone()}
    micro_batches = None
    if state.micro_batches is not None:
        micro_batches = []
        for index, batch in enumerate(state.micro_batches):
            entry = {}
            for key, value in batch.items():
                if isinstance(value, torch.Tensor):
                    name = f"micro_batches.{index}.{key}"
                    tensors[name] = value.detach().cpu().contiguous().clone()
                    entry[key] = {"tensor": name}
                else:
                    entry[key] = {"value": _plain(value, f"micro-batch key {key!r}")}
            micro_batches.append(entry)
    manifest = {
        "format": FORMAT_VERSION,
        "sampled_at_step": int(state.sampled_at_step),
        "num_tokens_seen": int(state.num_tokens_seen),
        "entropy_control": _plain(state.entropy_control, "entropy_control"),
        "micro_batches": micro_batches,
    }
    # Each file written aside and moved in whole; the JSON last, so its presence means both are complete.
    tensor_path, manifest_path = (
        _tensor_file(checkpoint_dir, process_index),
        rollout_file(checkpoint_dir, process_index),
    )
    save_file(tensors, tensor_path + ".tmp")
    os.replace(tensor_path + ".tmp", tensor_path)
    with open(manifest_path + ".tmp", "w", encoding="utf-8") as handle:
        json.dump(manifest, handle)
    os.replace(manifest_path + ".tmp", manifest_path)


def load_rollout_state(checkpoint_dir: str, process_index: int, device: torch.device) -> RolloutState | None:
    """The state saved by this process, or None for a checkpoint written before rollouts were saved."""
    manifest_path = rollout_file(checkpoint_dir, process_index)
    if os.path.exists(manifest_path):
        with open(manifest_path, encoding="utf-8") as handle:
            manifest = json.load(handle)
        if manifest.get("format") != FORMAT_VERSION:
            raise ValueError(
                f"{manifest_path}: rollout format {manifest.get('format')!r}; this gspo-trl reads "
                f"format {FORMAT_VERSION}. Resume with the gspo-trl version that wrote it."
            )
        tensors = load_file(_tensor_file(checkpoint_dir, process_index), device="cpu")
        micro_batches = None
        if manifest["micro_batches"] is not None:
            micro_batches = [
                {
                    key: tensors[item["tensor"]].to(device) if "tensor" in item else item["value"]
                    for key, item in batch.items()
                }
                for batch in manifest["micro_batches"]
            ]
        return RolloutState(
            micro_batches=micro_batches,
            sampled_at_step=manifest["sampled_at_step"],
            shuffle_generator_state=tensors["shuffle_generator_state"],
            num_tokens_seen=manifest["num_tokens_seen"],
            entropy_control=manifest["entropy_control"],
        )
    legacy = _legacy_file(checkpoint_dir, process_index)
    if not os.path.exists(legacy):
        return None
    try:  # tensors and plain containers only: no code named by the pickle runs
        saved = torch.load(legacy, map_location="cpu", weights_only=True)
    except Exception as error:  # torch raises UnpicklingError (or a RuntimeError wrapping it) for anything else
        raise ValueError(
            f"{legacy} (a rollout saved by an earlier gspo-trl) holds objects other than tensors and plain values, "
            "and is not loaded: unpickling them could run code. Resume with the gspo-trl version that wrote it, or "
            f"from another checkpoint. ({type(error).__name__}: {str(error)[:200]})"
        ) from error
    if saved["micro_batches"] is not None:
        saved["micro_batches"] = [
            {key: value.to(device) if isinstance(value, torch.Tensor) else value for key, value in batch.items()}
            for batch in saved["micro_batches"]
        ]
    return RolloutState(**saved)


def is_complete_checkpoint(checkpoint_dir: str, num_processes: int) -> bool:
    if not os.path.isfile(os.path.join(checkpoint_dir, TRAINER_STATE_FILE)):
        return False
    return all(
        os.path.isfile(rollout_file(checkpoint_dir, rank)) or os.path.isfile(_legacy_file(checkpoint_dir, rank))
        for rank in range(num_processes)
    )


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


def checkpoint_to_resume(output_dir: str, num_processes: int, warn) -> str:
    """The newest complete checkpoint under `output_dir` (`resume_from_checkpoint=True`: Trainer would take the
    newest folder, even a half-written one); newer incomplete ones are reported through `warn`."""
    path, skipped = last_complete_checkpoint(output_dir, num_processes)
    if skipped:
        warn(f"Skipped incomplete checkpoints (cut off while being written): {skipped}")
    if path is None:
        raise ValueError(f"No complete checkpoint found in output_dir ({output_dir}) to resume from.")
    return path

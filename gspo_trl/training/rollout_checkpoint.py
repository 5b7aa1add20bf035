"""The rollout in progress saved with each checkpoint, one pair of files per process.

A GSPO rollout is trained on for several optimizer steps, so a checkpoint usually falls inside one.
Its micro-batches (completions, advantages, π_old log-probs, routes) were sampled by weights that no longer
exist after the next update: a resumed run cannot sample them again. Each process saves its share into the
checkpoint folder being written; `checkpoints` seals the folder and moves it into place. What it does not own: the
checkpoint folder (`checkpoints`), the schedule (`schedule`, the trainer) and Trainer's own model / optimizer / RNG
files.

The files hold no pickle: the tensors go to `gspo_rollout_rank{i}.safetensors`, everything else to
`gspo_rollout_rank{i}.json` (written second, so it marks a whole pair), and resuming runs no code from them. A
checkpoint of the earlier format (`gspo_rollout_rank{i}.pt`, a pickle) is read with `torch.load(weights_only=True)`,
which loads tensors and plain values only. A file that cannot be read is named with its checkpoint in the error.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from typing import Any

import torch
from safetensors.torch import load_file, save_file

TRAINER_STATE_FILE = "trainer_state.json"  # transformers writes it last: an earlier checkpoint without it was cut off
_RANK_FILE = re.compile(r"^gspo_rollout_rank(\d+)\.(json|pt)$")


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
        manifest = _read(manifest_path, checkpoint_dir, _read_json)
        if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_VERSION:
            raise ValueError(
                f"{manifest_path}: rollout format {manifest.get('format')!r}; this gspo-trl reads "
                f"format {FORMAT_VERSION}. Resume with the gspo-trl version that wrote it."
            )
        tensors = _read(_tensor_file(checkpoint_dir, process_index), checkpoint_dir, load_file)
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


def rollout_process_count(checkpoint_dir: str) -> int:
    """How many processes saved a rollout into `checkpoint_dir` (0: none, a checkpoint from before rollouts were
    saved)."""
    ranks = [int(m.group(1)) for name in os.listdir(checkpoint_dir) if (m := _RANK_FILE.match(name))]
    return max(ranks) + 1 if ranks else 0


def _read_json(path: str) -> Any:
    with open(path, encoding="utf-8") as handle:
        return json.load(handle)


def _read(path: str, checkpoint_dir: str, reader) -> Any:
    """`reader(path)`, or an error naming the file and its checkpoint (a file cut short or overwritten)."""
    try:
        return reader(path)
    except Exception as error:  # safetensors, json and OSError each raise their own kind
        raise ValueError(
            f"Cannot resume from checkpoint {checkpoint_dir}: {os.path.basename(path)} cannot be read "
            f"({type(error).__name__}: {str(error)[:200]}). Resume from an earlier checkpoint, or pass "
            "resume_from_checkpoint=True to take the newest one that reads whole."
        ) from error

"""Checkpoint folders that are complete or absent, and the checks before a run writes into or resumes from one.

Every process writes a checkpoint into `<output_dir>/.gspo-staging/checkpoint-N` (Trainer's model, optimizer,
scheduler, RNG and state files, each process's rollout in progress, the synced reference model). The main process then
writes `gspo_checkpoint.json` (each file's size and CRC-32, the number of processes, the run's schedule fields, a save
sequence number), flushes every file to disk and renames the folder into place: a kill at any moment leaves the new
checkpoint either whole or not there, and the earlier ones as they were. Rotation (`save_total_limit`) then deletes
checkpoints saved earlier only, never the one just written nor the best one. "Newest" is by save sequence, so a run
resumed from an earlier checkpoint is followed, not the later steps of the run it abandoned.

Before training (`before_training`): a run whose output_dir already holds a run's checkpoints or model is refused
unless it resumes (`resume_from_checkpoint`) or overwrites (`overwrite_output_dir`); a resume reads the checkpoint's
files against its manifest (`resume_from_checkpoint=True` falls back past damaged ones), and refuses one written by
another number of processes or with other schedule fields. What it does not own: the rollout file's format
(`rollout_checkpoint`), the reference model's (`reference_sync`), what Trainer writes into the folder.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import zlib

from .rollout_checkpoint import is_complete_checkpoint, rollout_process_count

MANIFEST_FILE = "gspo_checkpoint.json"  # written last, inside the staging folder
STAGING_FOLDER = ".gspo-staging"  # under the run's output_dir: checkpoints being written, and ones being deleted
FORMAT_VERSION = 1
CHECKPOINT_NAME = re.compile(r"^checkpoint-(\d+)$")
# Fields a resumed run must share with the run that saved the checkpoint: they fix the rollout saved in it and the
# order of the prompts and steps after it.
RUN_FIELDS = (
    "seed",
    "num_generations",
    "per_device_train_batch_size",
    "gradient_accumulation_steps",
    "steps_per_generation",
    "num_iterations",
    "max_completion_length",
    "beta",
    "sync_ref_model",
    "async_rollouts",
)
# What a run leaves at the top of its output_dir, besides checkpoint folders (the demo writes the last two).
RUN_OUTPUT_FILES = (
    "trainer_state.json",
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "adapter_model.safetensors",
    "metrics.json",
    "reward_curve.png",
)
_CHUNK = 1 << 24


def _write_point(name: str) -> None:
    """Called between the writes of a save; a no-op (the crash-consistency test kills the process here)."""


class DamagedCheckpoint(ValueError):
    """A checkpoint that cannot be resumed from: a file missing, cut short or changed since it was written."""

    def __init__(self, checkpoint: str, file: str, problem: str):
        self.checkpoint, self.file = checkpoint, file
        super().__init__(f"checkpoint {checkpoint}: {file} {problem}")


def numbered_checkpoints(run_dir: str) -> list[tuple[int, str]]:
    """(step, path) of each `checkpoint-N` folder in `run_dir`, the newest first: by the save sequence of their
    manifests (a run resumed from an earlier checkpoint saves after the later ones it left), then by step (a folder
    without a readable manifest counts as saved before every one with)."""
    if not os.path.isdir(run_dir):
        return []
    found = []
    for name in os.listdir(run_dir):
        path = os.path.join(run_dir, name)
        if (match := CHECKPOINT_NAME.match(name)) and os.path.isdir(path):
            found.append((_sequence(path), int(match.group(1)), path))
    return [(step, path) for _, step, path in sorted(found, reverse=True)]


def _sequence(checkpoint: str) -> int:
    try:
        manifest = read_manifest(checkpoint)
    except DamagedCheckpoint:
        return 0
    return 0 if manifest is None else int(manifest.get("sequence", 0))


def _size_and_crc(path: str) -> tuple[int, int]:
    crc, size = 0, 0
    with open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK):
            crc, size = zlib.crc32(chunk, crc), size + len(chunk)
    return size, crc


def _fsync(path: str) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _files(folder: str) -> list[str]:
    """Every file under `folder`, as sorted paths relative to it."""
    found = []
    for root, _, names in os.walk(folder):
        found += [os.path.relpath(os.path.join(root, name), folder) for name in names]
    return sorted(found)


def write_manifest(folder: str, num_processes: int, run_fields: dict, sequence: int) -> None:
    """Seal a staged checkpoint: every file flushed to disk, then the manifest listing them (written last)."""
    files = {}
    for name in _files(folder):
        if name == MANIFEST_FILE:
            continue
        path = os.path.join(folder, name)
        size, crc = _size_and_crc(path)
        _fsync(path)
        files[name] = {"size": size, "crc32": crc}
    manifest = {"format": FORMAT_VERSION, "sequence": sequence, "num_processes": num_processes, "run": run_fields}
    manifest["files"] = files
    path = os.path.join(folder, MANIFEST_FILE)
    with open(path + ".tmp", "w", encoding="utf-8") as handle:
        json.dump(manifest, handle, indent=1)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(path + ".tmp", path)
    for root, _, _ in os.walk(folder):
        _fsync(root)


def read_manifest(checkpoint: str) -> dict | None:
    """The checkpoint's manifest; None for a checkpoint written without one (by an earlier gspo-trl)."""
    path = os.path.join(checkpoint, MANIFEST_FILE)
    if not os.path.exists(path):
        return None
    try:
        with open(path, encoding="utf-8") as handle:
            manifest = json.load(handle)
    except (OSError, ValueError) as error:
        raise DamagedCheckpoint(checkpoint, MANIFEST_FILE, f"cannot be read ({error})") from error
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_VERSION:
        raise DamagedCheckpoint(checkpoint, MANIFEST_FILE, f"is not a format-{FORMAT_VERSION} manifest")
    return manifest


def verify(checkpoint: str, num_processes: int) -> dict | None:
    """Check every file of `checkpoint` against its manifest (raises `DamagedCheckpoint` naming the first bad one);
    returns the manifest. A checkpoint without one must hold `trainer_state.json` and every process's rollout."""
    manifest = read_manifest(checkpoint)
    if manifest is None:
        if not is_complete_checkpoint(checkpoint, num_processes):
            raise DamagedCheckpoint(checkpoint, "trainer_state.json or a process's rollout file", "is missing")
        return None
    for name, expected in manifest["files"].items():
        path = os.path.join(checkpoint, name)
        if not os.path.isfile(path):
            raise DamagedCheckpoint(checkpoint, name, "is missing")
        size, crc = _size_and_crc(path)
        if size != expected["size"]:
            raise DamagedCheckpoint(checkpoint, name, f"has {size} bytes, {expected['size']} were written")
        if crc != expected["crc32"]:
            raise DamagedCheckpoint(checkpoint, name, "differs from what was written (CRC-32 mismatch)")
    return manifest


def run_fields(args) -> dict:
    return {name: getattr(args, name, None) for name in RUN_FIELDS}


def select_checkpoint(run_dir: str, num_processes: int, warn) -> str:
    """`resume_from_checkpoint=True`: the newest checkpoint in `run_dir` whose files read whole (Trainer would take the
    newest folder, even a half-written one); the newer ones passed over are reported through `warn`. One written by
    another number of processes is returned if it reads whole, for `check_resume` to refuse."""
    skipped = []
    for _, path in numbered_checkpoints(run_dir):
        try:
            verify(path, num_processes)
        except DamagedCheckpoint as error:
            skipped.append(str(error))
            continue
        if skipped:
            warn(f"Skipped incomplete or damaged checkpoints, resuming from {path}: " + "; ".join(skipped))
        return path
    listed = f": {'; '.join(skipped)}" if skipped else ""
    raise ValueError(f"No complete checkpoint found in output_dir ({run_dir}) to resume from{listed}.")


def saved_process_count(checkpoint: str) -> int | None:
    """How many processes wrote `checkpoint` (its manifest's count, else its rollout files'); None if unknown."""
    try:
        manifest = read_manifest(checkpoint)
    except DamagedCheckpoint:
        manifest = None
    if manifest is not None:
        return manifest["num_processes"]
    return rollout_process_count(checkpoint) or None


def check_resume(checkpoint: str, args, num_processes: int) -> None:
    """Before anything is loaded, refuse a checkpoint written by another number of processes, a damaged one, or one of
    a run with other `RUN_FIELDS`."""
    if not os.path.isdir(checkpoint):
        return  # Trainer says it cannot find it
    saved = saved_process_count(checkpoint)
    if saved is not None and saved != num_processes:
        raise ValueError(
            f"Cannot resume from {checkpoint}: it was written by {saved} processes and this run has {num_processes}. "
            f"Each process saved its own share of the buffered rollout and its random state; resume with {saved} "
            "processes."
        )
    try:
        manifest = read_manifest(checkpoint)
        if manifest is not None:  # an earlier gspo-trl's checkpoint has no manifest to check against
            verify(checkpoint, num_processes)
    except DamagedCheckpoint as error:
        raise ValueError(
            f"Cannot resume from {error}. Resume from an earlier checkpoint, or pass resume_from_checkpoint=True to "
            "take the newest one that reads whole."
        ) from error
    changed = {
        name: (value, getattr(args, name, None))
        for name, value in (manifest or {}).get("run", {}).items()
        if value != getattr(args, name, None)
    }
    if changed:
        listed = ", ".join(f"{name}={old!r} there, {new!r} here" for name, (old, new) in changed.items())
        raise ValueError(
            f"Cannot resume from {checkpoint}: it belongs to a run with other settings ({listed}). Resume with the "
            "settings it was written with, or start a new run in another output_dir."
        )


def run_outputs(run_dir: str) -> list[str]:
    """What an earlier run left in `run_dir`: checkpoint folders and model/metrics files (sorted names)."""
    if not os.path.isdir(run_dir):
        return []
    return sorted(
        name
        for name in os.listdir(run_dir)
        if name in RUN_OUTPUT_FILES or (CHECKPOINT_NAME.match(name) and os.path.isdir(os.path.join(run_dir, name)))
    )


class Checkpoints:
    """A run's checkpoint folders: the checks before training, and each save staged and renamed into place.

    `args` is the run's config, `accelerator` its processes (barriers, which one is main)."""

    def __init__(self, args, accelerator):
        self.args, self.accelerator = args, accelerator
        self.staging: str | None = None  # the run dir Trainer writes into while a save is under way

    def before_training(self, resume_from_checkpoint, warn):
        """The checkpoint to resume from (a path, or None) once the output_dir and the checkpoint are checked."""
        run_dir, processes, main = self.args.output_dir, self.accelerator.num_processes, self.args.should_save
        if resume_from_checkpoint is True:
            resume_from_checkpoint = select_checkpoint(run_dir, processes, warn)
        if resume_from_checkpoint:
            check_resume(str(resume_from_checkpoint), self.args, processes)
            return resume_from_checkpoint
        found = run_outputs(run_dir)
        if found and not self.args.overwrite_output_dir:
            raise ValueError(
                f"output_dir {run_dir} already holds another run's outputs ({', '.join(found[:5])}"
                f"{', ...' if len(found) > 5 else ''}). Pass resume_from_checkpoint=True to trainer.train() to "
                "continue that run, set overwrite_output_dir=True to start over there (its checkpoints are deleted), "
                "or choose another output_dir."
            )
        checkpoints = [path for _, path in numbered_checkpoints(run_dir)]
        if checkpoints:
            warn(f"overwrite_output_dir=True: deleting the earlier run's checkpoints {sorted(checkpoints)}")
            if main:
                for path in checkpoints:
                    self._delete(run_dir, path)
            self.accelerator.wait_for_everyone()
        return resume_from_checkpoint

    @contextlib.contextmanager
    def staged(self, run_dir: str, state):
        """Save the checkpoint of `state.global_step`: the body writes into the yielded folder (Trainer reaches it
        through `self.staging`); on leaving, it is sealed and renamed to `run_dir/checkpoint-N`, then older ones
        rotated."""
        name, main = f"checkpoint-{state.global_step}", self.args.should_save
        staging = os.path.join(run_dir, STAGING_FOLDER)
        if main:  # what a killed save or deletion left
            shutil.rmtree(staging, ignore_errors=True)
        self.accelerator.wait_for_everyone()
        self.staging = staging
        try:
            yield os.path.join(staging, name)
        finally:
            self.staging = None
        self.accelerator.wait_for_everyone()  # every process's files are written
        if state.best_model_checkpoint and os.path.dirname(state.best_model_checkpoint) == staging:
            # Trainer found the best checkpoint in the folder it wrote to: every process names its final place
            # instead (each loads it at the end under `load_best_model_at_end`).
            state.best_model_checkpoint = os.path.join(run_dir, name)
            if main:
                state.save_to_json(os.path.join(staging, name, "trainer_state.json"))
        if main:
            self._seal_and_place(run_dir, staging, name, state)
        self.accelerator.wait_for_everyone()

    def _seal_and_place(self, run_dir: str, staging: str, name: str, state) -> None:
        folder, final = os.path.join(staging, name), os.path.join(run_dir, name)
        _write_point("written")
        sequence = 1 + max((_sequence(path) for _, path in numbered_checkpoints(run_dir)), default=0)
        write_manifest(folder, self.accelerator.num_processes, run_fields(self.args), sequence)
        _write_point("sealed")
        if os.path.exists(final):  # a folder left by a killed run, or an abandoned later one: replaced whole
            os.rename(final, os.path.join(staging, "replaced-" + name))
            _write_point("moved aside")
        os.rename(folder, final)
        _fsync(run_dir)
        _write_point("renamed")
        self._rotate(run_dir, final, state.best_model_checkpoint)
        shutil.rmtree(staging, ignore_errors=True)

    def _rotate(self, run_dir: str, newest: str, best: str | None) -> None:
        """Keep the `save_total_limit` checkpoints saved last and the best one: never `newest`, the one just placed."""
        limit = self.args.save_total_limit
        if not limit or limit <= 0:
            return
        keep = {os.path.abspath(newest), *([os.path.abspath(best)] if best else [])}
        kept = 0
        for _, path in numbered_checkpoints(run_dir):  # the newest first
            if os.path.abspath(path) in keep or kept < limit:
                kept += 1
                continue
            self._delete(run_dir, path)
            _write_point("rotated")

    @staticmethod
    def _delete(run_dir: str, path: str) -> None:
        """Move the checkpoint out of the numbered names first, so no half-deleted folder is ever taken for one."""
        trash = os.path.join(run_dir, STAGING_FOLDER, "deleted-" + os.path.basename(path))
        os.makedirs(os.path.dirname(trash), exist_ok=True)
        shutil.rmtree(trash, ignore_errors=True)
        os.rename(path, trash)
        shutil.rmtree(trash, ignore_errors=True)

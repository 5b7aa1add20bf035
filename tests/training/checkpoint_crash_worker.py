"""The crash-consistency test's worker: a run killed with SIGKILL at each write of one save in turn, then resumed.

`python checkpoint_crash_worker.py TINY_MODEL_DIR WORK_DIR RESULTS_JSON [JSON: config overrides, and "kill_points",
the names of the points to kill at]`. It imports once, then forks one child per run (no torch work happens in this
process before a fork): the uninterrupted run, a run that counts the write points of the save of step `TARGET`, and
per write point a run killed there followed by a run resumed with `resume_from_checkpoint=True`. Each finished child
writes its final weights. The results JSON holds the points counted ("events") and, per point tried ("trials"):
whether the child was killed, the checkpoint folders it left, the resumed run's exit status and its largest weight
difference from the uninterrupted run (policy and reference).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [TESTS, os.path.dirname(TESTS)]  # helpers, and the gspo_trl of this checkout

import torch  # noqa: E402
from helpers import count_digits, length_reward, small_config, text_dataset  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from transformers import Trainer, TrainerState  # noqa: E402

import gspo_trl.trainer as trainer_module  # noqa: E402
from gspo_trl import GSPOTrainer  # noqa: E402
from gspo_trl.training import checkpoints  # noqa: E402
from gspo_trl.training.reference_sync import ReferenceSync  # noqa: E402

STEPS, TARGET = 4, 2  # the save of step 2 is the one cut; checkpoint-1 is the one before it
_saving = {"step": None, "events": [], "kill_at": None}


def _point(name: str) -> None:
    if _saving["step"] != TARGET:
        return
    _saving["events"].append(name)
    if len(_saving["events"]) == _saving["kill_at"]:
        os.kill(os.getpid(), signal.SIGKILL)


def _after(function, name):
    def wrapped(*args, **kwargs):
        result = function(*args, **kwargs)
        _point(name)
        return result

    return wrapped


def _patch() -> None:
    """A write point after each file (group) a save writes, and at the module's own points."""
    original_save = GSPOTrainer._save_checkpoint

    def save_checkpoint(self, model, trial):
        _saving["step"] = self.state.global_step
        _point("start")
        return original_save(self, model, trial)

    GSPOTrainer._save_checkpoint = save_checkpoint
    trainer_module.save_rollout_state = _after(trainer_module.save_rollout_state, "rollout")
    ReferenceSync.save = _after(ReferenceSync.save, "reference")
    Trainer.save_model = _after(Trainer.save_model, "model")
    Trainer._save_optimizer_and_scheduler = _after(Trainer._save_optimizer_and_scheduler, "optimizer")
    Trainer._save_rng_state = _after(Trainer._save_rng_state, "rng")
    TrainerState.save_to_json = _after(TrainerState.save_to_json, "trainer_state")
    checkpoints._write_point = _point


def _train(model_dir, output_dir, overrides, resume=None) -> GSPOTrainer:
    config = small_config(
        output_dir,
        per_device_train_batch_size=2,
        num_generations=2,
        max_completion_length=6,
        max_steps=STEPS,
        learning_rate=5e-3,
        gradient_accumulation_steps=2,
        steps_per_generation=3,  # a rollout trains 3 optimizer steps: the cut save falls inside one
        num_iterations=2,
        beta=0.1,
        sync_ref_model=True,
        ref_model_sync_steps=1,
        ref_model_mixup_alpha=0.5,
        save_strategy="steps",
        save_steps=1,
        save_total_limit=1,
        **overrides,
    )
    trainer = GSPOTrainer(model_dir, [count_digits, length_reward], args=config, train_dataset=text_dataset(6))
    trainer.train(resume_from_checkpoint=resume)
    return trainer


def _weights(trainer) -> dict[str, torch.Tensor]:
    weights = {f"policy.{n}": p.detach().clone() for n, p in trainer.model.named_parameters()}
    weights.update({f"reference.{n}": p.detach().clone() for n, p in trainer.ref_model.named_parameters()})
    return weights


def _in_child(work) -> int:
    """Run `work()` in a forked child; its exit status (a negative signal number if killed)."""
    pid = os.fork()
    if pid == 0:
        code = 0
        # One thread: the same operations in the same order in every run. With two threads, one of five trials resumed
        # from the same checkpoint-1 ended a few ulps away in every tensor (2e-6 on rarely used embedding rows, after
        # Adam) while the other four matched bit for bit.
        torch.set_num_threads(1)
        try:
            work()
        except BaseException as error:  # noqa: BLE001 - reported through the exit status
            print(f"child failed: {type(error).__name__}: {error}", file=sys.stderr, flush=True)
            code = 1
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def _resumed_weights(model_dir, output_dir, overrides, path) -> int:
    """Resume the run in `output_dir` with `resume_from_checkpoint=True` in a child; its final weights go to `path`."""
    return _in_child(lambda: save_file(_weights(_train(model_dir, output_dir, overrides, resume=True)), path))


def _killed_at(point: int, model_dir, output_dir, overrides) -> bool:
    _saving["kill_at"] = point
    try:
        return _in_child(lambda: _train(model_dir, output_dir, overrides)) == -signal.SIGKILL
    finally:
        _saving["kill_at"] = None


def _references(events, model_dir, work_dir, overrides, compare) -> dict[str, dict]:
    """The weights each trial must end on, by the newest checkpoint it left: the uninterrupted run's, or (async
    rollouts, whose resumed run samples the rollout in flight again) those of a run resumed from that checkpoint left
    whole (a save cut right after its rename leaves checkpoint-1 and checkpoint-2)."""
    if compare == "uninterrupted":
        whole = _in_child(
            lambda: save_file(_weights(_train(model_dir, f"{work_dir}/whole", overrides)), f"{work_dir}/whole.st")
        )
        assert whole == 0
        return {"checkpoint-1": load_file(f"{work_dir}/whole.st"), "checkpoint-2": load_file(f"{work_dir}/whole.st")}
    assert _killed_at(events.index("renamed") + 1, model_dir, f"{work_dir}/clean", overrides)
    references = {}
    for name in ("checkpoint-1", "checkpoint-2"):
        copy = f"{work_dir}/clean-{name}"
        shutil.copytree(f"{work_dir}/clean", copy)
        if name == "checkpoint-1":
            shutil.rmtree(f"{copy}/checkpoint-2")
        assert _resumed_weights(model_dir, copy, overrides, f"{copy}.st") == 0
        references[name] = load_file(f"{copy}.st")
    return references


def main() -> None:
    model_dir, work_dir, results_path = sys.argv[1:4]
    overrides = json.loads(sys.argv[4]) if len(sys.argv) > 4 else {}
    only = overrides.pop("kill_points", None)  # the names of the write points to kill at (default: all)
    compare = overrides.pop("compare", "uninterrupted")  # or "clean_resume"
    _patch()

    def count():
        _train(model_dir, os.path.join(work_dir, "count"), overrides)
        with open(f"{work_dir}/events.json", "w") as handle:
            json.dump(_saving["events"], handle)

    assert _in_child(count) == 0
    with open(f"{work_dir}/events.json") as handle:
        events = json.load(handle)
    references = _references(events, model_dir, work_dir, overrides, compare)
    results = []
    for kill_at in range(1, len(events) + 1):
        if only is not None and events[kill_at - 1] not in only:
            continue
        output_dir = os.path.join(work_dir, f"kill-{kill_at}")
        killed = _killed_at(kill_at, model_dir, output_dir, overrides)
        left = sorted(name for name in os.listdir(output_dir) if name.startswith("checkpoint-"))
        status = _resumed_weights(model_dir, output_dir, overrides, f"{work_dir}/resumed-{kill_at}.st")
        entry = {"event": events[kill_at - 1], "killed": killed, "left": left, "resume_status": status}
        if status == 0:
            got, expected = load_file(f"{work_dir}/resumed-{kill_at}.st"), references[left[-1]]
            entry["max_difference"] = max((got[k] - expected[k]).abs().max().item() for k in expected)
        results.append(entry)
    with open(results_path, "w") as handle:
        json.dump({"events": events, "trials": results}, handle, indent=1)


if __name__ == "__main__":
    main()

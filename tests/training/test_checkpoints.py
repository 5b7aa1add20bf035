"""gspo_trl.training.checkpoints: checkpoints complete or absent, never overwritten by a second run, never resumed
damaged, by another number of processes or by a run with other settings; a run (one process, or a two-process
torchrun launch) killed during a save resumes from the newest complete checkpoint; the best checkpoint outlives
rotation and is loaded at the end."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from datasets import Dataset
from helpers import close, count_digits, length_reward, scored_by_step, small_config, text_dataset, worker_env
from safetensors.torch import load_file
from transformers import TrainerCallback

from gspo_trl import GSPOTrainer
from gspo_trl.training.checkpoints import MANIFEST_FILE, STAGING_FOLDER, select_checkpoint, verify
from gspo_trl.training.reference_sync import REFERENCE_FILE
from gspo_trl.training.rollout_checkpoint import rollout_file

RUN = dict(
    per_device_train_batch_size=2,
    num_generations=2,
    max_completion_length=6,
    max_steps=2,
    gradient_accumulation_steps=2,
    steps_per_generation=3,  # a rollout spans 3 optimizer steps: both checkpoints fall inside one
    num_iterations=2,
    beta=0.1,
    sync_ref_model=True,
    ref_model_sync_steps=1,
    save_strategy="steps",
    save_steps=1,
)


def trainer_for(output_dir, model_dir, **overrides) -> GSPOTrainer:
    config = small_config(output_dir, **{**RUN, **overrides})
    return GSPOTrainer(model_dir, [count_digits, length_reward], args=config, train_dataset=text_dataset(6))


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory, tiny_model_dir):
    """A finished 2-step run that saved checkpoint-1 and checkpoint-2 (copy it before changing it)."""
    output_dir = tmp_path_factory.mktemp("saved-run")
    trainer_for(output_dir, tiny_model_dir).train()
    return output_dir


def copy_of(saved_run, tmp_path):
    target = tmp_path / "run"
    shutil.copytree(saved_run, target)
    return target


def every_file(folder) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_a_checkpoint_lists_every_file_it_holds_and_nothing_is_left_aside(saved_run):
    assert not (saved_run / STAGING_FOLDER).exists()
    for step in (1, 2):
        checkpoint = saved_run / f"checkpoint-{step}"
        manifest = json.loads((checkpoint / MANIFEST_FILE).read_text())
        on_disk = {str(p.relative_to(checkpoint)) for p in checkpoint.rglob("*") if p.is_file()} - {MANIFEST_FILE}
        assert set(manifest["files"]) == on_disk
        # the reference of sync_ref_model and the rollout in progress are inside the completeness check
        for name in (REFERENCE_FILE, "gspo_rollout_rank0.json", "gspo_rollout_rank0.safetensors", "optimizer.pt"):
            assert name in manifest["files"], name
        assert manifest["num_processes"] == 1 and manifest["run"]["seed"] == 0 and manifest["sequence"] == step
        assert verify(str(checkpoint), 1) == manifest


def test_rotation_keeps_the_newest_checkpoint(tmp_path, tiny_model_dir):
    trainer_for(tmp_path, tiny_model_dir, max_steps=3, save_total_limit=1).train()
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-3"]
    verify(str(tmp_path / "checkpoint-3"), 1)


def test_a_second_run_into_a_used_output_dir_is_refused_and_changes_nothing(saved_run, tmp_path, tiny_model_dir):
    output_dir = copy_of(saved_run, tmp_path)
    before = every_file(output_dir)
    trainer = trainer_for(output_dir, tiny_model_dir)
    with pytest.raises(ValueError, match=r"already holds another run's outputs \(checkpoint-1, checkpoint-2") as error:
        trainer.train()
    assert "resume_from_checkpoint=True" in str(error.value) and "overwrite_output_dir=True" in str(error.value)
    assert every_file(output_dir) == before


def test_overwrite_output_dir_starts_over_without_the_earlier_checkpoints(saved_run, tmp_path, tiny_model_dir):
    output_dir = copy_of(saved_run, tmp_path)
    (output_dir / "checkpoint-7").mkdir()  # a later step the new run would never replace
    trainer_for(output_dir, tiny_model_dir, overwrite_output_dir=True, max_steps=1).train()
    assert sorted(p.name for p in output_dir.glob("checkpoint-*")) == ["checkpoint-1"]


def test_a_damaged_file_falls_back_to_the_previous_checkpoint(saved_run, tmp_path, tiny_model_dir, caplog):
    output_dir = copy_of(saved_run, tmp_path)
    damaged = output_dir / "checkpoint-2" / "optimizer.pt"
    data = bytearray(damaged.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one bit pattern changed, same size: only the CRC can tell
    damaged.write_bytes(bytes(data))
    explicit = trainer_for(output_dir, tiny_model_dir)
    with pytest.raises(ValueError, match=r"checkpoint-2: optimizer.pt differs from what was written"):
        explicit.train(resume_from_checkpoint=str(output_dir / "checkpoint-2"))
    with caplog.at_level("WARNING"):
        assert select_checkpoint(str(output_dir), 1, print) == str(output_dir / "checkpoint-1")
        trainer = trainer_for(output_dir, tiny_model_dir)
        trainer.train(resume_from_checkpoint=True)
    assert "resuming from " + str(output_dir / "checkpoint-1") in caplog.text
    assert "checkpoint-2: optimizer.pt differs from what was written" in caplog.text
    verify(str(output_dir / "checkpoint-2"), 1)  # saved again by the resumed run, whole


def test_a_truncated_file_is_named_with_its_checkpoint(saved_run, tmp_path, tiny_model_dir):
    output_dir = copy_of(saved_run, tmp_path)
    path = output_dir / "checkpoint-2" / REFERENCE_FILE
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(ValueError, match=rf"checkpoint-2: {REFERENCE_FILE} has 100 bytes"):
        trainer_for(output_dir, tiny_model_dir).train(resume_from_checkpoint=str(output_dir / "checkpoint-2"))
    # An earlier gspo-trl's checkpoint (no manifest): the loader names the file and the checkpoint.
    os.remove(output_dir / "checkpoint-1" / MANIFEST_FILE)
    (output_dir / "checkpoint-1" / "gspo_rollout_rank0.json").write_text('{"format": 1, "micro')
    with pytest.raises(ValueError, match=r"checkpoint-1: gspo_rollout_rank0.json cannot be read \(JSONDecodeError"):
        trainer_for(output_dir, tiny_model_dir).train(resume_from_checkpoint=str(output_dir / "checkpoint-1"))


def test_a_resume_with_another_number_of_processes_is_refused_at_once(saved_run, tmp_path, tiny_model_dir):
    output_dir = copy_of(saved_run, tmp_path)
    manifest_path = output_dir / "checkpoint-2" / MANIFEST_FILE
    manifest = json.loads(manifest_path.read_text())
    manifest["num_processes"] = 2  # as a 2-process run writes it
    manifest_path.write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match="written by 2 processes and this run has 1"):
        trainer_for(output_dir, tiny_model_dir).train(resume_from_checkpoint=True)
    # An earlier gspo-trl's checkpoint: the count of its rollout files.
    os.remove(manifest_path)
    shutil.copy(rollout_file(str(output_dir / "checkpoint-2"), 0), rollout_file(str(output_dir / "checkpoint-2"), 1))
    with pytest.raises(ValueError, match="written by 2 processes and this run has 1"):
        trainer_for(output_dir, tiny_model_dir).train(resume_from_checkpoint=str(output_dir / "checkpoint-2"))


def test_a_resume_with_other_schedule_settings_is_refused(saved_run, tmp_path, tiny_model_dir):
    output_dir = copy_of(saved_run, tmp_path)
    trainer = trainer_for(output_dir, tiny_model_dir, seed=1, num_iterations=1)
    with pytest.raises(ValueError, match=r"other settings \(seed=0 there, 1 here, num_iterations=2 there, 1 here\)"):
        trainer.train(resume_from_checkpoint=True)


def test_a_run_resumed_from_an_earlier_checkpoint_saves_after_the_later_ones(saved_run, tmp_path, tiny_model_dir):
    # Resumed from checkpoint-1 while checkpoint-2 and checkpoint-3 (an abandoned continuation) are there: its new
    # checkpoint-2 replaces the old one whole and is the newest; resume=True takes it, not the abandoned step 3.
    output_dir = copy_of(saved_run, tmp_path)
    shutil.copytree(output_dir / "checkpoint-2", output_dir / "checkpoint-3")  # the same manifest: sequence 2
    old = (output_dir / "checkpoint-2" / MANIFEST_FILE).read_bytes()
    trainer_for(output_dir, tiny_model_dir).train(resume_from_checkpoint=str(output_dir / "checkpoint-1"))
    manifest = json.loads((output_dir / "checkpoint-2" / MANIFEST_FILE).read_text())
    assert manifest["sequence"] == 3 and (output_dir / "checkpoint-2" / MANIFEST_FILE).read_bytes() != old
    assert select_checkpoint(str(output_dir), 1, print) == str(output_dir / "checkpoint-2")


def test_load_best_model_at_end_loads_the_best_checkpoint_that_rotation_kept(tmp_path, tiny_model_dir):
    config = small_config(
        tmp_path,
        **{**RUN, "max_steps": 4, "save_total_limit": 1},
        eval_strategy="steps",
        eval_steps=1,
        load_best_model_at_end=True,
        metric_for_best_model="reward",
    )
    trainer = GSPOTrainer(
        tiny_model_dir,
        scored_by_step,
        args=config,
        train_dataset=text_dataset(6),
        eval_dataset=Dataset.from_dict({"prompt": ["Check 1", "Check 2"]}),
    )
    saved = {}  # step -> (the checkpoint folders after its save, the policy's weights then)

    class AfterEachSave(TrainerCallback):
        def on_save(self, args, state, control, **kwargs):
            folders = sorted(p.name for p in tmp_path.glob("checkpoint-*"))
            weights = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
            saved[state.global_step] = (folders, weights)

    trainer.add_callback(AfterEachSave())
    trainer.train()
    # save_total_limit=1 keeps the newest checkpoint and the best one: checkpoint-2 outlives the saves of steps 3, 4.
    assert {step: folders for step, (folders, _) in saved.items()} == {
        1: ["checkpoint-1"],
        2: ["checkpoint-2"],
        3: ["checkpoint-2", "checkpoint-3"],
        4: ["checkpoint-2", "checkpoint-4"],
    }
    assert trainer.state.best_global_step == 2 and trainer.state.best_metric == 0.75
    assert trainer.state.best_model_checkpoint == str(tmp_path / "checkpoint-2")  # its place, not the staging folder
    # Trainer's end of training with save_total_limit=1 leaves the best one alone; it reads whole, and so does the
    # state saved in each checkpoint after it (naming checkpoint-2 too).
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-2"]
    assert not (tmp_path / STAGING_FOLDER).exists()
    verify(str(tmp_path / "checkpoint-2"), 1)
    state = json.loads((tmp_path / "checkpoint-2" / "trainer_state.json").read_text())
    assert state["best_model_checkpoint"] == str(tmp_path / "checkpoint-2")
    # The policy at the end is step 2's, loaded back over step 4's.
    final = dict(trainer.model.named_parameters())
    assert all(torch.equal(final[n], w) for n, w in saved[2][1].items())
    assert any(not torch.equal(final[n], w) for n, w in saved[4][1].items())


# The points a save passes, in order: before it, after each file (group) Trainer or gspo-trl writes, after the
# manifest (sealed), after the rename, after the rotation deleted the previous checkpoint.
KILL_POINTS = ["start", "rollout", "reference", "model", "optimizer", "rng", "trainer_state", "written", "sealed"]
KILL_POINTS += ["renamed", "rotated"]


# Synchronous rollouts: every trial must end on the uninterrupted run's weights. Async rollouts: a resumed run samples
# the rollout that was in flight again (docs/async_rollouts.md), so a trial must end where a run resumed from the
# same checkpoint, left whole, ends; three points: before the save, sealed but not renamed, after the rotation.
@pytest.mark.slow  # two runs per kill point: both cases 4 min on 2 cores, 12 min with the machine shared
@pytest.mark.parametrize(
    "async_rollouts, kill_points, compare",
    [(False, KILL_POINTS, "uninterrupted"), (True, ["start", "sealed", "rotated"], "clean_resume")],
)
def test_a_run_killed_at_each_write_of_a_save_resumes_onto_the_uninterrupted_weights(
    tmp_path, tiny_model_dir, async_rollouts, kill_points, compare
):
    worker = os.path.join(os.path.dirname(__file__), "checkpoint_crash_worker.py")
    results_path = tmp_path / "results.json"
    overrides = json.dumps({"async_rollouts": async_rollouts, "kill_points": kill_points, "compare": compare})
    command = [sys.executable, worker, tiny_model_dir, str(tmp_path), str(results_path), overrides]
    completed = subprocess.run(command, capture_output=True, text=True, timeout=1800, env=worker_env())
    assert completed.returncode == 0, completed.stderr[-4000:]
    counted = json.loads(results_path.read_text())
    assert counted["events"] == KILL_POINTS  # every write of the save has a point here, in this order
    results = counted["trials"]
    events = [entry["event"] for entry in results]
    assert events == kill_points
    for entry in results:
        assert entry["killed"], entry
        assert entry["resume_status"] == 0, entry
        # the same steps on the same rows from the same state: as in the resume tests, equal up to 1e-6
        assert entry["max_difference"] <= 1e-6, entry
        after_rename = KILL_POINTS.index(entry["event"]) >= KILL_POINTS.index("renamed")
        assert entry["left"] == (
            ["checkpoint-2"] if entry["event"] == "rotated" else ["checkpoint-1"] + ["checkpoint-2"] * after_rename
        ), entry
    print(f"{len(results)} kill points: {events}")


WORKER = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "distributed_worker.py")


def torchrun(tmp_path, model_dir, mode, name) -> subprocess.CompletedProcess:
    """A 2-process launch of tests/distributed_worker.py in `mode`; its ranks write `<name>.rank<R>.json` and train
    into `<name>.output`."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", WORKER]
    command += [model_dir, mode, str(tmp_path / name)]
    return subprocess.run(command, capture_output=True, text=True, timeout=600, env=worker_env())


def rank_results(tmp_path, name) -> list[dict]:
    return [json.loads((tmp_path / f"{name}.rank{rank}.json").read_text()) for rank in (0, 1)]


def assert_whole_checkpoints(run_dir, names: list[str]) -> None:
    """`run_dir` holds exactly the checkpoints `names`, each reading whole against its manifest, written by both
    processes (each one's rollout listed) at the step its name says: no folder holds a mix of two saves."""
    assert sorted(p.name for p in run_dir.glob("checkpoint-*")) == names
    for name in names:
        manifest = verify(str(run_dir / name), 2)
        assert manifest["num_processes"] == 2
        assert {os.path.basename(rollout_file(name, rank)) for rank in (0, 1)} <= set(manifest["files"])
        assert json.loads((run_dir / name / "trainer_state.json").read_text())["global_step"] == int(name[11:])


# The launch (torchrun and both ranks) SIGKILLed during the save of step 2 of 4, with save_total_limit=1:
# `cutrollout` once rank 1 has written its rollout file into the staging folder (rank 0 anywhere in its own writes),
# `cutrenamed` once checkpoint-2 is in place and checkpoint-1 not yet rotated away. Each resumes with
# resume_from_checkpoint=True from the newest complete checkpoint and ends on the uninterrupted run's weights.
@pytest.mark.slow  # five torchrun launches: 5.5 min on 2 cores shared with other jobs
def test_two_processes_killed_during_a_save_resume_from_the_newest_complete_checkpoint(tmp_path, tiny_model_dir):
    whole = torchrun(tmp_path, tiny_model_dir, "ddp+checkpoints", "whole")
    assert whole.returncode == 0, whole.stderr[-4000:]
    whole = rank_results(tmp_path, "whole")
    for cut, left, newest, trained in (
        ("cutrollout", ["checkpoint-1"], "checkpoint-1", [2, 3, 4]),
        ("cutrenamed", ["checkpoint-1", "checkpoint-2"], "checkpoint-2", [3, 4]),
    ):
        killed = torchrun(tmp_path, tiny_model_dir, f"ddp+checkpoints+rotate+{cut}", cut)
        assert killed.returncode == -9, (killed.returncode, killed.stderr[-4000:])  # torchrun itself was SIGKILLed
        assert not (tmp_path / f"{cut}.rank0.json").exists() and not (tmp_path / f"{cut}.rank1.json").exists()
        run_dir = tmp_path / f"{cut}.output"
        assert_whole_checkpoints(run_dir, left)
        if cut == "cutrollout":  # killed mid-save: checkpoint-2 lies half-written, unsealed, in the staging folder
            staged = run_dir / STAGING_FOLDER / "checkpoint-2"
            assert os.path.exists(rollout_file(str(staged), 1)) and not (staged / MANIFEST_FILE).exists()
        assert select_checkpoint(str(run_dir), 2, print) == str(run_dir / newest)
        resumed = torchrun(tmp_path, tiny_model_dir, "ddp+resume+rotate", cut)
        assert resumed.returncode == 0, resumed.stderr[-4000:]
        resumed = rank_results(tmp_path, cut)
        assert resumed[0]["trained_steps"] == resumed[1]["trained_steps"] == trained  # from `newest` on
        assert_whole_checkpoints(run_dir, ["checkpoint-4"])
        assert not (run_dir / STAGING_FOLDER).exists()
        # The same steps on the same rows from the same state: as in the other resume tests, equal up to 1e-6.
        assert len(resumed[0]["logs"]) == len(whole[0]["logs"]) == 4
        for got, expected in zip(resumed[0]["logs"], whole[0]["logs"]):
            assert got.keys() == expected.keys() and all(got[k] == close(expected[k], 1e-6) for k in got), got
        for rank in resumed:
            assert rank["checksum"] == pytest.approx(whole[0]["checksum"], rel=1e-6)


@pytest.mark.slow  # a torchrun launch
def test_two_processes_load_the_best_checkpoint_at_the_end(tmp_path, tiny_model_dir):
    # Evaluated after each of 4 steps with scores that make step 2 the best (helpers.EVAL_SCORES), save_total_limit=1:
    # rotation keeps checkpoint-2, and both processes load it at the end (each needs its final path, not the staging
    # folder Trainer wrote it into).
    launch = torchrun(tmp_path, tiny_model_dir, "ddp+checkpoints+rotate+best", "best")
    assert launch.returncode == 0, launch.stderr[-4000:]
    run_dir = tmp_path / "best.output"
    assert_whole_checkpoints(run_dir, ["checkpoint-2"])
    weights = load_file(run_dir / "checkpoint-2" / "model.safetensors")
    best = sum(w.double().abs().sum().item() for w in weights.values())
    for rank in rank_results(tmp_path, "best"):
        assert rank["best_model_checkpoint"] == str(run_dir / "checkpoint-2")
        # the same fp32 weights summed in float64 in another order: equal to ~1e-15 relative
        assert rank["checksum"] == pytest.approx(best, rel=1e-9), rank["checksum"]

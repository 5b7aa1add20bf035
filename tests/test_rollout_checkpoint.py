"""gspo_trl.rollout_checkpoint: a run stopped inside a rollout and resumed from its checkpoint continues
the uninterrupted run step for step; incomplete checkpoints are never resumed from."""

from __future__ import annotations

import os

import pytest
import torch
from helpers import close, count_digits, length_reward, small_config, text_dataset
from transformers import TrainerCallback

from gspo_trl import GSPOTrainer
from gspo_trl.rollout_checkpoint import (
    RolloutState,
    last_complete_checkpoint,
    load_rollout_state,
    rollout_file,
    save_rollout_state,
)

STEPS = 5
SCHEDULE = dict(gradient_accumulation_steps=2, steps_per_generation=3, num_iterations=2)  # a rollout = 3 steps


class StopAt(TrainerCallback):
    """Ends training right after optimizer step `step` (its checkpoint is still written)."""

    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            control.should_training_stop = True


def run(output_dir, tiny_model_dir, resume=None, stop_at=None, **overrides):
    config = small_config(
        output_dir,
        per_device_train_batch_size=2,
        num_generations=2,
        max_completion_length=6,
        max_steps=STEPS,
        learning_rate=5e-3,
        epsilon=0.2,
        epsilon_high=0.2,
        **{**SCHEDULE, **overrides},
    )
    callbacks = [StopAt(stop_at)] if stop_at else None
    trainer = GSPOTrainer(
        tiny_model_dir, [count_digits, length_reward], args=config, train_dataset=text_dataset(6), callbacks=callbacks
    )
    trainer.train(resume_from_checkpoint=resume)
    return trainer


def step_logs(trainer):
    keys = ("loss", "reward", "ratio/min", "ratio/max", "num_tokens")
    return {e["step"]: {k: e[k] for k in keys if k in e} for e in trainer.state.log_history if "loss" in e}


@pytest.mark.parametrize("stop_at", [1, 2, 4])
def test_resumed_run_continues_the_uninterrupted_trajectory(tmp_path, tiny_model_dir, stop_at):
    uninterrupted = run(tmp_path / "whole", tiny_model_dir)
    run(tmp_path / "cut", tiny_model_dir, stop_at=stop_at, save_strategy="steps", save_steps=1)
    checkpoint = tmp_path / "cut" / f"checkpoint-{stop_at}"
    assert load_rollout_state(str(checkpoint), 0, torch.device("cpu")).micro_batches is not None  # mid-rollout
    resumed = run(tmp_path / "cut", tiny_model_dir, resume=True, save_strategy="steps", save_steps=1)
    expected = step_logs(uninterrupted)
    got = {step: logs for step, logs in step_logs(resumed).items() if step > stop_at}  # history before: restored
    assert sorted(got) == list(range(stop_at + 1, STEPS + 1))
    for step in got:
        assert got[step] == close(expected[step], 1e-6), step
    for (name, a), b in zip(uninterrupted.model.named_parameters(), resumed.model.parameters()):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6, msg=name)


def test_incomplete_checkpoints_are_skipped(tmp_path, tiny_model_dir, caplog):
    run(tmp_path, tiny_model_dir, stop_at=2, save_strategy="steps", save_steps=1)
    os.remove(tmp_path / "checkpoint-2" / "trainer_state.json")  # as if killed while writing checkpoint-2
    (tmp_path / "checkpoint-3").mkdir()  # and a folder from a save that never got far
    with caplog.at_level("WARNING"):
        resumed = run(tmp_path, tiny_model_dir, resume=True, save_strategy="no")
    assert "Skipped incomplete checkpoints" in caplog.text and "checkpoint-3" in caplog.text
    assert sorted(step_logs(resumed)) == [1, 2, 3, 4, 5]  # checkpoint-1's history, then steps 2-5


def test_last_complete_checkpoint_needs_every_process_rollout(tmp_path):
    for step, ranks in ((1, [0, 1]), (2, [0]), (10, [0, 1])):
        folder = tmp_path / f"checkpoint-{step}"
        folder.mkdir()
        for rank in ranks:
            save_rollout_state(str(folder), rank, RolloutState(None, step, torch.Generator().get_state(), 0))
    (tmp_path / "checkpoint-10" / "trainer_state.json").write_text("{}")
    (tmp_path / "checkpoint-2" / "trainer_state.json").write_text("{}")
    (tmp_path / "checkpoint-1" / "trainer_state.json").write_text("{}")
    assert last_complete_checkpoint(str(tmp_path), 2) == (str(tmp_path / "checkpoint-10"), [])
    os.remove(rollout_file(str(tmp_path / "checkpoint-10"), 1))
    path, skipped = last_complete_checkpoint(str(tmp_path), 2)
    assert path == str(tmp_path / "checkpoint-1")  # 10 lacks rank 1's rollout, 2 never had it
    assert skipped == [str(tmp_path / "checkpoint-10"), str(tmp_path / "checkpoint-2")]
    assert last_complete_checkpoint(str(tmp_path / "missing"), 1) == (None, [])

"""gspo_trl.training.rollout_checkpoint: a run stopped inside a rollout and resumed from its checkpoint continues
the uninterrupted run step for step; incomplete checkpoints are never resumed from."""

from __future__ import annotations

import os

import pytest
import torch
from helpers import close, count_digits, length_reward, small_config, text_dataset
from transformers import TrainerCallback

from gspo_trl import GSPOTrainer
from gspo_trl.training.checkpoints import select_checkpoint
from gspo_trl.training.rollout_checkpoint import (
    RolloutState,
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
    os.remove(tmp_path / "checkpoint-2" / "trainer_state.json")  # a file lost after the save
    # A folder without a manifest (an earlier gspo-trl's cut-off save) counts as saved before every one with a manifest.
    (tmp_path / "checkpoint-3").mkdir()
    with caplog.at_level("WARNING"):
        resumed = run(tmp_path, tiny_model_dir, resume=True, save_strategy="no")
    assert "Skipped incomplete or damaged checkpoints, resuming from " + str(tmp_path / "checkpoint-1") in caplog.text
    assert "checkpoint-2: trainer_state.json is missing" in caplog.text and "checkpoint-3" not in caplog.text
    assert sorted(step_logs(resumed)) == [1, 2, 3, 4, 5]  # checkpoint-1's history, then steps 2-5


def test_a_checkpoint_of_an_earlier_version_needs_every_process_rollout(tmp_path):
    # Checkpoints written before the manifest: complete with trainer_state.json and every process's rollout file.
    for step, ranks in ((1, [0, 1]), (2, [0]), (10, [0, 1])):
        folder = tmp_path / f"checkpoint-{step}"
        folder.mkdir()
        for rank in ranks:
            save_rollout_state(str(folder), rank, RolloutState(None, step, torch.Generator().get_state(), 0))
    (tmp_path / "checkpoint-10" / "trainer_state.json").write_text("{}")
    (tmp_path / "checkpoint-2" / "trainer_state.json").write_text("{}")
    (tmp_path / "checkpoint-1" / "trainer_state.json").write_text("{}")
    warnings = []
    assert select_checkpoint(str(tmp_path), 2, warnings.append) == str(tmp_path / "checkpoint-10")
    assert warnings == []
    os.remove(rollout_file(str(tmp_path / "checkpoint-10"), 1))
    assert select_checkpoint(str(tmp_path), 2, warnings.append) == str(tmp_path / "checkpoint-1")
    # 10 lacks rank 1's rollout, 2 never had it
    assert "checkpoint-10" in warnings[0] and "checkpoint-2" in warnings[0]
    with pytest.raises(ValueError, match="No complete checkpoint"):
        select_checkpoint(str(tmp_path / "missing"), 1, warnings.append)


def _state_with_a_rollout():
    generator = torch.Generator().manual_seed(3)
    ids = torch.arange(12).reshape(2, 6)
    batch = {
        "input_ids": ids,
        "completion_ids": ids[:, 2:],  # a view of the same storage, as slicing a rollout gives
        "completion_mask": torch.ones(2, 4, dtype=torch.bool),
        "advantages": torch.tensor([0.5, -0.5]),
        "num_items_in_batch": torch.tensor(8),
        "turn_ids": None,
    }
    entropy = {"coefficient": 0.01, "adaptive": True, "last_entropy": float("inf")}
    return RolloutState([batch, dict(batch)], 7, generator.get_state(), 96, entropy)


def _assert_same_state(got, expected):
    assert (got.sampled_at_step, got.num_tokens_seen) == (expected.sampled_at_step, expected.num_tokens_seen)
    assert got.entropy_control == expected.entropy_control
    assert torch.equal(got.shuffle_generator_state, expected.shuffle_generator_state)
    assert len(got.micro_batches) == len(expected.micro_batches)
    for a, b in zip(got.micro_batches, expected.micro_batches):
        assert a.keys() == b.keys()
        for key in b:
            if b[key] is None:
                assert a[key] is None, key
            else:
                assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key


def test_the_rollout_is_saved_as_safetensors_and_json_without_pickle(tmp_path):
    state = _state_with_a_rollout()
    save_rollout_state(str(tmp_path), 0, state)
    assert sorted(os.listdir(tmp_path)) == ["gspo_rollout_rank0.json", "gspo_rollout_rank0.safetensors"]
    _assert_same_state(load_rollout_state(str(tmp_path), 0, torch.device("cpu")), state)
    between = RolloutState(None, 3, torch.Generator().get_state(), 0)
    save_rollout_state(str(tmp_path / "between"), 1, between)
    assert load_rollout_state(str(tmp_path / "between"), 1, torch.device("cpu")).micro_batches is None


def test_a_value_json_cannot_hold_is_refused_when_saving(tmp_path):
    state = _state_with_a_rollout()
    state.micro_batches[0]["odd"] = object()
    with pytest.raises(TypeError, match="micro-batch key 'odd'"):
        save_rollout_state(str(tmp_path), 0, state)


def test_a_checkpoint_of_the_earlier_pickle_format_still_resumes(tmp_path):
    state = _state_with_a_rollout()
    checkpoint = tmp_path / "checkpoint-4"
    checkpoint.mkdir()
    torch.save({**state.__dict__}, checkpoint / "gspo_rollout_rank0.pt")  # what earlier versions wrote
    (checkpoint / "trainer_state.json").write_text("{}")
    assert select_checkpoint(str(tmp_path), 1, print) == str(checkpoint)  # complete with the old file
    _assert_same_state(load_rollout_state(str(checkpoint), 0, torch.device("cpu")), state)


class _RunsCode:
    """A pickle that would create a file when unpickled with weights_only=False."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_an_earlier_rollout_file_that_names_code_is_refused_without_running_it(tmp_path):
    marker = tmp_path / "code-ran"
    state = {**_state_with_a_rollout().__dict__, "num_tokens_seen": _RunsCode(str(marker))}
    torch.save(state, tmp_path / "gspo_rollout_rank0.pt")
    with pytest.raises(ValueError, match="not loaded: unpickling them could run code"):
        load_rollout_state(str(tmp_path), 0, torch.device("cpu"))
    assert not marker.exists()


@pytest.mark.slow
@pytest.mark.parametrize("routing_replay", ["none", "rollout"])
def test_a_mixture_of_experts_run_resumed_inside_a_rollout_continues_the_uninterrupted_trajectory(
    routing_replay, tmp_path
):
    # Qwen3-MoE: transformers holds the experts fused but saves them one by one, which Trainer's own load_state_dict
    # does not map back: the experts stayed at their initial weights (ratio/min 0.81567 against 0.81397 at step 2).
    # With routing_replay='rollout' the checkpoint also keeps the rollout's routes, which the resumed steps replay.
    from test_architectures import build, tokenizer

    model_dir = str(tmp_path / "model")
    build("qwen3_moe", None).save_pretrained(model_dir)
    tokenizer().save_pretrained(model_dir)
    uninterrupted = run(tmp_path / "whole", model_dir, routing_replay=routing_replay)
    run(tmp_path / "cut", model_dir, stop_at=1, save_strategy="steps", save_steps=1, routing_replay=routing_replay)
    saved = load_rollout_state(str(tmp_path / "cut" / "checkpoint-1"), 0, torch.device("cpu")).micro_batches
    for batch in saved:
        routes = batch["sampling_routes"]  # (B, P + C, L=2, k=2), aligned with input_ids
        assert routes.dtype == torch.int8 and routes.shape == (*batch["input_ids"].shape, 2, 2)
    resumed = run(
        tmp_path / "cut", model_dir, resume=True, save_strategy="steps", save_steps=1, routing_replay=routing_replay
    )
    expected = step_logs(uninterrupted)
    got = {step: logs for step, logs in step_logs(resumed).items() if step > 1}
    assert sorted(got) == list(range(2, STEPS + 1))
    for step in got:  # the dense test's bound: the same computation, so equal up to float32 rounding
        assert got[step] == close(expected[step], 1e-6), step
    for (name, a), b in zip(uninterrupted.model.named_parameters(), resumed.model.parameters()):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6, msg=name)
    # Step 2 trains on the restored rollout: with replay, a micro-batch without routes would have raised.
    logs = [entry for entry in resumed.state.log_history if "loss" in entry and entry["step"] > 1]
    assert len(logs) == STEPS - 1 and all("moe/route_mismatch" in entry for entry in logs)

"""gspo_trl/training/reference_sync.py: TR-DPO's mixing rule against hand-computed values, the reference of a run with
`sync_ref_model` against the rule replayed on the policy's weights, its checkpoint, and what is refused."""

from __future__ import annotations

import os

import pytest
import torch
from helpers import count_digits, small_config, text_dataset
from transformers import TrainerCallback

from gspo_trl import GSPOConfig, GSPOTrainer
from gspo_trl.training.reference_sync import REFERENCE_FILE, mix_into_reference


def test_mix_moves_the_reference_alpha_of_the_way_to_the_policy():
    reference = torch.tensor([1.0, 2.0, -4.0])
    mix_into_reference([("w", reference)], [("w", torch.tensor([3.0, 6.0, 0.0]))], alpha=0.25)
    # 0.75·ref + 0.25·π: every value exact in binary floating point
    assert reference.tolist() == [1.5, 3.0, -3.0]
    mix_into_reference([("w", reference)], [("w", torch.tensor([9.0, 9.0, 9.0]))], alpha=1.0)
    assert reference.tolist() == [9.0, 9.0, 9.0]  # α = 1: the policy itself


def test_config_checks_name_the_field(tmp_path):
    with pytest.raises(ValueError, match="set beta > 0"):
        GSPOConfig(output_dir=str(tmp_path), use_cpu=True, sync_ref_model=True)
    with pytest.raises(ValueError, match="ref_model_mixup_alpha must be in"):
        GSPOConfig(output_dir=str(tmp_path), use_cpu=True, sync_ref_model=True, beta=0.1, ref_model_mixup_alpha=1.5)
    with pytest.raises(ValueError, match="ref_model_sync_steps must be"):
        GSPOConfig(output_dir=str(tmp_path), use_cpu=True, sync_ref_model=True, beta=0.1, ref_model_sync_steps=0)


class PolicySnapshots(TrainerCallback):
    """The policy's weights after each optimizer step (registered after the sync: the same weights either way)."""

    def __init__(self):
        self.weights = {}

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self.weights[state.global_step] = {name: p.detach().clone() for name, p in model.named_parameters()}


def reference_weights(trainer) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in trainer.ref_model.named_parameters()}


def synced_run(tmp_path, tiny_model_dir, **overrides):
    args = small_config(
        tmp_path, beta=0.1, sync_ref_model=True, ref_model_mixup_alpha=0.5, ref_model_sync_steps=2, **overrides
    )
    trainer = GSPOTrainer(tiny_model_dir, count_digits, args=args, train_dataset=text_dataset())
    snapshots = PolicySnapshots()
    trainer.add_callback(snapshots)
    return trainer, snapshots


@pytest.mark.slow  # training runs
def test_the_reference_follows_the_policy_every_sync_steps(tmp_path, tiny_model_dir):
    trainer, snapshots = synced_run(tmp_path, tiny_model_dir, max_steps=4, bf16=True)  # bf16 autocast, fp32 weights
    initial = reference_weights(trainer)
    trainer.train()
    # Synced after steps 2 and 4 only: ref = 0.5·π₄ + 0.5·(0.5·π₂ + 0.5·ref₀).
    for name, value in reference_weights(trainer).items():
        expected = 0.5 * snapshots.weights[4][name] + 0.5 * (0.5 * snapshots.weights[2][name] + 0.5 * initial[name])
        # two fp32 multiply-adds per weight (|w| < 4 here): a rounding of a few ulps, 1e-6 bounds it
        torch.testing.assert_close(value, expected, rtol=0, atol=1e-6)
    assert not torch.equal(trainer.ref_model.model.embed_tokens.weight, initial["model.embed_tokens.weight"])


@pytest.mark.slow  # training runs
def test_a_resumed_run_continues_from_the_synced_reference(tmp_path, tiny_model_dir):
    trainer, _ = synced_run(tmp_path, tiny_model_dir, max_steps=2, save_strategy="steps", save_steps=2)
    trainer.train()
    checkpoint = os.path.join(trainer.args.output_dir, "checkpoint-2")
    assert os.path.isfile(os.path.join(checkpoint, REFERENCE_FILE))
    synced = reference_weights(trainer)

    resumed, _ = synced_run(tmp_path, tiny_model_dir, max_steps=2, save_strategy="steps", save_steps=2)
    resumed.train(resume_from_checkpoint=checkpoint)  # nothing left to train: only the state is restored
    for name, value in reference_weights(resumed).items():
        assert torch.equal(value, synced[name]), name  # the saved reference, not a copy of the resumed policy


def test_lora_is_refused_as_in_trl(tmp_path, tiny_model_dir):
    from peft import LoraConfig

    args = small_config(tmp_path, beta=0.1, sync_ref_model=True)
    with pytest.raises(ValueError, match="PEFT adapter"):
        GSPOTrainer(
            tiny_model_dir,
            count_digits,
            args=args,
            train_dataset=text_dataset(),
            peft_config=LoraConfig(r=4, target_modules="all-linear", task_type="CAUSAL_LM"),
        )

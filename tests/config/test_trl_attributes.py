"""TRL's `GRPOTrainer` attributes and mask helpers on `GSPOTrainer`: the helpers equal TRL's own on random inputs,
the attributes TRL reads every step can be set and change the run from the next step, and the ones the run was
built around refuse a new value with an error that says so."""

from __future__ import annotations

import types

import pytest
import torch
from helpers import count_digits, small_config, text_dataset
from transformers import TrainerCallback
from trl import GRPOTrainer

from gspo_trl import GSPOTrainer
from gspo_trl.config.trl_attributes import FIXED, LIVE


def one_process():
    """TRL's own tests' stand-in for a trainer in a single process: only `accelerator` is read."""
    accelerator = types.SimpleNamespace(
        num_processes=1, gather=lambda x: x, pad_across_processes=lambda x, dim, pad_index: x
    )
    return types.SimpleNamespace(accelerator=accelerator)


def random_case(generator, rows=6, columns=9, dtype=torch.float32):
    mask = (torch.rand(rows, columns, generator=generator) < 0.7).to(dtype)
    mask[0] = 0  # a row with no valid token
    return mask


@pytest.mark.parametrize("seed", range(8))
def test_get_off_policy_mask_equals_trls_static_method(seed):
    generator = torch.Generator().manual_seed(seed)
    for mask_dtype in (torch.float32, torch.int64):
        mask = random_case(generator, dtype=mask_dtype)
        logps = -torch.rand(mask.shape, generator=generator) * 3
        sampling = logps + torch.randn(mask.shape, generator=generator) * 0.5
        sampling[1, 2] = float("nan")  # a token the sampler could not score
        per_sequence, per_token = (
            torch.randn(mask.shape[0], 1, generator=generator),
            torch.randn(mask.shape, generator=generator),
        )
        for advantages in (per_sequence, per_token):
            for threshold in (0.0, 0.1, float(torch.rand(1, generator=generator)), 10.0):
                kwargs = dict(
                    advantages=advantages,
                    per_token_logps=logps,
                    sampling_per_token_logps=sampling,
                    mask=mask,
                    off_policy_threshold=threshold,
                )
                ours, theirs = GSPOTrainer.get_off_policy_mask(**kwargs), GRPOTrainer.get_off_policy_mask(**kwargs)
                assert ours.dtype == theirs.dtype and torch.equal(ours, theirs)


@pytest.mark.parametrize("seed", range(8))
def test_get_high_entropy_mask_equals_trls_method(seed):
    generator = torch.Generator().manual_seed(seed)
    mask = random_case(generator)
    # Rounded to 0.1 so that ties (several tokens at the threshold) occur.
    entropies = (torch.rand(mask.shape, generator=generator) * 3).round(decimals=1)
    trainer = one_process()
    for threshold in (0.0, 0.2, 0.5, 0.8, 1.0, float(torch.rand(1, generator=generator))):
        ours = GSPOTrainer.get_high_entropy_mask(trainer, entropies, mask, threshold)
        theirs = GRPOTrainer.get_high_entropy_mask(trainer, entropies, mask, threshold)
        assert ours.dtype == theirs.dtype == torch.bool and torch.equal(ours, theirs)
    nothing_valid = torch.zeros_like(mask)
    assert not GSPOTrainer.get_high_entropy_mask(trainer, entropies, nothing_valid, 0.5).any()


def test_a_subclass_overriding_a_mask_helper_is_refused():
    with pytest.raises(TypeError, match="overrides get_off_policy_mask, which the loss does not call here"):

        class MyTrainer(GSPOTrainer):
            @staticmethod
            def get_off_policy_mask(advantages, per_token_logps, sampling_per_token_logps, mask, threshold):
                return torch.ones_like(advantages)


def test_every_trl_config_copy_is_live_or_fixed_and_reads_the_run(tmp_path, tiny_model_dir):
    args = small_config(tmp_path, beta=0.0, epsilon=0.1, epsilon_high=0.3, temperature=0.7)
    trainer = GSPOTrainer(tiny_model_dir, count_digits, args=args, train_dataset=text_dataset())
    assert not set(LIVE) & set(FIXED)
    assert (trainer.num_generations, trainer.beta, trainer.temperature) == (4, 0.0, 0.7)
    assert (trainer.epsilon_low, trainer.epsilon_high, trainer.num_generations_eval) == (0.1, 0.3, 4)

    # Live: the config field and the objective the loss reads change together.
    trainer.epsilon_low, trainer.epsilon_high, trainer.loss_type = 0.2, 0.28, "dapo"
    assert (args.epsilon, args.epsilon_high, args.loss_type) == (0.2, 0.28, "dapo")
    objective = trainer.objective
    assert (objective.epsilon, objective.epsilon_high, objective.loss_type) == (0.2, 0.28, "dapo")
    trainer.scale_rewards = False  # TRL's spelling, stored as the option it means
    assert trainer.scale_rewards == "none"
    trainer.pad_to_multiple_of = "auto"
    assert trainer.pad_to_multiple_of is None  # TRL's 'auto' pads only on Neuron devices

    # A value the config refuses is refused here too, naming the field, and nothing changes.
    with pytest.raises(ValueError, match="loss_type must be one of"):
        trainer.loss_type = "ppo"
    with pytest.raises(ValueError, match="top_entropy_quantile must be in"):
        trainer.top_entropy_quantile = 1.5
    with pytest.raises(TypeError, match="mask_truncated_completions must be True or False"):
        trainer.mask_truncated_completions = "yes"
    assert trainer.loss_type == "dapo" and trainer.top_entropy_quantile == 1.0

    # beta > 0 needs the reference model, which a run built with beta=0 did not load.
    with pytest.raises(AttributeError, match="no reference model was loaded"):
        trainer.beta = 0.5
    assert trainer.beta == 0.0 and trainer.objective.beta == 0.0

    # Fixed: a new value raises and says why; the same value is accepted.
    for name in FIXED:
        setattr(trainer, name, getattr(trainer, name))
    with pytest.raises(AttributeError, match="num_generations cannot be changed after construction: the batch layout"):
        trainer.num_generations = 8
    with pytest.raises(AttributeError, match="temperature cannot be changed after construction: the sampler"):
        trainer.temperature = 1.0
    assert args.num_generations == 4 and args.temperature == 0.7

    trainer.reward_func_names = ["digits"]
    assert [f.name for f in trainer.reward_funcs] == ["digits"]
    with pytest.raises(ValueError, match="reward_func_names must be 1 strings"):
        trainer.reward_func_names = ["a", "b"]
    with pytest.raises(AttributeError, match="no load-balancing coefficient"):
        trainer.aux_loss_enabled = True
    with pytest.raises(ValueError, match="entropy_coef must be a finite number"):
        trainer.entropy_coef = float("nan")


def test_beta_set_on_a_run_with_a_reference_changes_the_kl_weight(tmp_path, tiny_model_dir):
    args = small_config(tmp_path, beta=0.1)
    trainer = GSPOTrainer(tiny_model_dir, count_digits, args=args, train_dataset=text_dataset())
    trainer.beta = 0.3
    assert args.beta == trainer.objective.beta == 0.3
    trainer.beta = 0.0  # no KL term from now on; the reference stays loaded
    assert trainer.objective.beta == 0.0 and trainer.ref_model is not None


class SetAfterFirstStep(TrainerCallback):
    """Sets attributes on the trainer after optimizer step 1, as a TRL user's callback does."""

    def __init__(self, values: dict):
        self.values, self.trainer = values, None

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == 1:
            for name, value in self.values.items():
                setattr(self.trainer, name, value)


def test_attributes_set_by_a_callback_change_the_next_steps(tmp_path, tiny_model_dir, capsys):
    callback = SetAfterFirstStep({"entropy_coef": 0.5, "log_completions": True, "num_completions_to_print": 1})
    args = small_config(tmp_path, max_steps=2, steps_per_generation=1)
    trainer = GSPOTrainer(tiny_model_dir, count_digits, args=args, train_dataset=text_dataset(), callbacks=[callback])
    callback.trainer = trainer
    trainer.train()
    first, second = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert "policy_loss" not in first and "entropy_coef" not in first  # no entropy bonus in step 1
    assert second["entropy_coef"] == 0.5
    # One micro-batch per step: the logged loss is the policy loss minus 0.5 × the mean entropy of its tokens (float32
    # sums of a few dozen O(1) terms: relative error far below 1e-4).
    assert second["policy_loss"] - second["loss"] == pytest.approx(0.5 * second["entropy"], rel=1e-4)
    printed = capsys.readouterr().out
    assert "completions at step 2" in printed and "completions at step 1" not in printed
    assert (tmp_path / "completions" / "completions_00002.parquet").exists()

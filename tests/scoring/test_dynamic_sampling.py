"""gspo_trl.scoring.dynamic_sampling: which groups are informative, which make the trained rollout, the extra prompts,
and
the trainer training on informative groups only (sync, async, resumed, bound hit)."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import close, small_config, text_dataset

from gspo_trl import GSPOConfig, GSPOTrainer
from gspo_trl.scoring.advantages import group_advantages
from gspo_trl.scoring.dynamic_sampling import (
    DynamicSampler,
    choose_groups,
    concat_rollouts,
    extra_prompt_indices,
    informative_groups,
)
from gspo_trl.training.micro_batch import MicroBatch

# --- pure functions ----------------------------------------------------------------------------


def test_a_group_is_informative_when_its_rewards_differ():
    rewards = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.5])
    assert informative_groups(rewards, 4).tolist() == [False, True, True]


def test_rows_without_a_reward_are_left_out_of_the_spread():
    nan = float("nan")
    rewards = torch.tensor([nan, 1.0, nan, nan, nan, 1.0, 2.0, nan, nan, 3.0, 3.0, nan])
    # one valid row: no spread defined; two valid that differ: informative; two valid and equal: not
    assert informative_groups(rewards, 4).tolist() == [False, True, False]


def test_the_spread_threshold_is_the_zero_advantage_tolerance():
    # ZERO_STD_TOLERANCE = 1e-6: the unbiased std of (0, d) is d / sqrt(2); float64 holds d exactly enough.
    below, above = 1e-6 * math.sqrt(2) * 0.5, 1e-6 * math.sqrt(2) * 2
    rewards = torch.tensor([0.0, below, 0.0, above], dtype=torch.float64)
    assert informative_groups(rewards, 2).tolist() == [False, True]


def test_informative_groups_needs_whole_groups():
    with pytest.raises(ValueError, match="multiple of 4"):
        informative_groups(torch.zeros(6), 4)


def test_choose_groups_takes_the_first_informative_groups_round_by_round():
    informative = [torch.tensor([False, True, False]), torch.tensor([True, True, False])]
    assert choose_groups(informative, 3) == [(0, 1), (1, 0), (1, 1)]
    assert choose_groups(informative, 2) == [(0, 1), (1, 0)]


def test_choose_groups_fills_up_with_the_earliest_dropped_groups():
    informative = [torch.tensor([False, True]), torch.tensor([False, False])]
    # one informative group; the first dropped one, (0, 0), fills the second place
    assert choose_groups(informative, 2) == [(0, 0), (0, 1)]
    assert choose_groups(informative, 3) == [(0, 0), (0, 1), (1, 0)]
    with pytest.raises(ValueError, match="at least 5"):
        choose_groups(informative, 5)


def test_extra_prompts_depend_on_seed_step_and_round_only():
    first = extra_prompt_indices(10, 4, seed=0, step=3, round_index=1)
    assert first == extra_prompt_indices(10, 4, seed=0, step=3, round_index=1)
    assert len(set(first)) == 4 and all(0 <= i < 10 for i in first)
    others = [
        extra_prompt_indices(10, 4, seed=1, step=3, round_index=1),
        extra_prompt_indices(10, 4, seed=0, step=4, round_index=1),
        extra_prompt_indices(10, 4, seed=0, step=3, round_index=2),
    ]
    assert all(other != first for other in others)
    wrapped = extra_prompt_indices(3, 7, seed=0, step=0, round_index=1)
    assert len(wrapped) == 7 and sorted(wrapped[:3]) == [0, 1, 2]  # a whole shuffle before any repeat


def _batch(prompt: list[list[int]], completion: list[list[int]], advantage: list[float]) -> MicroBatch:
    prompt_ids, completion_ids = torch.tensor(prompt), torch.tensor(completion)
    return MicroBatch(
        input_ids=torch.cat([prompt_ids, completion_ids], dim=1),
        attention_mask=torch.ones(len(prompt), len(prompt[0]) + len(completion[0]), dtype=torch.long),
        completion_ids=completion_ids,
        completion_mask=torch.ones_like(completion_ids),
        advantages=torch.tensor(advantage),
        rewards=torch.tensor(advantage) + 1,
        sampling_logps=torch.full(completion_ids.shape, -1.0),
    )


def test_concat_pads_prompts_on_the_left_and_completions_on_the_right():
    pad = 0
    joined = concat_rollouts([_batch([[5, 6]], [[7]], [0.5]), _batch([[8]], [[9, 10, 11]], [-0.5])], pad)
    assert joined.input_ids.tolist() == [[5, 6, 7, 0, 0], [0, 8, 9, 10, 11]]
    assert joined.attention_mask.tolist() == [[1, 1, 1, 0, 0], [0, 1, 1, 1, 1]]
    assert joined.completion_ids.tolist() == [[7, 0, 0], [9, 10, 11]]
    assert joined.completion_mask.tolist() == [[1, 0, 0], [1, 1, 1]]
    assert joined.sampling_logps.tolist() == [[-1.0, 0.0, 0.0], [-1.0, -1.0, -1.0]]
    assert joined.advantages.tolist() == [0.5, -0.5] and joined.rewards.tolist() == [1.5, 0.5]
    assert joined.old_logps is None and joined.ref_logps is None
    with_old = _batch([[1]], [[2]], [0.0])
    with_old.old_logps = torch.zeros(1, 1)
    with pytest.raises(ValueError, match="old_logps is set in some batches only"):
        concat_rollouts([with_old, _batch([[1]], [[2]], [0.0])], pad)


def test_batch_scaled_advantages_are_recomputed_over_the_kept_rollout(tmp_path):
    config = small_config(tmp_path, dynamic_sampling=True, scale_rewards="batch", num_generations=2)
    sampler = DynamicSampler(config, dataset=None, pad_token_id=0, log_metric=lambda *_: None)
    kept = _batch([[1]] * 4, [[2]] * 4, [9.0] * 4)
    kept.rewards = torch.tensor([0.0, 1.0, 0.0, 3.0])
    sampler._rescale(kept)
    # group means 0.5 and 1.5; the kept batch's rewards have mean 1 and unbiased variance (1 + 0 + 1 + 4) / 3 = 2
    expected = torch.tensor([-0.5, 0.5, -1.5, 1.5]) / math.sqrt(2)
    torch.testing.assert_close(kept.advantages, expected)


def test_group_scaled_advantages_are_kept(tmp_path):
    config = small_config(tmp_path, dynamic_sampling=True, num_generations=2)
    sampler = DynamicSampler(config, dataset=None, pad_token_id=0, log_metric=lambda *_: None)
    kept = _batch([[1]] * 2, [[2]] * 2, [0.7, -0.7])
    sampler._rescale(kept)
    assert kept.advantages.tolist() == pytest.approx([0.7, -0.7])


# --- config ------------------------------------------------------------------------------------


def test_the_config_refuses_what_dynamic_sampling_cannot_recompute(tmp_path):
    assert not GSPOConfig(output_dir=str(tmp_path)).dynamic_sampling
    with pytest.raises(ValueError, match="dynamic_sampling_max_rounds must be an int >= 1"):
        small_config(tmp_path, dynamic_sampling=True, dynamic_sampling_max_rounds=0)
    with pytest.raises(ValueError, match="normalize_then_sum"):
        small_config(tmp_path, dynamic_sampling=True, multi_objective_aggregation="normalize_then_sum")
    with pytest.raises(ValueError, match="skip_rollouts_without_rewards=True has nothing to skip"):
        small_config(tmp_path, dynamic_sampling=True, skip_rollouts_without_rewards=True)
    with pytest.raises(ValueError, match="advantage_granularity='turn'"):
        small_config(
            tmp_path,
            dynamic_sampling=True,
            scale_rewards="batch",
            advantage_granularity="turn",
            importance_sampling_level="sequence_token",
        )


def test_a_streamed_dataset_is_refused_it_has_no_rows_to_draw_extra_prompts_from(tmp_path, tiny_model_dir):
    from helpers import count_digits

    stream = text_dataset().to_iterable_dataset()
    args = small_config(tmp_path, dynamic_sampling=True, max_steps=2)
    with pytest.raises(ValueError, match="dynamic_sampling draws its extra prompts .* streamed dataset"):
        GSPOTrainer(tiny_model_dir, count_digits, args=args, train_dataset=stream)


# --- the trainer -------------------------------------------------------------------------------


def half_constant(completion_ids, answer, **kwargs):
    """0 for every completion of the prompts with an even i (answer 2i + 1 = 1 mod 4); elsewhere a number that
    differs between completions (the sum of the sampled ids mod 97)."""
    return [0.0 if int(a) % 4 == 1 else float(sum(ids) % 97) for ids, a in zip(completion_ids, answer)]


def constant(completions, **kwargs):
    return [1.0] * len(completions)


def trained_rollouts(trainer) -> list[MicroBatch]:
    """Record every rollout the schedule is filled with (its micro-batches, as trained)."""
    recorded = []
    fill = trainer.schedule.fill

    def recording_fill(micro_batches, sampled_at_step):
        recorded.append([batch.select(slice(None)) for batch in micro_batches])
        return fill(micro_batches, sampled_at_step)

    trainer.schedule.fill = recording_fill
    return recorded


def metric(trainer, name):
    return [entry[name] for entry in trainer.state.log_history if name in entry]


def assert_only_informative_groups(rollouts, group_size):
    for micro_batches in rollouts:
        for batch in micro_batches:
            assert informative_groups(batch.rewards, group_size).all()
            assert (batch.advantages != 0).any()


@pytest.mark.parametrize("async_rollouts", [False, True], ids=["sync", "async"])
def test_the_trained_rollout_holds_only_informative_groups(tmp_path, tiny_model_dir, async_rollouts):
    config = small_config(
        tmp_path,
        dynamic_sampling=True,
        dynamic_sampling_max_rounds=8,
        per_device_train_batch_size=8,
        steps_per_generation=1,  # a rollout per step: 2 groups of 4
        max_steps=3,
        async_rollouts=async_rollouts,
        layout_independent_sampling=True,
    )
    trainer = GSPOTrainer(tiny_model_dir, [half_constant], args=config, train_dataset=text_dataset(8))
    rollouts = trained_rollouts(trainer)
    trainer.train()
    assert len(rollouts) == 3
    assert_only_informative_groups(rollouts, 4)
    rounds = metric(trainer, "rollout/dynamic_sampling_rounds")
    assert len(rounds) == 3 and max(rounds) >= 2  # some rollout needed an extra round (seeded: the same each run)
    assert metric(trainer, "rollout/dynamic_sampling_filler_groups") == [0.0, 0.0, 0.0]
    dropped = metric(trainer, "rollout/dynamic_sampling_groups_dropped")
    assert dropped == [2 * r - 2 for r in rounds]  # every sampled group beyond the 2 trained
    ratios = metric(trainer, "rollout/sampled_tokens_per_trained_token")
    assert all(ratio >= 1 for ratio in ratios) and max(ratios) > 1


def test_the_bound_fills_the_rollout_with_dropped_groups_and_warns(tmp_path, tiny_model_dir, caplog):
    config = small_config(
        tmp_path, dynamic_sampling=True, dynamic_sampling_max_rounds=2, steps_per_generation=4, max_steps=1
    )  # a rollout of 16 rows: 4 groups of 4
    trainer = GSPOTrainer(tiny_model_dir, [constant], args=config, train_dataset=text_dataset(8))
    rollouts = trained_rollouts(trainer)
    with caplog.at_level("WARNING"):
        trainer.train()
    assert "dynamic_sampling: 2 generation rounds" in caplog.text and "filled up with 4 groups" in caplog.text
    assert metric(trainer, "rollout/dynamic_sampling_filler_groups") == [4.0]
    assert metric(trainer, "rollout/dynamic_sampling_rounds") == [2.0]
    assert sum(batch.rows for batch in rollouts[0]) == 16
    assert all((batch.advantages == 0).all() for batch in rollouts[0])


def run(output_dir, tiny_model_dir, resume=None, stop_at=None, **overrides):
    from test_rollout_checkpoint import StopAt

    config = small_config(
        output_dir,
        per_device_train_batch_size=2,
        num_generations=2,
        max_completion_length=6,
        max_steps=5,
        learning_rate=5e-3,
        epsilon=0.2,
        epsilon_high=0.2,
        gradient_accumulation_steps=2,
        steps_per_generation=4,  # a rollout = 2 optimizer steps of 4 groups
        dynamic_sampling=True,
        **overrides,
    )
    callbacks = [StopAt(stop_at)] if stop_at else None
    trainer = GSPOTrainer(
        tiny_model_dir, [half_constant], args=config, train_dataset=text_dataset(8), callbacks=callbacks
    )
    trainer.train(resume_from_checkpoint=resume)
    return trainer


@pytest.mark.slow
@pytest.mark.parametrize("stop_at", [1, 2])
def test_a_resumed_run_continues_the_uninterrupted_trajectory(tmp_path, tiny_model_dir, stop_at):
    keys = ("loss", "reward", "num_tokens", "rollout/dynamic_sampling_rounds")
    uninterrupted = run(tmp_path / "whole", tiny_model_dir)
    run(tmp_path / "cut", tiny_model_dir, stop_at=stop_at, save_strategy="steps", save_steps=1)
    resumed = run(tmp_path / "cut", tiny_model_dir, resume=True, save_strategy="steps", save_steps=1)

    def logs(trainer):
        return {e["step"]: {k: e[k] for k in keys if k in e} for e in trainer.state.log_history if "loss" in e}

    expected, got = logs(uninterrupted), logs(resumed)
    assert max(entry.get("rollout/dynamic_sampling_rounds", 0) for entry in expected.values()) >= 2  # extra rounds
    assert sorted(step for step in got if step > stop_at) == list(range(stop_at + 1, 6))
    for step in range(stop_at + 1, 6):
        # the two runs do the same float operations in the same order: only the checkpoint's round trip differs
        assert got[step] == close(expected[step], 1e-6), step
    for (name, a), b in zip(uninterrupted.model.named_parameters(), resumed.model.parameters()):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6, msg=name)


@pytest.mark.slow
@pytest.mark.parametrize("setting", ["batch", "lora+beta+bf16"])
def test_dynamic_sampling_in_the_configurations_users_run(tmp_path, tiny_model_dir, setting):
    from peft import LoraConfig

    overrides = dict(scale_rewards="batch") if setting == "batch" else dict(beta=0.04, bf16=True)
    peft = (
        LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM") if "lora" in setting else None
    )
    config = small_config(
        tmp_path,
        dynamic_sampling=True,
        dynamic_sampling_max_rounds=8,
        per_device_train_batch_size=4,
        steps_per_generation=2,  # rollouts of 2 groups of 4 in 2 micro-batches
        max_steps=4,
        **overrides,
    )
    trainer = GSPOTrainer(tiny_model_dir, [half_constant], args=config, train_dataset=text_dataset(8), peft_config=peft)
    rollouts = trained_rollouts(trainer)
    trainer.train()
    assert len(rollouts) == 2 and max(metric(trainer, "rollout/dynamic_sampling_rounds")) >= 2
    assert_only_informative_groups(rollouts, 4)
    for micro_batches in rollouts:
        rewards = torch.cat([batch.rewards for batch in micro_batches])
        advantages = torch.cat([batch.advantages for batch in micro_batches])
        if setting == "batch":  # scaled by the std of the trained rollout's rewards, not of a round's
            expected, _ = group_advantages(rewards, 4, "batch")
            # the same float32 formula over the same rows, its groups in another order (the micro-batch shuffle):
            # sums rounded differently, a few ulps, within assert_close's float32 rtol of 1.3e-6
            torch.testing.assert_close(advantages, expected)
        else:
            assert all(batch.ref_logps is not None and torch.isfinite(batch.ref_logps).all() for batch in micro_batches)
    assert all(math.isfinite(entry["loss"]) for entry in trainer.state.log_history if "loss" in entry)
    if setting != "batch":
        assert any(entry["kl"] > 0 for entry in trainer.state.log_history if "kl" in entry)

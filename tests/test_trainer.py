"""GSPOTrainer end to end on a tiny random Llama: the schedule, the paths (on/off-policy, LoRA, KL),
metrics, checkpoints and the model card. Learning itself is tested on the real model in test_learning.py."""

from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path

import pytest
import torch
from datasets import Dataset, DatasetDict, IterableDatasetDict
from helpers import count_digits, length_reward, small_config, text_dataset

from gspo_trl import GSPOConfig, GSPOTrainer
from gspo_trl.rollout.decoding.truncation import policy_logps
from gspo_trl.training.micro_batch import MicroBatch
from gspo_trl.training.schedule import fill_old_logps


def chat_dataset(n=8):
    return Dataset.from_dict(
        {
            "prompt": [[{"role": "user", "content": f"What is {i} + 3?"}] for i in range(n)],
            "answer": [str(i + 3) for i in range(n)],
        }
    )


def make_config(tmp_path, **overrides):
    return small_config(tmp_path / "out", **overrides)


def snapshot(model):
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def changed(before, model):
    return {name for name, p in model.named_parameters() if not torch.equal(before[name], p.detach())}


def train_logs(trainer):
    """One entry per optimizer step (logging_steps=1)."""
    return [entry for entry in trainer.state.log_history if "loss" in entry]


def test_defaults_follow_the_paper(tmp_path):
    config = GSPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=8, gradient_accumulation_steps=2)
    assert config.importance_sampling_level == "sequence"
    assert (config.epsilon, config.epsilon_high, config.beta) == (3e-4, 4e-4, 0.0)
    assert config.steps_per_generation == 8  # four optimizer steps per rollout batch
    assert config.generation_batch_size == 64
    assert not config.is_on_policy


def test_train_changes_weights_and_logs_metrics(tmp_path, tiny_model_dir):
    config = make_config(tmp_path, steps_per_generation=1)  # a rollout per step: rollout metrics at every log
    trainer = GSPOTrainer(tiny_model_dir, [count_digits, length_reward], args=config, train_dataset=text_dataset())
    before = snapshot(trainer.model)
    trainer.train()
    assert len(changed(before, trainer.model)) == len(before)
    logs = train_logs(trainer)
    assert len(logs) == 2
    expected = {
        "reward",
        "reward_std",
        "frac_reward_zero_std",
        "rewards/count_digits/mean",
        "rewards/count_digits/std",
        "rewards/length_reward/mean",
        "completions/mean_length",
        "completions/min_length",
        "completions/max_length",
        "completions/clipped_ratio",
        "clip_ratio/low",
        "clip_ratio/high",
        "clip_ratio/region",
        "ratio/mean",
        "ratio/min",
        "ratio/max",
        "entropy",
        "num_tokens",
        "loss",
    }
    assert expected <= set(logs[0]), expected - set(logs[0])
    assert "kl" not in logs[0]  # beta = 0: no reference model, no KL
    assert trainer.ref_model is None
    assert logs[1]["num_tokens"] > logs[0]["num_tokens"] > 0
    assert 1 <= logs[0]["completions/mean_length"] <= 12


def test_off_policy_minibatches_reuse_one_rollout_and_get_clipped(tmp_path, tiny_model_dir):
    # Defaults: steps_per_generation = 4 micro-batches (one per optimizer step) from one rollout of 16.
    config = make_config(tmp_path, max_steps=4, learning_rate=5e-3)
    assert config.steps_per_generation == 4
    trainer = GSPOTrainer(tiny_model_dir, count_digits, args=config, train_dataset=text_dataset())
    calls = []
    generate = trainer.rollout_backend.generate
    trainer.rollout_backend.generate = lambda prompts, *rest: calls.append(len(prompts)) or generate(prompts, *rest)
    trainer.train()
    assert calls == [16]  # one rollout feeds the four optimizer steps
    logs = train_logs(trainer)
    assert logs[0]["ratio/mean"] == pytest.approx(1.0, abs=1e-5)  # first minibatch: weights not yet moved
    later_clip = [entry["clip_ratio/region"] for entry in logs[1:]]
    assert max(later_clip) > 0, later_clip  # after an update at lr 5e-3, ratios leave [1-3e-4, 1+4e-4]
    assert max(abs(entry["ratio/mean"] - 1) for entry in logs[1:]) > 1e-4


def test_on_policy_skips_old_logprob_pass(tmp_path, tiny_model_dir):
    config = make_config(tmp_path, steps_per_generation=1)
    assert config.is_on_policy
    trainer = GSPOTrainer(tiny_model_dir, count_digits, args=config, train_dataset=text_dataset())
    scored = []
    original = trainer._score_without_grad
    trainer._score_without_grad = lambda model, inputs: scored.append(1) or original(model, inputs)
    trainer.train()
    assert scored == []
    for entry in train_logs(trainer):
        assert entry["ratio/mean"] == 1.0 and entry["clip_ratio/region"] == 0.0


def test_conversational_prompts_and_columns_reach_rewards(tmp_path, tiny_model_dir):
    seen = {}

    def spy(prompts, completions, completion_ids, answer, trainer_state, **kwargs):
        seen.update(prompts=prompts, completions=completions, answer=answer, state=trainer_state)
        return [1.0 if str(a) in c[0]["content"] else 0.0 for a, c in zip(answer, completions)]

    trainer = GSPOTrainer(tiny_model_dir, spy, args=make_config(tmp_path, max_steps=1), train_dataset=chat_dataset())
    trainer.train()
    assert seen["prompts"][0][0]["role"] == "user"
    assert seen["completions"][0][0]["role"] == "assistant"
    assert len(seen["answer"]) == 16
    assert seen["state"] is trainer.state
    # rows come in groups of num_generations identical prompts
    assert all(seen["prompts"][i] == seen["prompts"][i - i % 4] for i in range(16))


def test_lora_trains_only_the_adapter(tmp_path, tiny_model_dir):
    from peft import LoraConfig

    peft_config = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM")
    trainer = GSPOTrainer(
        tiny_model_dir, count_digits, args=make_config(tmp_path), train_dataset=text_dataset(), peft_config=peft_config
    )
    before = snapshot(trainer.model)
    trainer.train()
    moved = changed(before, trainer.model)
    assert moved and all("lora_" in name for name in moved)


def test_kl_with_frozen_reference_copy(tmp_path, tiny_model_dir):
    config = make_config(tmp_path, beta=0.1, max_steps=3)
    trainer = GSPOTrainer(tiny_model_dir, count_digits, args=config, train_dataset=text_dataset())
    assert trainer.ref_model is not None
    reference_before = snapshot(trainer.ref_model)
    trainer.train()
    assert changed(reference_before, trainer.ref_model) == set()
    logs = train_logs(trainer)
    assert all("kl" in entry for entry in logs)
    assert logs[0]["kl"] == pytest.approx(0.0, abs=1e-6)  # policy == reference before the first update
    assert logs[-1]["kl"] > 0


def test_kl_with_lora_uses_the_disabled_adapter_as_reference(tmp_path, tiny_model_dir):
    from peft import LoraConfig

    peft_config = LoraConfig(
        r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM", init_lora_weights=False
    )
    config = make_config(tmp_path, beta=0.1, max_steps=1)
    trainer = GSPOTrainer(
        tiny_model_dir, count_digits, args=config, train_dataset=text_dataset(), peft_config=peft_config
    )
    assert trainer.ref_model is None  # no second copy of the weights
    trainer.train()
    # init_lora_weights=False: the adapter is non-zero from the start, so policy != reference
    assert train_logs(trainer)[0]["kl"] > 0


def test_checkpoint_and_resume(tmp_path, tiny_model_dir):
    # One rollout per 4 optimizer steps; checkpoint in the middle of a rollout's steps.
    config = make_config(tmp_path, max_steps=6, save_strategy="steps", save_steps=2)
    trainer = GSPOTrainer(tiny_model_dir, count_digits, args=config, train_dataset=text_dataset())
    trainer.train()
    checkpoint = os.path.join(config.output_dir, "checkpoint-2")
    assert os.path.isdir(checkpoint) and os.path.isdir(os.path.join(config.output_dir, "checkpoint-6"))
    assert "GSPO" in open(os.path.join(config.output_dir, "README.md")).read()

    resumed = GSPOTrainer(tiny_model_dir, count_digits, args=config, train_dataset=text_dataset())
    rollouts = []
    generate = resumed.rollout_backend.generate
    resumed.rollout_backend.generate = lambda prompts, *rest: (
        rollouts.append(resumed.state.global_step) or generate(prompts, *rest)
    )
    resumed.train(resume_from_checkpoint=checkpoint)
    assert resumed.state.global_step == 6
    # The interrupted rollout continues from the checkpoint for steps 3-4 (it is not sampled again), and
    # the next one comes at step 5, in step with the dataloader (a new generation batch every 4 steps).
    assert rollouts == [4]
    # log_history comes back from the checkpoint (steps 1-2); the resumed run adds steps 3-6
    assert [e["step"] for e in train_logs(resumed)] == [1, 2, 3, 4, 5, 6]


def test_model_card_names_gspo_rewards_and_settings(tmp_path, tiny_model_dir):
    trainer = GSPOTrainer(
        tiny_model_dir, [count_digits, length_reward], args=make_config(tmp_path), train_dataset=text_dataset()
    )
    trainer.create_model_card(model_name="my-gspo-model")
    card = open(os.path.join(trainer.args.output_dir, "README.md")).read()
    for text in (
        "my-gspo-model",
        "GSPO",
        "2507.18071",
        "count_digits",
        "length_reward",
        "`epsilon` | `0.0003`",
        "`importance_sampling_level` | `sequence`",
        "library_name: transformers",
    ):
        assert text in card, text


def test_evaluate_reports_eval_reward(tmp_path, tiny_model_dir):
    config = make_config(tmp_path, per_device_eval_batch_size=4)
    trainer = GSPOTrainer(
        tiny_model_dir, count_digits, args=config, train_dataset=text_dataset(), eval_dataset=text_dataset(2)
    )
    metrics = trainer.evaluate()
    assert "eval_reward" in metrics and "eval_loss" in metrics


@pytest.mark.parametrize("kind", ["DatasetDict", "IterableDatasetDict"])
def test_several_evaluation_datasets_are_logged_each_under_its_own_prefix(tmp_path, tiny_model_dir, kind):
    # TRL's eval_dataset of several splits: Trainer evaluates each as eval_<name>; gspo-trl's own metrics and the
    # completion tables follow, so no split's rewards replace another's.
    easy, hard = text_dataset(2), Dataset.from_dict({"prompt": ["Write a long number:", "Count to 9:"]})
    if kind == "DatasetDict":
        splits = DatasetDict({"easy": easy, "hard": hard})
    else:
        splits = IterableDatasetDict({"easy": easy.to_iterable_dataset(), "hard": hard.to_iterable_dataset()})
    config = make_config(tmp_path, per_device_eval_batch_size=4, log_completions=True)
    trainer = GSPOTrainer(tiny_model_dir, count_digits, args=config, train_dataset=text_dataset(), eval_dataset=splits)
    metrics = trainer.evaluate()
    for name in ("easy", "hard"):
        for key in ("loss", "reward", "completions/mean_length", "frac_reward_zero_std"):
            assert math.isfinite(metrics[f"eval_{name}_{key}"]), (name, key)
    assert not any(key.startswith("eval_reward") for key in metrics)  # nothing left under the bare prefix
    logged = [entry for entry in trainer.state.log_history if any(key.endswith("_loss") for key in entry)]
    assert [sorted(k for k in entry if k.endswith("_reward")) for entry in logged] == [
        ["eval_easy_reward"],
        ["eval_hard_reward"],
    ]
    folder = Path(config.output_dir) / "completions"
    assert sorted(path.name for path in folder.iterdir()) == [
        "completions_00000_eval_easy.parquet",
        "completions_00000_eval_hard.parquet",
    ]
    # A dataset handed to evaluate() alone is logged under the plain prefix, as before.
    assert "eval_reward" in trainer.evaluate(eval_dataset=easy)


@pytest.mark.parametrize("eval_group", [1, 2])
def test_num_generations_eval_sets_the_evaluation_group_size(tmp_path, tiny_model_dir, eval_group):
    # TRL's num_generations_eval: fewer completions per prompt in evaluation (1: rewards measured, no group).
    config = make_config(tmp_path, per_device_eval_batch_size=4, num_generations_eval=eval_group)
    trainer = GSPOTrainer(
        tiny_model_dir, count_digits, args=config, train_dataset=text_dataset(), eval_dataset=text_dataset(4)
    )
    prompts = [row["prompt"] for row in trainer.eval_dataset]
    order = [prompts[i] for i in trainer._get_eval_sampler(trainer.eval_dataset)]
    groups = [order[i : i + eval_group] for i in range(0, len(order), eval_group)]
    assert len(groups) == 4 and all(len(set(group)) == 1 for group in groups)
    metrics = trainer.evaluate()
    assert math.isfinite(metrics["eval_reward"]) and math.isfinite(metrics["eval_loss"])
    if eval_group == 1:  # one completion per prompt: nothing to compare, every advantage 0
        assert metrics["eval_frac_reward_zero_std"] == 1.0


def test_reward_functions_can_log_metrics_and_extra_columns(tmp_path, tiny_model_dir, capsys):
    def with_logging(completions, log_metric, log_extra, **kwargs):
        log_metric("my_metric", 0.25)
        log_extra("note", ["n"] * len(completions))
        return [0.0] * len(completions)

    config = make_config(tmp_path, max_steps=1, log_completions=True, num_completions_to_print=2)
    trainer = GSPOTrainer(tiny_model_dir, with_logging, args=config, train_dataset=text_dataset())
    trainer.train()
    assert train_logs(trainer)[0]["my_metric"] == 0.25
    assert train_logs(trainer)[0]["frac_reward_zero_std"] == 1.0  # constant rewards: no signal
    printed = capsys.readouterr().out
    assert "completions at step 1" in printed and printed.count("[reward") == 2


@pytest.mark.parametrize("backend", ["tensorboard", "wandb", "trackio"])
def test_report_to_backends_write_the_gspo_metrics_offline(tmp_path, tiny_model_dir, monkeypatch, backend):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("TRACKIO_DIR", str(tmp_path / "trackio"))
    monkeypatch.setenv("TENSORBOARD_LOGGING_DIR", str(tmp_path / "tb"))
    config = make_config(tmp_path, max_steps=1, report_to=backend, run_name="gspo-test")
    trainer = GSPOTrainer(tiny_model_dir, count_digits, args=config, train_dataset=text_dataset())
    trainer.train()
    if backend == "wandb":
        import wandb

        wandb.finish()
    folders = [tmp_path]
    if backend == "trackio":  # trackio reads TRACKIO_DIR once, at import (TRL imports it): conftest sets it
        import trackio.utils

        folders.append(Path(trackio.utils.TRACKIO_DIR))
    files = [p for folder in folders for p in folder.rglob("*") if p.is_file() and "out" not in p.parts]
    written = b"".join(p.read_bytes() for p in files)
    # every backend stores the metric names; clip_ratio/region is GSPO's own
    assert b"clip_ratio/region" in written and b"reward" in written, sorted(map(str, files))


def test_activation_checkpointing_with_lora_trains_and_samples_with_kv_cache(tmp_path, tiny_model_dir, monkeypatch):
    from peft import LoraConfig

    from gspo_trl.rollout.decoding import dynamic

    config = make_config(tmp_path, activation_checkpointing=True, steps_per_generation=1)
    peft_config = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM")
    trainer = GSPOTrainer(
        tiny_model_dir, count_digits, args=config, train_dataset=text_dataset(), peft_config=peft_config
    )
    model = trainer.accelerator.unwrap_model(trainer.model)
    embed = model.get_base_model().model.embed_tokens
    rollouts, original_sample = [], dynamic.sample

    def spy(sampled_model, *args, **kwargs):
        # generation runs in eval mode, where transformers keeps the KV cache despite checkpointing: after the
        # first step every forward takes one new token per row
        lengths = []
        hook = embed.register_forward_pre_hook(lambda module, inputs: lengths.append(inputs[0].shape[1]))
        try:
            out = original_sample(sampled_model, *args, **kwargs)
        finally:
            hook.remove()
        rollouts.append((sampled_model.training, lengths))
        return out

    monkeypatch.setattr(dynamic, "sample", spy)
    before = snapshot(trainer.model)
    trainer.train()
    assert len(rollouts) == 2
    for training, lengths in rollouts:
        assert not training and len(lengths) > 2 and set(lengths[1:]) == {1}
    assert model.get_base_model().is_activation_checkpointing
    assert any("lora_" in name for name in changed(before, trainer.model))


def test_old_logprob_pass_only_for_micro_batches_trained_after_an_update(tmp_path, tiny_model_dir):
    # GA=2, steps_per_generation=8: micro-batches 0-1 form the first optimizer step (sampling weights),
    # micro-batches 2-7 come after updates and need π_old from a pass made before any update.
    config = make_config(
        tmp_path,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        max_steps=4,
        decode_logprobs_as_old=False,
    )
    assert config.steps_per_generation == 8
    trainer = GSPOTrainer(tiny_model_dir, count_digits, args=config, train_dataset=text_dataset())
    scored, seen_old = [], []
    original_score, original_loss = trainer._score_without_grad, trainer.compute_loss
    trainer._score_without_grad = lambda model, inputs: scored.append(model.training) or original_score(model, inputs)
    trainer.compute_loss = lambda model, inputs, **kw: (
        seen_old.append(inputs.old_logps is not None) or original_loss(model, inputs, **kw)
    )
    trainer.train()
    assert len(scored) == 6
    assert seen_old == [False, False] + [True] * 6


def test_decoded_logprobs_are_pi_old_in_full_precision(tmp_path, tiny_model_dir):
    # decode_logprobs_as_old, on by default in float32: the micro-batches trained after an update take π_old from
    # what the decoding loop recorded while sampling (no forward pass); the first step's stay on-policy (None).
    config = make_config(tmp_path, per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=4)
    assert config.decode_logprobs_as_old is None
    trainer = GSPOTrainer(tiny_model_dir, count_digits, args=config, train_dataset=text_dataset())
    assert trainer.rollout_backend.logp_temperature == config.temperature
    scored, seen_old = [], []
    original_score, original_loss = trainer._score_without_grad, trainer.compute_loss
    trainer._score_without_grad = lambda model, inputs: scored.append(1) or original_score(model, inputs)

    def loss(model, inputs, **kw):
        old = inputs.old_logps
        seen_old.append(old is not None and inputs.sampled_by_policy and old is inputs.sampling_logps)
        return original_loss(model, inputs, **kw)

    trainer.compute_loss = loss
    trainer.train()
    assert scored == []
    assert seen_old == [False, False] + [True] * 6


def test_decoded_logprobs_equal_the_old_logprob_pass(tmp_path, tiny_model_dir):
    # Same weights, same tokens: the decoding loop's log-probs and the trainer's π_old forward (packed rows, chunked
    # head) agree to float32 rounding, at a temperature that is not 1 and with top-k and a repetition penalty shaping
    # what was sampled; the GSPO sequence ratio between them is 1 to far within the clipping range (ε = 3e-4). Top-k
    # truncates: the loop records the renormalised log-probs it drew with and the kept mass, and π_old is the policy's
    # log-prob, their sum (`truncation.policy_logps`), which the schedule takes.
    config = make_config(tmp_path, temperature=0.7, top_k=20, repetition_penalty=1.2)
    trainer = GSPOTrainer(tiny_model_dir, count_digits, args=config, train_dataset=text_dataset())
    trainer.model.train()
    batch = trainer._generate_and_score([{"prompt": f"What is {i} + 1?"} for i in range(2) for _ in range(4)], "train")
    assert batch.sampled_by_policy  # the decoding loop's own: π_old, not the vLLM sampling correction's input
    mask = batch.completion_mask.bool()
    assert (batch.kept_log_mass[mask] < 0).all()  # top-20 of a ~400-token vocabulary cuts at every step
    decoded = policy_logps(batch.sampling_logps, batch.kept_log_mass)
    fill_old_logps([batch], [True], trainer.args, lambda _: pytest.fail("π_old is the loop's: no forward"))
    torch.testing.assert_close(batch.old_logps, decoded, atol=0, rtol=0)
    assert batch.engine_logps is None
    recomputed = trainer._score_without_grad(trainer.model, batch)
    torch.testing.assert_close(decoded[mask], recomputed[mask], atol=2e-5, rtol=0)
    log_ratio = ((recomputed - decoded) * mask).sum(1) / mask.sum(1)
    assert log_ratio.abs().max() < 1e-5


@pytest.mark.parametrize(
    "overrides, lora",
    [(dict(), False), (dict(use_cpu=True, bf16=True), False), (dict(beta=0.04), True), (dict(top_p=1.0), False)],
    ids=["fp32", "bf16", "LoRA beta", "no truncation"],
)
def test_the_mass_top_p_cuts_away_is_logged(tmp_path, tiny_model_dir, overrides, lora):
    # sampling/truncated_mass: the mean over completion tokens of the policy's mass the sampler's top-p left out, in
    # (0, 1) here (the tiny model is near uniform: top-p 0.5 cuts about half); under bf16 too, where the loop records
    # no log-probs; not logged where nothing is cut. The second step trains against π_old from the loop in float32:
    # the policy's log-probs, so the ratio stays near 1 (against the truncated ones it would be about Z, near 1/2).
    from peft import LoraConfig

    peft_config = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM") if lora else None
    config = make_config(tmp_path, max_steps=2, **{"top_p": 0.5, "top_k": 0, **overrides})
    trainer = GSPOTrainer(
        tiny_model_dir, count_digits, args=config, train_dataset=text_dataset(), peft_config=peft_config
    )
    trainer.train()
    first, second = train_logs(trainer)
    if overrides.get("top_p") == 1.0:
        assert "sampling/truncated_mass" not in first
    else:
        assert 0.3 < first["sampling/truncated_mass"] < 0.6
    assert 0.9 < second["ratio/min"] <= second["ratio/max"] < 1.1


@pytest.mark.parametrize(
    "overrides",
    [dict(bf16=True), dict(decode_logprobs_as_old=False), dict(decode_loop="generate")],
    ids=["bf16", "off", "generate"],
)
def test_old_logprob_pass_where_the_decoded_logprobs_are_not_pi_old(tmp_path, tiny_model_dir, overrides):
    # bf16 (decoding and training kernels round differently), switched off, or sampled by generate: no recorded
    # log-probs, so π_old comes from the trainer's forward pass.
    trainer = GSPOTrainer(
        tiny_model_dir, count_digits, args=make_config(tmp_path, **overrides), train_dataset=text_dataset()
    )
    assert trainer.rollout_backend.logp_temperature is None
    batch = trainer._generate_and_score([{"prompt": "What is 1 + 1?"}] * 4, "train")
    assert batch.sampling_logps is None and not batch.sampled_by_policy


def test_decode_logprobs_as_old_needs_the_decoding_loop(tmp_path):
    with pytest.raises(ValueError, match="decode_logprobs_as_old=True needs decode_loop='gspo'"):
        make_config(tmp_path, decode_logprobs_as_old=True, decode_loop="generate")


def test_first_step_without_old_pass_equals_explicit_old_logprobs(tmp_path, tiny_model_dir):
    """Skipping the pass keeps the loss and gradient of computing π_old explicitly (same weights)."""
    trainer = GSPOTrainer(tiny_model_dir, count_digits, args=make_config(tmp_path), train_dataset=text_dataset())
    trainer.model.train()
    batch = trainer._generate_and_score([{"prompt": f"What is {i} + 1?"} for i in range(2) for _ in range(4)], "train")
    batch.advantages = torch.linspace(-1, 1, 8)

    def loss_and_grads(old):
        trainer.model.zero_grad()
        loss = trainer.compute_loss(trainer.model, dataclasses.replace(batch, old_logps=old))
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in trainer.model.parameters()]

    skipped_loss, skipped_grads = loss_and_grads(None)
    explicit_loss, explicit_grads = loss_and_grads(trainer._score_without_grad(trainer.model, batch))
    torch.testing.assert_close(skipped_loss, explicit_loss, atol=1e-6, rtol=1e-5)
    for skipped, explicit in zip(skipped_grads, explicit_grads):
        torch.testing.assert_close(skipped, explicit, atol=1e-6, rtol=1e-4)


def test_padding_free_training_keeps_the_padded_loss_and_gradient(tmp_path, tiny_model_dir):
    trainer = GSPOTrainer(tiny_model_dir, count_digits, args=make_config(tmp_path), train_dataset=text_dataset())
    assert trainer.padding_free  # the default on CPU, and the tiny Llama supports it
    trainer.model.train()
    batch = trainer._generate_and_score([{"prompt": f"What is {i} + 1?"} for i in range(2) for _ in range(4)], "train")
    batch.advantages = torch.linspace(-1, 1, 8)
    batch.old_logps = trainer._score_without_grad(trainer.model, batch) - 0.01  # off-policy ratios

    def loss_and_grads(padding_free):
        trainer.padding_free = padding_free
        trainer.model.zero_grad()
        loss = trainer.compute_loss(trainer.model, batch)
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in trainer.model.parameters()]

    padded_loss, padded_grads = loss_and_grads(False)
    packed_loss, packed_grads = loss_and_grads(True)
    torch.testing.assert_close(packed_loss, padded_loss, atol=1e-6, rtol=1e-5)
    for packed, padded in zip(packed_grads, padded_grads):
        torch.testing.assert_close(packed, padded, atol=1e-6, rtol=1e-4)


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16 autocast"])
@pytest.mark.parametrize("padding_free", [True, False], ids=["packed", "padded"])
def test_activation_checkpointing_keeps_the_loss_and_gradient(tmp_path, tiny_model_dir, padding_free, bf16):
    # Long completions train with activation checkpointing (each layer recomputed in the backward pass): on the
    # packed layout (position ids and block mask through the checkpointed layers) and on padded rows, in fp32 and
    # under bf16 autocast, the same loss and gradient as keeping every activation.
    trainer = GSPOTrainer(
        tiny_model_dir, count_digits, args=make_config(tmp_path, bf16=bf16), train_dataset=text_dataset()
    )
    model = trainer.accelerator.unwrap_model(trainer.model)
    model.activation_checkpointing_enable()  # what Trainer.train does for activation_checkpointing=True
    trainer.padding_free = padding_free
    trainer.model.train()
    batch = trainer._generate_and_score([{"prompt": f"What is {i} + 1?"} for i in range(2) for _ in range(4)], "train")
    batch.advantages = torch.linspace(-1, 1, 8)
    batch.old_logps = trainer._score_without_grad(trainer.model, batch) - 0.01  # off-policy ratios
    layer_calls = []
    # A pre-hook inside the layer: its forward is what is checkpointed (hooks on the layer itself stay outside),
    # and the recomputation stops once it has what the backward pass needs.
    hook = model.model.layers[0].self_attn.register_forward_pre_hook(lambda *args: layer_calls.append(1))

    def loss_and_grads():
        layer_calls.clear()
        trainer.model.zero_grad()
        loss = trainer.compute_loss(trainer.model, batch)
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in trainer.model.parameters()], len(layer_calls)

    try:
        checkpointed_loss, checkpointed_grads, checkpointed_calls = loss_and_grads()
        model.activation_checkpointing_disable()
        plain_loss, plain_grads, plain_calls = loss_and_grads()
    finally:
        hook.remove()
    assert checkpointed_calls == 2 * plain_calls  # the layer ran again in the backward pass
    torch.testing.assert_close(checkpointed_loss, plain_loss, atol=1e-6, rtol=1e-5)
    for checkpointed, plain in zip(checkpointed_grads, plain_grads):
        torch.testing.assert_close(checkpointed, plain, atol=1e-6, rtol=1e-4)


@pytest.mark.parametrize("keep", [True, False], ids=["attention kept", "everything recomputed"])
def test_activation_checkpointing_keeps_attention_outputs_by_default(tmp_path, tiny_model_dir, keep):
    # Trainer.train enables checkpointing with the user's kwargs; GSPOTrainer enables it again with the policy that
    # keeps SDPA's output, on every checkpointed layer, unless asked not to.
    config = make_config(
        tmp_path,
        activation_checkpointing=True,
        activation_checkpointing_keep_attention=keep,
        activation_checkpointing_kwargs={"use_reentrant": False},
        max_steps=1,
    )
    trainer = GSPOTrainer(tiny_model_dir, count_digits, args=config, train_dataset=text_dataset())
    trainer.train()
    layers = trainer.accelerator.unwrap_model(trainer.model).model.layers
    assert all(layer.gradient_checkpointing for layer in layers)
    policies = [layer._gradient_checkpointing_func.keywords.get("context_fn") for layer in layers]
    assert all((policy is not None) == keep for policy in policies)
    assert all(layer._gradient_checkpointing_func.keywords["use_reentrant"] is False for layer in layers)


def test_micro_batches_hold_whole_groups():
    from gspo_trl.training.schedule import split_into_micro_batches

    rows = torch.arange(16)
    batch = MicroBatch(rows.unsqueeze(1), torch.ones(16, 1), rows.unsqueeze(1), torch.ones(16, 1))
    micro_batches = split_into_micro_batches(
        batch, num_slices=4, group_size=4, generator=torch.Generator().manual_seed(0)
    )
    groups = [sorted((mb.input_ids.flatten() // 4).tolist()) for mb in micro_batches]
    assert all(len(set(g)) == 1 for g in groups) and sorted(g[0] for g in groups) == [0, 1, 2, 3]
    assert sorted(torch.cat([mb.input_ids.flatten() for mb in micro_batches]).tolist()) == rows.tolist()
    assert all(mb.old_logps is None and torch.equal(mb.completion_ids, mb.input_ids) for mb in micro_batches)


def test_unsupported_attention_falls_back_to_padded_rows(tmp_path, tiny_model_dir, caplog):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    model.config.sliding_window = 4  # a model with sliding-window attention cannot take the block-tree mask
    # Llama's attention ignores the window that its KV cache then keeps, so the decoding loop's log-probs are not the
    # model's: the log-prob check would say so (rightly) before training.
    config = make_config(tmp_path, check_logprobs="off")
    with caplog.at_level("WARNING"):
        trainer = GSPOTrainer(model, count_digits, args=config, train_dataset=text_dataset())
    assert not trainer.padding_free
    assert "padding_free is not used: it uses sliding-window attention" in caplog.text
    trainer.train()  # trains on padded rows


def ended_apart(batch, lengths):
    """The batch with row i's completion ending after lengths[i] tokens (as rows that sampled EOS there)."""
    width = batch.completion_mask.shape[1]
    keep = (torch.arange(width).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)).long()  # (B, C)
    prompt_width = batch.attention_mask.shape[1] - width
    attention_mask = torch.cat(
        [batch.attention_mask[:, :prompt_width], batch.attention_mask[:, prompt_width:] * keep], dim=1
    )
    return dataclasses.replace(batch, completion_mask=batch.completion_mask * keep, attention_mask=attention_mask)


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo", "vespo"])
@pytest.mark.parametrize(
    "padding_free, bf16, lora",
    [(True, False, False), (False, False, False), (False, True, False), (False, False, True)],
    ids=["packed", "padded", "padded bf16 autocast", "padded LoRA"],
)
def test_training_passes_keep_the_micro_batch_loss_gradient_and_metrics(
    tmp_path, tiny_model_dir, loss_type, padding_free, bf16, lora
):
    # A micro-batch of 8 rows of different lengths, trained in one pass and in passes of at most 40 positions (rows
    # of similar length together, each pass cut to its longest completion): the same loss, gradient and logged
    # metrics, for each way the loss averages (sequence mean, token mean, constant, the step's tokens, VESPO's
    # sequence weights), with an entropy bonus and a KL term (LoRA: to the disabled adapter).
    from peft import LoraConfig

    config = make_config(tmp_path, loss_type=loss_type, bf16=bf16, beta=0.04, entropy_coef=0.01, max_tokens_per_pass=0)
    peft_config = (
        LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM", init_lora_weights=False)
        if lora
        else None
    )
    trainer = GSPOTrainer(
        tiny_model_dir, count_digits, args=config, train_dataset=text_dataset(), peft_config=peft_config
    )
    assert trainer.max_tokens_per_pass is None  # 0: one pass per micro-batch
    trainer.padding_free = padding_free
    trainer.current_gradient_accumulation_steps = 1  # set by Trainer's training loop
    trainer.model.train()
    batch = trainer._generate_and_score([{"prompt": f"What is {i} + 1?"} for i in range(2) for _ in range(4)], "train")
    batch = ended_apart(batch, [12, 3, 7, 12, 1, 9, 5, 12])
    batch.advantages = torch.linspace(-1, 1, 8)
    batch.old_logps = trainer._score_without_grad(trainer.model, batch) - 0.01  # off-policy ratios
    batch.num_items_in_batch = batch.completion_mask.sum() * 2  # this micro-batch is half of the rollout
    trainer._metrics.pop_averages("train")  # the rollout's
    calls = []
    hook = trainer.model.register_forward_pre_hook(
        lambda module, args, kwargs: calls.append(kwargs["input_ids"].shape), with_kwargs=True
    )

    def step(budget):
        trainer.max_tokens_per_pass = budget
        trainer.model.zero_grad()
        calls.clear()
        loss = trainer.training_step(trainer.model, batch)
        grads = [p.grad.clone() for p in trainer.model.parameters() if p.requires_grad]
        return loss, grads, trainer._metrics.pop_averages("train")

    try:
        whole_loss, whole_grads, whole_metrics = step(None)
        assert len(calls) == 1
        parts_loss, parts_grads, parts_metrics = step(40)
    finally:
        hook.remove()
    assert len(calls) >= 3
    if not padding_free:  # padded rows: each pass within the budget, the shortest rows without the longest's padding
        assert (
            all(rows * width <= 40 for rows, width in calls)
            and min(width for _, width in calls) < batch.input_ids.shape[1]
        )
    if bf16:
        # Each pass's weight gradient comes out of a bf16 matmul rounded on its own, so the two differ by bf16
        # rounding (0.45% of the norm seen). Both are held against the same step in fp32: the passes' gradient
        # is as close to it as one pass's.
        torch.testing.assert_close(parts_loss, whole_loss, atol=1e-5, rtol=1e-3)
        fp32 = GSPOTrainer(
            tiny_model_dir,
            count_digits,
            args=make_config(tmp_path, loss_type=loss_type, beta=0.04, entropy_coef=0.01, max_tokens_per_pass=0),
            train_dataset=text_dataset(),
        )
        fp32.current_gradient_accumulation_steps = 1
        fp32.training_step(fp32.model, batch)
        for parts, whole, exact in zip(parts_grads, whole_grads, [p.grad for p in fp32.model.parameters()]):
            whole_error, parts_error = (whole - exact).norm(), (parts - exact).norm()
            assert whole_error <= 2e-2 * exact.norm()
            assert parts_error <= 1.5 * whole_error + 1e-6
    else:
        torch.testing.assert_close(parts_loss, whole_loss, atol=1e-6, rtol=1e-5)
        for parts, whole in zip(parts_grads, whole_grads):
            torch.testing.assert_close(parts, whole, atol=1e-6, rtol=1e-5)
    assert parts_metrics.keys() == whole_metrics.keys()
    for name, value in whole_metrics.items():
        assert parts_metrics[name] == pytest.approx(value, rel=1e-2 if bf16 else 1e-5, abs=1e-6), name


def test_gdpo_and_a_smaller_eval_group_train_in_the_gpu_recipe(tmp_path, tiny_model_dir):
    # What users run: bf16 autocast (on CPU here), a LoRA adapter and the KL term to the disabled-adapter reference,
    # with two reward functions combined per GDPO and evaluation in groups of 2.
    from peft import LoraConfig

    def is_short(completions, **kwargs):
        return [float(len(completion) < 20) for completion in completions]

    config = make_config(
        tmp_path,
        max_steps=1,
        bf16=True,
        beta=0.04,
        multi_objective_aggregation="normalize_then_sum",
        per_device_eval_batch_size=4,
        num_generations_eval=2,
    )
    peft_config = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM")
    trainer = GSPOTrainer(
        tiny_model_dir,
        [count_digits, is_short],
        args=config,
        train_dataset=text_dataset(),
        eval_dataset=text_dataset(4),
        peft_config=peft_config,
    )
    before = snapshot(trainer.model)
    trainer.train()
    log = train_logs(trainer)[0]
    assert math.isfinite(log["loss"]) and math.isfinite(log["kl"])
    assert changed(before, trainer.model) and all("lora" in name for name in changed(before, trainer.model))
    metrics = trainer.evaluate()
    assert math.isfinite(metrics["eval_reward"]) and math.isfinite(metrics["eval_loss"])


def no_reward(completions, **kwargs):
    return [None] * len(completions)


def test_a_rollout_no_reward_function_scores_raises_by_default(tmp_path, tiny_model_dir):
    trainer = GSPOTrainer(
        tiny_model_dir, no_reward, args=make_config(tmp_path, max_steps=1), train_dataset=text_dataset()
    )
    with pytest.raises(ValueError, match=r"Every reward function \(no_reward\) returned None"):
        trainer.train()


@pytest.mark.parametrize(
    "overrides",
    [dict(beta=0.04, entropy_coef=0.1), dict(use_cpu=True, bf16=True, beta=0.04, entropy_coef=0.1, loss_type="dapo")],
    ids=["fp32", "bf16"],
)
def test_skipped_rollouts_train_on_nothing(tmp_path, tiny_model_dir, overrides, caplog):
    # skip_rollouts_without_rewards: each rollout (every row None) is skipped with a warning; its loss is multiplied by
    # 0, so neither the KL term (beta > 0) nor the entropy bonus (whose gradient zero advantages alone would keep) gives
    # a gradient, and AdamW's first steps on zero gradients (no weight decay) leave every weight as it was.
    # rollout/skipped logs the share of rollouts skipped: all of them here.
    config = make_config(tmp_path, max_steps=2, skip_rollouts_without_rewards=True, **overrides)
    trainer = GSPOTrainer(tiny_model_dir, no_reward, args=config, train_dataset=text_dataset())
    before = snapshot(trainer.model)
    with caplog.at_level("WARNING"):
        trainer.train()
    assert "returned None for every completion of this rollout: skipping it" in caplog.text
    assert changed(before, trainer.model) == set()
    logs = train_logs(trainer)
    # One rollout serves both optimizer steps here: its metrics are logged with the step that sampled it.
    assert [entry.get("rollout/skipped") for entry in logs] == [1.0, None]
    assert all(entry["loss"] == 0.0 for entry in logs)

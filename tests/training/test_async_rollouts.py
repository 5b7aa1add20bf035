"""async_rollouts: the one-rollout-ahead schedule and its parts by hand, then the trainer: max_staleness=0 is the
synchronous trainer exactly, a rollout sampled ahead trains with its sampling weights' log-probs as π_old, and
unchanged weights give the synchronous run's numbers whatever the staleness."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch
from datasets import Dataset
from helpers import close, count_digits, small_config, text_dataset

from gspo_trl import GSPOTrainer
from gspo_trl.training.async_rollouts import (
    Lookahead,
    RolloutPrefetcher,
    WeightSnapshot,
    check_async_rollouts_supported,
    earliest_launch_step,
)
from gspo_trl.training.logprobs import completion_logprobs
from gspo_trl.training.micro_batch import MicroBatch

# --- the parts ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "start, per_rollout, staleness, expected",
    [
        (0, 4, 4, 0),  # full overlap: the next rollout samples while this one's first step trains
        (0, 4, 1, 3),  # only the last step of this rollout overlaps
        (8, 4, 0, 12),  # none: sampled when its own training starts (the synchronous schedule)
        (8, 4, 9, 8),  # one rollout ahead at most
    ],
)
def test_earliest_launch_step(start, per_rollout, staleness, expected):
    assert earliest_launch_step(start, per_rollout, staleness) == expected


def test_earliest_launch_step_refuses_bad_settings():
    with pytest.raises(ValueError, match="max_staleness"):
        earliest_launch_step(0, 4, -1)


def test_lookahead_peeks_without_changing_what_next_returns():
    items = Lookahead(iter("abcde"))
    assert next(items) == "a"
    assert items.peek(2) == "d" and items.peek(0) == "b"
    assert [next(items), next(items)] == ["b", "c"]
    assert items.peek(5) is None  # past the end
    assert list(items) == ["d", "e"]
    with pytest.raises(ValueError, match="taken already"):
        items.peek(-1)


def test_weight_snapshot_is_frozen_until_refreshed_and_refreshes_only_what_trains():
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.BatchNorm1d(3))
    model[0].bias.requires_grad_(False)  # like a frozen base under LoRA
    snapshot = WeightSnapshot()
    frozen = snapshot.refresh(model)
    assert frozen is not model and not any(p.requires_grad for p in frozen.parameters())
    with torch.no_grad():
        model[0].weight.add_(1.0)
        model[0].bias.add_(1.0)
        model[1].running_mean.add_(2.0)
    assert not torch.equal(frozen[0].weight, model[0].weight)  # training does not reach the snapshot
    assert snapshot.refresh(model) is frozen
    assert torch.equal(frozen[0].weight, model[0].weight)
    assert torch.equal(frozen[1].running_mean, model[1].running_mean)  # buffers are copied
    assert not torch.equal(frozen[0].bias, model[0].bias)  # a frozen parameter is copied once


def test_prefetcher_hands_over_the_rollout_of_its_step_and_raises_its_errors():
    prefetcher = RolloutPrefetcher()
    prefetcher.submit(for_step=4, weights_step=2, sample=lambda: threading.current_thread().name)
    with pytest.raises(RuntimeError, match="already"):
        prefetcher.submit(for_step=4, weights_step=2, sample=lambda: None)
    name, weights_step = prefetcher.take(4)
    assert name.startswith("gspo-rollout") and weights_step == 2
    assert prefetcher.take(4) is None  # taken once
    prefetcher.submit(for_step=6, weights_step=4, sample=lambda: "stale")
    assert prefetcher.take(8) is None and prefetcher.pending is None  # another step's: dropped
    prefetcher.submit(for_step=8, weights_step=6, sample=lambda: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        prefetcher.take(8)


def test_sharded_training_is_refused_for_sampling_on_the_trained_model():
    backend, gpu = SimpleNamespace(samples_with_training_model=True), torch.device("cuda")
    zero3 = SimpleNamespace(
        state=SimpleNamespace(deepspeed_plugin=SimpleNamespace(zero_stage=3)),
        device=gpu,
        distributed_type=SimpleNamespace(name="DEEPSPEED"),
    )
    with pytest.raises(ValueError, match="ZeRO-3.*use_vllm=True"):
        check_async_rollouts_supported(backend, zero3)
    fsdp = SimpleNamespace(
        state=SimpleNamespace(deepspeed_plugin=None), distributed_type=SimpleNamespace(name="FSDP"), device=gpu
    )
    with pytest.raises(ValueError, match="FSDP"):
        check_async_rollouts_supported(backend, fsdp)
    check_async_rollouts_supported(SimpleNamespace(samples_with_training_model=False), zero3)  # a server samples


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(max_staleness=2), "only applies with async_rollouts=True"),
        (dict(async_rollouts=True, max_staleness=-1), "max_staleness must be >= 0"),
        (dict(async_rollouts=True, steps_per_generation=3, gradient_accumulation_steps=2), "multiple of gradient_acc"),
    ],
)
def test_config_refuses_settings_async_rollouts_cannot_follow(tmp_path, overrides, message):
    with pytest.raises(ValueError, match=message):
        small_config(tmp_path, **overrides)


def test_config_resolves_max_staleness_to_the_steps_per_rollout(tmp_path):
    args = small_config(tmp_path, async_rollouts=True, steps_per_generation=6, gradient_accumulation_steps=2)
    assert args.max_staleness == 3


# --- the trainer -------------------------------------------------------------------------------------------------


def run(tmp_path, model_dir, **overrides):
    """Six optimizer steps, two per rollout. Returns (trainer, [(thread, optimizer step when it was asked for, step it
    is for)] per rollout, logs)."""
    args = small_config(tmp_path / "out", **{"max_steps": 6, "steps_per_generation": 2, **overrides})
    trainer = GSPOTrainer(model_dir, count_digits, args=args, train_dataset=text_dataset())
    samples, launches = [], []
    original_sample, original_launch = trainer._sample, trainer._launch_rollout

    def sample(backend, runner, batch, mode, step, **kwargs):
        samples.append((threading.current_thread().name, step))
        return original_sample(backend, runner, batch, mode, step, **kwargs)

    def launch(batch, for_step):  # on the main thread, where the optimizer step is read safely
        launches.append(trainer.state.global_step)
        return original_launch(batch, for_step)

    trainer._sample, trainer._launch_rollout = sample, launch
    trainer.train()
    if not launches:  # synchronous: asked for when sampled
        launches = [step for _, step in samples]
    samples = [(name, asked, step) for (name, step), asked in zip(samples, launches, strict=True)]
    return trainer, samples, [entry for entry in trainer.state.log_history if "loss" in entry]


def test_sampling_ahead_on_a_cpu_warns_that_it_measured_no_faster(tmp_path, tiny_model_dir, caplog):
    args = small_config(tmp_path / "out", async_rollouts=True)
    with caplog.at_level("WARNING"):
        GSPOTrainer(tiny_model_dir, count_digits, args=args, train_dataset=text_dataset())
    assert "same cores" in caplog.text


def test_zero_staleness_is_the_synchronous_trainer_exactly(tmp_path, tiny_model_dir):
    sync, sync_samples, sync_logs = run(tmp_path / "sync", tiny_model_dir)
    pipelined, samples, logs = run(tmp_path / "async", tiny_model_dir, async_rollouts=True, max_staleness=0)
    assert [s[0] for s in samples] == ["gspo-rollout_0"] * 3  # sampled on the pipeline's thread
    assert [s[1:] for s in samples] == [s[1:] for s in sync_samples] == [(0, 0), (2, 2), (4, 4)]
    assert [e["loss"] for e in logs] == [e["loss"] for e in sync_logs]
    assert [e["rollout/staleness"] for e in logs] == [0, 1] * 3
    for (name, ours), theirs in zip(pipelined.model.named_parameters(), sync.model.parameters()):
        assert torch.equal(ours, theirs), name


@pytest.mark.parametrize(
    "schedule, launches, staleness",
    [
        # (step it was launched at, step it trains from) per rollout; staleness per optimizer step
        (dict(), [(0, 0), (0, 2), (2, 4)], [0, 1, 2, 3, 2, 3]),
        (dict(max_staleness=1), [(0, 0), (1, 2), (3, 4)], [0, 1, 1, 2, 1, 2]),
        (
            dict(gradient_accumulation_steps=2, steps_per_generation=4, per_device_train_batch_size=2),
            [(0, 0), (0, 2), (2, 4)],
            [0, 1, 2, 3, 2, 3],
        ),
        (dict(num_iterations=2, steps_per_generation=1, max_steps=6), [(0, 0), (0, 2), (2, 4)], [0, 1, 2, 3, 2, 3]),
    ],
    ids=["full", "max_staleness=1", "accumulation", "iterations"],
)
def test_unchanged_weights_give_the_synchronous_numbers_at_any_staleness(
    tmp_path, tiny_model_dir, schedule, launches, staleness
):
    # learning_rate=0: a rollout sampled ahead comes from the same weights, so only the plumbing can differ
    # (which prompts, which sampling streams, which π_old).
    settings = dict(learning_rate=0.0, layout_independent_sampling=True, **schedule)
    _, sync_samples, sync_logs = run(
        tmp_path / "sync", tiny_model_dir, **{k: v for k, v in settings.items() if k != "max_staleness"}
    )
    _, samples, logs = run(tmp_path / "async", tiny_model_dir, async_rollouts=True, **settings)
    assert [s[1:] for s in samples] == launches
    assert [e["rollout/staleness"] for e in logs] == staleness
    assert len(logs) == len(sync_logs) == 6
    for ours, theirs in zip(logs, sync_logs):
        for key in ("loss", "reward", "completions/mean_length", "ratio/mean", "entropy"):
            if key in theirs:
                assert ours[key] == close(theirs[key], 1e-6), key


@pytest.mark.parametrize("decode_logprobs_as_old", [None, False], ids=["decoded", "scored by the frozen copy"])
def test_a_rollout_sampled_ahead_trains_with_its_sampling_weights_log_probs(
    tmp_path, tiny_model_dir, decode_logprobs_as_old
):
    # π_old of a rollout sampled ahead: what the decoding loop recorded on the sampling copy (the default in
    # float32), or that copy's forward pass.
    args = small_config(
        tmp_path / "out",
        max_steps=4,
        steps_per_generation=2,
        async_rollouts=True,
        learning_rate=5e-3,
        decode_logprobs_as_old=decode_logprobs_as_old,
    )
    trainer = GSPOTrainer(tiny_model_dir, count_digits, args=args, train_dataset=text_dataset())
    weights, seen = {}, []
    original_prepare = trainer._prepare_inputs

    def prepare(batch):
        if isinstance(batch, MicroBatch):  # a micro-batch already prepared, handed on by training_step
            return original_prepare(batch)
        # Weights after `global_step` optimizer steps, as they are when this step's rollout could be launched.
        weights.setdefault(
            trainer.state.global_step, {n: p.detach().clone() for n, p in trainer.model.state_dict().items()}
        )
        inputs = original_prepare(batch)
        seen.append((trainer.state.global_step, inputs))
        return inputs

    trainer._prepare_inputs = prepare
    trainer.train()
    step, inputs = seen[2]  # the first micro-batch of the second rollout, sampled at step 0 for step 2
    assert step == 2 and inputs.old_logps is not None
    sampler = type(trainer.model).from_pretrained(tiny_model_dir)
    sampler.load_state_dict(weights[0])
    with torch.no_grad():
        expected = completion_logprobs(
            sampler, inputs.input_ids, inputs.attention_mask, inputs.completion_ids, inputs.completion_mask
        ).logps
        now = completion_logprobs(
            trainer.model,
            inputs.input_ids,
            inputs.attention_mask,
            inputs.completion_ids,
            inputs.completion_mask,
        ).logps
    torch.testing.assert_close(inputs.old_logps, expected, atol=1e-5, rtol=1e-5)
    assert (now - expected).abs().max() > 1e-3  # the weights have moved since: the ratio is not 1
    decoded = inputs.sampling_logps if inputs.sampled_by_policy else None  # the decoding loop's
    assert decoded is None if decode_logprobs_as_old is False else torch.equal(inputs.old_logps, decoded)


class CountingEnv:
    """Two turns at most; rewards digits."""

    def reset(self, seed=None, options=None):
        self.turns = 0
        return "", {}

    def step(self, action):
        self.turns += 1
        return "Again.", sum(c.isdigit() for c in action) / max(len(action), 1), self.turns >= 2, False, {}


def test_episodes_are_sampled_ahead_in_their_own_environments_and_evaluation_waits(tmp_path, tiny_model_dir):
    rows = Dataset.from_dict({"prompt": [[{"role": "user", "content": f"Count to {i}."}] for i in range(8)]})
    args = small_config(
        tmp_path / "out",
        max_steps=4,
        steps_per_generation=2,
        async_rollouts=True,
        max_turns=2,
        max_completion_length=24,
        eval_strategy="steps",
        eval_steps=1,
        per_device_eval_batch_size=4,
    )
    trainer = GSPOTrainer(
        tiny_model_dir, None, args=args, train_dataset=rows, eval_dataset=rows.select(range(1)), env_factory=CountingEnv
    )
    runners = []
    original = trainer._sample
    trainer._sample = lambda backend, runner, *a, **k: runners.append(runner) or original(backend, runner, *a, **k)
    trainer.train()
    # Training's two rollouts ran on the pipeline's runner; evaluation, on the trainer's own.
    assert [r for r in runners if r is not trainer.episode_runner] == [trainer.rollout_pipeline.runner] * 2
    assert trainer.episode_runner in runners
    assert not set(map(id, trainer.rollout_pipeline.runner.pool)) & set(map(id, trainer.episode_runner.pool))
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert [e["rollout/staleness"] for e in logs] == [0, 1, 2, 3]
    assert all(e["episodes/turns/mean"] >= 1 for e in logs if "episodes/turns/mean" in e)
    assert any("eval_reward" in entry for entry in trainer.state.log_history)


def test_a_resumed_run_samples_the_lost_rollout_again_then_pipelines_in_step(tmp_path, tiny_model_dir):
    args = small_config(
        tmp_path / "out", max_steps=6, steps_per_generation=2, async_rollouts=True, save_strategy="steps", save_steps=2
    )
    first = GSPOTrainer(tiny_model_dir, count_digits, args=args, train_dataset=text_dataset())
    first.train()
    resumed = GSPOTrainer(tiny_model_dir, count_digits, args=args, train_dataset=text_dataset())
    resumed.train(resume_from_checkpoint=f"{args.output_dir}/checkpoint-2")
    first_logs = {e["step"]: e for e in first.state.log_history if "loss" in e}
    logs = {e["step"]: e for e in resumed.state.log_history if "loss" in e}
    # The rollout sampled ahead for step 2 was not saved: sampled again at step 2, without staleness.
    assert [logs[step]["rollout/staleness"] for step in (3, 4, 5, 6)] == [0, 1, 2, 3]
    # The one for step 4 was launched at step 2 in both runs, from the same weights (checkpoint-2) and streams, on
    # the same prompts (the look-ahead reads the resumed data order): the same completions.
    for key in ("reward", "completions/mean_length", "rewards/count_digits/std"):
        assert logs[5][key] == first_logs[5][key], key


def test_sampling_ahead_under_the_gpu_recipe_bf16_lora_and_kl(tmp_path, tiny_model_dir):
    # bf16 autocast on CPU (per thread: the pipeline's thread enters it itself), a LoRA adapter (the snapshot copies
    # only the adapter after the first launch), and beta > 0 (the reference is the live model's disabled adapter).
    from peft import LoraConfig

    args = small_config(
        tmp_path / "out",
        max_steps=4,
        steps_per_generation=2,
        async_rollouts=True,
        bf16=True,
        beta=0.04,
        learning_rate=5e-3,
    )
    trainer = GSPOTrainer(
        tiny_model_dir,
        count_digits,
        args=args,
        train_dataset=text_dataset(),
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"),
    )
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert [e["rollout/staleness"] for e in logs] == [0, 1, 2, 3]
    assert all(torch.isfinite(torch.tensor([e["loss"], e["kl"]])).all() for e in logs)
    assert logs[2]["ratio/mean"] != 1.0  # the rollout sampled ahead trains off-policy from its first step
    snapshot = trainer.rollout_pipeline.snapshot
    assert all("lora" in name for name in snapshot.trainable)
    live = dict(trainer.accelerator.unwrap_model(trainer.model).named_parameters())
    frozen = dict(snapshot.model.named_parameters())
    moved = [name for name in snapshot.trainable if not torch.equal(frozen[name], live[name])]
    assert moved  # the snapshot holds the weights of its last launch (step 2), not the live ones

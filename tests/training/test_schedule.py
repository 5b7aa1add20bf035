"""gspo_trl.training.schedule: which micro-batches need π_old, by hand, against a simulation of Trainer's
optimizer steps, and end to end: the shortcut gives the reference mode's losses, ratios and weights
for every combination of gradient_accumulation_steps × steps_per_generation × num_iterations."""

from __future__ import annotations

import itertools
import math
from unittest.mock import patch

import pytest
import torch
from datasets import Dataset
from helpers import close, count_digits, length_reward, small_config, text_dataset, worker_env

from gspo_trl import GSPOConfig, GSPOTrainer
from gspo_trl.training.micro_batch import MicroBatch
from gspo_trl.training.schedule import (
    CURRENT_WEIGHTS,
    DECODING_LOOP,
    FORWARD,
    SAMPLED_AHEAD,
    SAMPLER,
    RolloutSchedule,
    fill_old_logps,
    micro_batches_needing_old_logprobs,
    micro_steps_into_epoch,
    old_logps_source,
)


def needs(spg, mu, ga, offset=0, first_use=0):
    return micro_batches_needing_old_logprobs(
        steps_per_generation=spg,
        num_iterations=mu,
        gradient_accumulation_steps=ga,
        window_offset=offset,
        first_use=first_use,
    )


def test_hand_derived_cases():
    # The paper's schedule: 4 optimizer steps of 2 micro-batches; only the first step's pair is on-policy.
    assert needs(8, 1, 2) == [False, False] + [True] * 6
    # On-policy: one optimizer step per rollout, no π_old at all.
    assert needs(4, 1, 4) == [False] * 4
    # A rollout that starts after one micro-step of a window of 2: micro-batch 0 ends the window.
    assert needs(3, 1, 2, offset=1) == [False, True, True]
    # Two passes inside one window of 4 micro-steps: the weights never move under this rollout.
    assert needs(2, 2, 4) == [False, False]
    # Two passes, one step per pass: every micro-batch is reused after the first update.
    assert needs(2, 2, 2) == [True, True]
    # Resumed at use 3 of 4 (two passes of 2): micro-batch 0 is done, micro-batch 1 has its last use left.
    assert needs(2, 2, 1, first_use=3) == [False, False]
    assert needs(2, 2, 1, first_use=2) == [False, True]


def test_rejects_positions_outside_the_rollout():
    with pytest.raises(ValueError, match="window_offset"):
        needs(2, 1, 2, offset=2)
    with pytest.raises(ValueError, match="first_use"):
        needs(2, 1, 2, first_use=2)


def simulate(spg, mu, ga, rollouts_per_epoch, epochs=2):
    """Trainer's loop written out: per micro-step (epoch position, optimizer steps done before it)."""
    steps_in_epoch = rollouts_per_epoch * spg * mu
    timeline, updates = [], 0
    for _ in range(epochs):
        for t in range(steps_in_epoch):
            timeline.append((t, updates))
            if (t + 1) % ga == 0 or t + 1 == steps_in_epoch:
                updates += 1
    return timeline, steps_in_epoch


GRID = list(itertools.product([1, 2, 3, 4], [1, 2, 3, 5], [1, 2, 3], [1, 2, 3]))  # ga, spg, mu, rollouts/epoch


@pytest.mark.parametrize("ga,spg,mu,rollouts_per_epoch", GRID)
def test_rule_matches_simulated_optimizer_steps(ga, spg, mu, rollouts_per_epoch):
    timeline, steps_in_epoch = simulate(spg, mu, ga, rollouts_per_epoch)
    uses = spg * mu
    for start in range(0, len(timeline), uses):
        epoch_position, sampled_at = timeline[start]
        expected = [any(timeline[start + j * spg + i][1] != sampled_at for j in range(mu)) for i in range(spg)]
        assert needs(spg, mu, ga, offset=epoch_position % ga) == expected, (start, expected)


@pytest.mark.parametrize("ga,spg,mu,rollouts_per_epoch", GRID)
def test_resume_position_and_rule_match_simulation(ga, spg, mu, rollouts_per_epoch):
    timeline, steps_in_epoch = simulate(spg, mu, ga, rollouts_per_epoch)
    uses = spg * mu
    for step, (epoch_position, updates) in enumerate(timeline):
        if step and timeline[step - 1][1] == updates:
            continue  # a run resumes only right after an optimizer step
        assert micro_steps_into_epoch(updates, steps_in_epoch, ga) == epoch_position
        first_use = epoch_position % uses
        rollout_end = step - first_use + uses
        # A re-sampled rollout: its remaining uses compare with the weights at the resume point.
        expected = []
        for i in range(spg):
            later = [step - first_use + j * spg + i for j in range(mu) if j * spg + i >= first_use]
            expected.append(any(timeline[t][1] != updates for t in later if t < rollout_end))
        assert needs(spg, mu, ga, first_use=first_use) == expected, (step, expected)


# --- end to end: the shortcut against the reference mode ----------------------------------------


def train(tmp_path, tiny_model_dir, name, max_steps, resume=None, **overrides):
    # π_old from the forward pass (decode_logprobs_as_old=False): the schedule of that pass is what is tested.
    values = dict(
        per_device_train_batch_size=2,
        num_generations=2,
        max_completion_length=6,
        max_steps=max_steps,
        learning_rate=5e-3,
        epsilon=0.2,
        epsilon_high=0.2,
        decode_logprobs_as_old=False,
    )
    config = small_config(tmp_path / name, **{**values, **overrides})
    trainer = GSPOTrainer(tiny_model_dir, [count_digits, length_reward], args=config, train_dataset=text_dataset(6))
    trainer.train(resume_from_checkpoint=resume)
    return trainer


STAT_NAMES = ("loss", "ratio/mean", "ratio/min", "ratio/max", "clip_ratio/region", "reward")


def compare_runs(shortcut, reference):
    logs = [
        [{k: e[k] for k in STAT_NAMES if k in e} for e in t.state.log_history if "loss" in e]
        for t in (shortcut, reference)
    ]
    assert len(logs[0]) == len(logs[1]) > 0
    for step, (a, b) in enumerate(zip(*logs)):
        assert a.keys() == b.keys()
        for name in a:
            assert a[name] == close(b[name], 1e-6), (step, name, a[name], b[name])
    for (name, p), q in zip(shortcut.model.named_parameters(), reference.model.parameters()):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=1e-6, msg=name)


SCHEDULES = [  # (gradient_accumulation_steps, steps_per_generation, num_iterations, batch, group size)
    (1, 1, 1, 2, 2),
    (1, 2, 1, 2, 2),
    (1, 1, 2, 2, 2),
    (2, 2, 1, 2, 2),
    (2, 4, 1, 2, 2),
    (2, 3, 1, 2, 2),
    (3, 2, 1, 2, 2),
    (2, 1, 2, 2, 2),
    (2, 2, 2, 2, 2),
    (2, 3, 2, 2, 2),
    (3, 4, 1, 2, 2),
    (4, 2, 2, 2, 2),
    # other batch geometries: two groups per micro-batch; a group split over two micro-batches
    (2, 3, 1, 4, 2),
    (3, 2, 2, 4, 2),
    (2, 2, 1, 2, 4),
    (2, 4, 1, 2, 4),
    # a group split over two optimizer steps (steps of 2 and of 6 completions, groups of 4), as TRL accepts
    (1, 2, 1, 2, 4),
    (3, 4, 1, 2, 4),
]


@pytest.mark.parametrize("ga,spg,mu,batch,group", SCHEDULES)
def test_shortcut_equals_always_computing_old_logprobs(tmp_path, tiny_model_dir, ga, spg, mu, batch, group):
    # 6 prompts: rollouts of spg × batch / group prompts, so some schedules end an epoch on a short window.
    steps = 4
    common = dict(
        gradient_accumulation_steps=ga,
        steps_per_generation=spg,
        num_iterations=mu,
        per_device_train_batch_size=batch,
        num_generations=group,
    )
    shortcut = train(tmp_path, tiny_model_dir, "shortcut", steps, **common)
    reference = train(tmp_path, tiny_model_dir, "reference", steps, always_compute_old_logprobs=True, **common)
    compare_runs(shortcut, reference)


@pytest.mark.slow  # 16 micro-steps
def test_groups_straddling_optimizer_steps_train_on_the_generation_batches_in_order(tmp_path, tiny_model_dir):
    # TRL's own check of this batch geometry: optimizer steps of 2 × 3 = 6 completions, groups of 4, rollouts of
    # 4 micro-steps of 2 completions, each trained on twice (num_iterations=2), one epoch of 4 prompts.
    config = small_config(
        tmp_path,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=3,
        steps_per_generation=4,
        num_generations=4,
        num_iterations=2,
        shuffle_dataset=False,
        max_steps=-1,
        num_train_epochs=1,
    )
    prompts = text_dataset(4)["prompt"]
    trainer = GSPOTrainer(tiny_model_dir, count_digits, args=config, train_dataset=text_dataset(4))
    with patch.object(GSPOTrainer, "training_step", wraps=trainer.training_step) as training_step:
        trainer.train()
    # Each micro-step is handed its rollout's generation batch (2 prompts × 4): 2 rollouts × 8 uses.
    handed = [[row["prompt"] for row in call.args[1]] for call in training_step.call_args_list]
    first, second = [p for p in prompts[:2] for _ in range(4)], [p for p in prompts[2:] for _ in range(4)]
    assert handed == [first] * 8 + [second] * 8
    assert trainer.state.global_step == 6  # 16 micro-steps in windows of 3: the epoch's last window holds one
    assert all(math.isfinite(entry["loss"]) for entry in trainer.state.log_history if "loss" in entry)


def test_ratio_moves_once_the_weights_do(tmp_path, tiny_model_dir):
    # Four optimizer steps per rollout: steps 2-4 train with moved weights and must see ratios != 1.
    trainer = train(tmp_path, tiny_model_dir, "moving", 4, steps_per_generation=4, learning_rate=2e-2)
    logs = [e for e in trainer.state.log_history if "loss" in e]
    assert logs[0]["ratio/min"] == logs[0]["ratio/max"] == 1.0  # sampling weights: exactly 1
    assert all(e["ratio/max"] > 1.0 or e["ratio/min"] < 1.0 for e in logs[1:]), logs


@pytest.mark.parametrize("resume_step", [1, 2, 3])
def test_resume_mid_rollout_matches_the_reference_mode(tmp_path, tiny_model_dir, resume_step):
    common = dict(
        gradient_accumulation_steps=2, steps_per_generation=3, num_iterations=2, save_strategy="steps", save_steps=1
    )
    first = train(tmp_path, tiny_model_dir, "first", resume_step, **common)
    checkpoint = str(tmp_path / "first" / f"checkpoint-{resume_step}")
    resumed = [
        train(tmp_path, tiny_model_dir, "first", 5, resume=checkpoint, **common),
        train(tmp_path, tiny_model_dir, "first", 5, resume=checkpoint, always_compute_old_logprobs=True, **common),
    ]
    assert all(t.state.global_step == 5 for t in resumed) and first.state.global_step == resume_step
    compare_runs(*resumed)


def test_trainer_refuses_to_train_a_stale_micro_batch_without_old_logprobs(tmp_path, tiny_model_dir):
    trainer = GSPOTrainer(
        tiny_model_dir,
        count_digits,
        train_dataset=Dataset.from_dict({"prompt": ["a", "b"]}),
        args=GSPOConfig(
            output_dir=str(tmp_path),
            per_device_train_batch_size=2,
            num_generations=2,
            use_cpu=True,
            steps_per_generation=1,
            max_completion_length=4,
            report_to="none",
        ),
    )
    trainer.model.train()
    batch = trainer._generate_and_score([{"prompt": "a"}, {"prompt": "a"}], "train")
    trainer.state.global_step = 1  # an optimizer step happened after the rollout was sampled at step 0
    with pytest.raises(RuntimeError, match="schedule error"):
        trainer.compute_loss(trainer.model, batch)


def test_epoch_structure_assumed_by_the_rule(tmp_path, tiny_model_dir):
    # An epoch ends where a rollout ends: the dataloader holds whole rollouts' uses.
    trainer = train(
        tmp_path, tiny_model_dir, "epochs", 1, gradient_accumulation_steps=2, steps_per_generation=3, num_iterations=2
    )
    assert trainer.schedule.micro_steps_per_epoch == 6 // 3 * 3 * 2  # 2 rollouts of 3 prompts, 6 uses each


@pytest.mark.slow  # torchrun launch
def test_shortcut_equals_reference_on_two_processes(tmp_path, tiny_model_dir):
    # Two gloo processes under torchrun (use_cpu=True), rollouts starting inside accumulation windows.
    import json
    import subprocess
    import sys
    from pathlib import Path

    result = tmp_path / "result.json"
    worker = Path(__file__).parents[1] / "schedule_worker.py"
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        str(worker),
        tiny_model_dir,
        str(result),
    ]
    completed = subprocess.run(command, capture_output=True, text=True, timeout=300, env=worker_env())
    assert completed.returncode == 0, completed.stderr[-3000:]
    runs = json.loads(result.read_text())
    shortcut, reference = runs["shortcut"], runs["reference"]
    assert shortcut["world_size"] == reference["world_size"] == 2
    assert len(shortcut["logs"]) == len(reference["logs"]) == 4
    for step, (a, b) in enumerate(zip(shortcut["logs"], reference["logs"])):
        for name in b:
            assert a[name] == close(b[name], 1e-6), (step, name)
    assert any(e["ratio/max"] != 1.0 for e in reference["logs"])  # weights moved under some micro-batches
    assert shortcut["weights"] == pytest.approx(reference["weights"], abs=1e-5)


def _with_earlier_key_names(checkpoint):
    """Rewrite a checkpoint's saved rollout as gspo-trl wrote it before `MicroBatch`: the micro-batch keys
    old_per_token_logps, ref_per_token_logps and sampling_per_token_logps / decoding_per_token_logps."""
    import json
    from pathlib import Path

    manifest_path = Path(checkpoint) / "gspo_rollout_rank0.json"
    manifest = json.loads(manifest_path.read_text())
    earlier = []
    for batch in manifest["micro_batches"]:
        by_policy = batch.pop("sampled_by_policy")["value"]
        sampling = batch.pop("sampling_logps")
        batch["decoding_per_token_logps"] = sampling if by_policy else {"value": None}
        batch["sampling_per_token_logps"] = {"value": None} if by_policy else sampling
        batch["old_per_token_logps"], batch["ref_per_token_logps"] = batch.pop("old_logps"), batch.pop("ref_logps")
        for name in ("micro_batch_rows", "micro_batch_tokens", "last_pass"):
            batch.pop(name)
        earlier.append(batch)
    manifest["micro_batches"] = earlier
    manifest_path.write_text(json.dumps(manifest))
    (Path(checkpoint) / "gspo_checkpoint.json").unlink()  # that version wrote no checkpoint manifest
    return earlier


def test_a_checkpoint_with_the_earlier_micro_batch_keys_resumes_the_same_run(tmp_path, tiny_model_dir):
    # A rollout saved mid-way by the earlier code (dict keys of the old names), π_old from the decoding loop: the
    # resumed run is the one resumed from this version's checkpoint, step for step.
    import shutil

    common = dict(
        gradient_accumulation_steps=2,
        steps_per_generation=3,
        num_iterations=2,
        save_strategy="steps",
        save_steps=1,
        decode_logprobs_as_old=None,  # on in float32: the saved rollout holds the decoding loop's log-probs
    )
    train(tmp_path, tiny_model_dir, "first", 1, **common)
    checkpoint = tmp_path / "first" / "checkpoint-1"
    earlier = tmp_path / "earlier" / "checkpoint-1"
    shutil.copytree(checkpoint, earlier)
    saved = _with_earlier_key_names(earlier)
    assert saved and any(batch["decoding_per_token_logps"].get("tensor") for batch in saved)
    resumed = [
        train(tmp_path, tiny_model_dir, "first", 3, resume=str(checkpoint), **common),
        train(tmp_path, tiny_model_dir, "earlier", 3, resume=str(earlier), **common),
    ]
    compare_runs(*resumed)


# --- π_old: the source table and the buffer ------------------------------------------------------


def _micro_batch(**fields):
    ids = torch.ones(2, 3, dtype=torch.long)
    return MicroBatch(ids, torch.ones(2, 3), ids[:, 1:], torch.ones(2, 2), **fields)


def _options(**overrides):
    from types import SimpleNamespace

    values = dict(use_vllm=False, vllm_logprobs_as_old=False, always_compute_old_logprobs=False)
    return SimpleNamespace(**{**values, **overrides})


DECODED = dict(sampling_logps=torch.zeros(2, 2), sampled_by_policy=True)  # the decoding loop's own log-probs


@pytest.mark.parametrize(
    "fields, options, needed, source",
    [
        (dict(old_logps=torch.zeros(2, 2)), dict(use_vllm=True, vllm_logprobs_as_old=True), True, SAMPLED_AHEAD),
        (dict(sampling_logps=torch.zeros(2, 2)), dict(use_vllm=True, vllm_logprobs_as_old=True), False, SAMPLER),
        (dict(), dict(vllm_logprobs_as_old=True), False, CURRENT_WEIGHTS),  # without vLLM the option is idle
        (
            dict(sampling_logps=torch.zeros(2, 2), sampled_by_policy=True),
            dict(always_compute_old_logprobs=True),
            False,
            FORWARD,
        ),
        (dict(sampling_logps=torch.zeros(2, 2), sampled_by_policy=True), dict(), False, CURRENT_WEIGHTS),
        (dict(sampling_logps=torch.zeros(2, 2), sampled_by_policy=True), dict(), True, DECODING_LOOP),
        (dict(sampling_logps=torch.zeros(2, 2)), dict(), True, FORWARD),  # another engine's are not π_old
        (dict(sampled_by_policy=True), dict(), True, FORWARD),  # the loop recorded none (or failed the check)
    ],
)
def test_old_logps_source_table(fields, options, needed, source):
    assert old_logps_source(_micro_batch(**fields), _options(**options), needed) == source


def test_fill_old_logps_takes_each_source():
    decoded, engine, ahead = torch.full((2, 2), -1.0), torch.full((2, 2), -2.0), torch.full((2, 2), -3.0)
    batches = [
        _micro_batch(sampling_logps=decoded, sampled_by_policy=True),
        _micro_batch(sampling_logps=decoded, sampled_by_policy=True),
        _micro_batch(sampling_logps=engine),
        _micro_batch(old_logps=ahead),
    ]
    forwards = []
    fill_old_logps(batches, [False, True, True, True], _options(), lambda batch: forwards.append(batch) or engine + 1)
    assert batches[0].old_logps is None and batches[1].old_logps is decoded
    assert forwards == [batches[2]] and torch.equal(batches[2].old_logps, engine + 1)
    assert batches[3].old_logps is ahead
    vllm = [_micro_batch(sampling_logps=engine)]
    fill_old_logps(vllm, [False], _options(use_vllm=True, vllm_logprobs_as_old=True), forwards.append)
    assert vllm[0].old_logps is engine and len(forwards) == 1


def test_pi_old_from_a_truncating_loop_is_the_policys_log_prob():
    # The loop drew from top-k/top-p's renormalised μ = p / Z and recorded log μ and log Z: π_old is log p = log μ +
    # log Z (exact here: sums of small dyadic numbers), the sampling log-probs themselves where nothing was cut.
    sampled, log_mass = torch.tensor([[-0.5, -1.0], [-0.25, -2.0]]), torch.tensor([[-0.25, 0.0], [-0.5, -0.125]])
    batches = [
        _micro_batch(sampling_logps=sampled, sampled_by_policy=True, kept_log_mass=log_mass),
        _micro_batch(sampling_logps=sampled, sampled_by_policy=True),
    ]
    fill_old_logps(batches, [True, True], _options(), lambda batch: pytest.fail("no forward: the loop's π_old"))
    assert torch.equal(batches[0].old_logps, torch.tensor([[-0.75, -1.0], [-0.75, -2.125]]))
    assert batches[1].old_logps is sampled


def test_the_buffer_saves_the_rollout_only_inside_it_and_takes_it_up_on_resume(tmp_path):
    from types import SimpleNamespace

    from gspo_trl.training.rollout_checkpoint import save_rollout_state

    args = SimpleNamespace(steps_per_generation=2, num_iterations=1, gradient_accumulation_steps=1, seed=0)
    accelerator = SimpleNamespace(process_index=0, device=torch.device("cpu"))
    buffer = RolloutSchedule(args)
    buffer.micro_steps_per_epoch = 4
    assert buffer.start(global_step=0)  # use 0: a rollout is sampled
    buffer.fill([_micro_batch(advantages=torch.tensor([1.0, -1.0])), _micro_batch(old_logps=torch.zeros(2, 2))], 0)
    assert buffer.current().advantages is not None
    assert buffer.checkpoint_state(0, None).micro_batches is None  # no use trained yet: a resume samples it again
    buffer.advance()
    state = buffer.checkpoint_state(12, None)
    assert state.micro_batches[1]["old_logps"] is not None and state.num_tokens_seen == 12
    save_rollout_state(str(tmp_path), 0, state)
    buffer.advance()
    assert buffer.checkpoint_state(12, None).micro_batches is None  # between rollouts: nothing to continue
    resumed = RolloutSchedule(args)
    resumed.micro_steps_per_epoch = 4
    assert resumed.restore(str(tmp_path), accelerator).num_tokens_seen == 12
    assert not resumed.start(global_step=1)  # one micro-step into the epoch: the saved rollout continues
    assert resumed.use == 1 and torch.equal(resumed.current().old_logps, torch.zeros(2, 2))


@pytest.mark.slow  # training runs
@pytest.mark.parametrize("max_tokens_per_pass", [None, 12])  # one pass per micro-batch; passes of single rows
def test_pad_to_multiple_of_pads_each_micro_batch_and_trains_the_same(tmp_path, tiny_model_dir, max_tokens_per_pass):
    # Padded rows (padding_free=False) train on the same tokens: the extra columns are masked and positions come
    # from the mask, so only the kernels' summation order may differ: fp32 rounding, far inside 1e-6 of values of
    # order one. The weights are not compared: Adam divides by √v, so a rounding-sized gradient where the exact one
    # is 0 moves a weight by up to lr; the gradient norm and the ratios after each update are compared instead.
    options = dict(padding_free=False, max_tokens_per_pass=max_tokens_per_pass)
    shapes = []
    compute_loss = GSPOTrainer.compute_loss

    def spy(self, model, inputs, *rest, **kwargs):
        shapes.append((inputs.input_ids.shape[1] - inputs.completion_ids.shape[1], inputs.completion_ids.shape[1]))
        return compute_loss(self, model, inputs, *rest, **kwargs)

    GSPOTrainer.compute_loss = spy
    try:
        padded = train(tmp_path, tiny_model_dir, "padded", 3, pad_to_multiple_of=16, **options)
    finally:
        GSPOTrainer.compute_loss = compute_loss
    plain = train(tmp_path, tiny_model_dir, "plain", 3, **options)
    assert shapes and all(prompt % 16 == 0 and completion % 16 == 0 for prompt, completion in shapes), shapes
    logs = [[e for e in trainer.state.log_history if "loss" in e] for trainer in (padded, plain)]
    assert len(logs[0]) == len(logs[1]) == 3
    for step, (a, b) in enumerate(zip(*logs)):
        assert a.keys() == b.keys()
        for name in {*STAT_NAMES, "grad_norm", "entropy"} & a.keys():  # rewards: on the steps that sample
            assert a[name] == close(b[name], 1e-6), (step, name)

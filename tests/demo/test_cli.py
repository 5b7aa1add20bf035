"""The `gspo-trl` command line: flags and YAML parsing, and a whole run on a tiny model."""

from __future__ import annotations

import json
import os
import sys
import textwrap

import pytest
from datasets import Dataset

from gspo_trl.demo.cli import DEMO_DEFAULTS, main, parse_train_args, summarize
from gspo_trl.training.checkpoints import MANIFEST_FILE


def test_no_arguments_gives_the_demo_settings():
    run_args, config = parse_train_args([])
    assert run_args.model_name_or_path is None and run_args.task is None
    assert config.max_steps == DEMO_DEFAULTS["max_steps"]
    assert config.learning_rate == DEMO_DEFAULTS["learning_rate"]
    assert config.importance_sampling_level == "sequence"
    assert config.optimizer_steps_per_rollout == 4 and not config.is_on_policy  # the paper's schedule


def test_every_config_field_is_a_flag_and_flags_override_yaml(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("epsilon: 0.001\nmax_steps: 7\ntask: basic_arithmetic\ngeneration_kwargs: {min_new_tokens: 2}\n")
    run_args, config = parse_train_args(["--config", str(path), "--max_steps", "3", "--beta", "0.05"])
    assert config.epsilon == 0.001  # from YAML
    assert config.max_steps == 3  # the flag wins
    assert config.beta == 0.05
    assert config.generation_kwargs == {"min_new_tokens": 2}
    assert run_args.task == "basic_arithmetic"


def test_unknown_yaml_field_is_named(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("epsilonn: 0.1\n")
    with pytest.raises(ValueError, match="epsilonn"):
        parse_train_args(["--config", str(path)])


def test_summarize_compares_first_and_last_window():
    history = [{"step": i + 1, "reward": r} for i, r in enumerate([0.1] * 10 + [0.5] * 10)]
    summary = summarize(history)
    assert summary["reward_first_window"] == pytest.approx(0.1)
    assert summary["reward_gain"] == pytest.approx(0.4)
    # one entry per rollout of 4 optimizer steps: 10 steps are the first and last 3 rollouts
    rollouts = [{"step": 4 * i + 1, "reward": r} for i, r in enumerate([0.1, 0.2, 0.3, 0.5, 0.6, 0.7, 0.8, 0.9])]
    summary = summarize(rollouts, steps_per_rollout=4)
    assert summary["window"] == 3 and summary["rollouts"] == 8
    assert summary["reward_first_window"] == pytest.approx(0.2) and summary["reward_last_window"] == pytest.approx(0.8)


def test_training_health_summary_and_hints():
    from gspo_trl.reporting.metrics import format_health, training_health

    def step(n, lo, hi, clip, **rollout):
        return {"step": n, "loss": 0.0, "ratio/min": lo, "ratio/max": hi, "clip_ratio/region": clip, **rollout}

    history = [
        step(1, 1.0, 1.0, 0.0, reward=0.2, frac_reward_zero_std=0.75, **{"completions/mean_length": 30.0}),
        step(2, 0.99, 1.02, 0.5),
        step(3, 0.98, 1.03, 0.7),
        step(4, 1.0, 1.0, 0.0, reward=0.4, frac_reward_zero_std=0.25, **{"completions/mean_length": 10.0}),
        step(5, 0.97, 1.01, 0.6),
        {"train_runtime": 1.0},
    ]
    health = training_health(history, window=1)
    assert health["zero_std_group_share"] == pytest.approx(0.5) and health["off_policy_steps"] == 3
    assert health["clip_ratio_off_policy"] == pytest.approx(0.6)  # the on-policy steps' zeros are not averaged in
    assert (health["ratio_min"], health["ratio_max"]) == (0.97, 1.03)
    assert (health["length_first"], health["length_last"]) == (30.0, 10.0)
    assert len(health["hints"]) == 2  # clipping and shrinking lengths; 50% equal-reward groups is not over the line
    assert "lower learning_rate" in health["hints"][0] and "shrank" in health["hints"][1]
    on_policy = training_health([step(1, 1.0, 1.0, 0.0, reward=0.1, frac_reward_zero_std=0.9)])
    assert any("equal rewards" in h for h in on_policy["hints"]) and any("on-policy" in h for h in on_policy["hints"])
    assert format_health(health).startswith("Training health:")


def tiny_train_command(tmp_path, tiny_model_dir, monkeypatch, out) -> list[str]:
    """`gspo-trl train` of 2 steps on the tiny model, a local dataset and a reward function from a file in the working
    directory, into `out`."""
    data = tmp_path / "prompts.jsonl"
    Dataset.from_dict({"prompt": [f"Say {i}" for i in range(4)], "target": [str(i) for i in range(4)]}).to_json(data)
    (tmp_path / "my_rewards.py").write_text(
        textwrap.dedent("""
        def has_target(completions, target, **kwargs):
            return [float(t in c) for c, t in zip(completions, target)]
    """)
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    return [
        "train",
        "--model_name_or_path",
        tiny_model_dir,
        "--dataset_name",
        str(data),
        "--reward_funcs",
        "my_rewards:has_target",
        "--output_dir",
        str(out),
        "--max_steps",
        "2",
        "--per_device_train_batch_size",
        "4",
        "--num_generations",
        "4",
        "--steps_per_generation",
        "1",
        "--max_completion_length",
        "6",
        "--disable_tqdm",
        "true",
    ]


def test_train_command_end_to_end(tmp_path, tiny_model_dir, monkeypatch):
    out = tmp_path / "out"
    code = main(tiny_train_command(tmp_path, tiny_model_dir, monkeypatch, out))
    assert code == 0
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["summary"]["steps"] == 2
    assert (out / "reward_curve.png").stat().st_size > 0
    assert os.path.isfile(out / "model.safetensors") and os.path.isfile(out / "README.md")


def test_a_second_train_into_a_used_output_dir_is_refused_unless_it_resumes_or_overwrites(
    tmp_path, tiny_model_dir, monkeypatch
):
    out = tmp_path / "out"
    command = tiny_train_command(tmp_path, tiny_model_dir, monkeypatch, out) + ["--save_strategy", "steps"]
    command += ["--save_steps", "1"]
    assert main(command) == 0
    manifests = {name: (out / name / MANIFEST_FILE).read_bytes() for name in ("checkpoint-1", "checkpoint-2")}
    before = {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}
    with pytest.raises(ValueError) as refused:
        main(command)
    message = str(refused.value)
    assert f"--output_dir {out} already holds an earlier run's outputs (checkpoint-1, checkpoint-2, " in message
    assert "--resume_from_checkpoint true" in message and "--overwrite_output_dir true" in message, message
    assert before == {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}
    # The remedies the message names work. Resumed from checkpoint-2 (left as it was) to step 3:
    assert main(command + ["--max_steps", "3", "--resume_from_checkpoint", "true"]) == 0
    assert json.loads((out / "metrics.json").read_text())["summary"]["steps"] == 3
    assert all((out / name / MANIFEST_FILE).read_bytes() == manifest for name, manifest in manifests.items())
    assert json.loads((out / "checkpoint-3" / MANIFEST_FILE).read_text())["sequence"] == 3
    # Overwritten: the earlier checkpoints deleted (checkpoint-3 too), a new run of 2 steps saved in their place.
    assert main(command + ["--overwrite_output_dir", "true"]) == 0
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-1", "checkpoint-2"]
    assert json.loads((out / "checkpoint-2" / MANIFEST_FILE).read_text())["sequence"] == 2
    assert json.loads((out / "metrics.json").read_text())["summary"]["steps"] == 2


def test_unknown_command_fails():
    assert main(["fly"]) == 2


def test_env_calculator_sets_its_schedule_and_builds_the_tool_task():
    from gspo_trl.demo.calculator import Calculator, correct_answer
    from gspo_trl.demo.cli import build_run

    run_args, config = parse_train_args(["--env", "calculator", "--model_name_or_path", "some/model"])
    assert (config.max_tool_calling_iterations, config.max_completion_length, config.max_steps) == (1, 96, 12)
    assert (config.per_device_train_batch_size, config.num_generations, run_args.dataset_size) == (8, 4, 256)
    assert run_args.warm_up_steps == 3
    model, dataset, rewards, factory = build_run(run_args)
    assert model == "some/model" and factory is Calculator and rewards == [correct_answer]
    assert len(dataset) == 256 and dataset[0]["prompt"][0]["content"].startswith("What is ")
    with pytest.raises(ValueError, match="cannot take --task"):
        build_run(parse_train_args(["--env", "calculator", "--task", "basic_arithmetic"])[0])

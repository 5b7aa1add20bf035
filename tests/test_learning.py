"""Learning is tested by learning, on the real SmolLM2-135M-Instruct on CPU: the embedded demo (the reasoning-gym
verifier as reward) within a dozen GSPO steps, and the two agent examples (retry with feedback, a calculator tool)
must raise their reward. Minutes each; under `pytest -n 2` they run beside the rest of the suite."""

from __future__ import annotations

import json

import pytest

from gspo_trl.demo.cli import main


@pytest.mark.slow
def test_demo_reward_rises_on_the_real_model(tmp_path):
    out = tmp_path / "demo"
    code = main(
        ["train", "--output_dir", str(out), "--max_steps", "12", "--dataset_size", "64", "--disable_tqdm", "true"]
    )
    assert code == 0
    summary = json.loads((out / "metrics.json").read_text())["summary"]
    # The demo's schedule: 3 rollouts of 4 optimizer steps; the summary compares the first and the last rollout.
    assert summary["steps"] == 12 and summary["rollouts"] == 3 and summary["window"] == 1
    assert summary["health"]["off_policy_steps"] > 0  # clipping had steps to act on
    assert summary["reward_gain"] >= 0.15, summary


@pytest.mark.slow
def test_retry_environment_reward_rises_on_the_real_model(tmp_path):
    # Multi-turn episodes (docs/agents.md): a wrong reply gets feedback and one more try; each turn has its own
    # ratio and advantage. 5 rollouts of 8 questions x 4 episodes, about 4 minutes here. A rollout's mean reward
    # over 32 episodes has a standard error near 0.08 and most of the learning happens by the second rollout, so
    # the test compares the first rollout with the mean of the last two (SE of the difference ≈ 0.1); recorded
    # runs gained 0.29-0.46.
    out = tmp_path / "retry"
    code = main(
        [
            "train",
            "--env",
            "retry",
            "--output_dir",
            str(out),
            "--max_steps",
            "20",
            "--dataset_size",
            "64",
            "--per_device_train_batch_size",
            "8",
            "--num_generations",
            "4",
            "--max_turns",
            "2",
            "--max_completion_length",
            "128",
            "--disable_tqdm",
            "true",
        ]
    )
    assert code == 0
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["summary"]["steps"] == 20 and metrics["summary"]["rollouts"] == 5
    rollouts = [entry for entry in metrics["log_history"] if "reward" in entry]
    rewards = [entry["reward"] for entry in rollouts]
    assert (rewards[-1] + rewards[-2]) / 2 - rewards[0] >= 0.15, rewards
    assert max(entry["episodes/turns/max"] for entry in rollouts) == 2  # feedback and a second try happened
    first_try = [entry["episodes/reward_turn_0/mean"] for entry in rollouts]
    assert (first_try[-1] + first_try[-2]) / 2 > first_try[0], first_try


@pytest.mark.slow
def test_calculator_tool_use_improves_on_the_real_model(tmp_path):
    # TRL's environment_factory convention (docs/agents.md): a 3-step supervised warm-up shows SmolLM2 the tool-call
    # format, then 5 rollouts of 32 episodes train on what it does with it (about 9 minutes on one thread, as under
    # pytest -n 2). A rollout's reward has a standard error near 0.08, so as in the retry test the first rollout is
    # compared with the mean of the last two. The learning rate is twice the command's default: on one thread the
    # reward gained 0.33-0.63 with it (seeds 0-3), and 0.02-0.36 in six runs with the default (seeds 0-4), too close
    # to the bar for a test that must not fail by chance. The tool is what a right answer needs: calls per episode
    # must rise too (by 0.25-0.58 in the four runs at this rate). Not asserted: the failed-call rate, a rate over a
    # rollout's few calls, which moved by less than 0.1 either way in 8 of 10 runs (2026-11-25) while rewards rose.
    out = tmp_path / "calculator"
    code = main(
        [
            "train",
            "--env",
            "calculator",
            "--output_dir",
            str(out),
            "--max_steps",
            "20",
            "--learning_rate",
            "2e-5",
            "--disable_tqdm",
            "true",
        ]
    )
    assert code == 0
    metrics = json.loads((out / "metrics.json").read_text())
    rollouts = [entry for entry in metrics["log_history"] if "reward" in entry]
    assert metrics["summary"]["steps"] == 20 and len(rollouts) == 5
    assert rollouts[0]["tools/call_frequency"] > 0.3  # the warm-up taught the format: calls from the first rollout

    def gain(values):  # the mean of the last two rollouts against the first
        return (values[-1] + values[-2]) / 2 - values[0]

    rewards = [entry["reward"] for entry in rollouts]
    calls = [entry["tools/call_frequency"] for entry in rollouts]
    assert gain(rewards) >= 0.1, rewards
    assert gain(calls) >= 0.15, calls

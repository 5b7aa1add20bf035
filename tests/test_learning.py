"""Learning is tested by learning: the embedded demo (real SmolLM2-135M-Instruct, the reasoning-gym
verifier as reward, CPU) must raise its reward within a dozen GSPO steps (about two minutes here)."""

from __future__ import annotations

import json

import pytest

from gspo_trl.cli import main


@pytest.mark.slow
def test_demo_reward_rises_on_the_real_model(tmp_path):
    out = tmp_path / "demo"
    code = main(["train", "--output_dir", str(out), "--max_steps", "12", "--dataset_size", "64", "--disable_tqdm", "true"])
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
    code = main(["train", "--env", "retry", "--output_dir", str(out), "--max_steps", "20", "--dataset_size", "64",
                 "--per_device_train_batch_size", "8", "--num_generations", "4", "--max_turns", "2",
                 "--max_completion_length", "128", "--disable_tqdm", "true"])
    assert code == 0
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["summary"]["steps"] == 20 and metrics["summary"]["rollouts"] == 5
    rollouts = [entry for entry in metrics["log_history"] if "reward" in entry]
    rewards = [entry["reward"] for entry in rollouts]
    assert (rewards[-1] + rewards[-2]) / 2 - rewards[0] >= 0.15, rewards
    assert max(entry["episodes/turns/max"] for entry in rollouts) == 2  # feedback and a second try happened
    first_try = [entry["episodes/reward_turn_0/mean"] for entry in rollouts]
    assert (first_try[-1] + first_try[-2]) / 2 > first_try[0], first_try

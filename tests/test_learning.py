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
    # ratio and advantage. 3 rollouts of 8 questions x 4 episodes, about 4 minutes here.
    out = tmp_path / "retry"
    code = main(["train", "--env", "retry", "--output_dir", str(out), "--max_steps", "12", "--dataset_size", "64",
                 "--per_device_train_batch_size", "8", "--num_generations", "4", "--max_turns", "2",
                 "--max_completion_length", "128", "--disable_tqdm", "true"])
    assert code == 0
    metrics = json.loads((out / "metrics.json").read_text())
    summary = metrics["summary"]
    assert summary["steps"] == 12 and summary["rollouts"] == 3
    assert summary["reward_gain"] >= 0.15, summary
    rollouts = [entry for entry in metrics["log_history"] if "reward" in entry]
    assert max(entry["episodes/turns/max"] for entry in rollouts) == 2  # feedback and a second try happened
    assert rollouts[-1]["episodes/reward_turn_0/mean"] > rollouts[0]["episodes/reward_turn_0/mean"]

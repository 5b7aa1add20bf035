"""GSPOTrainer with env_factory: multi-turn episodes end to end on the tiny model (the loop itself is tested in
test_rollout_episodes.py, the turn-level math in test_loss.py and test_advantages.py)."""

from __future__ import annotations

import math

import pytest
import torch
from datasets import Dataset
from helpers import small_config

from gspo_trl import GSPOTrainer


def chat_rows(n=8):
    return Dataset.from_dict(
        {
            "prompt": [[{"role": "user", "content": f"What is {i} + 3?"}] for i in range(n)],
            "answer": [str(i + 3) for i in range(n)],
        }
    )


class DigitsEnv:
    """Rewards digits in each reply; up to three replies, ends when a reply has 3 or more digits."""

    seeds: list[int] = []

    def reset(self, seed=None, options=None):
        DigitsEnv.seeds.append(seed)
        self.turns = 0
        return "", {}

    def step(self, action):
        self.turns += 1
        digits = sum(c.isdigit() for c in action)
        return "More digits.", digits / max(len(action), 1), digits >= 3, False, {}


def config(tmp_path, **overrides):
    values = dict(
        max_completion_length=48, max_turns=3, generation_kwargs={"sequence_bias": [[[2], 4.0]]}
    )  # id 2 = <|im_end|>: turns end sometimes
    values.update(overrides)
    return small_config(tmp_path / "out", **values)


@pytest.mark.parametrize(
    "level, granularity",
    [
        ("sequence", "trajectory"),
        ("turn", "turn"),
        ("turn", "trajectory"),
        ("sequence_token", "turn"),
        ("token", "turn"),
    ],
)
def test_episodes_train_at_every_level(tmp_path, tiny_model_dir, tiny_tokenizer, level, granularity):
    assert tiny_tokenizer.convert_ids_to_tokens(2) == "<|im_end|>"
    args = config(tmp_path, importance_sampling_level=level, advantage_granularity=granularity)
    trainer = GSPOTrainer(tiny_model_dir, None, args=args, train_dataset=chat_rows(), env_factory=DigitsEnv)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert all(math.isfinite(entry["loss"]) for entry in logs)
    first = logs[0]
    assert first["episodes/turns/mean"] > 1  # some episodes went past their first turn
    assert 0 < first["episodes/env_token_fraction"] < 1
    assert sum(
        first[f"episodes/ended_by/{r}"] for r in ("terminated", "env_truncated", "max_turns", "length", "budget")
    ) == pytest.approx(1.0)
    assert "rewards/env/mean" in first and "episodes/reward_turn_0/mean" in first
    assert any(not torch.equal(before[n], p.detach()) for n, p in trainer.model.named_parameters())


def test_environment_tokens_are_out_of_the_loss_and_turn_advantages_are_per_turn(tmp_path, tiny_model_dir):
    args = config(tmp_path, importance_sampling_level="turn", advantage_granularity="turn")
    trainer = GSPOTrainer(tiny_model_dir, None, args=args, train_dataset=chat_rows(), env_factory=DigitsEnv)
    rows = [chat_rows()[i // 4] for i in range(8)]  # two groups of 4
    inputs = trainer._generate_and_score(rows, mode="train")
    completion_length = inputs.completion_ids.shape[1]
    attended = inputs.attention_mask[:, -completion_length:].bool()
    turn_ids, mask, advantages = inputs.turn_ids, inputs.completion_mask.bool(), inputs.advantages
    assert (attended & (turn_ids == -1)).any()  # observations are in the sequence ...
    assert not (mask & (turn_ids == -1)).any()  # ... but not in the loss
    assert torch.equal(mask, attended & (turn_ids >= 0))
    assert advantages.shape == turn_ids.shape
    for row in range(8):
        for turn in turn_ids[row][mask[row]].unique():
            values = advantages[row][mask[row] & (turn_ids[row] == turn)]
            assert torch.all(values == values[0])  # one advantage per turn
    # Turn 0 is played by every episode: its advantages are normalised within each group.
    first_turn = advantages[:, 0].view(2, 4)
    torch.testing.assert_close(first_turn.mean(1), torch.zeros(2), atol=1e-6, rtol=0)


def test_a_groups_episodes_start_from_the_same_seed(tmp_path, tiny_model_dir):
    DigitsEnv.seeds = []
    trainer = GSPOTrainer(tiny_model_dir, None, args=config(tmp_path), train_dataset=chat_rows(), env_factory=DigitsEnv)
    DigitsEnv.seeds = []  # construction made one environment to check it
    trainer._generate_and_score([chat_rows()[i // 4] for i in range(8)], mode="train")
    seeds = DigitsEnv.seeds
    assert len(seeds) == 8 and len(set(seeds[:4])) == 1 and len(set(seeds[4:])) == 1 and seeds[0] != seeds[4]


def test_reward_functions_get_the_conversation_and_the_environments(tmp_path, tiny_model_dir):
    seen = {}

    def final_digits(completions, environments, **kwargs):
        seen["completions"], seen["environments"] = completions, environments
        return [float(sum(c.isdigit() for c in completion[-1]["content"])) for completion in completions]

    trainer = GSPOTrainer(
        tiny_model_dir,
        [final_digits],
        args=config(tmp_path, max_steps=1),
        train_dataset=chat_rows(),
        env_factory=DigitsEnv,
    )
    trainer.train()
    assert all(isinstance(env, DigitsEnv) for env in seen["environments"])
    assert all(c[0]["role"] == "assistant" for c in seen["completions"])
    assert any(len(c) > 1 and c[1]["role"] == "user" and c[1]["content"] == "More digits." for c in seen["completions"])
    log = trainer.state.log_history[0]
    assert "rewards/env/mean" in log and "rewards/final_digits/mean" in log


def test_rows_without_prompt_start_from_the_reset_observation(tmp_path, tiny_model_dir):
    class Asks(DigitsEnv):
        def reset(self, seed=None, options=None):
            super().reset(seed, options)
            return f"Count to {options['n']}.", {}

    data = Dataset.from_dict({"n": list(range(8))})
    # reward_funcs left out, as TRL allows: the environment's step rewards are the reward.
    trainer = GSPOTrainer(tiny_model_dir, args=config(tmp_path, max_steps=1), train_dataset=data, env_factory=Asks)
    trainer.train()
    assert math.isfinite(trainer.state.log_history[0]["loss"])


def test_no_reward_source_is_refused(tmp_path, tiny_model_dir):
    with pytest.raises(ValueError, match="reward_funcs is empty"):
        GSPOTrainer(tiny_model_dir, [], args=config(tmp_path), train_dataset=chat_rows())
    with pytest.raises(ValueError, match="reward_funcs is empty"):  # optional as in TRL, but something must reward
        GSPOTrainer(tiny_model_dir, args=config(tmp_path), train_dataset=chat_rows())


def test_a_group_of_one_in_evaluation_is_refused_for_episodes(tmp_path, tiny_model_dir):
    with pytest.raises(ValueError, match="num_generations_eval=1 is for single-turn rollouts"):
        GSPOTrainer(
            tiny_model_dir,
            args=config(tmp_path, num_generations_eval=1),
            train_dataset=chat_rows(),
            env_factory=DigitsEnv,
        )


def test_episodes_with_the_gpu_recipe_bf16_lora_and_kl(tmp_path, tiny_model_dir):
    # What users run: bf16 autocast (on CPU here), a LoRA adapter and the KL term to the disabled-adapter reference.
    from peft import LoraConfig

    args = config(
        tmp_path,
        importance_sampling_level="turn",
        advantage_granularity="turn",
        bf16=True,
        beta=0.04,
        steps_per_generation=2,
        gradient_accumulation_steps=1,
        max_steps=2,
    )
    trainer = GSPOTrainer(
        tiny_model_dir,
        None,
        args=args,
        train_dataset=chat_rows(),
        env_factory=DigitsEnv,
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM"),
    )
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert all(math.isfinite(entry["loss"]) for entry in logs)
    assert any(entry["kl"] > 0 for entry in logs)  # the reference scored the episodes' sampled tokens
    assert logs[0]["episodes/turns/mean"] > 1


class QuestionEnv(DigitsEnv):
    """Owns the data: reset() gives the question, so no train_dataset is needed (TRL's environment-owned data)."""

    rows: list[dict] = []

    def reset(self, seed=None, options=None):
        super().reset(seed, options)
        QuestionEnv.rows.append(options)
        return "What is 2 + 3?", {}


def test_an_env_factory_that_owns_the_data_trains_without_a_dataset(tmp_path, tiny_model_dir):
    QuestionEnv.rows = []
    trainer = GSPOTrainer(tiny_model_dir, None, args=config(tmp_path, max_steps=1), env_factory=QuestionEnv)
    trainer.train()
    assert trainer.state.global_step == 1 and math.isfinite(trainer.state.log_history[0]["loss"])
    # 16 episodes (4 steps per rollout × 4 completions), each reset on the stand-in's row: an empty user message, to
    # which the episode appends the observation (the episodes' own tests check that rendering).
    assert QuestionEnv.rows == [{"prompt": [{"role": "user", "content": ""}]}] * 16

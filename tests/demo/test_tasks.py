"""Tests for gspo_trl.demo.tasks: reasoning-gym datasets and the shaped reward (no model needed)."""

import json
import pickle

import pytest

from gspo_trl.demo.tasks import (
    DEFAULT_SYSTEM_PROMPT,
    DEFAULT_TASK,
    DEFAULT_TASK_KWARGS,
    GENERIC_SYSTEM_PROMPT,
    ReasoningGymReward,
    default_task_dataset,
    default_task_reward,
    ends_with_answer,
    extract_answer,
    reasoning_gym_dataset,
    reasoning_gym_reward,
)


@pytest.fixture(scope="module")
def dataset():
    return default_task_dataset(size=8, seed=3)


@pytest.fixture(scope="module")
def reward():
    return default_task_reward()


def score(reward, dataset, completions, index=0):
    """Reward each completion against the same dataset row, as TRL would with a group."""
    row = dataset[index]
    n = len(completions)
    return reward(
        prompts=[row["prompt"]] * n,
        completions=completions,
        completion_ids=None,
        answer=[row["answer"]] * n,
        entry_json=[row["entry_json"]] * n,
        task=[row["task"]] * n,
    )


def test_dataset_columns_and_chat_format(dataset):
    assert len(dataset) == 8
    assert set(dataset.column_names) == {"prompt", "answer", "entry_json", "task"}
    for row in dataset:
        system, user = row["prompt"]
        assert system == {"role": "system", "content": DEFAULT_SYSTEM_PROMPT}
        assert user["role"] == "user" and user["content"].startswith("Calculate ")
        entry = json.loads(row["entry_json"])
        assert entry["question"] == user["content"]
        assert entry["answer"] == row["answer"]
        assert row["task"] == DEFAULT_TASK


def test_default_difficulty_is_small_addition(dataset):
    for row in dataset:
        left, right = row["prompt"][1]["content"].removeprefix("Calculate ").rstrip(".").split(" + ")
        # reasoning-gym draws "1-digit" terms from 0..10 inclusive.
        assert 0 <= int(left) <= 10 and 0 <= int(right) <= 10
        assert int(row["answer"]) == int(left) + int(right)


def test_dataset_is_deterministic_with_seed():
    first = default_task_dataset(size=6, seed=11)
    again = default_task_dataset(size=6, seed=11)
    other = default_task_dataset(size=6, seed=12)
    assert first.to_list() == again.to_list()
    assert first["answer"] != other["answer"] or first["entry_json"] != other["entry_json"]


def test_other_task_and_system_prompts():
    data = reasoning_gym_dataset("chain_sum", size=3, seed=0, max_terms=2, max_digits=1)
    assert data[0]["prompt"][0] == {"role": "system", "content": GENERIC_SYSTEM_PROMPT}
    assert data[0]["task"] == "chain_sum"
    custom = reasoning_gym_dataset("chain_sum", size=3, seed=0, system_prompt="Be brief.", max_terms=2)
    assert custom[0]["prompt"][0] == {"role": "system", "content": "Be brief."}


def test_non_numeric_task_reward():
    data = reasoning_gym_dataset("spell_backward", size=2, seed=0)
    reward = reasoning_gym_reward("spell_backward", numeric=False)
    row = data[0]
    rewards = reward(
        prompts=[row["prompt"]] * 2,
        completions=[f"<answer>{row['answer']}</answer>", "<answer>zzzz</answer>"],
        entry_json=[row["entry_json"]] * 2,
    )
    assert rewards[0] == pytest.approx(1.0) and rewards[1] < rewards[0]


def test_extract_answer_prefers_tag_then_last_number():
    assert extract_answer("I think <answer> 12 </answer> maybe 3") == "12"
    assert extract_answer("4 + 3 = 7") == "7"
    assert extract_answer("no digits here") is None
    assert extract_answer("first line\nlast line", numeric=False) == "last line"


def test_ends_with_answer():
    assert ends_with_answer("4 + 3 = 7.")
    assert ends_with_answer("<answer>7</answer>\n")
    assert not ends_with_answer("7 is the sum of the numbers")
    assert not ends_with_answer("")


def test_reward_ranks_correct_above_wrong_above_garbage(dataset, reward):
    answer = dataset[0]["answer"]
    wrong = str(int(answer) + 1)
    correct, wrong_formed, wrong_buried, garbage = score(
        reward,
        dataset,
        [f"The sum is {answer}.", f"The sum is {wrong}.", f"{wrong} is what I get, I think", "banana!"],
    )
    assert correct == pytest.approx(1.0)
    assert wrong_formed == pytest.approx(0.2)
    assert wrong_buried == 0.0
    assert garbage == 0.0
    assert correct > wrong_formed > garbage


def test_reward_accepts_conversational_completions(dataset, reward):
    answer = dataset[1]["answer"]
    as_text = score(reward, dataset, [f"<answer>{answer}</answer>"], index=1)
    as_messages = score(reward, dataset, [[{"role": "assistant", "content": f"<answer>{answer}</answer>"}]], index=1)
    assert as_text == as_messages == [pytest.approx(1.0)]


def test_correct_answer_not_at_the_end_gets_correctness_only(dataset, reward):
    answer = dataset[2]["answer"]
    (buried,) = score(reward, dataset, [f"so {answer} is the answer"], index=2)
    assert buried == pytest.approx(0.8)


def test_reward_name_logs_and_pickles(dataset, reward):
    assert reward.__name__ == "basic_arithmetic_reward"
    logged = {}
    row = dataset[0]
    reward(
        prompts=[row["prompt"]] * 2,
        completions=[f"= {row['answer']}", "nothing"],
        entry_json=[row["entry_json"]] * 2,
        log_metric=logged.__setitem__,
        trainer_state=None,
    )
    assert logged == {"basic_arithmetic_reward/accuracy": 0.5, "basic_arithmetic_reward/well_formed": 0.5}
    restored = pickle.loads(pickle.dumps(reward))
    assert restored(prompts=[None], completions=["x"], entry_json=[row["entry_json"]]) == [0.0]


def test_reward_without_entry_column_explains_itself(reward):
    with pytest.raises(KeyError, match="reasoning_gym_dataset"):
        reward(prompts=["p"], completions=["1"])


def test_factory_and_format_weight_validation():
    custom = reasoning_gym_reward(DEFAULT_TASK, format_weight=0.0, **DEFAULT_TASK_KWARGS)
    assert isinstance(custom, ReasoningGymReward) and custom.format_weight == 0.0
    with pytest.raises(ValueError):
        ReasoningGymReward(DEFAULT_TASK, format_weight=1.5)

"""gspo_trl/data/checks.py: the errors a user gets for a dataset the trainer cannot use, evaluation datasets by name,
and the collator that dataloader workers run."""

from __future__ import annotations

import math
import pickle

import pytest
import torch
from datasets import Dataset, DatasetDict, IterableDatasetDict
from helpers import count_digits, small_config, text_dataset

from gspo_trl import GSPOConfig, GSPOTrainer
from gspo_trl.data.checks import (
    RowCollator,
    check_datasets,
    check_enough_prompts,
    check_prompt_dataset,
    environment_owned_prompts,
    eval_splits,
)


def test_a_dataset_dict_and_a_missing_prompt_column_are_named():
    prompts = Dataset.from_dict({"prompt": ["a", "b"]})
    with pytest.raises(
        TypeError,
        match=r"train_dataset must be a Dataset or IterableDataset, got DatasetDict .*train_dataset=dataset\['train'\]",
    ):
        check_prompt_dataset(DatasetDict({"train": prompts}), "train_dataset")
    with pytest.raises(ValueError, match=r"train_dataset needs a 'prompt' column .* it has \['question'\]"):
        check_prompt_dataset(Dataset.from_dict({"question": ["a"]}), "train_dataset")
    check_prompt_dataset(Dataset.from_dict({"question": ["a"]}), "train_dataset", needs_prompt=False)  # episodes
    check_prompt_dataset(prompts, "train_dataset")
    check_prompt_dataset(None, "eval_dataset")


def test_fewer_prompts_than_one_rollout_takes_is_an_error_with_the_arithmetic(tmp_path):
    args = GSPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=8, num_generations=4, use_cpu=True)
    assert args.generation_batch_size == 32  # 4 steps per generation: 8 prompts per rollout
    with pytest.raises(ValueError, match="train_dataset has 7 prompts, but one rollout takes 8"):
        check_enough_prompts(Dataset.from_dict({"prompt": ["p"] * 7}), args)
    check_enough_prompts(Dataset.from_dict({"prompt": ["p"] * 8}), args)


def test_a_prompt_message_without_content_is_refused_at_construction_naming_the_row():
    good = [{"role": "user", "content": "hi"}]
    dataset = Dataset.from_dict({"prompt": [good, good, [{"role": "user"}]]})
    with pytest.raises(ValueError, match=r"train_dataset row 2: Prompt message 0 \('user'\) has no 'content'"):
        check_prompt_dataset(dataset, "train_dataset")
    # Arrow gives the message without content a None one (the column's struct has the field): refused the same.
    check_prompt_dataset(Dataset.from_dict({"prompt": [good, good]}), "train_dataset")
    check_prompt_dataset(Dataset.from_dict({"prompt": ["plain text"]}), "train_dataset")


def test_several_evaluation_datasets_are_checked_each_under_its_name(tmp_path):
    args = small_config(tmp_path)
    prompts, questions = text_dataset(2), Dataset.from_dict({"question": ["a"]})
    splits = DatasetDict({"easy": prompts, "hard": prompts})
    assert eval_splits(splits) == {"eval_dataset['easy']": prompts, "eval_dataset['hard']": prompts}
    assert eval_splits({"only": prompts}) == {"eval_dataset['only']": prompts}  # a plain dict, as Trainer takes
    assert eval_splits(prompts) == {"eval_dataset": prompts} and eval_splits(None) == {}
    check_datasets(text_dataset(), splits, args, episodes=False)
    check_datasets(text_dataset(), IterableDatasetDict({"s": prompts.to_iterable_dataset()}), args, episodes=False)
    with pytest.raises(ValueError, match=r"eval_dataset\['hard'\] needs a 'prompt' column"):
        check_datasets(text_dataset(), {"easy": prompts, "hard": questions}, args, episodes=False)
    with pytest.raises(TypeError, match=r"eval_dataset\['nested'\] must be a Dataset"):
        check_datasets(text_dataset(), {"nested": splits}, args, episodes=False)


def test_a_missing_train_dataset_is_trls_error_before_the_model_loads(tmp_path):
    with pytest.raises(ValueError, match="`train_dataset` is required unless an environment_factory"):
        GSPOTrainer("no/such-model", count_digits, args=small_config(tmp_path))
    with pytest.raises(ValueError, match="set max_steps"):  # the environment owns the data: how long to train?
        GSPOTrainer("no/such-model", None, args=small_config(tmp_path, max_steps=-1), environment_factory=Echo)
    with pytest.raises(ValueError, match="requires a `train_dataset` with an 'environment' column"):
        GSPOTrainer("no/such-model", None, args=small_config(tmp_path), environment_factory={"a": Echo, "b": Echo})


def test_an_environment_that_owns_the_data_gets_one_rollout_of_empty_prompts(tmp_path):
    args = small_config(tmp_path, steps_per_generation=2)  # rollouts of 4 × 2 = 8 completions: 2 prompts
    prompts = environment_owned_prompts(None, args, Echo)
    assert prompts["prompt"] == [[{"role": "user", "content": ""}]] * 2
    given = text_dataset()
    assert environment_owned_prompts(given, args, Echo) is given and environment_owned_prompts(None, args, None) is None


class Echo:
    """A TRL environment that owns the data: reset() returns the prompt; its one tool echoes."""

    def reset(self, **row):
        return "What is 2 + 3? Reply with just the number."

    def echo(self, text: str) -> str:
        """Echo the text.

        Args:
            text: what to echo
        """
        return text


@pytest.mark.slow  # a training run
def test_training_where_the_environment_owns_the_data(tmp_path, tiny_model_dir):
    seen = []

    def answers_five(prompts, completions, **kwargs):
        seen.extend(prompts)
        return [float("5" in c[-1]["content"]) for c in completions]

    args = small_config(tmp_path, max_steps=2, max_completion_length=8, max_tool_calling_iterations=1)
    trainer = GSPOTrainer(tiny_model_dir, answers_five, args=args, environment_factory=Echo)
    trainer.train()
    assert trainer.state.global_step == 2 and len(trainer.train_dataset) == 4  # 16 completions a rollout, groups of 4
    assert all(math.isfinite(entry["loss"]) for entry in losses(trainer)) and len(seen) == 16
    # Each episode's prompt is the empty user message with the reset() observation appended, as in TRL (then the
    # tools' description, as the tiny model's template does not present tools).
    assert all(prompt[-1]["role"] == "user" and prompt[-1]["content"].startswith(Echo().reset()) for prompt in seen)


def test_the_collator_survives_pickling_as_dataloader_workers_need():
    collator = pickle.loads(pickle.dumps(RowCollator(needs_prompt=True)))
    assert collator([{"prompt": "a", "answer": "1"}]) == [{"prompt": "a", "answer": "1"}]
    with pytest.raises(ValueError, match="no 'prompt' column"):
        collator([{"question": "a"}])


@pytest.mark.slow  # two dataloader workers start Python, torch and gspo_trl each (spawn)
def test_training_with_dataloader_workers_started_by_spawn(tmp_path, tiny_model_dir):
    # spawn (macOS's default, and what TRL's test uses) pickles the collator and the dataset into each worker: the
    # strictest start method. Each worker reads its own batches of the sampler's indices; the groups stay whole.
    args = small_config(tmp_path, dataloader_num_workers=2, dataloader_multiprocessing_context="spawn")
    trainer = GSPOTrainer(tiny_model_dir, count_digits, args=args, train_dataset=text_dataset(16))
    before = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    rollouts = []
    generate = trainer.rollout_backend.generate
    trainer.rollout_backend.generate = lambda prompts, *rest: rollouts.append(list(prompts)) or generate(prompts, *rest)
    trainer.train()
    assert trainer.get_train_dataloader().num_workers == 2
    assert trainer.state.global_step == 2 and all(torch.isfinite(torch.tensor(e["loss"])) for e in losses(trainer))
    assert all(not torch.equal(before[name], p) for name, p in trainer.model.named_parameters())
    groups = [rollout[start : start + 4] for rollout in rollouts for start in range(0, len(rollout), 4)]
    assert len(groups) == 4 and all(len(set(group)) == 1 for group in groups)  # one rollout: 4 prompts × 4


def losses(trainer) -> list[dict]:
    return [entry for entry in trainer.state.log_history if "loss" in entry]


def test_columns_the_policy_cannot_read_are_refused_and_renamed_ones_pass():
    from gspo_trl.data.checks import check_dataset_modalities

    text = ["What is 1 + 1?"] * 2
    with pytest.raises(ValueError, match=r"train_dataset has a 'images' column, which the policy \(a text model\)"):
        check_dataset_modalities(None, Dataset.from_dict({"prompt": text, "images": [[]] * 2}), None)
    videos = Dataset.from_dict({"prompt": text, "video": ["a.mp4"] * 2})
    with pytest.raises(ValueError, match=r"eval_dataset has a 'video' column"):
        check_dataset_modalities(None, None, videos)
    with pytest.raises(ValueError, match=r"eval_dataset\['hard'\] has a 'video' column"):  # several, by name
        check_dataset_modalities(None, None, {"easy": Dataset.from_dict({"prompt": text}), "hard": videos})
    # A column only reward functions read passes under another name; no dataset (eval_dataset=None) passes.
    renamed = Dataset.from_dict({"prompt": text, "reward_image": [None] * 2})
    check_dataset_modalities(None, renamed, None)
    parts = [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    check_dataset_modalities(None, Dataset.from_dict({"prompt": [parts]}), None)  # text parts pass

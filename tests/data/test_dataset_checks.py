"""dataset_checks: the errors a user gets for a dataset the trainer cannot use."""

from __future__ import annotations

import pytest
from datasets import Dataset, DatasetDict

from gspo_trl import GSPOConfig
from gspo_trl.data.checks import check_enough_prompts, check_prompt_dataset


def test_a_dataset_dict_and_a_missing_prompt_column_are_named():
    prompts = Dataset.from_dict({"prompt": ["a", "b"]})
    with pytest.raises(
        TypeError, match=r"eval_dataset is a DatasetDict; pass one split, e.g. eval_dataset=dataset\['train'\]"
    ):
        check_prompt_dataset(DatasetDict({"train": prompts}), "eval_dataset")
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


def test_columns_the_policy_cannot_read_are_refused_and_renamed_ones_pass():
    from gspo_trl.data.checks import check_dataset_modalities

    text = ["What is 1 + 1?"] * 2
    with pytest.raises(ValueError, match=r"train_dataset has a 'images' column, which the policy \(a text model\)"):
        check_dataset_modalities(None, {"train_dataset": Dataset.from_dict({"prompt": text, "images": [[]] * 2})})
    with pytest.raises(ValueError, match=r"eval_dataset has a 'video' column"):
        check_dataset_modalities(None, {"eval_dataset": Dataset.from_dict({"prompt": text, "video": ["a.mp4"] * 2})})
    # A column only reward functions read passes under another name; no dataset (eval_dataset=None) passes.
    renamed = Dataset.from_dict({"prompt": text, "reward_image": [None] * 2})
    check_dataset_modalities(None, {"train_dataset": renamed, "eval_dataset": None})
    parts = [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    check_dataset_modalities(None, {"train_dataset": Dataset.from_dict({"prompt": [parts]})})  # text parts pass

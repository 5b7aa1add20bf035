"""Bad input fails fast with a clear error: at construction, or on the first batch before any
optimizer step (the weights are untouched)."""

from __future__ import annotations

import math

import pytest
import torch
from datasets import Dataset
from helpers import count_digits, small_config

from gspo_trl import GSPOConfig, GSPOTrainer


def ok_reward(completions, **kwargs):
    return [0.5] * len(completions)


def raising_reward(completions, **kwargs):
    raise KeyError("answer")


def nan_reward(completions, **kwargs):
    return [math.nan] + [1.0] * (len(completions) - 1)


def short_reward(completions, **kwargs):
    return [1.0]


def string_reward(completions, **kwargs):
    return ["1.0"] * len(completions)


def dataset():
    return Dataset.from_dict({"prompt": [f"Count to {i}." for i in range(4)]})


def config(tmp_path, **kwargs):
    values = dict(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=6,
        max_steps=2,
        learning_rate=1e-2,
        report_to="none",
        save_strategy="no",
        use_cpu=True,
    )
    values.update(kwargs)
    return GSPOConfig(**values)


@pytest.mark.parametrize(
    "reward, message",
    [
        (raising_reward, r"raising_reward"),
        (nan_reward, r"nan_reward.*index 0"),
        (short_reward, r"short_reward.*1 reward"),
        (string_reward, r"string_reward.*index 0"),
    ],
)
def test_bad_reward_stops_before_the_first_optimizer_step(tmp_path, tiny_model_dir, reward, message):
    trainer = GSPOTrainer(tiny_model_dir, [ok_reward, reward], args=config(tmp_path), train_dataset=dataset())
    before = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    with pytest.raises(ValueError, match=message):
        trainer.train()
    assert trainer.state.global_step == 0
    assert all(torch.equal(before[name], p) for name, p in trainer.model.named_parameters())


def test_dataset_without_prompt_column(tmp_path, tiny_model_dir):
    bad = Dataset.from_dict({"question": ["a", "b"]})
    with pytest.raises(ValueError, match="train_dataset.*'prompt'"):
        GSPOTrainer(tiny_model_dir, ok_reward, args=config(tmp_path), train_dataset=bad)


def test_args_must_be_gspo_config(tmp_path, tiny_model_dir):
    from transformers import TrainingArguments

    with pytest.raises(TypeError, match="GSPOConfig"):
        GSPOTrainer(
            tiny_model_dir, ok_reward, args=TrainingArguments(output_dir=str(tmp_path)), train_dataset=dataset()
        )


def test_reward_weights_length(tmp_path, tiny_model_dir):
    with pytest.raises(ValueError, match="reward_weights"):
        GSPOTrainer(
            tiny_model_dir, ok_reward, args=config(tmp_path, reward_weights=[1.0, 2.0]), train_dataset=dataset()
        )


def test_bad_reward_func_type(tmp_path, tiny_model_dir):
    with pytest.raises(TypeError, match=r"reward_funcs\[1\]"):
        GSPOTrainer(tiny_model_dir, [ok_reward, 3], args=config(tmp_path), train_dataset=dataset())


def test_bad_model_type(tmp_path):
    with pytest.raises(TypeError, match="model"):
        GSPOTrainer(42, ok_reward, args=config(tmp_path), train_dataset=dataset())


def test_model_init_kwargs_with_instantiated_model(tmp_path, tiny_model):
    with pytest.raises(ValueError, match="model_init_kwargs"):
        GSPOTrainer(
            tiny_model,
            ok_reward,
            args=config(tmp_path, model_init_kwargs={"dtype": "float32"}),
            train_dataset=dataset(),
        )


def test_too_few_prompts_for_one_rollout_is_a_clear_error(tmp_path, tiny_model_dir):
    # 2 prompts, a rollout of 4 × 2 / 2 = 4 prompts: the sampler would yield nothing and Trainer stop at step 0.
    args = GSPOConfig(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        num_generations=2,
        steps_per_generation=2,
        use_cpu=True,
        report_to="none",
    )
    with pytest.raises(ValueError, match=r"train_dataset has 2 prompts, but one rollout takes 4: .* 1 processes"):
        GSPOTrainer(tiny_model_dir, ok_reward, args=args, train_dataset=Dataset.from_dict({"prompt": ["a", "b"]}))


def test_training_passes_with_a_whole_micro_batch_quantile_are_refused_by_name(tmp_path, tiny_model_dir):
    # The entropy quantile spans the whole micro-batch: a budget set by hand is refused, the default keeps one pass.
    dataset = Dataset.from_dict({"prompt": [f"What is {i} + 1?" for i in range(8)]})
    with pytest.raises(ValueError, match="max_tokens_per_pass=64 cannot train a micro-batch in several passes"):
        GSPOTrainer(
            tiny_model_dir,
            count_digits,
            train_dataset=dataset,
            args=small_config(tmp_path, top_entropy_quantile=0.2, max_tokens_per_pass=64),
        )
    from gspo_trl.training.passes import pass_budget

    assert pass_budget(small_config(tmp_path, top_entropy_quantile=0.2), "cuda", router_aux_loss=False) is None
    assert pass_budget(small_config(tmp_path), "cuda", router_aux_loss=True) is None
    assert pass_budget(small_config(tmp_path), "cuda", router_aux_loss=False) == 8192


def test_reward_processing_classes_is_public_as_in_trl(tmp_path, tiny_model_dir, tiny_tokenizer):
    # TRL's GRPOTrainer exposes one processing class per reward function (None for plain callables).
    from test_rewards import build_reward_model

    reward_model = build_reward_model(tiny_tokenizer)
    trainer = GSPOTrainer(
        tiny_model_dir,
        [reward_model, count_digits],
        args=config(tmp_path),
        train_dataset=Dataset.from_dict({"prompt": ["a"] * 8}),
        reward_processing_classes=[tiny_tokenizer, None],
    )
    assert trainer.reward_processing_classes == [tiny_tokenizer, None]

"""gspo_trl/data/streaming.py: a stream reordered into the sampler's order (checked against `RepeatSampler` itself), its
checks, and training, evaluation and resuming on a `datasets.IterableDataset` (two processes:
tests/models/test_distributed.py)."""

from __future__ import annotations

import json
import os

import pytest
import torch
from datasets import Dataset, IterableDataset
from helpers import count_digits, small_config, text_dataset

from gspo_trl import GSPOTrainer
from gspo_trl.data.checks import RowCollator
from gspo_trl.data.streaming import check_stream, check_stream_resume, repeat_groups, stream_in_sampler_order
from gspo_trl.training.schedule import RolloutSchedule


def test_repeat_groups_repeats_each_row_then_the_batch():
    batch = {"prompt": ["a", "b"], "answer": ["1", "2"]}
    repeated = repeat_groups(batch, prompts=2, group_size=3, uses=2)
    once = ["a", "a", "a", "b", "b", "b"]
    assert repeated["prompt"] == once + once
    assert repeated["answer"] == ["1"] * 3 + ["2"] * 3 + ["1"] * 3 + ["2"] * 3


def test_repeat_groups_drops_a_short_last_batch_and_copies_messages():
    assert repeat_groups({"prompt": ["a"]}, prompts=2, group_size=2, uses=1) == {"prompt": []}
    messages = [{"role": "user", "content": "hi"}]
    repeated = repeat_groups({"prompt": [messages]}, prompts=1, group_size=2, uses=1)["prompt"]
    repeated[0][0]["content"] = "changed"
    assert repeated[1][0]["content"] == "hi"  # no repeat shares the other's messages


def test_unshuffled_stream_comes_in_the_samplers_order(tmp_path):
    # 10 prompts, generation batches of 8 rows = 2 prompts × 4, each used 2 × 1 times: the sampler's index order.
    args = small_config(tmp_path, steps_per_generation=2, shuffle_dataset=False)
    dataset = text_dataset(10)
    expected = [dataset[index]["prompt"] for index in RolloutSchedule(args).train_sampler(dataset)]
    streamed = [row["prompt"] for row in stream_in_sampler_order(dataset.to_iterable_dataset(), True, args)]
    assert streamed == expected
    assert len(streamed) == 5 * 8 * 2  # 5 generation batches of 2 prompts, 8 rows each, twice


def test_eval_stream_repeats_each_prompt_num_generations_eval_times(tmp_path):
    args = small_config(tmp_path, num_generations_eval=2, per_device_eval_batch_size=2)
    rows = [row["prompt"] for row in stream_in_sampler_order(text_dataset(5).to_iterable_dataset(), False, args)]
    assert len(rows) == 10 and all(rows[i] == rows[i + 1] for i in range(0, 10, 2))
    assert sorted(set(rows)) == sorted(text_dataset(5)["prompt"])  # shuffled, each prompt once


def test_stream_checks_name_the_field(tmp_path):
    stream = text_dataset().to_iterable_dataset()
    with pytest.raises(ValueError, match="set max_steps"):
        check_stream(stream, "train_dataset", small_config(tmp_path, max_steps=-1))
    check_stream(stream, "eval_dataset", small_config(tmp_path, max_steps=-1))  # evaluation reads it to its end
    with pytest.raises(ValueError, match="Iterable datasets require `dispatch_batches=False`: train_dataset is a"):
        check_stream(stream, "train_dataset", small_config(tmp_path, accelerator_config={"dispatch_batches": True}))

    class TorchStream(torch.utils.data.IterableDataset):
        def __iter__(self):
            yield {"prompt": "hi"}

    with pytest.raises(TypeError, match="must be a datasets.IterableDataset"):
        check_stream(TorchStream(), "train_dataset", small_config(tmp_path))


def test_a_row_without_prompt_is_refused_as_it_arrives():
    with pytest.raises(ValueError, match=r"no 'prompt' column.*\['question'\]"):
        RowCollator(needs_prompt=True)([{"question": "hi"}])
    assert RowCollator(needs_prompt=False)([{"question": "hi"}]) == [{"question": "hi"}]


def streamed_prompts(n=16):
    def rows():
        for i in range(n):
            yield {"prompt": f"What is {i} + {i + 1}?"}

    return IterableDataset.from_generator(rows)  # no features known before the first row


def recording(trainer) -> list[list[str]]:
    """The prompts of each rollout `trainer` samples."""
    sampled, generate = [], trainer.rollout_backend.generate
    trainer.rollout_backend.generate = lambda prompts, *rest: sampled.append(list(prompts)) or generate(prompts, *rest)
    return sampled


@pytest.mark.slow  # training runs
def test_train_and_evaluate_on_streams(tmp_path, tiny_model_dir):
    args = small_config(tmp_path, max_steps=4, steps_per_generation=2, eval_strategy="steps", eval_steps=4)
    args.dataloader_num_workers = 2  # read by one worker all the same (a warning)
    trainer = GSPOTrainer(
        tiny_model_dir, count_digits, args=args, train_dataset=streamed_prompts(), eval_dataset=streamed_prompts(3)
    )
    sampled = recording(trainer)
    trainer.train()
    assert trainer.state.global_step == 4
    train, evaluation = sampled[:2], sampled[2:]
    # 2 rollouts of 2 prompts × 4 completions, each prompt's group whole and new
    assert [len(rollout) for rollout in train] == [8, 8]
    groups = [rollout[start : start + 4] for rollout in train for start in (0, 4)]
    assert all(len(set(group)) == 1 for group in groups) and len({group[0] for group in groups}) == 4
    # evaluation: 3 prompts × 4 completions (num_generations) in batches of 8 rows (the last filled from the first)
    assert sorted({prompt for batch in evaluation for prompt in batch}) == [f"What is {i} + {i + 1}?" for i in range(3)]
    eval_logs = [entry for entry in trainer.state.log_history if "eval_loss" in entry]
    assert len(eval_logs) == 1 and "eval_reward" in eval_logs[0]
    assert args.dataloader_num_workers == 0  # set at construction, as TRL does


def test_a_training_stream_gets_trls_settings_at_construction(tmp_path, tiny_model_dir, caplog):
    args = small_config(tmp_path, max_steps=1, dataloader_num_workers=4)
    assert args.accelerator_config.dispatch_batches is None
    trainer = GSPOTrainer(tiny_model_dir, count_digits, args=args, train_dataset=streamed_prompts())
    assert trainer.args.dataloader_num_workers == 0 and trainer.args.accelerator_config.dispatch_batches is False
    assert trainer.accelerator.dataloader_config.dispatch_batches is False
    assert "dataloader_num_workers=4 is set to 0" in caplog.text


def test_an_evaluation_stream_leaves_a_map_style_training_dataset_its_workers(tmp_path, tiny_model_dir):
    args = small_config(tmp_path, dataloader_num_workers=2)
    trainer = GSPOTrainer(
        tiny_model_dir, count_digits, args=args, train_dataset=text_dataset(), eval_dataset=streamed_prompts(2)
    )
    assert trainer.args.accelerator_config.dispatch_batches is False  # any stream: each process reads its own slice
    assert trainer.get_train_dataloader().num_workers == 2
    assert trainer.get_eval_dataloader().num_workers == 0  # the stream's loader only
    assert trainer.args.dataloader_num_workers == 2


def test_dispatch_batches_with_a_stream_is_refused_in_trls_words_before_the_model_loads(tmp_path):
    args = small_config(tmp_path, accelerator_config={"dispatch_batches": True})
    for datasets in ({"train_dataset": streamed_prompts()}, {"eval_dataset": {"s": streamed_prompts()}}):
        datasets.setdefault("train_dataset", text_dataset())
        with pytest.raises(ValueError, match="Iterable datasets require `dispatch_batches=False`"):
            GSPOTrainer("no/such-model", count_digits, args=args, **datasets)


def test_a_stream_without_max_steps_is_refused_before_the_model_loads(tmp_path):
    with pytest.raises(ValueError, match="set max_steps"):
        GSPOTrainer(
            "no/such-model", count_digits, args=small_config(tmp_path, max_steps=-1), train_dataset=streamed_prompts()
        )


@pytest.mark.slow  # training runs
def test_resuming_on_a_stream_continues_with_the_prompts_of_the_uninterrupted_run(tmp_path, tiny_model_dir):
    # Rollouts at steps 0, 2, 4 (steps_per_generation=2, one micro-step per optimizer step); a checkpoint at each step.
    args = small_config(tmp_path, max_steps=6, steps_per_generation=2, save_strategy="steps", save_steps=1)
    whole = GSPOTrainer(tiny_model_dir, count_digits, args=args, train_dataset=streamed_prompts())
    whole_rollouts = recording(whole)
    whole.train()
    assert len(whole_rollouts) == 3
    for checkpoint, resampled in (("checkpoint-2", whole_rollouts[1:]), ("checkpoint-3", whole_rollouts[2:])):
        resumed = GSPOTrainer(tiny_model_dir, count_digits, args=args, train_dataset=streamed_prompts())
        rollouts = recording(resumed)
        resumed.train(resume_from_checkpoint=os.path.join(args.output_dir, checkpoint))
        # The stream is read again from its start and the trained micro-batches skipped: the same next prompts.
        # From checkpoint-3 (inside the rollout of steps 2-3) the saved rollout continues and step 4 samples anew.
        assert resumed.state.global_step == 6
        assert rollouts == resampled


def test_resuming_after_a_second_pass_over_the_stream_is_refused(tmp_path):
    checkpoint = tmp_path / "checkpoint-9"
    checkpoint.mkdir()
    (checkpoint / "trainer_state.json").write_text(json.dumps({"epoch": 1.25}))
    with pytest.raises(ValueError, match="read the stream to its end"):
        check_stream_resume(str(checkpoint), streamed_prompts())
    check_stream_resume(str(checkpoint), Dataset.from_dict({"prompt": ["a"]}))  # map-style: Trainer's own resume
    (checkpoint / "trainer_state.json").write_text(json.dumps({"epoch": 1.0}))  # one pass, ended at max_steps
    check_stream_resume(str(checkpoint), streamed_prompts())

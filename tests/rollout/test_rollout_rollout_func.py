"""`rollout_func` (TRL's custom rollouts): the output checks and the `Rollout` built from it, by hand; then the
same function trained under TRL 1.16's `GRPOTrainer` and `GSPOTrainer` side by side, and a function that samples
from the trainer's own backend."""

import math
import types

import pytest
import torch

from gspo_trl.rollout.rollout_func import check_rollout_func, rollout_from_output

PAD, EOS = 0, 2


def output(**overrides):
    values = {
        "prompt_ids": [[5, 6], [7]],
        "completion_ids": [[10, 11, EOS], [12, 13, 14, 15]],
        "logprobs": [[-0.5, -1.0, -0.1], [-2.0, None, -0.2, -0.3]],
    }
    values.update(overrides)
    return values


def build(values, keep_logprobs=False):
    return rollout_from_output(values, 2, PAD, [EOS], keep_logprobs)


def test_rollout_pads_prompts_left_and_completions_right_and_keeps_every_returned_token():
    rollout, columns = build(output(completion_ids=[[10, EOS, 11, EOS], [12]], logprobs=None))
    assert rollout.prompt_ids.tolist() == [[5, 6], [PAD, 7]]
    assert rollout.prompt_mask.tolist() == [[1, 1], [0, 1]]
    # An EOS inside a completion (between turns) does not end it: the function's tokens are the completion.
    assert rollout.completion_ids.tolist() == [[10, EOS, 11, EOS], [12, PAD, PAD, PAD]]
    assert rollout.completion_mask.tolist() == [[1, 1, 1, 1], [1, 0, 0, 0]]
    assert rollout.is_truncated.tolist() == [False, True]  # TRL: truncated when the last token is no EOS / pad
    assert rollout.env_mask is None and rollout.sampling_logps is None and columns == {}


def test_logprobs_become_the_sampling_engines_only_when_kept():
    assert build(output())[0].sampling_logps is None  # checked, not used: the trained model sampled
    logps = build(output(), keep_logprobs=True)[0].sampling_logps
    assert logps.dtype == torch.float32 and logps.shape == (2, 4)
    assert logps[0].tolist() == pytest.approx([-0.5, -1.0, -0.1, 0.0])
    assert math.isnan(logps[1, 1]) and logps[1, [0, 2, 3]].tolist() == pytest.approx([-2.0, -0.2, -0.3])


def test_env_mask_marks_the_tokens_not_trained_on():
    rollout, _ = build(output(env_mask=[[1, 0, 1], [1, 1, 0, 0]]))
    assert rollout.env_mask.tolist() == [[1, 0, 1, 0], [1, 1, 0, 0]]
    assert rollout.sampled_mask.tolist() == [[1, 0, 1, 0], [1, 1, 0, 0]]


def test_extra_keys_become_reward_columns():
    _, columns = build(output(answer=["3", "4"], task="add", env_reward=torch.tensor([1.0, 0.0])))
    assert columns["answer"] == ["3", "4"]
    assert columns["task"] == ["add", "add"]  # not a list: the same value for every completion (TRL)
    assert len(columns["env_reward"]) == 2


def test_tensors_are_accepted_for_token_rows():
    rollout, _ = build(
        output(
            prompt_ids=torch.tensor([[5, 6], [7, 8]]),
            completion_ids=[torch.tensor([10, EOS]), torch.tensor([12])],
            logprobs=None,
        )
    )
    assert rollout.completion_ids.tolist() == [[10, EOS], [12, PAD]]


@pytest.mark.parametrize(
    "values, error, match",
    [
        (["not", "a dict"], TypeError, "must return a dict"),
        ({"prompt_ids": [[1], [1]], "completion_ids": [[1], [1]]}, ValueError, r"keys \['logprobs'\]"),
        (output(completion_ids=[[10, EOS]]), ValueError, "returned 1 completion_ids for 2 prompts"),
        (output(prompt_ids="5 6"), TypeError, "prompt_ids must be a list"),
        (
            output(completion_ids=[[10, "a"], [12]], logprobs=None),
            TypeError,
            r"completion_ids\[0\] must be a list of token",
        ),
        (output(completion_ids=[[10, EOS], []], logprobs=None), ValueError, r"completion_ids\[1\] is empty"),
        (output(logprobs=[[-0.5], [-1.0, -1.0, -1.0, -1.0]]), ValueError, r"logprobs\[0\] must have one value per"),
        (output(logprobs=[[-0.5, 1.5, -0.1], [-2.0, -1.0, -0.2, -0.3]]), ValueError, r"log-probabilities"),
        (output(env_mask=[[1, 2, 1], [1, 1, 1, 1]]), ValueError, r"env_mask\[0\] must hold 0 or 1"),
        (output(env_mask=[[1, 1, 1], [0, 0, 0, 0]]), ValueError, r"no sampled token .* \[1\]"),
        (output(answer=["3"]), ValueError, "'answer' has 1 values for 2 completions"),
        (output(completions=["a", "b"]), ValueError, r"\['completions'\].*rename"),
    ],
)
def test_bad_output_names_rollout_func_and_the_key(values, error, match):
    with pytest.raises(error, match=match):
        build(values)


def test_what_rollout_func_cannot_be_combined_with():
    args = types.SimpleNamespace(async_rollouts=False, layout_independent_sampling=False)
    check_rollout_func(None, args, episodes=True)
    check_rollout_func(lambda prompts, trainer: {}, args, episodes=False)
    with pytest.raises(TypeError, match="must be a callable"):
        check_rollout_func("generate", args, episodes=False)
    with pytest.raises(ValueError, match="cannot be combined with tools, environment_factory or env_factory"):
        check_rollout_func(lambda p, t: {}, args, episodes=True)
    with pytest.raises(ValueError, match="set async_rollouts=False"):
        check_rollout_func(
            lambda p, t: {},
            types.SimpleNamespace(async_rollouts=True, layout_independent_sampling=False),
            episodes=False,
        )
    with pytest.raises(ValueError, match="set layout_independent_sampling=False"):
        check_rollout_func(
            lambda p, t: {},
            types.SimpleNamespace(async_rollouts=False, layout_independent_sampling=True),
            episodes=False,
        )


# --- in training -------------------------------------------------------------------------------------------------


def scripted_rollout_func(prompts, trainer):
    """A TRL-style rollout_func that does not sample (the same tokens under any trainer): an answer turn, an
    environment reply the model did not write (env_mask 0), and a second turn; the environment's reward as an
    extra key."""
    tokenizer = trainer.processing_class
    eos = tokenizer.eos_token_id
    prompt_ids, completion_ids, env_mask, env_reward = [], [], [], []
    for index, prompt in enumerate(prompts):
        answer = tokenizer(f" {index} {index + 1}", add_special_tokens=False)["input_ids"]
        reply = tokenizer(" wrong, again", add_special_tokens=False)["input_ids"]
        retry = tokenizer(f" {3 * index}", add_special_tokens=False)["input_ids"] + [eos]
        prompt_ids.append(tokenizer(prompt, add_special_tokens=False)["input_ids"])
        completion_ids.append(answer + reply + retry)
        env_mask.append([1] * len(answer) + [0] * len(reply) + [1] * len(retry))
        env_reward.append(float(index % 2) + 0.25 * index)
    return {
        "prompt_ids": prompt_ids,
        "completion_ids": completion_ids,
        "logprobs": None,
        "env_mask": env_mask,
        "env_reward": env_reward,
    }


def reward_from_environment(completions, env_reward, **kwargs):
    return env_reward


def test_side_by_side_with_trl_grpo_trainer(tmp_path):
    """The same rollout_func and reward function under TRL 1.16's GRPOTrainer (GSPO mode) and GSPOTrainer log the
    same rewards and token counts, and one SGD step moves the weights the same way: so the environment's tokens
    are left out of the loss and of the sequence length on both sides (a GSPOTrainer that trained on them moved
    the weights with cosine 0.93 to TRL's, measured). Directions, not bits: TRL 1.16 scores tokens through
    transformers' fused LM head, whose fp32 log-probs differ from a plain forward's by up to 2e-3 (measured)."""
    import os
    import warnings

    from conftest import build_tiny_model, build_tiny_tokenizer
    from datasets import Dataset
    from helpers import small_config
    from trl import GRPOConfig, GRPOTrainer

    from gspo_trl import GSPOTrainer

    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    tokenizer = build_tiny_tokenizer()
    data = Dataset.from_dict({"prompt": [f"What is {i} + 1?" for i in range(4)]})
    common = dict(
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=32,
        max_steps=1,
        steps_per_generation=1,
        optim="sgd",
        learning_rate=1e-2,
        loss_type="grpo",
        importance_sampling_level="sequence",
        epsilon=3e-4,
        epsilon_high=4e-4,
        beta=0.0,
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        seed=0,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trl = GRPOTrainer(
            model=build_tiny_model(tokenizer),
            reward_funcs=[reward_from_environment],
            train_dataset=data,
            processing_class=tokenizer,
            rollout_func=scripted_rollout_func,
            args=GRPOConfig(output_dir=str(tmp_path / "trl"), **common),
        )
    ours = GSPOTrainer(
        build_tiny_model(tokenizer),
        [reward_from_environment],
        train_dataset=data,
        processing_class=tokenizer,
        rollout_func=scripted_rollout_func,
        args=small_config(tmp_path / "gspo", **common),
    )
    start = torch.cat([p.detach().flatten() for p in ours.model.parameters()])
    trl.train()
    ours.train()

    theirs_log, ours_log = trl.state.log_history[0], ours.state.log_history[0]
    for name in (
        "reward",
        "reward_std",
        "completions/mean_length",
        "completions/max_length",
        "completions/clipped_ratio",
        "rewards/reward_from_environment/mean",
        "grad_norm",
    ):
        assert ours_log[name] == pytest.approx(theirs_log[name], rel=5e-3), name
    assert ours_log["completions/mean_length"] == 4.375  # the sampled tokens alone, not the environment's reply
    ours_step = torch.cat([p.detach().flatten() for p in ours.model.parameters()]) - start
    theirs_step = torch.cat([p.detach().flatten() for p in trl.model.parameters()]) - start
    assert torch.nn.functional.cosine_similarity(ours_step, theirs_step, dim=0) > 0.9999
    assert ours_step.norm() / theirs_step.norm() == pytest.approx(1.0, abs=1e-3)


def test_a_rollout_func_sampling_from_the_trainers_backend_trains(tmp_path, tiny_model_dir):
    """The documented pattern: sample with `trainer.rollout_backend` (the trained model here, the synced vLLM server
    with use_vllm), add what the reward functions need."""
    from helpers import small_config, text_dataset

    from gspo_trl import GSPOTrainer

    seen = []

    def rollout_func(prompts, trainer):
        tokenizer = trainer.processing_class
        prompt_ids = [tokenizer(p)["input_ids"] for p in prompts]
        rollout = trainer.rollout_backend.generate_from_ids(prompt_ids, max_new_tokens=8)
        completion_ids = [
            ids[mask.bool()].tolist() for ids, mask in zip(rollout.completion_ids, rollout.completion_mask)
        ]
        seen.append(len(prompts))
        return {
            "prompt_ids": prompt_ids,
            "completion_ids": completion_ids,
            "logprobs": None,
            "length": [len(ids) for ids in completion_ids],
        }

    def shorter_is_better(completions, length, answer, **kwargs):
        assert len(length) == len(answer) == len(completions)
        return [-n / 8 for n in length]

    trainer = GSPOTrainer(
        tiny_model_dir,
        shorter_is_better,
        train_dataset=text_dataset(),
        args=small_config(tmp_path, steps_per_generation=1),
        rollout_func=rollout_func,
    )
    trainer.train()
    assert seen == [4, 4]  # this process's prompts, each already repeated num_generations times
    history = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert len(history) == 2 and all(math.isfinite(entry["loss"]) for entry in history)
    assert all(-1.0 <= entry["rewards/shorter_is_better/mean"] < 0 for entry in history)


def test_trainer_refuses_rollout_func_with_episodes(tmp_path, tiny_model_dir):
    from helpers import count_digits, small_config, text_dataset

    from gspo_trl import GSPOTrainer

    with pytest.raises(ValueError, match="cannot be combined with tools"):
        GSPOTrainer(
            tiny_model_dir,
            count_digits,
            train_dataset=text_dataset(),
            args=small_config(tmp_path),
            rollout_func=lambda prompts, trainer: {},
            tools=[math.sqrt],
        )

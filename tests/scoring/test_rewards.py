"""Tests for gspo_trl.scoring.rewards: calling convention, async concurrency, validation errors, reward models."""

import asyncio
import functools
import gc
import math
import time
import warnings

import numpy as np
import pytest
import torch
from conftest import build_tiny_tokenizer
from transformers import LlamaConfig, LlamaForSequenceClassification, TrainerState

from gspo_trl.scoring.rewards import (
    RewardFunction,
    RewardModelFunction,
    compute_rewards,
    load_reward_funcs,
    resolve_reward_weights,
)

PROMPTS = ["a", "bb", "ccc", "dddd"]
COMPLETIONS = ["x", "yy", "zzz", "w"]
COMPLETION_IDS = [[1], [2, 2], [3, 3, 3], [4]]


def score(funcs, columns=None, trainer_state=None, prompts=PROMPTS, completions=COMPLETIONS):
    return compute_rewards(load_reward_funcs(funcs), prompts, completions, COMPLETION_IDS, columns, trainer_state)


def length_reward(completions, **kwargs):
    return [float(len(c)) for c in completions]


# ---- calling convention ---------------------------------------------------------------------------------------------


def test_sync_function_and_table_shape():
    def one(prompts, **kwargs):
        return [1] * len(prompts)

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every row has a reward: no warning
        rewards = score([length_reward, one])
    assert rewards.dtype == torch.float32 and rewards.shape == (4, 2)
    assert rewards[:, 0].tolist() == [1.0, 2.0, 3.0, 1.0]
    assert rewards[:, 1].tolist() == [1.0] * 4


def test_kwargs_arrive():
    seen = {}

    def spy(prompts, completions, completion_ids, answer, trainer_state, **kwargs):
        seen.update(prompts=prompts, completions=completions, ids=completion_ids, answer=answer, state=trainer_state)
        return [0.0] * len(prompts)

    state = TrainerState(global_step=7)
    score(spy, columns={"answer": ["1", "2", "3", "4"]}, trainer_state=state)
    assert seen["prompts"] == PROMPTS and seen["completions"] == COMPLETIONS and seen["ids"] == COMPLETION_IDS
    assert seen["answer"] == ["1", "2", "3", "4"]
    assert seen["state"] is state and seen["state"].global_step == 7


def test_names_and_single_item():
    class Judge:
        def __call__(self, completions, **kwargs):
            return [0.0] * len(completions)

    funcs = load_reward_funcs([length_reward, Judge(), functools.partial(length_reward)])
    assert [f.name for f in funcs] == ["length_reward", "Judge", "length_reward"]
    assert len(load_reward_funcs(length_reward)) == 1
    wrapped = RewardFunction(length_reward, name="custom")
    assert load_reward_funcs([wrapped])[0] is wrapped


def test_accepts_numpy_tensor_bool_and_tuple():
    rewards = score(
        [
            lambda prompts, **kw: np.array([1.0, 2.0, 3.0, 4.0]),
            lambda prompts, **kw: torch.tensor([0.5, 0.5, 0.5, 0.5]),
            lambda prompts, **kw: (True, False, 1, np.float32(2.5)),
        ]
    )
    assert rewards.tolist() == [[1.0, 0.5, 1.0], [2.0, 0.5, 0.0], [3.0, 0.5, 1.0], [4.0, 0.5, 2.5]]


# ---- async ----------------------------------------------------------------------------------------------------------


def make_sleepy(name, spans):
    async def sleepy(prompts, **kwargs):
        start = time.perf_counter()
        await asyncio.sleep(0.2)
        spans[name] = (start, time.perf_counter())
        return [1.0] * len(prompts)

    sleepy.__name__ = name
    return sleepy


def test_async_functions_run_concurrently():
    spans = {}
    rewards = score([make_sleepy("a", spans), length_reward, make_sleepy("b", spans)])
    assert rewards[:, 0].tolist() == [1.0] * 4 and rewards[:, 1].tolist() == [1.0, 2.0, 3.0, 1.0]
    (start_a, end_a), (start_b, end_b) = spans["a"], spans["b"]
    assert start_b < end_a and start_a < end_b  # the two sleeps overlap in time


def test_async_callable_class_and_sync_returning_awaitable():
    class AsyncJudge:
        async def __call__(self, prompts, **kwargs):
            return [2.0] * len(prompts)

    async def later(n):
        return [3.0] * n

    rewards = score([AsyncJudge(), lambda prompts, **kw: later(len(prompts))])
    assert rewards.tolist() == [[2.0, 3.0]] * 4


def test_error_after_sync_returned_awaitable_leaves_nothing_unawaited():
    async def later(n):
        return [3.0] * n

    def crashes(prompts, **kwargs):
        raise RuntimeError("down")

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(ValueError, match="'crashes' raised RuntimeError"):
            score([lambda prompts, **kw: later(len(prompts)), crashes])
        gc.collect()
    assert not [w for w in caught if "never awaited" in str(w.message)]


def test_async_inside_running_event_loop():
    spans = {}

    async def notebook_cell():  # a running loop in this thread, as in Jupyter
        return score([make_sleepy("a", spans), make_sleepy("b", spans)])

    rewards = asyncio.run(notebook_cell())
    assert rewards.shape == (4, 2)
    assert spans["b"][0] < spans["a"][1]


# ---- None handling and weights --------------------------------------------------------------------------------------


def test_none_becomes_nan_and_warns_once():
    def sometimes(prompts, **kwargs):
        return [1.0, None, None, 0.0]

    def other(prompts, **kwargs):
        return [None, 2.0, None, None]

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rewards = score([sometimes, other])
    assert math.isnan(rewards[1, 0]) and math.isnan(rewards[0, 1]) and torch.isnan(rewards[2]).all()
    messages = [str(w.message) for w in caught]
    assert len(messages) == 1 and "1 of 4 completions got no reward" in messages[0]
    assert "zero advantage" in messages[0]


def test_resolve_reward_weights():
    assert resolve_reward_weights(None, 3).tolist() == [1.0, 1.0, 1.0]
    weights = resolve_reward_weights([0.5, 2], 2)
    assert weights.dtype == torch.float32 and weights.tolist() == [0.5, 2.0]
    with pytest.raises(ValueError, match="reward_weights has 3 values but there are 2 reward functions"):
        resolve_reward_weights([1, 2, 3], 2)


# ---- validation errors ----------------------------------------------------------------------------------------------


def returning(value):
    def bad_reward(prompts, **kwargs):
        return value

    return bad_reward


@pytest.mark.parametrize(
    "output, pattern",
    [
        ([1.0, 2.0, 3.0], r"reward function 'bad_reward' returned 3 rewards for 4 completions"),
        ([1.0, float("nan"), 0.0, 0.0], r"'bad_reward' returned nan at index 1.*return None for 'not applicable'"),
        ([1.0, 0.0, float("-inf"), 0.0], r"'bad_reward' returned -inf at index 2.*return None"),
        ([1.0, 0.0, 0.0, "good"], r"'bad_reward' returned a non-number at index 3: 'good' \(str\)"),
        ([[1.0], 0.0, 0.0, 0.0], r"'bad_reward' returned a non-number at index 0"),
        ({"a": 1.0}, r"'bad_reward' returned dict; expected a list"),
        (2.0, r"'bad_reward' returned float; expected a list"),
        (np.zeros((4, 1)), r"'bad_reward' returned an array of shape \(4, 1\)"),
    ],
)
def test_bad_outputs(output, pattern):
    with pytest.raises(ValueError, match=pattern):
        score([length_reward, returning(output)])


async def async_crashes(prompts, **kwargs):
    raise ZeroDivisionError("division by zero")


def sync_crashes(prompts, **kwargs):
    raise ZeroDivisionError("division by zero")


@pytest.mark.parametrize("crashes", [sync_crashes, async_crashes])
def test_exception_inside_function_is_wrapped(crashes):
    pattern = rf"reward function '{crashes.__name__}' raised ZeroDivisionError.*sample indices 0\.\.3"
    with pytest.raises(ValueError, match=pattern) as info:
        score([length_reward, crashes])
    assert isinstance(info.value.__cause__, ZeroDivisionError)


def test_batch_columns_and_processing_class_checks():
    with pytest.raises(ValueError, match="completion_ids"):
        compute_rewards(load_reward_funcs(length_reward), PROMPTS, COMPLETIONS, COMPLETION_IDS[:2])
    with pytest.raises(ValueError, match="columns.*trainer_state"):
        score(length_reward, columns={"trainer_state": [0] * 4})
    with pytest.raises(ValueError, match="reward_processing_classes has 2 entries but there are 1"):
        load_reward_funcs([length_reward], reward_processing_classes=[None, None])


@pytest.mark.parametrize("item", [3, None, torch.nn.Linear(2, 1)])
def test_bad_reward_func_type(item):
    with pytest.raises(TypeError, match=r"reward_funcs\[1\].*callable.*PreTrainedModel.*string"):
        load_reward_funcs([length_reward, item])


# ---- reward models --------------------------------------------------------------------------------------------------


build_tokenizer = build_tiny_tokenizer


def build_reward_model(tokenizer):
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, num_labels=1,
    )  # fmt: skip
    config.pad_token_id = tokenizer.pad_token_id
    return LlamaForSequenceClassification(config).eval()


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


@pytest.fixture(scope="module")
def reward_model(tokenizer):
    return build_reward_model(tokenizer)


def manual_scores(model, tokenizer, texts):
    inputs = tokenizer(texts, return_tensors="pt", padding=True, padding_side="right", add_special_tokens=False)
    with torch.no_grad():
        return model(**inputs).logits[:, 0].tolist()


def test_reward_model_scores_match_manual_forward(reward_model, tokenizer):
    funcs = load_reward_funcs([reward_model, length_reward], reward_processing_classes=[tokenizer, None])
    assert isinstance(funcs[0], RewardModelFunction) and not funcs[0].model.training
    rewards = compute_rewards(funcs, PROMPTS, COMPLETIONS, COMPLETION_IDS)
    texts = [p + c for p, c in zip(PROMPTS, COMPLETIONS)]
    assert rewards[:, 0].tolist() == pytest.approx(manual_scores(reward_model, tokenizer, texts), abs=1e-5)
    # right padding must not change a score: a short (padded in the batch) text scored alone gives the same value
    assert rewards[0, 0].item() == pytest.approx(manual_scores(reward_model, tokenizer, [texts[0]])[0], abs=1e-5)


def test_reward_model_conversational_uses_chat_template(reward_model, tokenizer):
    prompts = [[{"role": "user", "content": "What is two plus two?"}], [{"role": "user", "content": "hello"}]]
    completions = [[{"role": "assistant", "content": "four"}], [{"role": "assistant", "content": "world"}]]
    funcs = load_reward_funcs(reward_model, reward_processing_classes=tokenizer)
    rewards = compute_rewards(funcs, prompts, completions, [[1], [2]])
    texts = [
        "<|im_start|>user\nWhat is two plus two?<|im_end|>\n<|im_start|>assistant\nfour<|im_end|>\n",
        "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\nworld<|im_end|>\n",
    ]
    assert funcs[0]._text(prompts[0], completions[0]) == texts[0]
    assert rewards[:, 0].tolist() == pytest.approx(manual_scores(reward_model, tokenizer, texts), abs=1e-5)


def test_tokenizer_without_pad_gets_eos():
    tokenizer = build_tokenizer(with_pad=False)
    assert tokenizer.pad_token_id is None
    funcs = load_reward_funcs(build_reward_model(tokenizer), reward_processing_classes=tokenizer)
    assert tokenizer.pad_token == tokenizer.eos_token == "<|im_end|>"
    assert funcs[0].model.config.pad_token_id == tokenizer.eos_token_id


def test_reward_model_from_saved_path(tmp_path, tokenizer):
    model = build_reward_model(tokenizer)
    path = tmp_path / "tiny-rm"
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    funcs = load_reward_funcs(str(path))  # tokenizer comes from the same path
    assert isinstance(funcs[0], RewardModelFunction) and funcs[0].name == "tiny-rm" and not funcs[0].model.training
    rewards = compute_rewards(funcs, PROMPTS, COMPLETIONS, COMPLETION_IDS)
    texts = [p + c for p, c in zip(PROMPTS, COMPLETIONS)]
    assert rewards[:, 0].tolist() == pytest.approx(manual_scores(model, tokenizer, texts), abs=1e-5)

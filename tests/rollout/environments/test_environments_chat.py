"""Tests for gspo_trl.rollout.environments.chat: the tokens an observation adds after an assistant turn."""

import pytest
from conftest import build_tiny_tokenizer
from trl.chat_template_utils import qwen3_chat_template

from gspo_trl.rollout.environments.chat import ObservationEncoder


def test_user_observation_after_a_chatml_turn(tiny_tokenizer):
    encoder = ObservationEncoder(tiny_tokenizer, True, [tiny_tokenizer.eos_token_id])
    assert (
        tiny_tokenizer.decode(encoder("Try again."))
        == "\n<|im_start|>user\nTry again.<|im_end|>\n<|im_start|>assistant\n"
    )
    # A template without tool support gets tool results as user messages.
    tool = encoder([{"role": "tool", "name": "add", "content": "5"}])
    assert (
        tiny_tokenizer.decode(tool)
        == "\n<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )


def test_a_template_that_is_not_prefix_preserving_uses_trls_training_version():
    # Qwen3 drops the empty thinking block of earlier assistant turns: rendered as is, the history would change.
    tokenizer = build_tiny_tokenizer()
    tokenizer.chat_template = qwen3_chat_template
    encoder = ObservationEncoder(tokenizer, True, [tokenizer.eos_token_id])
    assert encoder.chat_template is not None
    assert tokenizer.decode(encoder("Again.")) == "\n<|im_start|>user\nAgain.<|im_end|>\n<|im_start|>assistant\n"


def test_text_prompts_get_the_observation_tokens(tiny_tokenizer):
    encoder = ObservationEncoder(tiny_tokenizer, False, [tiny_tokenizer.eos_token_id])
    assert encoder(" Again.") == tiny_tokenizer(" Again.", add_special_tokens=False)["input_ids"]


def test_a_template_without_an_end_of_turn_token_is_refused(tiny_tokenizer):
    with pytest.raises(ValueError, match="end-of-turn token"):
        ObservationEncoder(tiny_tokenizer, True, [12345])

"""The rollout record's helpers: prompt rendering and its checks, EOS masks and truncation flags."""

from __future__ import annotations

import pytest
import torch

from gspo_trl.rollout import completion_mask_from_eos, render_prompts
from gspo_trl.rollout.types import check_messages


def test_completion_mask_keeps_tokens_through_first_eos():
    ids = torch.tensor([[5, 6, 2, 7, 2], [5, 6, 7, 8, 9], [2, 0, 0, 0, 0]])
    mask, truncated = completion_mask_from_eos(ids, [2])
    assert mask.tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]]
    assert truncated.tolist() == [False, True, False]
    mask, truncated = completion_mask_from_eos(ids, [9, 8])  # several EOS ids
    assert mask[1].tolist() == [1, 1, 1, 1, 0] and truncated.tolist() == [True, False, True]


def test_render_prompts_uses_chat_template_for_messages(tiny_tokenizer):
    texts = render_prompts(["plain text", [{"role": "user", "content": "hi"}]], tiny_tokenizer)
    assert texts[0] == "plain text"
    assert texts[1] == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize(
    "message, match",
    [
        ({"role": "user"}, "message 0 \\('user'\\) has no 'content'"),
        ({"role": "user", "content": None}, "has no 'content'"),
        ({"content": "hi"}, "string 'role'"),
    ],
)
def test_a_message_the_template_would_render_empty_is_refused_naming_it(tiny_tokenizer, message, match):
    with pytest.raises(ValueError, match=match):
        render_prompts(["plain", [message]], tiny_tokenizer)


def test_an_assistant_message_with_tool_calls_may_have_no_content():
    # Chat templates with tool support (Qwen2.5's, for one) render such a message from its calls.
    call = {"type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}
    check_messages([{"role": "user", "content": "1+2?"}, {"role": "assistant", "tool_calls": [call]}])
    with pytest.raises(ValueError, match="'assistant'"):
        check_messages([{"role": "user", "content": "1+2?"}, {"role": "assistant"}])


@pytest.mark.parametrize(
    "prompt, error, match",
    [
        (None, TypeError, "must be a string or a list of chat messages, got NoneType"),
        ("", ValueError, "empty string"),
        ([], ValueError, "empty list of messages"),
        ([{"role": "system", "content": "Be brief."}], ValueError, "last message has role 'system'"),
        ([{"role": "user", "content": ["hi"]}], ValueError, "content part that is not a dict"),
    ],
)
def test_a_prompt_that_is_not_prompt_text_is_refused_as_it_is_rendered(tiny_tokenizer, prompt, error, match):
    # Streamed datasets are checked here, as their rows arrive; map-style ones at construction (data.checks).
    with pytest.raises(error, match=match):
        render_prompts(["plain", prompt], tiny_tokenizer)
    # A prefilled assistant answer is continued, as in TRL; a whitespace prompt is still text.
    render_prompts(["  ", [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "The"}]], tiny_tokenizer)

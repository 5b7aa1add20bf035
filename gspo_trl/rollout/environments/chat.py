"""How an environment's observation joins an episode's token ids after an assistant turn.

The history of an episode stays token ids (never decoded and re-tokenized, which could change the tokens the model
sampled). An observation is appended as the tokens the chat template puts after a finished assistant turn: the user
message and the next generation prompt. They are found once per template by rendering a short conversation with and
without the message (TRL does the same for tool results) and cutting after the assistant's end-of-turn token, which
is where sampling stopped. Text prompts (no chat template) get the observation's own tokens.

A template that renders earlier assistant turns differently from the last one (Qwen3 drops an empty thinking block)
is not prefix-preserving: then TRL's prefix-preserving training version of the template renders observations, as
TRL does for tools.

An observation may also be a list of messages (tool results: ``{"role": "tool", "name": ..., "content": ...}``).
A template that renders tool calls and tool messages (TRL's `supports_tool_calling`) gets them as they are; any
other template gets each result as a user message wrapped in ``<tool_response>`` tags.
"""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase
from trl.chat_template_utils import (
    get_training_chat_template,
    is_chat_template_prefix_preserving,
    supports_tool_calling,
)


class ObservationEncoder:
    """`encoder(text)`: the token ids that show `text` to the model as the next user message."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        conversational: bool,
        end_of_turn_ids: list[int],
        chat_template_kwargs: dict | None = None,
    ):
        self.tokenizer = tokenizer
        self.conversational = conversational
        self.end_of_turn_ids = set(end_of_turn_ids)
        self.chat_template_kwargs = chat_template_kwargs or {}
        self.chat_template = None
        if conversational and not is_chat_template_prefix_preserving(tokenizer):
            self.chat_template = get_training_chat_template(tokenizer)
        self._history = [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Hello."}]
        self._prefix = self._history_ids(self._history) if conversational else None
        self._native_tools = None  # whether the template renders tool messages, checked on first use

    def _render(self, messages: list[dict], add_generation_prompt: bool) -> list[int]:
        ids = self.tokenizer.apply_chat_template(
            messages,
            tokenize=True,
            add_generation_prompt=add_generation_prompt,
            return_dict=False,
            chat_template=self.chat_template,
            **self.chat_template_kwargs,
        )
        return list(ids)

    def _history_ids(self, history: list[dict]) -> list[int]:
        prefix = self._render(history, add_generation_prompt=False)
        ends = [i for i, token in enumerate(prefix) if token in self.end_of_turn_ids]
        if not ends:
            raise ValueError(
                "The chat template does not end an assistant turn with an end-of-turn token the sampler stops at "
                f"({sorted(self.end_of_turn_ids)}), so observations cannot be appended after a turn as token ids. "
                "Set the tokenizer's eos_token (or generation_config.eos_token_id) to the template's end-of-turn token."
            )
        return prefix[: ends[-1] + 1]  # what sampling produced: the turn up to and including its end-of-turn token

    def __call__(self, observation: str | list[dict]) -> list[int]:
        if isinstance(observation, str):
            messages = [{"role": "user", "content": observation}]
        else:
            messages = observation
        if not self.conversational:
            text = "".join(_as_user_message(m)["content"] for m in messages)
            return self.tokenizer(text, add_special_tokens=False)["input_ids"]
        history, prefix = self._history, self._prefix
        if any(m["role"] == "tool" for m in messages):
            if self._native_tools is None:
                self._native_tools = supports_tool_calling(self.tokenizer)
            if self._native_tools:
                # Templates that render tool results may need the assistant's call (e.g. for the tool's name).
                calls = [
                    {"type": "function", "function": {"name": m.get("name", "tool"), "arguments": {}}}
                    for m in messages
                    if m["role"] == "tool"
                ]
                history = [self._history[0], {"role": "assistant", "content": "", "tool_calls": calls}]
                prefix = self._history_ids(history)
            else:
                messages = [_as_user_message(m) for m in messages]
        full = self._render(history + messages, add_generation_prompt=True)
        if full[: len(prefix)] != prefix:
            raise ValueError(
                "The chat template renders a conversation differently once a user message follows the assistant's "
                "turn (the earlier tokens change), so observations cannot be appended as token ids."
            )
        return full[len(prefix) :]


def _as_user_message(message: dict) -> dict:
    if message["role"] != "tool":
        return message
    return {"role": "user", "content": f"<tool_response>\n{message['content']}\n</tool_response>"}

"""The rollout record and the backend interface: what every way of sampling hands the trainer.

Owns `Rollout` (sampled completions aligned with their prompts), `SampledRollout` (a rollout before it is
scored), the `RolloutBackend` interface the backends implement (`hf`, `vllm_server`, `vllm_colocate`; `episodes`
plays multi-turn episodes on any of them), and the prompt helpers they share: chat-template rendering,
tokenization with left padding, and the EOS bookkeeping of completions. What it does not own: how
completions are sampled, rewards, advantages and log-probabilities.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import GenerationConfig, PreTrainedTokenizerBase
from trl.data_utils import is_conversational, maybe_apply_chat_template

from ..models.multimodal import VisionInputs

# The keyword arguments every reward function receives (TRL's); a dataset column or a rollout_func field of one of
# these names would be shadowed, so both are refused.
RESERVED_REWARD_KWARGS = ("prompts", "completions", "completion_ids", "trainer_state", "log_metric", "log_extra")


@dataclass
class Rollout:
    """One batch of sampled completions, aligned row by row with the prompts that produced them."""

    prompt_ids: torch.Tensor  # (N, P) left-padded
    prompt_mask: torch.Tensor  # (N, P) 1 on real prompt tokens
    completion_ids: torch.Tensor  # (N, C) right-padded
    completion_mask: torch.Tensor  # (N, C) 1 up to and including the first EOS
    is_truncated: torch.Tensor  # (N,) bool: no EOS within max_completion_length
    # (N, C) log-probs of the sampled tokens under the engine that sampled them, where it recorded them; 0 on
    # padding, NaN where the engine gave none. None otherwise. `sampled_by_policy` says which engine: another one
    # (a vLLM server: the importance-sampling correction's input), or the trained model's own decoding loop, whose
    # log-probs are π_old itself (`decode_logprobs_as_old`).
    sampling_logps: torch.Tensor | None = None
    # Multi-turn episodes (`episodes`): (N, C) 1 on the tokens the model sampled, 0 on the environment's
    # (observations between turns), and (N, C) the assistant turn (0, 1, ...) of each sampled token, -1 elsewhere.
    # None for single-turn rollouts, where every completion token is sampled and there is one turn.
    env_mask: torch.Tensor | None = None
    turn_ids: torch.Tensor | None = None
    # From `generate_from_ids`: per row, what the backend kept to continue the row in its next call (the KV cache
    # of the decoding loop, `decoding.dynamic.RowState`), None where nothing was kept; None for backends that keep
    # nothing.
    states: list | None = None
    sampled_by_policy: bool = False
    # (N, C) where the trained model's decoding loop truncated (top-k, top-p, min-p): the log of the policy's mass it
    # kept at each token (0 on padding). Its `sampling_logps`, where recorded, are then the truncated, renormalised
    # log-probs it drew with, and `decoding.truncation.policy_logps` the policy's own. None where nothing was cut.
    kept_log_mass: torch.Tensor | None = None
    # The decoding loop that sampled the rows on the trained model (and recorded `sampling_logps`, where it did):
    # "static" (a static KV cache, `decoding.static`) or "dynamic" (`decoding.dynamic`); None for others (generate,
    # vLLM).
    decoding_loop: str | None = None
    # A vision-language model's prompt images (the processor's fields), once per prompt (`multimodal`); None for text.
    vision: VisionInputs | None = None
    # Mixture-of-Experts models sampled by the decoding loop: (N, P + C, L, k) the experts each position was routed
    # to, aligned with prompt then completion, -1 where not recorded (`moe.replay.rollout_routes`). None otherwise.
    sampling_routes: torch.Tensor | None = None

    @property
    def sampled_mask(self) -> torch.Tensor:
        """(N, C) 1 on the tokens the model sampled: the completion without an environment's observations."""
        return self.completion_mask if self.env_mask is None else self.completion_mask * self.env_mask

    def to(self, device) -> Rollout:
        return Rollout(
            **{
                name: value.to(device) if isinstance(value, torch.Tensor | VisionInputs) else value
                for name, value in vars(self).items()
            }
        )

    def model_inputs(self) -> dict[str, torch.Tensor]:
        """The log-prob inputs of these completions: prompt + completion ids and attention, the sampled tokens
        scored."""
        return {
            "input_ids": torch.cat([self.prompt_ids, self.completion_ids], dim=1),
            "attention_mask": torch.cat([self.prompt_mask, self.completion_mask], dim=1),
            "completion_ids": self.completion_ids,
            "completion_mask": self.sampled_mask,
        }


@dataclass
class EpisodeBatch:
    """A batch of finished episodes, row by row with the dataset rows that started them."""

    rollout: Rollout  # completions hold every turn and observation; env_mask and turn_ids tell them apart
    prompts: list  # each episode's first prompt (the row's prompt with the reset observation)
    turn_rewards: torch.Tensor  # (N, K) the reward after each assistant turn, 0 past an episode's end
    reached: torch.Tensor  # (N, K) bool, the turns each episode played
    completions: list  # for reward functions: the messages after the prompt, or the completion's text
    completion_ids: list[list[int]]  # every completion token (turns and observations), as TRL passes them
    environments: list  # each episode's environment, in its final state (reward functions get `environments=`)
    ends: list[str]  # why each episode ended (`END_REASONS`)
    tool_calls: torch.Tensor  # (N,) tool calls per episode (0 without tools)
    tool_failures: torch.Tensor  # (N,) tool calls that failed (an error result)


@dataclass
class SampledRollout:
    """A rollout before it is scored: the completions (or episodes) and the prompts they answer."""

    rollout: Rollout
    prompts: list
    episodes: EpisodeBatch | None = None  # multi-turn episodes (`episodes`)
    old_logps: torch.Tensor | None = None  # (N, C) π_old, where the sampling weights will be gone before training
    reward_columns: dict[str, list] = field(default_factory=dict)  # extra reward kwargs (`rollout_func`'s keys)


class RolloutBackend(ABC):
    """What the trainer needs from a generator."""

    # True when completions are sampled by the trained model in this process: the trainer then runs generation
    # under its precision context and, under ZeRO-3, with gathered weights.
    samples_with_training_model = True

    def update_weights(self, model, global_step: int) -> None:  # noqa: B027 (a no-op by default)
        """Called before every rollout with the (wrapped) policy: an engine with its own copy of the weights
        refreshes it when they changed since it last did (`global_step` counts optimizer steps). Every process
        calls it."""

    def avoid_loop(self, loop: str) -> None:  # noqa: B027 (a no-op by default)
        """Stop sampling with decoding loop `loop` (a `Rollout.decoding_loop`), whose log-probs the log-prob check
        found to be other than the model's (`logprob_check`); a backend that has no such loop ignores it."""

    @abstractmethod
    def generate(self, prompts: list[Any], stream_keys: torch.Tensor | None = None) -> Rollout:
        """Sample one completion per prompt (prompts arrive already repeated num_generations times).

        With `stream_keys` ((N,) int64, see `stream_keys`), row i's randomness depends on its key and
        token position only, so it samples the same completion in any batch, on any number of processes.
        """

    def generate_from_ids(
        self,
        prompt_ids: list[list[int]],
        max_new_tokens: int,
        stream_keys: torch.Tensor | None = None,
        states: list | None = None,
    ) -> Rollout:
        """Sample one completion of at most `max_new_tokens` after each token-id prompt: the next assistant turn of
        a multi-turn episode, whose history is kept as token ids (never re-tokenized). `states`: for each row that
        continues a row of an earlier call, that call's `Rollout.states` entry (None elsewhere); a backend may
        use them to skip recomputing what it computed then."""
        raise NotImplementedError(f"{type(self).__name__} cannot continue token-id prompts (multi-turn episodes).")


def render_prompts(
    prompts: list[Any],
    tokenizer: PreTrainedTokenizerBase,
    chat_template_kwargs=None,
    tools: list[list[dict] | None] | None = None,
) -> list[str]:
    """Prompt texts: conversational prompts go through the chat template with a generation prompt (and, per
    prompt, the JSON schemas of the tools the template should present)."""
    for prompt in prompts:
        check_prompt(prompt)
    tools = tools or [None] * len(prompts)
    return [
        maybe_apply_chat_template(
            {"prompt": prompt}, tokenizer, tools=prompt_tools or None, **(chat_template_kwargs or {})
        )["prompt"]
        for prompt, prompt_tools in zip(prompts, tools)
    ]


# The roles a prompt may end with: the chat template adds the assistant's turn after a user or tool message, or
# continues an assistant message (a prefilled answer), as TRL's `apply_chat_template` does.
LAST_PROMPT_ROLES = ("user", "tool", "assistant")


def check_prompt(prompt: Any) -> None:
    """A `TypeError` or `ValueError` for a prompt that is not prompt text: anything but a non-empty string or a
    non-empty list of chat messages (`check_messages`) whose last message is a user, tool or assistant one. Raised
    before the tokenizer or the chat template meets it, where the error would not say which value was wrong."""
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError(
                "The prompt is an empty string: no token would precede the completion. Remove empty prompts, e.g. "
                "dataset.filter(lambda row: row['prompt'])."
            )
        return
    if not isinstance(prompt, list | tuple):
        raise TypeError(
            f"The prompt must be a string or a list of chat messages, got {type(prompt).__name__}: {prompt!r:.100}. "
            "Fill every row's 'prompt' with text (dataset.filter drops the others)."
        )
    if not prompt:
        raise ValueError("The prompt is an empty list of messages. Give every conversational prompt a user message.")
    check_messages(prompt)
    if prompt[-1]["role"] not in LAST_PROMPT_ROLES:
        raise ValueError(
            f"The prompt's last message has role {prompt[-1]['role']!r}, after which the chat template cannot start "
            "the assistant's turn: end every prompt with a 'user', 'tool' or 'assistant' message."
        )


def check_messages(messages: list) -> None:
    """A `ValueError` naming the message a chat template would render wrongly without a word: one that is not a
    dict with a string 'role' and a 'content' (a string, or a list of content parts). An assistant message that
    carries 'tool_calls' may have no content, as chat templates allow."""
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ValueError(f"Prompt message {index} must be a dict with a string 'role'; got {message!r:.200}.")
        content = message.get("content")
        if isinstance(content, list):
            check_content_parts(index, message["role"], content)
            continue
        if isinstance(content, str) or (content is None and message.get("tool_calls")):
            continue
        raise ValueError(
            f"Prompt message {index} ({message['role']!r}) has no 'content' (a string, or a list of content parts), "
            f"so the chat template would render it as empty: {message!r:.200}. Give every message a 'content'."
        )


def check_content_parts(index: int, role: str, parts: list) -> None:
    """A `ValueError` naming a content part that is not a dict with a string 'type' ({"type": "text", ...},
    {"type": "image"}, ...), which chat templates and processors read parts by."""
    for part in parts:
        if not isinstance(part, dict) or not isinstance(part.get("type"), str):
            raise ValueError(
                f"Prompt message {index} ({role!r}) has a content part that is not a dict with a string 'type': "
                f"{part!r:.100}. Write content parts as {{'type': 'text', 'text': ...}}."
            )


def tokenize_prompts(
    prompts: list[Any],
    tokenizer: PreTrainedTokenizerBase,
    max_prompt_length: int | None,
    chat_template_kwargs=None,
    tools: list[list[dict] | None] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(prompt_ids, prompt_mask), (N, P) left-padded, truncated from the left to `max_prompt_length`."""
    texts = render_prompts(prompts, tokenizer, chat_template_kwargs, tools)
    # Chat templates already carry the special tokens; plain text prompts get none added either, matching TRL.
    encoded = tokenizer(texts, return_tensors="pt", padding=True, padding_side="left", add_special_tokens=False)
    prompt_ids, prompt_mask = encoded["input_ids"], encoded["attention_mask"]
    if max_prompt_length is not None and prompt_ids.shape[1] > max_prompt_length:
        prompt_ids = prompt_ids[:, -max_prompt_length:]
        prompt_mask = prompt_mask[:, -max_prompt_length:]
    return prompt_ids, prompt_mask


def left_pad(sequences: list[list[int]], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, mask), (N, L) left-padded to the longest sequence."""
    length = max(1, max(len(ids) for ids in sequences))
    ids = torch.full((len(sequences), length), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), length), dtype=torch.long)
    for row, tokens in enumerate(sequences):
        if tokens:
            ids[row, length - len(tokens) :] = torch.tensor(tokens, dtype=torch.long)
            mask[row, length - len(tokens) :] = 1
    return ids, mask


def completion_mask_from_eos(
    completion_ids: torch.Tensor, eos_token_ids: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """(mask, is_truncated): the mask keeps tokens up to and including the first EOS of each row."""
    is_eos = torch.isin(completion_ids, torch.tensor(eos_token_ids, device=completion_ids.device))  # (N, C)
    length = completion_ids.shape[1]
    first_eos = torch.where(is_eos.any(dim=1), is_eos.int().argmax(dim=1), length)  # (N,)
    positions = torch.arange(length, device=completion_ids.device).expand_as(completion_ids)
    mask = (positions <= first_eos.unsqueeze(1)).long()
    return mask, ~is_eos.any(dim=1)


def eos_token_ids_of(generation_config: GenerationConfig, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    eos = generation_config.eos_token_id if generation_config.eos_token_id is not None else tokenizer.eos_token_id
    if eos is None:
        raise ValueError("The tokenizer and generation config define no eos_token_id: completions could never end.")
    return [eos] if isinstance(eos, int) else list(eos)


def is_conversational_prompt(prompt: Any) -> bool:
    return is_conversational({"prompt": prompt})

"""TRL's `rollout_func`: completions sampled by the user's own function instead of a rollout backend.

`rollout_func(prompts, trainer) -> dict` is called on every process with that process's prompts, each repeated
`num_generations` times as the sampler yields them, and returns one completion per prompt entry (TRL 1.16's
contract):

- "prompt_ids", "completion_ids": token-id lists, one per prompt entry;
- "logprobs": the sampling engine's log-prob of every completion token (None where it gave none), or None;
- optionally "env_mask": 1 on the tokens the model sampled, 0 on tokens something else inserted (an
  environment's reply): those are not trained on and do not count in the sequence length;
- any other key goes to the reward functions as a keyword argument: a list gives one value per completion,
  anything else the same value to every completion.

This module owns checking that output (errors name `rollout_func` and the key) and turning it into a `Rollout`.
It does not own sampling: the function may call `trainer.rollout_backend` (the trained model or the vLLM server,
whose weights are synced before every rollout as for built-in sampling) or anything else.
"""

from __future__ import annotations

import copy
import math
import numbers
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from .types import RESERVED_REWARD_KWARGS, Rollout, SampledRollout, eos_token_ids_of, left_pad

REQUIRED_KEYS = ("prompt_ids", "completion_ids", "logprobs")


def sample_with_rollout_func(rollout_func, trainer, prompts: list) -> SampledRollout:
    """Call the user's function on this process's prompts (a copy: it may edit them) and check what it returned."""
    output = rollout_func(copy.deepcopy(prompts), trainer)
    model = trainer.accelerator.unwrap_model(trainer.model)
    tokenizer = trainer.processing_class
    rollout, columns = rollout_from_output(
        output,
        len(prompts),
        tokenizer.pad_token_id,
        eos_token_ids_of(model.generation_config, tokenizer),
        keep_logprobs=trainer.args.use_vllm,
    )
    return SampledRollout(rollout.to(trainer.accelerator.device), prompts, reward_columns=columns)


def rollout_from_output(
    output: Any, num_prompts: int, pad_token_id: int, eos_token_ids: list[int], keep_logprobs: bool
) -> tuple[Rollout, dict[str, list]]:
    """(rollout, reward columns) from what `rollout_func` returned for `num_prompts` prompt entries.

    A completion is every token the function returned (an EOS inside it, e.g. between turns, does not end it);
    it counts as truncated when its last token is not an EOS or the pad token, as in TRL. `keep_logprobs`: keep
    "logprobs" as the sampling engine's log-probs (used for the vLLM sampling correction), else only check them.
    """
    if not isinstance(output, Mapping):
        raise TypeError(
            f"rollout_func must return a dict with keys {list(REQUIRED_KEYS)}, got {type(output).__name__}."
        )
    missing = [key for key in REQUIRED_KEYS if key not in output]
    if missing:
        raise ValueError(
            f"rollout_func must return the keys {missing} in its output dict (it returned {sorted(output)})."
        )
    prompt_ids = _token_lists(output["prompt_ids"], "prompt_ids", num_prompts)
    completion_ids = _token_lists(output["completion_ids"], "completion_ids", num_prompts)
    lengths = [len(ids) for ids in completion_ids]
    env_mask = output.get("env_mask")
    if env_mask is not None:
        env_mask = _aligned_rows(env_mask, "env_mask", lengths, _mask_value)
        empty = [row for row, mask in enumerate(env_mask) if not any(mask)]
        if empty:
            raise ValueError(
                f"rollout_func returned an env_mask with no sampled token (no 1) in completion(s) "
                f"{empty[:5]}: each completion needs at least one token the model sampled."
            )
    logprobs = output["logprobs"]
    if logprobs is not None:
        logprobs = _aligned_rows(logprobs, "logprobs", lengths, _logprob_value)

    prompt_ids, prompt_mask = left_pad(prompt_ids, pad_token_id)
    width = max(lengths)
    ids = torch.full((num_prompts, width), pad_token_id, dtype=torch.long)
    completion_mask = torch.zeros((num_prompts, width), dtype=torch.long)
    for row, tokens in enumerate(completion_ids):
        ids[row, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        completion_mask[row, : len(tokens)] = 1
    ends = set(eos_token_ids) | {pad_token_id}
    is_truncated = torch.tensor([tokens[-1] not in ends for tokens in completion_ids])
    rollout = Rollout(
        prompt_ids,
        prompt_mask,
        ids,
        completion_mask,
        is_truncated,
        sampling_logps=_right_pad(logprobs, width, 0.0, torch.float32)
        if keep_logprobs and logprobs is not None
        else None,
        env_mask=_right_pad(env_mask, width, 0, torch.long) if env_mask is not None else None,
    )
    return rollout, _reward_columns(output, num_prompts)


def _token_lists(value: Any, key: str, num_prompts: int) -> list[list[int]]:
    rows = _rows(value, key, num_prompts)
    token_lists = []
    for row, ids in enumerate(rows):
        ids = ids.tolist() if isinstance(ids, torch.Tensor) else ids
        if not isinstance(ids, Sequence) or isinstance(ids, str) or not all(_is_int(t) for t in ids):
            raise TypeError(f"rollout_func's {key}[{row}] must be a list of token ids (ints), got {ids!r:.80}.")
        if not ids:
            raise ValueError(f"rollout_func's {key}[{row}] is empty: every prompt and completion needs a token.")
        token_lists.append([int(t) for t in ids])
    return token_lists


def _aligned_rows(value: Any, key: str, lengths: list[int], convert) -> list[list]:
    """Rows of per-token values, each as long as its completion."""
    rows = _rows(value, key, len(lengths))
    aligned = []
    for row, (values, length) in enumerate(zip(rows, lengths)):
        values = values.tolist() if isinstance(values, torch.Tensor) else values
        if not isinstance(values, Sequence) or len(values) != length:
            got = len(values) if isinstance(values, Sequence) else type(values).__name__
            raise ValueError(
                f"rollout_func's {key}[{row}] must have one value per completion token ({length}), got {got}."
            )
        aligned.append([convert(v, key, row) for v in values])
    return aligned


def _rows(value: Any, key: str, num_prompts: int) -> list:
    if isinstance(value, torch.Tensor):
        value = list(value)
    if not isinstance(value, Sequence) or isinstance(value, str):
        raise TypeError(f"rollout_func's {key} must be a list with one entry per prompt, got {type(value).__name__}.")
    if len(value) != num_prompts:
        raise ValueError(
            f"rollout_func returned {len(value)} {key} for {num_prompts} prompts: it gets each prompt "
            "already repeated num_generations times and must return one completion per entry."
        )
    return list(value)


def _mask_value(value: Any, key: str, row: int) -> int:
    if value not in (0, 1):
        raise ValueError(f"rollout_func's {key}[{row}] must hold 0 or 1, got {value!r}.")
    return int(value)


def _logprob_value(value: Any, key: str, row: int) -> float:
    if value is None:  # vLLM gives None where a log-prob is NaN; no correction there
        return math.nan
    if not isinstance(value, numbers.Real) or isinstance(value, bool) or value > 0:
        raise ValueError(
            f"rollout_func's {key}[{row}] must hold log-probabilities (floats <= 0 or None), got {value!r}."
        )
    return float(value)


def _is_int(token: Any) -> bool:
    return isinstance(token, numbers.Integral) and not isinstance(token, bool)


def _right_pad(rows: list[list], width: int, fill, dtype: torch.dtype) -> torch.Tensor:
    padded = torch.full((len(rows), width), fill, dtype=dtype)
    for row, values in enumerate(rows):
        padded[row, : len(values)] = torch.tensor(values, dtype=dtype)
    return padded


def _reward_columns(output: Mapping, num_prompts: int) -> dict[str, list]:
    """The extra keys, one value per completion, for the reward functions' keyword arguments."""
    extra = {key: value for key, value in output.items() if key not in (*REQUIRED_KEYS, "env_mask")}
    reserved = sorted(set(extra) & set(RESERVED_REWARD_KWARGS))
    if reserved:
        raise ValueError(
            f"rollout_func returned the key(s) {reserved}, which reward functions already receive from "
            "the trainer: rename them."
        )
    columns = {}
    for key, value in extra.items():
        if isinstance(value, list):
            if len(value) != num_prompts:
                raise ValueError(
                    f"rollout_func's {key!r} has {len(value)} values for {num_prompts} completions: a "
                    "list gives one value per completion (anything else is given to every completion)."
                )
            columns[key] = value
        else:
            columns[key] = [value] * num_prompts
    return columns


def check_rollout_func(rollout_func: Any, args, episodes: bool) -> None:
    """At construction: what `rollout_func` cannot be combined with, with the setting to change."""
    if rollout_func is None:
        return
    if not callable(rollout_func):
        raise TypeError(
            f"rollout_func must be a callable (prompts, trainer) -> dict, got {type(rollout_func).__name__}."
        )
    if episodes:
        raise ValueError(
            "rollout_func samples the completions itself: it cannot be combined with tools, "
            "environment_factory or env_factory, whose episodes the trainer plays. Pass one or the other."
        )
    if args.async_rollouts:
        raise ValueError(
            "async_rollouts=True samples the next rollout on a background thread, where rollout_func "
            "(which gets the trainer) cannot run safely: set async_rollouts=False with rollout_func."
        )
    if args.layout_independent_sampling:
        raise ValueError(
            "layout_independent_sampling=True keys the trainer's own sampling, but rollout_func samples "
            "with its own randomness: set layout_independent_sampling=False with rollout_func."
        )

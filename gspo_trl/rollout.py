"""Rollout backends: prompts in, sampled completion ids and masks out.

Owns prompt rendering (chat template for conversational prompts), tokenization with left padding,
the choice of decoding loop (`decoding.sample`, or transformers' `generate`) and of prefix sharing
(`prefix_sharing.py`), per-row random streams, and the EOS/truncation bookkeeping of the result.
The trainer only sees the `Rollout` record, so another backend (a vLLM server, vLLM colocated)
plugs in by implementing `RolloutBackend.generate`. What it does not own: rewards, advantages and
log-probabilities.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList, PreTrainedTokenizerBase
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)
from transformers.utils import logging
from trl.data_utils import is_conversational, maybe_apply_chat_template

from . import decode_memory, decoding, static_decoding
from .kv_cache import cache_kwargs
from .packing import padding_free_unsupported_reason
from .prefix_sharing import prefill, prefill_after_states, prefill_shared_prefixes, prefill_shared_prompts

if TYPE_CHECKING:  # environments import this module
    from .environments.episodes import EpisodeBatch

logger = logging.get_logger(__name__)


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
    # Multi-turn episodes (`environments.episodes`): (N, C) 1 on the tokens the model sampled, 0 on the environment's
    # (observations between turns), and (N, C) the assistant turn (0, 1, ...) of each sampled token, -1 elsewhere.
    # None for single-turn rollouts, where every completion token is sampled and there is one turn.
    env_mask: torch.Tensor | None = None
    turn_ids: torch.Tensor | None = None
    # From `generate_from_ids`: per row, what the backend kept to continue the row in its next call (the KV cache
    # of the decoding loop, `decoding.RowState`), None where nothing was kept; None for backends that keep nothing.
    states: list | None = None
    sampled_by_policy: bool = False
    # The decoding loop that sampled the rows on the trained model (and recorded `sampling_logps`, where it did):
    # "static" (a static KV cache, `static_decoding`) or "dynamic" (`decoding`); None for others (generate, vLLM).
    decoding_loop: str | None = None

    @property
    def sampled_mask(self) -> torch.Tensor:
        """(N, C) 1 on the tokens the model sampled: the completion without an environment's observations."""
        return self.completion_mask if self.env_mask is None else self.completion_mask * self.env_mask

    def to(self, device) -> Rollout:
        return Rollout(
            **{
                name: value.to(device) if isinstance(value, torch.Tensor) else value
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
class SampledRollout:
    """A rollout before it is scored: the completions (or episodes) and the prompts they answer."""

    rollout: Rollout
    prompts: list
    episodes: EpisodeBatch | None = None  # multi-turn episodes (`environments.episodes`)
    behaviour_logps: torch.Tensor | None = None  # (N, C) under the sampling weights, where those will be gone
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


def create_rollout_backend(args, tokenizer: PreTrainedTokenizerBase, accelerator, model_getter) -> RolloutBackend:
    """The backend `args` asks for: a vLLM server (`use_vllm`), or the trained model itself."""
    if args.use_vllm:
        from .vllm.backend import VLLMServerBackend

        return VLLMServerBackend(tokenizer, args, accelerator, model_getter())
    return HFGenerateBackend(model_getter, tokenizer, args)


def render_prompts(
    prompts: list[Any],
    tokenizer: PreTrainedTokenizerBase,
    chat_template_kwargs=None,
    tools: list[list[dict] | None] | None = None,
) -> list[str]:
    """Prompt texts: conversational prompts go through the chat template with a generation prompt (and, per
    prompt, the JSON schemas of the tools the template should present)."""
    tools = tools or [None] * len(prompts)
    return [
        maybe_apply_chat_template(
            {"prompt": prompt}, tokenizer, tools=prompt_tools or None, **(chat_template_kwargs or {})
        )["prompt"]
        for prompt, prompt_tools in zip(prompts, tools)
    ]


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


class HFGenerateBackend(RolloutBackend):
    """Sampling on the training model itself (KV cache on, eval mode), with gspo-trl's decoding loop
    (`decoding.sample`) or, for `decode_loop="generate"` and settings the loop does not implement, `model.generate`."""

    def __init__(self, model_getter, tokenizer: PreTrainedTokenizerBase, args):
        # `model_getter` returns the current, unwrapped policy: weights change between rollouts and
        # wrappers (DDP, DeepSpeed) can be replaced after construction.
        self.model_getter = model_getter
        self.tokenizer = tokenizer
        self.max_prompt_length = args.max_prompt_length
        self.chat_template_kwargs = args.chat_template_kwargs
        model = model_getter()
        sampling = {
            "do_sample": True,
            "max_new_tokens": args.max_completion_length,
            "temperature": args.temperature,
            "top_p": args.top_p,
            "top_k": args.top_k,
            "min_p": args.min_p,
            "repetition_penalty": args.repetition_penalty,
            "cache_implementation": args.cache_implementation,
            "pad_token_id": tokenizer.pad_token_id,
            "bos_token_id": tokenizer.bos_token_id,
            "eos_token_id": model.generation_config.eos_token_id or tokenizer.eos_token_id,
            "use_cache": True,
        }
        sampling.update(args.generation_kwargs or {})
        self.generation_config = GenerationConfig(**sampling)
        self.eos_token_ids = eos_token_ids_of(self.generation_config, tokenizer)
        # gspo-trl's loop unless the user asked for generate or for something only generate implements.
        unsupported = decoding.unsupported_settings(self.generation_config)
        self.use_decode_loop = args.decode_loop == "gspo" and not unsupported
        if args.decode_loop == "gspo" and unsupported:
            logger.warning(
                f"decode_loop='gspo' does not implement {', '.join(unsupported)} (from generation_kwargs "
                "or cache_implementation): sampling uses transformers' generate instead, which decodes "
                "finished completions to the longest one's length."
            )
        self.processors = decoding.logits_processors(self.generation_config)
        # The loop's log-probs of what it samples, at the temperature training scores with (π_old, where asked).
        self.logp_temperature = (
            args.temperature if self.use_decode_loop and records_decode_logprobs(args, model) else None
        )
        self.cuda_graphs = args.decode_cuda_graphs
        self._static_refusal_logged = False
        self.max_decode_rows = args.decode_max_rows
        # full_determinism: the same samples on every run, so no product form chosen by timing (decode_linear).
        self.timed_forms = not args.full_determinism
        self._slicing_logged = False
        # Prefill each prefix that rows share once (False: identical rows only), and continue an episode's row from
        # the KV cache of its previous turn (False: prefill it again); switches for benchmarks/episode_rollout.py.
        self.share_prefixes = True
        self.reuse_turn_cache = True

    def tokenize_prompts(self, prompts: list[Any]) -> tuple[torch.Tensor, torch.Tensor]:
        return tokenize_prompts(prompts, self.tokenizer, self.max_prompt_length, self.chat_template_kwargs)

    def avoid_loop(self, loop: str) -> None:
        if loop == "static":  # the dynamic loop, on the model's own cache and masks
            self.cuda_graphs = False
        elif loop == "dynamic":  # transformers' generate (which records no log-probs: π_old gets its forward pass)
            self.use_decode_loop, self.logp_temperature = False, None

    def generate(self, prompts: list[Any], stream_keys: torch.Tensor | None = None) -> Rollout:
        prompt_ids, prompt_mask = self.tokenize_prompts(prompts)
        return self._sample(prompt_ids, prompt_mask, stream_keys, self.generation_config.max_new_tokens)

    def generate_from_ids(
        self,
        prompt_ids: list[list[int]],
        max_new_tokens: int,
        stream_keys: torch.Tensor | None = None,
        states: list | None = None,
    ) -> Rollout:
        ids, mask = left_pad(prompt_ids, self.tokenizer.pad_token_id)
        return self._sample(ids, mask, stream_keys, max_new_tokens, states, keep_states=self.reuse_turn_cache)

    @torch.no_grad()
    def _sample(
        self, prompt_ids, prompt_mask, stream_keys, max_new_tokens: int, states=None, keep_states: bool = False
    ) -> Rollout:
        model = self.model_getter()
        prompt_ids, prompt_mask = prompt_ids.to(model.device), prompt_mask.to(model.device)
        keys = None if stream_keys is None else stream_keys.to(model.device)
        rows = prompt_ids.shape[0]
        step = self._rows_per_slice(model, rows, prompt_ids.shape[1] + max_new_tokens)
        was_training = model.training
        # Eval mode: with gradient checkpointing in training mode, transformers turns the KV cache off
        # (about 7x slower sampling).
        model.eval()
        try:
            sliced = [
                self._sample_rows(
                    model,
                    prompt_ids[part],
                    prompt_mask[part],
                    None if keys is None else keys[part],
                    max_new_tokens,
                    None if states is None else states[part],
                    keep_states,
                )
                for part in (slice(start, start + step) for start in range(0, max(rows, 1), step))
            ]
        finally:
            model.train(was_training)
        parts, loops = [part for part, _ in sliced], {loop for _, loop in sliced}
        pad = self.tokenizer.pad_token_id
        width = max(part.completion_ids.shape[1] for part in parts)
        completion_ids = torch.cat(
            [F.pad(part.completion_ids, (0, width - part.completion_ids.shape[1]), value=pad) for part in parts]
        )
        logps = None
        if all(part.logps is not None for part in parts):
            logps = torch.cat([F.pad(part.logps, (0, width - part.logps.shape[1])) for part in parts])
        kept = None if any(part.states is None for part in parts) else sum((part.states for part in parts), [])
        completion_mask, is_truncated = completion_mask_from_eos(completion_ids, self.eos_token_ids)
        # Tokens after the first EOS are padding; make them the pad id so decoding is clean.
        completion_ids = completion_ids.masked_fill(completion_mask == 0, pad)
        return Rollout(
            prompt_ids,
            prompt_mask,
            completion_ids,
            completion_mask,
            is_truncated,
            sampling_logps=logps,
            states=kept if keep_states else None,
            sampled_by_policy=logps is not None,
            decoding_loop=None if loops == {None} else "static" if "static" in loops else "dynamic",
        )

    def _rows_per_slice(self, model, rows: int, positions: int) -> int:
        """How many rows to decode at once: `decode_max_rows`, or on a GPU as many as the free memory holds."""
        if self.max_decode_rows is not None:
            return max(1, min(rows, self.max_decode_rows))
        free = decode_memory.free_device_bytes(model.device)
        per_position = decode_memory.kv_bytes_per_position(model.config, model.dtype)
        if free is None or per_position is None or rows <= 1:
            return max(rows, 1)
        per_row = positions * per_position
        # The turn caches episodes keep between turns are counted through the free memory measured at every turn.
        step = decode_memory.rows_per_slice(rows, per_row, int(free * decode_memory.KV_CACHE_MEMORY_FRACTION))
        if step < rows and not self._slicing_logged:
            logger.warning(
                f"The KV cache of {rows} rows × {positions} positions ({rows * per_row / 2**30:.1f} GiB) does not "
                f"fit {decode_memory.KV_CACHE_MEMORY_FRACTION:.0%} of the free device memory ({free / 2**30:.1f} "
                f"GiB): decoding in slices of {step} rows. Set decode_max_rows to choose."
            )
            self._slicing_logged = True
        return step

    def _sample_rows(
        self, model, prompt_ids, prompt_mask, keys, max_new_tokens, states, keep_states
    ) -> tuple[decoding.Decoded, str | None]:
        """One slice of rows, decoded together, and the decoding loop that sampled them (None: generate)."""
        if self.use_decode_loop:
            return self._sample_with_loop(model, prompt_ids, prompt_mask, keys, max_new_tokens, states, keep_states)
        return decoding.Decoded(self._sample_with_generate(model, prompt_ids, prompt_mask, keys, max_new_tokens)), None

    def _sample_with_loop(
        self, model, prompt_ids, prompt_mask, keys, max_new_tokens, states, keep_states
    ) -> tuple[decoding.Decoded, str]:
        def keyed_uniforms(rows, position):  # one uniform per row and position, from the row's own stream
            return keyed_uniform(keys[rows], position, 1).squeeze(1)

        uniforms = decoding.random_uniforms if keys is None else keyed_uniforms
        shared, pad = None, self.tokenizer.pad_token_id
        if _takes_gapped_rows(model):  # what rows share with others, or with their own last turn, runs once
            rows = [
                [token for token, keep in zip(ids, mask) if keep]  # one device-to-host copy, not one per row
                for ids, mask in zip(prompt_ids.tolist(), prompt_mask.tolist())
            ]
            if self.reuse_turn_cache and states is not None and all(state is not None for state in states):
                shared = prefill_after_states(model, rows, states, pad)
            if shared is None and self.share_prefixes:
                shared = prefill_shared_prefixes(model, rows, pad)
        else:
            keep_states = False  # the cache cannot be put back in another layout
        if shared is None:
            ids, mask, cache = prompt_ids, prompt_mask, prefill_shared_prompts(model, prompt_ids, prompt_mask)
        else:
            ids, mask, cache = shared
        sampling = dict(
            max_new_tokens=max_new_tokens,
            eos_token_ids=self.eos_token_ids,
            pad_token_id=pad,
            processors=self.processors,
            uniforms=uniforms,
            history=prompt_ids,
            keep_states=keep_states,
            logp_temperature=self.logp_temperature,
        )
        if self._uses_static_loop(ids.device):
            if cache is None:
                cache = prefill(model, ids, mask)
            reason = static_decoding.unsupported_reason(model, cache)
            if reason is None:
                graphs = ids.device.type == "cuda"
                return static_decoding.sample(model, ids, mask, cache=cache, graphs=graphs, **sampling), "static"
            if not self._static_refusal_logged:
                logger.warning(f"decode_cuda_graphs: decoding without CUDA graphs because of {reason}.")
                self._static_refusal_logged = True
        return decoding.sample(model, ids, mask, cache=cache, timed_forms=self.timed_forms, **sampling), "dynamic"

    def _uses_static_loop(self, device: torch.device) -> bool:
        # The static loop pays on a GPU only (CUDA graphs); tests run it on CPU by replacing this.
        return self.cuda_graphs and device.type == "cuda"

    def _sample_with_generate(self, model, prompt_ids, prompt_mask, keys, max_new_tokens) -> torch.Tensor:
        generation_config, processors = self.generation_config, None
        if max_new_tokens != generation_config.max_new_tokens:
            generation_config = GenerationConfig(**{**generation_config.to_dict(), "max_new_tokens": max_new_tokens})
        if keys is not None:
            # Greedy over Gumbel-perturbed, warped scores: an exact sample, drawn from the row's own stream.
            sampling = generation_config
            generation_config = GenerationConfig(
                **{
                    **sampling.to_dict(),
                    "do_sample": False,
                    "temperature": None,
                    "top_p": None,
                    "top_k": None,
                    "min_p": None,
                }
            )
            processors = LogitsProcessorList(
                [
                    KeyedGumbelSampler(
                        keys, prompt_ids.shape[1], sampling.temperature, sampling.top_k, sampling.top_p, sampling.min_p
                    )
                ]
            )
        cache = None
        if self.generation_config.cache_implementation is None:
            cache = prefill_shared_prompts(model, prompt_ids, prompt_mask)
        sequences = model.generate(
            input_ids=prompt_ids,
            attention_mask=prompt_mask,
            **cache_kwargs(model, cache),
            generation_config=generation_config,
            logits_processor=processors,
        )
        return sequences[:, prompt_ids.shape[1] :]


def records_decode_logprobs(args, model) -> bool:
    """Whether the decoding loop records its log-probs as π_old (`decode_logprobs_as_old`; unset: where sampling
    runs in full precision, so that they equal a training forward's to float32 rounding: float32 weights, no
    bf16/fp16 autocast, and no TF32 matrix products on a GPU)."""
    if args.decode_logprobs_as_old is not None:
        return args.decode_logprobs_as_old
    tf32 = getattr(args, "tf32", None) or (model.device.type == "cuda" and torch.backends.cuda.matmul.allow_tf32)
    return not (args.bf16 or args.fp16 or tf32) and model.dtype == torch.float32


def _takes_gapped_rows(model) -> bool:
    """Whether `model` reads position ids and a mask with gaps exactly (what packed training needs too)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return padding_free_unsupported_reason(base) is None


_GOLDEN = 0x9E3779B97F4A7C15


def _signed(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


def _shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> sign-extends)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def _mix64(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser on int64 tensors (multiplication wraps modulo 2^64)."""
    x = (x ^ _shift_right(x, 30)) * _signed(0xBF58476D1CE4E5B9)
    x = (x ^ _shift_right(x, 27)) * _signed(0x94D049BB133111EB)
    return x ^ _shift_right(x, 31)


def stream_keys(seed: int, *ids: torch.Tensor | int) -> torch.Tensor:
    """One int64 key per row from a seed and row identifiers (e.g. step, mode, global row index)."""
    key = _mix64(torch.tensor(seed, dtype=torch.int64))
    for value in ids:
        value = torch.as_tensor(value, dtype=torch.int64)
        key = _mix64(key ^ (value + _signed(_GOLDEN)))
    return key


def keyed_uniform(keys: torch.Tensor, position: int, vocab_size: int) -> torch.Tensor:
    """(N, V) float64 uniforms in (0, 1), a pure function of (key, position, token)."""
    step_keys = _mix64(keys ^ _mix64(torch.tensor(position, dtype=torch.int64, device=keys.device)))  # (N,)
    tokens = torch.arange(vocab_size, device=keys.device, dtype=torch.int64)
    bits = _mix64(step_keys.unsqueeze(1) ^ _mix64(tokens + _signed(_GOLDEN)).unsqueeze(0))  # (N, V)
    return (_shift_right(bits, 11).double() + 0.5) * 2.0**-53


class KeyedGumbelSampler(LogitsProcessor):
    """Sampling whose randomness belongs to each row: argmax(warped scores + Gumbel noise) is an exact
    sample of softmax(warped scores) (the Gumbel-max trick), and the noise is a function of the row's
    key, the completion position and the token, not of the batch or the process the row is in."""

    def __init__(self, keys, prompt_length, temperature, top_k, top_p, min_p):
        self.keys, self.prompt_length = keys, prompt_length
        self.warpers = []
        if temperature is not None and temperature != 1.0:
            self.warpers.append(TemperatureLogitsWarper(temperature))
        if top_k:
            self.warpers.append(TopKLogitsWarper(top_k))
        if top_p is not None and top_p < 1.0:
            self.warpers.append(TopPLogitsWarper(top_p))
        if min_p is not None:
            self.warpers.append(MinPLogitsWarper(min_p))

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        for warper in self.warpers:
            scores = warper(input_ids, scores)
        uniform = keyed_uniform(self.keys, input_ids.shape[1] - self.prompt_length, scores.shape[1])
        gumbel = -torch.log(-torch.log(uniform))
        return (scores.double() + gumbel).to(scores.dtype)


def is_conversational_prompt(prompt: Any) -> bool:
    return is_conversational({"prompt": prompt})

"""Rollouts: prompts in, sampled completions out, by whichever engine the config names.

`types` holds the record every backend returns and the interface they implement; `hf` samples on the trained model in
this process (its decoding loops live in `gspo_trl.rollout.decoding`); `vllm_server` asks a vLLM server;
`vllm_colocate` a vLLM
engine in this process; `episodes` plays multi-turn episodes on any backend; `rollout_func` takes TRL's user-written
rollout instead; `streams` gives each row its own random stream. The trainer asks for completions and hands over new
weights; it never learns which engine answered.
"""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

from ..models.context import check_budget_fits
from .episodes import EpisodeRunner, episode_runner_for
from .hf import HFGenerateBackend, records_decode_logprobs
from .streams import KeyedGumbelSampler, keyed_uniform, stream_keys
from .types import (
    EpisodeBatch,
    Rollout,
    RolloutBackend,
    SampledRollout,
    completion_mask_from_eos,
    eos_token_ids_of,
    is_conversational_prompt,
    left_pad,
    render_prompts,
    tokenize_prompts,
)

__all__ = [
    "EpisodeBatch",
    "EpisodeRunner",
    "episode_runner_for",
    "HFGenerateBackend",
    "KeyedGumbelSampler",
    "Rollout",
    "RolloutBackend",
    "SampledRollout",
    "completion_mask_from_eos",
    "create_rollout_backend",
    "eos_token_ids_of",
    "is_conversational_prompt",
    "keyed_uniform",
    "left_pad",
    "records_decode_logprobs",
    "render_prompts",
    "stream_keys",
    "tokenize_prompts",
]


def create_rollout_backend(
    args, tokenizer: PreTrainedTokenizerBase, accelerator, model_getter, processor=None
) -> RolloutBackend:
    """The backend `args` asks for: a vLLM server (`use_vllm`), a vLLM engine in this process (`vllm_mode="colocate"`),
    or the trained model itself (`processor`: a vision-language model's multimodal processor, which encodes its
    prompts). A prompt + completion budget past the model's context is refused first (`models.context`)."""
    check_budget_fits(model_getter().config, args.max_prompt_length, args.max_completion_length)
    if args.use_vllm and args.vllm_mode == "colocate":
        from .vllm_colocate import VLLMColocateBackend  # vLLM is imported only where an engine is built

        return VLLMColocateBackend(tokenizer, args, accelerator, model_getter())
    if args.use_vllm:
        from .vllm_server import VLLMServerBackend  # the server's client is imported only where one is used

        return VLLMServerBackend(tokenizer, args, accelerator, model_getter())
    return HFGenerateBackend(model_getter, tokenizer, args, processor)

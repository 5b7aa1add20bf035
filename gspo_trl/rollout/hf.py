"""The HF backend: sampling on the trained model itself, in this process.

Owns the choice of decoding loop (gspo-trl's dynamic loop `decoding.dynamic`, the static one with CUDA
graphs `decoding.static`, or transformers' `generate` for settings the loops do not implement), prefix
sharing (`decoding.prefix_sharing`), slicing rows to fit the KV cache in memory, and the EOS/truncation
bookkeeping of the result. What it does not own: the rollout record (`types`), the random streams
(`streams`), rewards, advantages and training log-probabilities.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.nn.functional as F
from transformers import GenerationConfig, LogitsProcessorList, PreTrainedTokenizerBase
from transformers.utils import logging

from ..models.context import check_prompts_fit, context_length
from ..models.moe.replay import pad_routes, rollout_routes, route_recorder_for
from ..models.multimodal import VisionInputs, encode_prompts
from ..models.packing import padding_free_unsupported_reason
from ..models.vision_features import images_encoded_once
from .decoding import cpu, dynamic, memory, static
from .decoding.kv_cache import cache_kwargs
from .decoding.prefix_sharing import prefill, prefill_after_states, prefill_shared_prefixes, prefill_shared_prompts
from .streams import KeyedGumbelSampler, keyed_uniform
from .types import Rollout, RolloutBackend, completion_mask_from_eos, eos_token_ids_of, left_pad, tokenize_prompts

logger = logging.get_logger(__name__)


class HFGenerateBackend(RolloutBackend):
    """Sampling on the training model itself (KV cache on, eval mode), with gspo-trl's decoding loop
    (`dynamic.sample`) or, for `decode_loop="generate"` and settings the loop does not implement, `model.generate`."""

    def __init__(self, model_getter, tokenizer: PreTrainedTokenizerBase, args, processor=None):
        # `model_getter` returns the current, unwrapped policy: weights change between rollouts and
        # wrappers (DDP, DeepSpeed) can be replaced after construction.
        self.model_getter = model_getter
        self.tokenizer = tokenizer
        self.processor = processor  # a vision-language model's: it encodes prompts with their images
        self.max_prompt_length = args.max_prompt_length
        self.chat_template_kwargs = args.chat_template_kwargs
        model = model_getter()
        self.context = context_length(model.config)  # a prompt + completion past it is refused (`models.context`)
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
        if processor is not None:  # an image token sampled in a completion would have no image features
            sampling["suppress_tokens"] = [image_token_id(processor, model)]
        sampling.update(args.generation_kwargs or {})
        self.generation_config = GenerationConfig(**sampling)
        self.eos_token_ids = eos_token_ids_of(self.generation_config, tokenizer)
        # gspo-trl's loop unless the user asked for generate or for something only generate implements. The loops
        # prefill text only: a vision-language model samples with generate, which passes the images to its prefill.
        unsupported = dynamic.unsupported_settings(self.generation_config)
        self.use_decode_loop = args.decode_loop == "gspo" and not unsupported and processor is None
        if args.decode_loop == "gspo" and unsupported and processor is None:
            logger.warning(
                f"decode_loop='gspo' does not implement {', '.join(unsupported)} (from generation_kwargs "
                "or cache_implementation): sampling uses transformers' generate instead, which decodes "
                "finished completions to the longest one's length."
            )
        self.processors = dynamic.logits_processors(self.generation_config)
        # The loop's log-probs of what it samples, at the temperature training scores with (π_old, where asked).
        self.logp_temperature = (
            args.temperature if self.use_decode_loop and records_decode_logprobs(args, model) else None
        )
        self.cuda_graphs = args.decode_cuda_graphs
        self._static_refusal_logged = False
        self.max_decode_rows = args.decode_max_rows
        # The dynamic loop's CPU accelerations (`cpu_decoding_kernels`, for the device the policy is on; None: none);
        # full_determinism: the same samples on every run, so no choice by timing. Benchmarks set their own.
        self.cpu_kernels = cpu.for_setting(args.cpu_decoding_kernels, model.device, args.full_determinism)
        self._slicing_logged = False
        # Prefill each prefix that rows share once (False: identical rows only), and continue an episode's row from
        # the KV cache of its previous turn (False: prefill it again); switches for benchmarks/episode_rollout.py.
        self.share_prefixes = True
        self.reuse_turn_cache = True
        # routing_replay replays the prompt's routes too (with "old", where π_old is the decoding loop's log-probs):
        # the loop then prefills each prompt row itself.
        self.records_prompt_routes = getattr(args, "routing_replay", "none") != "none"

    def tokenize_prompts(self, prompts: list[Any]) -> tuple[torch.Tensor, torch.Tensor]:
        return tokenize_prompts(prompts, self.tokenizer, self.max_prompt_length, self.chat_template_kwargs)

    def avoid_loop(self, loop: str) -> None:
        if loop == "static":  # the dynamic loop, on the model's own cache and masks
            self.cuda_graphs = False
        elif loop == "dynamic":  # transformers' generate (which records no log-probs: π_old gets its forward pass)
            self.use_decode_loop, self.logp_temperature = False, None

    def generate(self, prompts: list[Any], stream_keys: torch.Tensor | None = None) -> Rollout:
        if self.processor is None:
            prompt_ids, prompt_mask = self.tokenize_prompts(prompts)
            return self._sample(prompt_ids, prompt_mask, stream_keys, self.generation_config.max_new_tokens)
        prompt_ids, prompt_mask, vision = encode_prompts(
            self.processor, prompts, self.max_prompt_length, self.chat_template_kwargs
        )
        max_new_tokens = self.generation_config.max_new_tokens
        rollout = self._sample(prompt_ids, prompt_mask, stream_keys, max_new_tokens, vision=vision)
        rollout.vision = None if vision is None else vision.to(rollout.prompt_ids.device)  # where training reads it
        return rollout

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
        self,
        prompt_ids,
        prompt_mask,
        stream_keys,
        max_new_tokens: int,
        states=None,
        keep_states: bool = False,
        vision: VisionInputs | None = None,
    ) -> Rollout:
        model = self.model_getter()
        check_prompts_fit(prompt_mask, max_new_tokens, self.context)
        prompt_ids, prompt_mask = prompt_ids.to(model.device), prompt_mask.to(model.device)
        keys = None if stream_keys is None else stream_keys.to(model.device)
        rows = prompt_ids.shape[0]
        step = self._rows_per_slice(model, rows, prompt_ids.shape[1] + max_new_tokens)
        was_training = model.training
        recorder = route_recorder_for(model) if self.use_decode_loop else None  # Mixture-of-Experts routes
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
                    None if vision is None else vision.select(part).to(model.device),
                    recorder,
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
        logps = kept_log_mass = None
        if all(part.logps is not None for part in parts):
            logps = torch.cat([F.pad(part.logps, (0, width - part.logps.shape[1])) for part in parts])
        if all(part.kept_log_mass is not None for part in parts):  # the loop truncated (same processors every part)
            kept_log_mass = torch.cat(
                [F.pad(part.kept_log_mass, (0, width - part.kept_log_mass.shape[1])) for part in parts]
            )
        kept = None if any(part.states is None for part in parts) else sum((part.states for part in parts), [])
        routes = None
        if all(part.step_routes is not None for part in parts):
            routes = torch.cat(
                [rollout_routes(part.prompt_routes, pad_routes(part.step_routes, width), prompt_ids.shape[1])
                 for part in parts]
            )  # fmt: skip
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
            kept_log_mass=kept_log_mass,
            sampling_routes=routes,
            decoding_loop=None if loops == {None} else "static" if "static" in loops else "dynamic",
        )

    def _rows_per_slice(self, model, rows: int, positions: int) -> int:
        """How many rows to decode at once: `decode_max_rows`, or on a GPU as many as the free memory holds."""
        if self.max_decode_rows is not None:
            return max(1, min(rows, self.max_decode_rows))
        free = memory.free_device_bytes(model.device)
        per_position = memory.kv_bytes_per_position(model.config, model.dtype)
        if free is None or per_position is None or rows <= 1:
            return max(rows, 1)
        per_row = positions * per_position
        # The turn caches episodes keep between turns are counted through the free memory measured at every turn.
        step = memory.rows_per_slice(rows, per_row, int(free * memory.KV_CACHE_MEMORY_FRACTION))
        if step < rows and not self._slicing_logged:
            logger.warning(
                f"The KV cache of {rows} rows × {positions} positions ({rows * per_row / 2**30:.1f} GiB) does not "
                f"fit {memory.KV_CACHE_MEMORY_FRACTION:.0%} of the free device memory ({free / 2**30:.1f} "
                f"GiB): decoding in slices of {step} rows. Set decode_max_rows to choose."
            )
            self._slicing_logged = True
        return step

    def _sample_rows(
        self, model, prompt_ids, prompt_mask, keys, max_new_tokens, states, keep_states, vision=None, recorder=None
    ) -> tuple[dynamic.Decoded, str | None]:
        """One slice of rows, decoded together, and the decoding loop that sampled them (None: generate)."""
        if self.use_decode_loop:
            loop = (model, prompt_ids, prompt_mask, keys, max_new_tokens, states, keep_states, recorder)
            return self._sample_with_loop(*loop)
        sampled = self._sample_with_generate(model, prompt_ids, prompt_mask, keys, max_new_tokens, vision)
        return dynamic.Decoded(sampled), None

    def _sample_with_loop(
        self, model, prompt_ids, prompt_mask, keys, max_new_tokens, states, keep_states, recorder=None
    ) -> tuple[dynamic.Decoded, str]:
        def keyed_uniforms(rows, position):  # one uniform per row and position, from the row's own stream
            return keyed_uniform(keys[rows], position, 1).squeeze(1)

        uniforms = dynamic.random_uniforms if keys is None else keyed_uniforms
        shared, pad = None, self.tokenizer.pad_token_id
        if recorder is not None and self.records_prompt_routes:  # the loop's own prefill records the prompt's routes
            sampling = dict(eos_token_ids=self.eos_token_ids, pad_token_id=pad, processors=self.processors)
            sampling.update(uniforms=uniforms, logp_temperature=self.logp_temperature, route_recorder=recorder)
            decoded = dynamic.sample(model, prompt_ids, prompt_mask, max_new_tokens=max_new_tokens, **sampling)
            return decoded, "dynamic"
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
        if self._uses_static_loop(ids.device) and recorder is None:
            if cache is None:
                cache = prefill(model, ids, mask)
            reason = static.unsupported_reason(model, cache)
            if reason is None:
                graphs = ids.device.type == "cuda"
                return static.sample(model, ids, mask, cache=cache, graphs=graphs, **sampling), "static"
            if not self._static_refusal_logged:
                logger.warning(f"decode_cuda_graphs: decoding without CUDA graphs because of {reason}.")
                self._static_refusal_logged = True
        if recorder is not None and self._uses_static_loop(ids.device) and not self._static_refusal_logged:
            # The experts' token dispatch copies to the host, which graph capture refuses (measured on an H200 for
            # Qwen3-MoE, Mixtral, OLMoE and DeepSeek-V3), and the dynamic loop records the routes the metrics need.
            logger.warning("decode_cuda_graphs: a Mixture-of-Experts model decodes without CUDA graphs.")
            self._static_refusal_logged = True
        sampling["route_recorder"] = recorder
        return dynamic.sample(model, ids, mask, cache=cache, cpu_kernels=self.cpu_kernels, **sampling), "dynamic"

    def _uses_static_loop(self, device: torch.device) -> bool:
        # The static loop pays on a GPU only (CUDA graphs); tests run it on CPU by replacing this.
        return self.cuda_graphs and device.type == "cuda"

    def _sample_with_generate(self, model, prompt_ids, prompt_mask, keys, max_new_tokens, vision=None) -> torch.Tensor:
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
        cache, images = None, contextlib.nullcontext({})
        if vision is not None:  # generate's own prefill reads the images, each prompt's encoded once
            images = images_encoded_once(model, vision, prompt_ids)
        elif self.generation_config.cache_implementation is None:
            cache = prefill_shared_prompts(model, prompt_ids, prompt_mask)
        with images as image_inputs:
            sequences = model.generate(
                input_ids=prompt_ids,
                attention_mask=prompt_mask,
                **image_inputs,
                **cache_kwargs(model, cache),
                generation_config=generation_config,
                logits_processor=processors,
            )
        return sequences[:, prompt_ids.shape[1] :]


def image_token_id(processor, model) -> int:
    """The token id a vision-language model's image features take the place of: the model config's (Gemma 3's
    processor names its begin-of-image token instead), else the processor's."""
    token_id = getattr(model.config, "image_token_id", None)
    if token_id is None:
        token_id = getattr(model.config, "image_token_index", None) or getattr(processor, "image_token_id", None)
    if token_id is None:
        raise ValueError(
            f"{type(processor).__name__} and the model's config name no image token id (image_token_id): the "
            "sampler could not keep completions free of image tokens."
        )
    return int(token_id)


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

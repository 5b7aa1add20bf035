"""`VLLMColocateBackend`: rollouts sampled by a vLLM engine in the trainer's own process (`vllm_mode="colocate"`).

Owns what a rollout needs from the colocated engine: prompts tokenized here and sent as token ids, de-duplicated (`n`
samples per distinct prompt), a tensor-parallel group's prompts sampled together and split again, the sampled token
ids and their log-probs returned as a `Rollout` (the same record as the server's), and the weight push whenever the
weights changed since the last one (every process into its own engine; merged LoRA weights). What it does not own:
building the engine, the push itself and sleep mode (`vllm.colocate`), the weights as named tensors
(`vllm.weight_sync`), the correction for the engine/trainer mismatch (`sampling_correction`).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from ..models.context import check_prompts_fit, context_length
from ..models.distributed import unwrap_model
from ..vllm.colocate import ColocatedEngine
from ..vllm.weight_sync import named_weights
from .types import Rollout, RolloutBackend, eos_token_ids_of, left_pad, tokenize_prompts
from .vllm_server import prompt_runs, rollout_from_samples, sampling_params


def samples_of(outputs: list) -> list[dict]:
    """vLLM's `RequestOutput`s as `{"token_ids", "logprobs"}` per sample, prompt by prompt (as the server returns
    them): each sampled token's log-prob, which `logprobs=0` records alone."""
    samples = []
    for output in outputs:
        for completion in output.outputs:
            token_ids = list(completion.token_ids)
            logprobs = [float("nan")] * len(token_ids)
            for position, (token, recorded) in enumerate(zip(token_ids, completion.logprobs or [])):
                if recorded and token in recorded:
                    logprobs[position] = recorded[token].logprob
            samples.append({"token_ids": token_ids, "logprobs": logprobs})
    return samples


class VLLMColocateBackend(RolloutBackend):
    """Sampling on a vLLM engine that each training process holds beside its model."""

    samples_with_training_model = False

    def __init__(self, tokenizer, args, accelerator, model):
        self.tokenizer = tokenizer
        self.args = args
        self.accelerator = accelerator
        self.eos_token_ids = eos_token_ids_of(unwrap_model(model).generation_config, tokenizer)
        self.sampling = sampling_params(args, self.eos_token_ids)
        self.context = context_length(unwrap_model(model).config)  # the trained model's (`models.context`)
        self.engine = ColocatedEngine(args, unwrap_model(model), accelerator)
        self.synced_step: int | None = None  # optimizer steps done when the engine last got the weights
        self.sync_seconds: list[float] = []
        accelerator.wait_for_everyone()

    def update_weights(self, model, global_step: int) -> None:
        if self.synced_step == global_step:
            return
        started = time.perf_counter()
        # Every process iterates (ZeRO-3 and FSDP2 gather collectively) and pushes into its own engine.
        self.engine.push(named_weights(model, self.engine.dtype, merge_lora=True, to_cpu=False))
        self.synced_step = global_step
        self.sync_seconds.append(time.perf_counter() - started)

    def generate(self, prompts: list[Any], stream_keys: torch.Tensor | None = None) -> Rollout:
        # stream_keys: unused; GSPOConfig refuses layout_independent_sampling with use_vllm (the engine samples).
        prompt_ids, prompt_mask = tokenize_prompts(
            prompts, self.tokenizer, self.args.max_prompt_length, self.args.chat_template_kwargs
        )
        check_prompts_fit(prompt_mask, self.args.max_completion_length, self.context)
        runs = prompt_runs(prompt_ids, prompt_mask)
        samples = self._sample([(tokens, count, self.sampling) for tokens, count in runs])
        return self._rollout(prompt_ids, prompt_mask, samples)

    def generate_from_ids(
        self,
        prompt_ids: list[list[int]],
        max_new_tokens: int,
        stream_keys: torch.Tensor | None = None,
        states: list | None = None,
    ) -> Rollout:
        # One sample per episode history; the engine's prefix cache, not `states`, saves recomputing earlier turns.
        sampling = {**self.sampling, "max_tokens": max_new_tokens}
        samples = self._sample([(ids, 1, sampling) for ids in prompt_ids])
        ids, mask = left_pad(prompt_ids, self.tokenizer.pad_token_id)
        return self._rollout(ids, mask, samples)

    def _sample(self, requests: list[tuple[list[int], int, dict]]) -> list[dict]:
        """(token ids, samples wanted, sampling fields) per request → the samples, request by request. The processes
        of a tensor-parallel group drive one engine together: all of them send the group's requests."""
        group = self.engine.tp_group
        if group is not None:
            gathered = [None] * torch.distributed.get_world_size(group)
            torch.distributed.all_gather_object(gathered, requests, group=group)
            own = torch.distributed.get_rank(group)
            requests = [request for part in gathered for request in part]
            first = sum(sum(count for _, count, _ in part) for part in gathered[:own])
            wanted = sum(count for _, count, _ in gathered[own])
        prompts = [{"prompt_token_ids": tokens} for tokens, _, _ in requests]
        params = [self.engine.sampling_params(count, fields) for _, count, fields in requests]
        samples = samples_of(self.engine.generate(prompts, params))
        return samples if group is None else samples[first : first + wanted]

    def _rollout(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, samples: list[dict]) -> Rollout:
        pad_id, device = self.tokenizer.pad_token_id, self.accelerator.device
        return rollout_from_samples(prompt_ids, prompt_mask, samples, self.eos_token_ids, pad_id, device)


__all__ = ["VLLMColocateBackend", "samples_of"]

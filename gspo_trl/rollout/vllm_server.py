"""`VLLMServerBackend`: rollouts sampled by a vLLM server, which gets the trained weights before each rollout.

Owns what a rollout needs from the server: prompts tokenized here and sent as token ids (no re-tokenization),
de-duplicated (`n` samples per distinct prompt), the sampled token ids and their log-probs returned as a
`Rollout`, and the weight sync (pause, send the weights, prefix-cache reset, resume) whenever the weights
changed since the last one. Every process sends its own prompts; process 0 alone sends the weights, the others
wait at a barrier. A server without gspo-trl's worker extension (`trl vllm-serve`) is described by its vLLM config
and takes the weights through its weight-transfer engine. What it does not own: HTTP details (`client`), how the
weights travel (`vllm.transport`), turning the model into named tensors (`weight_sync`), the correction for the
server/trainer mismatch (`sampling_correction`), and how several servers share a rollout and a sync (`vllm_servers`;
with one server, everything runs as it always did).
"""

from __future__ import annotations

import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any

import torch

from ..models.context import check_prompts_fit, context_length
from ..models.distributed import unwrap_model
from ..vllm.address import base_url, check_base_urls
from ..vllm.auth import resolve_token
from ..vllm.client import VLLMServerClient, VLLMServerError
from ..vllm.engine_transport import EngineTransport
from ..vllm.folders import remove_snapshot_dir
from ..vllm.transport import HTTPTransport, SharedDirTransport, choose_transport, local_sync_dir
from ..vllm.weight_sync import adapter_sync_unsupported_reason
from .types import Rollout, RolloutBackend, completion_mask_from_eos, eos_token_ids_of, left_pad, tokenize_prompts
from .vllm_servers import (
    ServerLink,
    check_servers_alike,
    describe_server,
    gathers_collectively,
    in_parallel,
    split_groups,
)

ADAPTER_NAME = "gspo-trl-policy"  # the name the trained LoRA adapter is served under

# Config fields of the trained model that must match the served one.
MATCHING_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers")


def server_base_urls(args) -> list[str]:
    """The servers' URLs: `vllm_server_base_url` (one, a list, or comma-separated), else host and port."""
    if args.vllm_server_base_url:
        return check_base_urls(args.vllm_server_base_url)
    return [base_url(args.vllm_server_host, args.vllm_server_port)]


def sampling_params(args, eos_token_ids: list[int]) -> dict[str, Any]:
    """The request fields that make the server sample as the trainer's own loop would."""
    params = {
        "max_tokens": args.max_completion_length,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": args.top_k if args.top_k else -1,
        "min_p": args.min_p or 0.0,
        "repetition_penalty": args.repetition_penalty,
        "stop_token_ids": eos_token_ids,  # the stop token is returned with its log-prob
        "skip_special_tokens": False,
    }
    if args.vllm_structured_outputs_regex:
        params["structured_outputs"] = {"regex": args.vllm_structured_outputs_regex}
    params.update(args.generation_kwargs or {})
    return params


def prompt_runs(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> list[tuple[list[int], int]]:
    """(token ids without padding, how many consecutive rows repeat it): prompts arrive repeated per group."""
    runs: list[tuple[list[int], int]] = []
    for ids, mask in zip(prompt_ids.tolist(), prompt_mask.tolist()):
        tokens = [token for token, keep in zip(ids, mask) if keep]
        if runs and runs[-1][0] == tokens:
            runs[-1] = (tokens, runs[-1][1] + 1)
        else:
            runs.append((tokens, 1))
    return runs


def pad_samples(samples: list[dict], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(completion_ids, sampling_logps) right-padded to the longest sample: pad id and log-prob 0 after the end."""
    length = max(1, max(len(sample["token_ids"]) for sample in samples))
    ids = torch.full((len(samples), length), pad_token_id, dtype=torch.long)
    logps = torch.zeros((len(samples), length), dtype=torch.float32)
    for row, sample in enumerate(samples):
        count = len(sample["token_ids"])
        ids[row, :count] = torch.tensor(sample["token_ids"], dtype=torch.long)
        logps[row, :count] = torch.tensor(sample["logprobs"], dtype=torch.float32)
    return ids, logps


class VLLMServerBackend(RolloutBackend):
    """Sampling on a vLLM server started with `gspo-trl vllm-serve`, or on several (`servers`, one `ServerLink` each;
    `client`, `transport`, `server_info`, ... are the first's)."""

    samples_with_training_model = False

    def __init__(self, tokenizer, args, accelerator, model):
        self.tokenizer = tokenizer
        self.args = args
        self.accelerator = accelerator
        self.eos_token_ids = eos_token_ids_of(unwrap_model(model).generation_config, tokenizer)
        self.sampling = sampling_params(args, self.eos_token_ids)
        self.context = context_length(unwrap_model(model).config)  # the trained model's (`models.context`)
        token = resolve_token(args.vllm_server_token)
        urls = server_base_urls(args)
        clients = [VLLMServerClient(url, timeout=args.vllm_server_timeout, token=token) for url in urls]
        self.synced_step: int | None = None  # optimizer steps done when the servers last got the weights
        self.sync_seconds: list[float] = []
        self.servers: list[ServerLink] = in_parallel([(c.base_url, partial(describe_server, c)) for c in clients])
        if len(self.servers) > 1:
            check_servers_alike(self.servers)
        self.sends_adapter = self._choose_adapter_sync(model)
        self.base_sent = False  # adapter syncs: the server's base weights are the trainer's (sent once)
        self._check_and_choose_transport(model)

    # The first server's: what one server's callers read.
    client = property(lambda self: self.servers[0].client)
    server_config = property(lambda self: self.servers[0].config)
    server_info = property(lambda self: self.servers[0].info)
    transport = property(lambda self: self.servers[0].transport)
    snapshot_dir = property(lambda self: self.servers[0].snapshot_dir)

    # --- construction checks -------------------------------------------------------------------

    def _check_same_model(self, model, link: ServerLink) -> None:
        base = model.get_base_model() if hasattr(model, "peft_config") else model
        config = base.config.get_text_config() if hasattr(base.config, "get_text_config") else base.config
        ours = {name: getattr(config, name, None) for name in MATCHING_FIELDS}
        theirs = {name: link.info.get(name) for name in MATCHING_FIELDS}
        mismatched = [
            f"{name}: trainer {ours[name]}, server {theirs[name]}"
            for name in MATCHING_FIELDS
            if ours[name] is not None and theirs[name] and ours[name] != theirs[name]
        ]
        architectures = set(getattr(config, "architectures", None) or getattr(base.config, "architectures", None) or [])
        served = set(link.info.get("architectures") or [])
        if architectures and served and not architectures & served:
            mismatched.append(f"architectures: trainer {sorted(architectures)}, server {sorted(served)}")
        if mismatched:
            raise ValueError(
                f"The vLLM server at {link.url} serves a different model than the one being trained "
                f"({'; '.join(mismatched)}). Start the server with the trained model's checkpoint."
            )

    def _choose_adapter_sync(self, model) -> bool:
        """Send only the LoRA adapter (vLLM applies it at runtime) where possible, else merged full weights.
        Every process decides alike: the requests of all of them must name the adapter."""
        reason = adapter_sync_unsupported_reason(model, self.server_info.get("max_lora_rank"))
        wanted = self.args.vllm_lora_adapter_sync
        if wanted and reason is not None:
            raise ValueError(
                f"vllm_lora_adapter_sync=True, but {reason}. Set it to None (auto) or False to send merged "
                "full weights."
            )
        return reason is None and wanted is not False

    def _check_and_choose_transport(self, model) -> None:
        """Process 0 checks each served model and picks each server's transport (probing the server where asked); the
        others follow its choices, or raise its error with it rather than wait for it."""
        choice: list = [None]
        if self.accelerator.is_main_process:
            try:
                for link in self.servers:  # each server its own snapshot folder: no two syncs write into one
                    link.snapshot_dir = local_sync_dir(self.args.vllm_weight_sync_dir)
                    weakref.finalize(self, remove_snapshot_dir, link.snapshot_dir)  # goes with the backend
                choose = self._choose_transport
                choice = [
                    in_parallel([(link.url, partial(choose, model, i, link)) for i, link in enumerate(self.servers)])
                ]
            except ValueError as error:
                choice = [error]
        if self.accelerator.num_processes > 1:
            from accelerate.utils import broadcast_object_list

            broadcast_object_list(choice)
        if isinstance(choice[0], ValueError):
            raise choice[0]
        if not self.accelerator.is_main_process:  # they only take part in the collective gathers
            chunk_bytes = int(self.args.vllm_weight_chunk_mb * 1024**2)
            for link, (name, backend) in zip(self.servers, choice[0]):
                if name == EngineTransport.name:
                    link.transport = EngineTransport(link.client, backend)
                else:
                    http = HTTPTransport(link.client, None, chunk_bytes)
                    link.transport = http if name == http.name else SharedDirTransport(link.client, None)

    def _choose_transport(self, model, index: int, link: ServerLink) -> tuple[str, str | None]:
        self._check_same_model(unwrap_model(model), link)
        port = self.args.vllm_group_port + index if self.args.vllm_group_port else 0  # one group per server
        link.transport = choose_transport(
            self.args, link.client, link.snapshot_dir, link.config, link.info.get("worker_extension", True), port
        )
        return link.transport.name, getattr(link.transport, "backend", None)

    # --- RolloutBackend ------------------------------------------------------------------------

    def update_weights(self, model, global_step: int) -> None:
        if self.synced_step == global_step:
            return
        started = time.perf_counter()
        is_main = self.accelerator.is_main_process
        # Full weights; for adapter syncs, the frozen base once, since a server may hold other weights.
        send_full = not self.sends_adapter or not self.base_sent
        # Every server at once, each through its own transport; where gathering the weights is a collective
        # (ZeRO-3, FSDP2), one server after the other on every process, so that the gathers pair up.
        tasks = [(link.url, partial(self._sync_server, link, model, is_main, send_full)) for link in self.servers]
        try:
            in_parallel(tasks, parallel=is_main and not gathers_collectively(model))
        except BaseException:
            self.synced_step = None  # a sync that failed half-way leaves its server paused (it holds some old weights)
            raise
        self.base_sent = True
        self.accelerator.wait_for_everyone()  # nobody samples before the servers have the new weights
        for link in self.servers if self.sends_adapter else ():
            link.client.model_name = ADAPTER_NAME  # requests now sample from the base model plus the adapter
        self.synced_step = global_step
        self.sync_seconds.append(time.perf_counter() - started)

    def _sync_server(self, link: ServerLink, model, is_main: bool, send_full: bool) -> None:
        """One server's sync: pause, the weights (`send_full`) and adapter, prefix-cache reset, resume. A sync that
        fails half-way leaves the server paused: it holds a mix of old and new weights until a sync completes."""
        if is_main:
            link.client.pause()
        if send_full:
            dtype = _torch_dtype(link.info.get("dtype"))
            link.transport.send_weights(model, is_writer=is_main, dtype=dtype, merge_lora=not self.sends_adapter)
        if self.sends_adapter and is_main:
            link.client.load_lora_adapter(ADAPTER_NAME, link.transport.send_adapter(model))
        if is_main:
            link.client.reset_prefix_cache()
            link.client.resume()

    def generate(self, prompts: list[Any], stream_keys: torch.Tensor | None = None) -> Rollout:
        # stream_keys: unused; GSPOConfig refuses layout_independent_sampling with use_vllm (the server samples).
        prompt_ids, prompt_mask = tokenize_prompts(
            prompts, self.tokenizer, self.args.max_prompt_length, self.args.chat_template_kwargs
        )
        check_prompts_fit(prompt_mask, self.args.max_completion_length, self.context)
        runs = prompt_runs(prompt_ids, prompt_mask)
        # Each server a consecutive share of whole groups, all at once; their samples back in the prompts' order.
        shares = split_groups([n for _, n in runs], len(self.servers))
        tasks = [
            (link.url, partial(self._sample_runs, link.client, runs[share.start : share.stop]))
            for link, share in zip(self.servers, shares)
            if len(share)
        ]
        samples = [sample for part in in_parallel(tasks) for sample in part]
        return self._rollout(prompt_ids, prompt_mask, samples)

    def _sample_runs(self, client: VLLMServerClient, runs: list[tuple[list[int], int]]) -> list[dict]:
        """One server's samples of `runs` (prompt, group size), row by row in their order."""
        # One request per group size (normally one in all). No per-request seed: vLLM 0.32's CPU build kills its
        # engine when a seeded request's prefill is split across steps ("CPU Generator does not use offset").
        sizes = sorted({n for _, n in runs})
        requests = [([tokens for tokens, count in runs if count == n], n) for n in sizes]
        with ThreadPoolExecutor(max_workers=len(requests)) as pool:
            answers = list(pool.map(lambda r: client.complete(r[0], r[1], self.sampling), requests))
        pending = {n: iter(answer) for (_, n), answer in zip(requests, answers)}
        return [sample for _, n in runs for sample in next(pending[n])]

    def _rollout(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, samples: list[dict]) -> Rollout:
        pad_id, device = self.tokenizer.pad_token_id, self.accelerator.device
        return rollout_from_samples(prompt_ids, prompt_mask, samples, self.eos_token_ids, pad_id, device)

    def generate_from_ids(
        self,
        prompt_ids: list[list[int]],
        max_new_tokens: int,
        stream_keys: torch.Tensor | None = None,
        states: list | None = None,
    ) -> Rollout:
        # Each episode has its own history: one sample per prompt, in one request per server (the server's prefix
        # cache, not `states`, saves recomputing earlier turns).
        sampling = {**self.sampling, "max_tokens": max_new_tokens}
        shares = split_groups([1] * len(prompt_ids), len(self.servers))
        tasks = [
            (link.url, partial(link.client.complete, prompt_ids[share.start : share.stop], 1, sampling))
            for link, share in zip(self.servers, shares)
            if len(share)
        ]
        answers = [answer for part in in_parallel(tasks) for answer in part]
        ids, mask = left_pad(prompt_ids, self.tokenizer.pad_token_id)
        return self._rollout(ids, mask, [samples[0] for samples in answers])


def rollout_from_samples(
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    samples: list[dict],
    eos_token_ids: list[int],
    pad_id: int,
    device: torch.device,
) -> Rollout:
    """The `Rollout` of one sample per prompt row (`token_ids` and their `logprobs`, as vLLM returns them): cut after
    the first EOS, padded, the engine's log-probs as `sampling_logps`."""
    completion_ids, sampling_logps = pad_samples(samples, pad_id)
    completion_mask, is_truncated = completion_mask_from_eos(completion_ids, eos_token_ids)
    completion_ids = completion_ids.masked_fill(completion_mask == 0, pad_id)
    sampling_logps = sampling_logps.masked_fill(completion_mask == 0, 0.0)
    return Rollout(
        prompt_ids.to(device),
        prompt_mask.to(device),
        completion_ids.to(device),
        completion_mask.to(device),
        is_truncated.to(device),
        sampling_logps.to(device),
    )


def _torch_dtype(name: str | None) -> torch.dtype | None:
    value = getattr(torch, name, None) if name else None
    return value if isinstance(value, torch.dtype) else None


__all__ = [
    "VLLMServerBackend",
    "VLLMServerError",
    "prompt_runs",
    "rollout_from_samples",
    "sampling_params",
    "server_base_urls",
]

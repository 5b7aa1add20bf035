"""How the trained weights reach a vLLM server: vLLM's weight-transfer engine (`engine_transport`), a snapshot in a
directory both sides see, or chunks over HTTP.

Owns the file-based transports behind one interface (`send_weights`: the full weights, LoRA merged or the frozen base;
`send_adapter`: a LoRA adapter, returning the path the server loads it from) and choosing one
(`vllm_weight_transport`; 'auto' takes the engine where the server has one this trainer can drive, else writes a
probe file in the sync directory and asks the server whether it sees it).
What it does not own: turning the model into named tensors (`weight_sync`), the wire format (`client`), and when to
sync (`rollout.vllm_server`).
"""

from __future__ import annotations

import os
import uuid
import weakref

import torch
from transformers.utils import logging

from . import delta
from .client import VLLMServerClient, VLLMServerError
from .engine_transport import EngineTransport, server_backend, unusable_reason
from .folders import new_snapshot_dir
from .weight_sync import named_weights, serialize_chunk, weight_chunks, write_adapter, write_snapshot

logger = logging.get_logger(__name__)


class SharedDirTransport:
    """A safetensors snapshot written into `directory`, which the server reloads from (same machine or a shared
    filesystem): the fastest, but the server must see the trainer's files."""

    name = "shared_dir"

    def __init__(self, client: VLLMServerClient, directory: str | None):
        self.client = client
        self.directory = directory  # None on processes other than the writer

    def send_weights(self, model: torch.nn.Module, is_writer: bool, dtype: torch.dtype | None, merge_lora: bool) -> int:
        """Every process calls it (ZeRO-3 gathers are collective); only `is_writer` sends. Returns the bytes sent."""
        total = write_snapshot(model, self.directory or "", is_writer=is_writer, dtype=dtype, merge_lora=merge_lora)
        if is_writer:
            self.client.reload_weights(self.directory)
        return total

    def send_adapter(self, model: torch.nn.Module) -> str:
        """The writer alone: the adapter written where the server reads it; returns that path."""
        adapter_dir = os.path.join(self.directory, "adapter")
        write_adapter(model, adapter_dir)
        return adapter_dir


class HTTPTransport:
    """The weights sent through the server's `/collective_rpc` endpoint, in safetensors chunks of at most
    `chunk_bytes` (or one layer, if larger), each loaded in place by the worker extension before the next is built:
    no file is shared, and neither side holds more than a few chunks' worth."""

    name = "http"

    def __init__(self, client: VLLMServerClient, directory: str | None, chunk_bytes: int, delta_sync: bool = False):
        self.client = client
        self.directory = directory  # local scratch for the adapter's files (the writer's only)
        self.chunk_bytes = chunk_bytes
        self.remote_dir = f"gspo-trl-adapter-{uuid.uuid4().hex[:12]}"  # in the server's temporary folder
        self.cleanup = None
        self.sender = delta.DeltaSender() if delta_sync else None  # `vllm_weight_sync_delta`
        self.version = None  # the sync the server holds every tensor from (delta syncs)

    def send_weights(self, model: torch.nn.Module, is_writer: bool, dtype: torch.dtype | None, merge_lora: bool) -> int:
        """Every process calls it (ZeRO-3 gathers are collective); only `is_writer` sends. Returns the bytes sent:
        the weights' own, or with deltas the requests' safetensors payloads."""
        weights = named_weights(model, dtype, merge_lora)
        if not is_writer:
            for _ in weights:  # the gathers of ZeRO-3 / FSDP2 need every process
                pass
            return 0
        if self.sender is None:
            total = 0
            for chunk in weight_chunks(weights, self.chunk_bytes):
                self.client.load_weights_chunk(serialize_chunk(chunk))
                total += sum(tensor.numel() * tensor.element_size() for _, tensor in chunk)
            self.client.finish_weight_load()
            return total
        version, base = delta.new_version(), self.version
        self.version = None  # until this sync is through, the server holds a mix
        try:
            total = sum(
                self._send_delta_chunk(chunk, base, version) for chunk in weight_chunks(weights, self.chunk_bytes)
            )
            self.client.finish_weight_load()
        except BaseException:
            self.sender.forget()  # what the server holds is unknown: the next sync goes whole
            raise
        self.version = version
        return total

    def _send_delta_chunk(self, chunk: list[tuple[str, torch.Tensor]], base: str | None, version: str) -> int:
        """One chunk as deltas against the server's `base` where they are smaller; the tensors the server does not
        hold in `base`, and the rest of the chunk with them, whole. Returns the bytes sent."""
        chunk = [(name, tensor.to("cpu")) for name, tensor in chunk]
        entries = {}
        for name, tensor in chunk:
            entries.update(self.sender.entries(name, tensor, base))
        payload = serialize_chunk(list(entries.items()))
        sent = len(payload)
        if self.client.load_weights_chunk(payload, version=version, delta_base=base or ""):
            payload = serialize_chunk(chunk)  # the workers loaded nothing of it: all whole
            sent += len(payload)
            self.client.load_weights_chunk(payload, version=version)
        self.sender.acknowledge([name for name, _ in chunk], [tensor for _, tensor in chunk], version)
        return sent

    def send_adapter(self, model: torch.nn.Module) -> str:
        local = os.path.join(self.directory, "adapter")
        write_adapter(model, local)
        remote = None
        for name in sorted(os.listdir(local)):
            remote = self.client.send_file(self.remote_dir, os.path.join(local, name), self.chunk_bytes)
        if self.cleanup is None:  # the server's copy goes when this transport does
            self.cleanup = weakref.finalize(self, self.client.remove_directory, self.remote_dir)
        return remote


def local_sync_dir(configured: str | None) -> str:
    """The directory snapshots are written to: a new one under `configured`, else in /dev/shm (see `folders`)."""
    return new_snapshot_dir(configured)


def server_sees(client: VLLMServerClient, directory: str) -> bool:
    """Whether every worker of the server reads a probe file written into `directory`."""
    probe = os.path.join(directory, f"probe-{uuid.uuid4().hex}")
    with open(probe, "w") as handle:
        handle.write("gspo-trl")
    try:
        return all(client.can_read(probe))
    finally:
        os.remove(probe)


def choose_transport(
    args,
    client: VLLMServerClient,
    directory: str,
    server_config: dict | None = None,
    worker_extension: bool = True,
    group_port: int | None = None,
):
    """The transport `args.vllm_weight_transport` asks for. 'auto': vLLM's weight-transfer engine where the server
    has one this trainer can drive (one broadcast, no copy through files or base64); else the shared directory if
    the server sees it (a probe file), else HTTP chunks. `server_config`: the server's vLLM config;
    `worker_extension`: whether it has gspo-trl's worker extension (the shared directory and HTTP need it);
    `group_port`: the engine group's port, else `args.vllm_group_port`."""
    wanted = args.vllm_weight_transport
    if wanted in ("engine", "auto"):
        backend = server_backend(server_config)
        reason = unusable_reason(backend, client.base_url)
        if reason is None:
            files = _file_transport(args, client, directory, "auto") if worker_extension else None
            port = args.vllm_group_port if group_port is None else group_port
            transport = EngineTransport(client, backend, files, port)
            try:
                transport.connect()
                if args.vllm_weight_sync_delta:
                    logger.info("vllm_weight_sync_delta: the weight-transfer engine sends whole weights.")
                return transport
            except VLLMServerError as error:
                if wanted == "engine" or not worker_extension:
                    raise ValueError(str(error)) from error
                logger.warning(f"{error} Sending the weights through the server's worker extension instead.")
        elif wanted == "engine" or not worker_extension:
            fallback = "" if worker_extension else ", and it has no gspo-trl worker extension for the other transports"
            raise ValueError(f"vllm_weight_transport={wanted!r}, but {reason}{fallback}.")
        else:
            logger.info(f"Not using vLLM's weight-transfer engine: {reason}.")
    return _file_transport(args, client, directory, wanted)


def _file_transport(args, client: VLLMServerClient, directory: str, wanted: str):
    """The shared directory or HTTP, through gspo-trl's worker extension; 'auto' probes whether the server sees
    `directory`."""
    chunk_bytes = int(args.vllm_weight_chunk_mb * 1024**2)
    delta_sync = args.vllm_weight_sync_delta
    if wanted == "http":
        return HTTPTransport(client, directory, chunk_bytes, delta_sync)
    if server_sees(client, directory):
        if args.vllm_weight_sync_delta:
            logger.info("vllm_weight_sync_delta: the server sees the sync directory, which takes whole snapshots.")
        return SharedDirTransport(client, directory)
    if wanted == "shared_dir":
        raise ValueError(
            f"The vLLM server at {client.base_url} cannot read the weight-sync directory {directory}: it runs on "
            "another machine or in another filesystem namespace, or it was not started with `gspo-trl vllm-serve "
            "--weight-sync-dir DIR` for vllm_weight_sync_dir=DIR. Set vllm_weight_sync_dir to a directory both the "
            "trainer and the server can reach (a shared filesystem) and name it when starting the server, or "
            "vllm_weight_transport='http' (or 'auto') to send the weights over HTTP."
        )
    log = logger.warning if args.vllm_weight_sync_dir else logger.info
    log(
        f"The vLLM server at {client.base_url} cannot read the weight-sync directory {directory}: the weights go "
        f"to it over HTTP, in chunks of at most {args.vllm_weight_chunk_mb:g} MiB (vllm_weight_transport='auto')."
    )
    return HTTPTransport(client, directory, chunk_bytes, delta_sync)

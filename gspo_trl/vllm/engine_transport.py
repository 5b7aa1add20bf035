"""The weights sent through vLLM's weight-transfer engine: the trainer joins the server's workers as rank 0 of a
group and broadcasts the tensors packed into buffers, as TRL's `VLLMClient` does.

One code path for the two collectives vLLM's engine runs over: NCCL (`--weight-transfer-config '{"backend":
"nccl"}'`, what `trl vllm-serve` starts; GPUs on both sides, vLLM installed in the trainer's environment, whose
rendezvous and packed broadcast are then vLLM's own) and gloo (`gspo-trl vllm-serve`'s engine, `gloo_engine`; any
device, torch alone on the trainer's side). The HTTP control plane is the same for both: `/init_weight_transfer_engine`
while the trainer opens its end of the group, then per sync `/start_weight_update`, one `/update_weights` per chunk
of whole layers (announcing its tensors while the trainer broadcasts them) and `/finish_weight_update`.
Where the server has gspo-trl's worker extension, a trainer first undoes an update a trainer before it left unfinished
(killed during a sync), and a sync that fails half-way is undone on the server before the error is raised: the server
never keeps layers waiting for weights, and the next sync starts clean.
What it does not own: the tensors (`weight_sync`), the wire format of the requests (`client`), when to sync.
"""

from __future__ import annotations

import socket
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlparse

import torch
from transformers.utils import logging

from . import collective, shared_buffers
from .client import VLLMServerClient, VLLMServerError
from .weight_sync import named_weights, weight_chunks

logger = logging.get_logger(__name__)

BACKENDS = ("gloo", "nccl")
BUFFER_BYTES = 64 * 1024**2  # one packed broadcast; the receiving side holds two
CHUNK_BYTES = 512 * 1024**2  # one /update_weights call (whole layers; a larger layer goes alone)
JOIN_TIMEOUT_S = 120.0  # the workers' rendezvous with the trainer; after it, the requests' timeout applies


class EngineUnavailable(ValueError):
    """The server's weight-transfer engine cannot be used from this trainer (the message says why and what to do)."""


def server_backend(config: dict | None) -> str | None:
    """The weight-transfer backend a server was started with (`/server_info`'s vLLM config), None without one."""
    transfer = (config or {}).get("weight_transfer_config")
    return transfer.get("backend") if isinstance(transfer, dict) else None


def unusable_reason(backend: str | None, base_url: str) -> str | None:
    """Why this trainer cannot send weights through a server's engine of `backend` (None: it can)."""
    if backend is None:
        return (
            f"the vLLM server at {base_url} was started without a weight-transfer engine (start it with "
            '`gspo-trl vllm-serve`, or pass --weight-transfer-config \'{"backend": "gloo"}\' with gspo-trl\'s worker '
            'extension, or \'{"backend": "nccl"}\' on GPUs)'
        )
    if backend not in BACKENDS:
        return f"the vLLM server at {base_url} uses the weight-transfer backend {backend!r}; gspo-trl drives {BACKENDS}"
    if backend == "nccl":
        if not torch.cuda.is_available():
            return (
                f"the vLLM server at {base_url} uses vLLM's NCCL weight-transfer engine (as `trl vllm-serve` starts "
                "it), which needs a CUDA GPU in the trainer too, and this process has none. On CPU, start the server "
                "with `gspo-trl vllm-serve MODEL` (the same protocol over gloo)"
            )
        try:
            import vllm.distributed.weight_transfer.nccl_common  # noqa: F401
        except ImportError:
            return (
                f"the vLLM server at {base_url} uses vLLM's NCCL weight-transfer engine, whose trainer side is part "
                "of vLLM, and vLLM is not installed in the trainer's environment (`pip install 'gspo-trl[vllm]'`)"
            )
    return None


def _free_port(host: str) -> int:
    with socket.socket() as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


class EngineTransport:
    """Full weights through the server's weight-transfer engine; a LoRA adapter alone (which vLLM's engine does not
    carry) through `files`, the shared-directory or HTTP transport, when the server has gspo-trl's extension."""

    name = "engine"

    def __init__(self, client: VLLMServerClient, backend: str, files=None, group_port: int = 0):
        self.client = client
        self.backend = backend
        self.files = files
        self.group = None
        host = urlparse(client.base_url).hostname or "127.0.0.1"
        self.address = collective.local_address_towards(host)  # where the server's workers reach this process
        self.group_port = group_port
        # Workers on this host that read the trainer's snapshot folder (the files transport found they do) take the
        # buffers through files in it (`shared_buffers`), the group carrying only signals; others through the group.
        seen = getattr(files, "name", None) == "shared_dir" and files.directory and backend == "gloo"
        self.offered = None
        if seen:
            try:
                self.offered = shared_buffers.SharedSlots(files.directory, writer=True)
                for index in range(2):  # the usual buffers' room, reserved now: else the group carries them
                    self.offered.view(index, BUFFER_BYTES)
            except OSError as error:
                self.offered = None
                logger.info(f"The weight buffers go through the gloo group, not {files.directory}: {error}")
        self.shared = None  # the offer, once every worker took it

    def connect(self) -> None:
        """Join the server's workers in one group (the writer only, once): the trainer rank 0, the workers after."""
        undone = self._abandon_unfinished_update()
        if undone:
            logger.warning(
                f"The vLLM server at {self.client.base_url} was in the middle of a weight update that another trainer "
                f"started and never finished (it stopped during a sync): undone ({undone}); this trainer's first sync "
                "sends every weight."
            )
        world_size = self.client.world_size() + 1
        init_info = {
            "master_address": self.address,
            "rank_offset": 1,
            "world_size": world_size,
            "packed": True,
            "packed_buffer_size_bytes": BUFFER_BYTES,
            "packed_num_buffers": 2,
        }
        if self.backend == "gloo":
            store = collective.open_master_store(self.address, self.group_port, world_size, JOIN_TIMEOUT_S)
            init_info.update(master_port=store.port, timeout_s=JOIN_TIMEOUT_S)
            init_info.update(shared_buffers.offer(self.offered and self.offered.folder))

            def open_group():
                timeout = self.client.request_timeout
                group = collective.join_group(store, 0, world_size, self.address, JOIN_TIMEOUT_S, timeout)
                if self.offered is not None:
                    self.shared = shared_buffers.trainer_agrees(group, self.offered)
                return group
        else:
            from vllm.distributed.weight_transfer.nccl_common import trainer_init

            init_info["master_port"] = self.group_port or _free_port(self.address)

            def open_group():
                return trainer_init(init_info)

        # The workers wait inside the request for the trainer to join: both must run at once.
        pool = ThreadPoolExecutor(max_workers=1)
        answer = pool.submit(self.client.init_weight_transfer_engine, init_info)
        try:
            self.group = open_group()
        except Exception as error:
            cause = answer.exception() if answer.done() else None
            raise VLLMServerError(
                f"The vLLM server at {self.client.base_url} did not join the weight-transfer group at "
                f"{self.address}:{init_info['master_port']} ({cause or error}). Check that the server's machine can "
                "open a connection to that address and port (vllm_group_port), or set vllm_weight_transport to "
                "'shared_dir' or 'http'."
            ) from error
        finally:
            pool.shutdown(wait=False)  # never wait on a request whose peer is gone
        answer.result()

    def send_weights(self, model: torch.nn.Module, is_writer: bool, dtype: torch.dtype | None, merge_lora: bool) -> int:
        """Every process calls it (ZeRO-3 gathers are collective); only `is_writer` sends. Returns the bytes sent."""
        weights = named_weights(model, dtype, merge_lora, to_cpu=False)
        if not is_writer:
            for _ in weights:  # the gathers of ZeRO-3 / FSDP2 need every process
                pass
            return 0
        if self.group is None:
            self.connect()
        device = torch.device("cpu") if self.backend == "gloo" else torch.device("cuda", torch.cuda.current_device())
        weights = ((name, tensor.to(device)) for name, tensor in weights)
        try:
            return self._send(weights)
        except BaseException as error:
            self.group = None  # whatever state the broadcast left it in, the next sync joins afresh
            undone = self._abandon_unfinished_update()
            if not isinstance(error, Exception):  # KeyboardInterrupt, SystemExit: as they are
                raise
            undo = (
                "The server put back the weights it served before in every layer this sync had not finished"
                if undone is not None
                else "The server has no gspo-trl worker extension to undo it (restart the server)"
            )
            raise VLLMServerError(
                f"The weight sync to the vLLM server at {self.client.base_url} failed half-way: {error}. {undo}: it "
                "holds some of this step's weights and some older ones, and stays paused until a sync completes (the "
                "next one sends every weight again)."
            ) from error

    def _send(self, weights) -> int:
        total = 0
        self.client.start_weight_update()
        for chunk in weight_chunks(weights, CHUNK_BYTES):
            names = [name for name, _ in chunk]
            sizes = [tensor.numel() * tensor.element_size() for _, tensor in chunk]
            lengths = collective.buffer_lengths(names, sizes, BUFFER_BYTES)
            update_info = {
                "names": names,
                "dtype_names": [str(tensor.dtype).removeprefix("torch.") for _, tensor in chunk],
                "shapes": [list(tensor.shape) for _, tensor in chunk],
            }
            if self.backend == "gloo":
                update_info["buffer_lengths"] = lengths
            # The workers receive inside the request: it runs while this process broadcasts.
            with ThreadPoolExecutor(max_workers=1) as pool:
                answer = pool.submit(self.client.update_weights, update_info)
                total += self._broadcast(chunk, lengths)
                answer.result()
        self.client.finish_weight_update()
        return total

    def _abandon_unfinished_update(self) -> str | None:
        """Have the server undo a weight update left unfinished (best effort: the server may be what failed). Returns
        what was undone ("" if nothing), None where the server has no gspo-trl extension or did not answer."""
        if self.files is None:  # the worker extension's methods come with the file transports
            return None
        try:
            results = self.client.abandon_weight_update()
        except VLLMServerError as error:
            logger.warning(f"Could not undo an unfinished weight update on {self.client.base_url}: {error}")
            return None
        layers = sum(int(result.get("layers_restored", 0)) for result in results if isinstance(result, dict))
        active = any(isinstance(result, dict) and result.get("was_active") for result in results)
        return f"{layers} layers put back" if layers or active else ""

    def _broadcast(self, chunk: list[tuple[str, torch.Tensor]], lengths: list[int]) -> int:
        if self.backend == "gloo":
            if self.shared is not None:
                return shared_buffers.send_shared(self.group, chunk, lengths, self.shared)
            return collective.send_packed(self.group, chunk, lengths)
        from vllm.distributed.weight_transfer.packed_tensor import packed_nccl_broadcast_producer

        packed_nccl_broadcast_producer(
            iterator=iter(chunk),
            group=self.group,
            src=0,
            post_iter_func=lambda item: item[1],
            buffer_size_bytes=BUFFER_BYTES,
            num_buffers=2,
        )
        torch.cuda.current_stream().synchronize()
        return sum(tensor.numel() * tensor.element_size() for _, tensor in chunk)

    def send_adapter(self, model: torch.nn.Module) -> str:
        if self.files is None:
            raise ValueError(
                f"The vLLM server at {self.client.base_url} has no gspo-trl worker extension to receive a LoRA "
                "adapter: set vllm_lora_adapter_sync=False (merged weights go through the engine)."
            )
        return self.files.send_adapter(model)

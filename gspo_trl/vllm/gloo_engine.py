"""vLLM's weight-transfer engine over gloo: the protocol of vLLM's NCCL engine on any device, CPU included.

Loaded into each worker of a server started with `--weight-transfer-config '{"backend": "gloo"}'` (the worker
extension registers it; `gspo-trl vllm-serve` passes both). The trainer joins the workers' group as rank 0
(`init_weight_transfer_engine`), then each sync announces its tensors (`update_weights`: names, dtypes, shapes, and
how many go in each buffer) while it broadcasts them packed into buffers; the worker loads each buffer through vLLM's
layer-wise reload, as the NCCL engine does, and re-packs the tied LM head at the end. An update a trainer leaves
unfinished (it died or failed in the middle) is undone, when the receive fails or at the next start, so that the
model never serves from layers still waiting for weights and the next trainer's update starts clean. It imports only
torch, vLLM, `collective` and `shared_buffers` (torch, numpy and the standard library) and the worker extension's
re-packing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from vllm.distributed.weight_transfer.base import WeightTransferEngine, WeightTransferInitInfo, WeightTransferUpdateInfo

from . import collective
from .shared_buffers import receive_shared, worker_agrees
from .worker_extension import abandon_layerwise_reload, repack_lm_head


@dataclass
class GlooInitInfo(WeightTransferInitInfo):
    """Where the trainer's group is (the NCCL engine's fields, same names; the buffers' cuts come with each update)."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    packed: bool = True
    packed_buffer_size_bytes: int = collective.DEFAULT_BUFFER_BYTES
    packed_num_buffers: int = 2
    timeout_s: float = 600.0
    shared_dir: str = ""  # the trainer's snapshot folder, where the buffers may pass instead (`shared_buffers`)
    host_id: str = ""  # the trainer's kernel: the buffers pass through files only on the same one


@dataclass
class GlooUpdateInfo(WeightTransferUpdateInfo):
    """The tensors one `update_weights` call receives, in the order they are broadcast, and how many of them each
    packed buffer holds (`collective.buffer_lengths`: cut between layers)."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    buffer_lengths: list[int]

    def __post_init__(self):
        if not len(self.names) == len(self.dtype_names) == len(self.shapes):
            raise ValueError(
                f"names, dtype_names and shapes must have one entry per tensor, got {len(self.names)}, "
                f"{len(self.dtype_names)} and {len(self.shapes)}"
            )
        if sum(self.buffer_lengths) != len(self.names) or any(count <= 0 for count in self.buffer_lengths):
            raise ValueError(
                f"buffer_lengths {self.buffer_lengths} must cut the {len(self.names)} tensors into non-empty buffers"
            )
        for name in self.dtype_names:
            if not isinstance(getattr(torch, name, None), torch.dtype):
                raise ValueError(f"dtype_names: {name!r} is not a torch dtype")


class GlooWeightTransferEngine(WeightTransferEngine[GlooInitInfo, GlooUpdateInfo]):
    init_info_cls = GlooInitInfo
    update_info_cls = GlooUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device, model):
        super().__init__(config, vllm_config, device, model)
        self.group = None
        self.store = None
        self.shared = None

    def init_transfer_engine(self, init_info: GlooInitInfo) -> None:
        if not init_info.packed:
            raise ValueError("The gloo weight-transfer engine receives packed buffers only (packed=True).")
        parallel = self.parallel_config
        rank = parallel.data_parallel_index * parallel.world_size + parallel.rank + init_info.rank_offset
        self.shutdown()  # a new trainer replaces the last one's group
        self.store = collective.connect_store(
            init_info.master_address, init_info.master_port, init_info.world_size, init_info.timeout_s
        )
        address = collective.local_address_towards(init_info.master_address)
        self.group = collective.join_group(
            self.store, rank, init_info.world_size, address, init_info.timeout_s, op_timeout=600.0
        )
        self.shared = worker_agrees(self.group, init_info.shared_dir, init_info.host_id)

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        abandon_layerwise_reload(self.model)  # what an update left unfinished would otherwise mix into this one
        initialize_layerwise_reload(self.model)

    def receive_weights(self, update_info: GlooUpdateInfo) -> None:
        if self.group is None:
            raise RuntimeError("The gloo weight transfer has no trainer: POST /init_weight_transfer_engine first.")
        dtypes = [getattr(torch, name) for name in update_info.dtype_names]
        plan = (self.group, update_info.names, dtypes, update_info.shapes, update_info.buffer_lengths)
        try:
            if self.shared is not None:
                receive_shared(*plan, self.model.load_weights, self.shared)
            else:
                collective.receive_packed(*plan, self.model.load_weights)
        except BaseException:
            # The trainer died or the load failed: vLLM ends the update here (the next call must start a new one),
            # so the layers still waiting for weights get back those they served with, and the group is dropped
            # (closing its connections, which ends a trainer's broadcast still waiting on this worker).
            abandon_layerwise_reload(self.model)
            self.shutdown()
            raise

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)
        repack_lm_head(self.model)  # the CPU kernels' pre-packed copy of a tied head is not refreshed by the reload

    def shutdown(self) -> None:
        self.group = None
        self.store = None
        self.shared = None

"""vLLM's weight-transfer engine over gloo: the protocol of vLLM's NCCL engine on any device, CPU included.

Loaded into each worker of a server started with `--weight-transfer-config '{"backend": "gloo"}'` (the worker
extension registers it; `gspo-trl vllm-serve` passes both). The trainer joins the workers' group as rank 0
(`init_weight_transfer_engine`), then each sync announces its tensors (`update_weights`: names, dtypes, shapes) while
it broadcasts them packed into buffers; the worker loads each buffer through vLLM's layer-wise reload, as the NCCL
engine does, and re-packs the tied LM head at the end. It imports only torch, vLLM and the torch-only `collective`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from vllm.distributed.weight_transfer.base import WeightTransferEngine, WeightTransferInitInfo, WeightTransferUpdateInfo

from . import collective
from .worker_extension import repack_lm_head


@dataclass
class GlooInitInfo(WeightTransferInitInfo):
    """Where the trainer's group is and how its buffers are cut (the NCCL engine's fields, same names)."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    packed: bool = True
    packed_buffer_size_bytes: int = collective.DEFAULT_BUFFER_BYTES
    packed_num_buffers: int = 2
    timeout_s: float = 600.0


@dataclass
class GlooUpdateInfo(WeightTransferUpdateInfo):
    """The tensors one `update_weights` call receives, in the order they are broadcast."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]

    def __post_init__(self):
        if not len(self.names) == len(self.dtype_names) == len(self.shapes):
            raise ValueError(
                f"names, dtype_names and shapes must have one entry per tensor, got {len(self.names)}, "
                f"{len(self.dtype_names)} and {len(self.shapes)}"
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
        self.buffer_bytes = collective.DEFAULT_BUFFER_BYTES

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
        self.buffer_bytes = init_info.packed_buffer_size_bytes

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def receive_weights(self, update_info: GlooUpdateInfo) -> None:
        if self.group is None:
            raise RuntimeError("The gloo weight transfer has no trainer: POST /init_weight_transfer_engine first.")
        dtypes = [getattr(torch, name) for name in update_info.dtype_names]
        collective.receive_packed(
            self.group, update_info.names, dtypes, update_info.shapes, self.buffer_bytes, self.model.load_weights
        )

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)
        repack_lm_head(self.model)  # the CPU kernels' pre-packed copy of a tied head is not refreshed by the reload

    def shutdown(self) -> None:
        self.group = None
        self.store = None

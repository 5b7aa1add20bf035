"""Lift accelerate's GPU-only gate on FSDP for a CPU (gloo) run of tests/distributed_worker.py.

accelerate turns an FSDP plugin into `DistributedType.FSDP` only for multi-accelerator launches; on CPU it leaves a
multi-process run as MULTI_CPU (DDP) and drops the plugin. FSDP2 itself runs on CPU over gloo, so for the worker's
`fsdp2` mode this module finishes accelerate's state the way it would on GPUs (the distributed type, the plugin, its
mixed precision): everything after that, accelerate's `fsdp2_prepare_model`, the trainer and gspo-trl's own code, is
what a GPU run executes. Import it before the trainer is built."""

from __future__ import annotations

import accelerate.state as state
from accelerate.utils import DistributedType

_accelerator_state_init = state.AcceleratorState.__init__


def _init_with_fsdp_on_cpu(self, *args, fsdp_plugin=None, **kwargs):
    _accelerator_state_init(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
    if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
        if self._mixed_precision != "no":
            fsdp_plugin.set_mixed_precision(self._mixed_precision)
        self.fsdp_plugin = fsdp_plugin
        self.distributed_type = DistributedType.FSDP
        state.PartialState._shared_state["distributed_type"] = DistributedType.FSDP


state.AcceleratorState.__init__ = _init_with_fsdp_on_cpu

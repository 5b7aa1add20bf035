"""The vLLM engine in the trainer's own process (`vllm_mode="colocate"`): built, given the weights, put to sleep.

Owns the engine's construction (one per training process: vLLM's in-process executor for one process on one
device, TRL's `external_launcher` layout otherwise, tensor-parallel groups of `vllm_tensor_parallel_size` ranks),
what building it must leave alone in the trainer's process (the random state, `LD_PRELOAD` for child processes), the
in-memory weight push (the worker's in-place reload, the tied head re-packed) and sleep mode. What it does not own:
prompts and samples (`rollout.vllm_colocate`), the weights as named tensors (`weight_sync`), when to sync.
"""

from __future__ import annotations

import importlib.util
import os
import random
import socket
import sys
from collections.abc import Iterable

import numpy as np
import torch

from .worker_extension import reload_in_place


def checkpoint_path(model) -> str:
    """The directory (or Hub id) the policy was loaded from, which the engine loads its architecture from."""
    base = model.get_base_model() if hasattr(model, "peft_config") else model
    path = getattr(base, "name_or_path", None) or getattr(base.config, "_name_or_path", None)
    if not path:
        raise ValueError(
            "vllm_mode='colocate' builds its vLLM engine from the checkpoint the model was loaded from, and this "
            "model has none (built in memory): save it with save_pretrained and pass the directory as `model`."
        )
    return path


def engine_dtype(model) -> torch.dtype:
    """The dtype the engine runs in: the policy's own (its embedding's, which a 4-bit base leaves unquantized), so
    both sides compute in the same precision (vLLM's default would run an fp32 checkpoint in bf16)."""
    return model.get_input_embeddings().weight.dtype


def engine_kwargs(args, model, process_index: int, world_size: int, on_cpu: bool) -> dict:
    """`vllm.LLM`'s arguments for this process's engine."""
    tensor_parallel = args.vllm_tensor_parallel_size
    max_model_len = args.vllm_max_model_length
    if max_model_len is None and args.max_prompt_length is not None:
        max_model_len = args.max_prompt_length + args.max_completion_length
    kwargs = {
        "model": checkpoint_path(model),
        "dtype": str(engine_dtype(model)).replace("torch.", ""),
        "tensor_parallel_size": tensor_parallel,
        "gpu_memory_utilization": args.vllm_gpu_memory_utilization,  # on CPU: the share of the node's memory
        "max_model_len": max_model_len,
        # One local generation batch at once (TRL's bound).
        "max_num_seqs": max(1, args.per_device_train_batch_size * tensor_parallel * args.steps_per_generation),
        "enable_sleep_mode": args.vllm_enable_sleep_mode,
        "model_impl": args.vllm_model_impl,
        # The ranks of one tensor-parallel group sample alike; the groups differ.
        "seed": args.seed + process_index // tensor_parallel,
        "logprobs_mode": "processed_logprobs",  # the log-probs of the distribution sampled from (the correction's)
        "trust_remote_code": getattr(args, "trust_remote_code", False),
    }
    if world_size > 1 or tensor_parallel > 1:
        kwargs["distributed_executor_backend"] = "external_launcher"  # every training process drives its engine
    if on_cpu:
        kwargs["enforce_eager"] = True  # compiling the CPU graphs costs more than a run of this size saves
    else:
        kwargs["max_num_batched_tokens"] = max(4096, max_model_len or 0)  # vLLM's profiler misjudges its default
    return kwargs


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class ColocatedEngine:
    """One vLLM `LLM` in this process, holding a copy of the policy."""

    def __init__(self, args, model, accelerator):
        if importlib.util.find_spec("vllm") is None:
            raise ImportError(
                f"vllm_mode='colocate' runs a vLLM engine in the training process, and this environment "
                f"({sys.executable}) has no vLLM: `pip install 'gspo-trl[vllm]'` on GPUs; on CPU, run the trainer with "
                "the Python of the venv scripts/setup_vllm_cpu.sh builds (docs/vllm.md#colocated-vllm)."
            )
        on_cpu = accelerator.device.type == "cpu"
        world_size, process_index = accelerator.num_processes, accelerator.process_index  # tp divides it (config)
        kwargs = engine_kwargs(args, model, process_index, world_size, on_cpu)
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine in this process, where the weights are
        if "distributed_executor_backend" in kwargs:  # vLLM joins the process group (torchrun sets these)
            os.environ.setdefault("RANK", str(process_index))
            os.environ.setdefault("LOCAL_RANK", str(accelerator.local_process_index))
            os.environ.setdefault("WORLD_SIZE", str(world_size))
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", str(_free_port()))
        self.sleep_mode = args.vllm_enable_sleep_mode
        self.tp_group = None
        if args.vllm_tensor_parallel_size > 1:  # collective: every process builds every group
            size = args.vllm_tensor_parallel_size
            ranks = [list(range(start, start + size)) for start in range(0, world_size, size)]
            self.tp_group, _ = torch.distributed.new_subgroups_by_enumeration(ranks)
        from vllm import LLM

        # Building the engine re-seeds the global random generators and, on CPU, adds its allocator to LD_PRELOAD,
        # which every child process would inherit: both are put back as they were.
        rng_states = (random.getstate(), np.random.get_state(), torch.random.get_rng_state())
        cuda_states = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
        ld_preload = os.environ.get("LD_PRELOAD")
        try:
            self.llm = LLM(**kwargs)
        finally:
            random.setstate(rng_states[0])
            np.random.set_state(rng_states[1])
            torch.random.set_rng_state(rng_states[2])
            if cuda_states is not None:
                torch.cuda.set_rng_state_all(cuda_states)
            if ld_preload is None:
                os.environ.pop("LD_PRELOAD", None)
            else:
                os.environ["LD_PRELOAD"] = ld_preload
        self.dtype = engine_dtype(model)
        self.asleep = False
        self.sleep()

    def sampling_params(self, n: int, fields: dict):
        """vLLM's `SamplingParams` for `n` samples from the request fields the server takes (`sampling_params`),
        each sampled token's log-prob recorded."""
        from vllm import SamplingParams
        from vllm.sampling_params import StructuredOutputsParams

        fields = dict(fields)
        if isinstance(fields.get("structured_outputs"), dict):
            fields["structured_outputs"] = StructuredOutputsParams(**fields["structured_outputs"])
        return SamplingParams(n=n, logprobs=0, **fields)

    def push(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load (checkpoint name, tensor) pairs into the engine in place, then forget the KV cache of old weights."""
        self.wake()
        self.llm.collective_rpc(reload_in_place, kwargs={"weights_iterator": iter(weights)})
        self.llm.reset_prefix_cache()

    def generate(self, prompts: list[dict], params: list) -> list:
        """vLLM's `RequestOutput` per prompt (`{"prompt_token_ids": ...}`), awake only for the call with sleep mode."""
        self.wake()
        try:
            return self.llm.generate(prompts, sampling_params=params, use_tqdm=False)
        finally:
            self.sleep()

    def sleep(self) -> None:
        """With sleep mode: the weights offloaded to host memory and the KV cache freed while the trainer trains (level
        1 keeps the weights, so a multi-turn episode's next turn needs no new push)."""
        if self.sleep_mode and not self.asleep:
            self.llm.sleep(level=1)
            self.asleep = True

    def wake(self) -> None:
        if self.asleep:
            self.llm.wake_up()
            self.asleep = False

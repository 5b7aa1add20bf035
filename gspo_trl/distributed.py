"""Distributed concerns the other modules call instead of branching on the launcher themselves.

Owns finding the Hugging Face model inside whatever wraps it (DDP, a DeepSpeed engine, FSDP,
`torch.compile`) and choosing the process group's backend for a multi-process launch on a machine
without an accelerator. What it does not own: gathering rewards and metrics (the trainer, through
accelerate) and the sharding itself (accelerate, DeepSpeed, FSDP).
"""

from __future__ import annotations

import os

import torch


def unwrap_model(model: torch.nn.Module) -> torch.nn.Module:
    """The innermost module under DDP / DeepSpeed / FSDP / `torch.compile` wrappers (a PEFT model stays
    a PEFT model). A DeepSpeed engine forwards unknown attributes to its module, so asking it for
    `config` or `get_output_embeddings` would answer with the wrong object: peel wrappers by their
    `module` / `_orig_mod` attributes instead of probing for the model's methods."""
    while True:
        inner = getattr(model, "_orig_mod", None)
        if not isinstance(inner, torch.nn.Module):
            inner = model.__dict__.get("_modules", {}).get("module")
        if not isinstance(inner, torch.nn.Module):
            return model
        model = inner


def launched_processes() -> int:
    """Processes started by torchrun / accelerate launch / mpirun (1 when run directly)."""
    for name in ("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE"):
        if name in os.environ:
            return int(os.environ[name])
    return 1


def has_accelerator() -> bool:
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None and hasattr(accelerator, "is_available"):
        return bool(accelerator.is_available())
    return torch.cuda.is_available()


def needs_cpu_process_group(use_cpu: bool) -> bool:
    """True for a multi-process launch on a machine with no accelerator and `use_cpu` unset.

    Without `use_cpu`, accelerate sees no GPU and trains each process alone on its own copy of the
    batch (and rank 1 later fails with an IndexError). With it, the processes form a gloo group.
    """
    return not use_cpu and launched_processes() > 1 and not has_accelerator()

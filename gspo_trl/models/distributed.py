"""Distributed concerns the other modules call instead of branching on the launcher themselves.

Owns finding the Hugging Face model inside whatever wraps it (DDP, a DeepSpeed engine, FSDP,
`torch.compile`), joining the process group before the model is built, telling ZeRO-3-partitioned
modules apart and gathering the weights for a whole rollout's generation (ZeRO-3, FSDP2) or for the LM
head outside the forward (FSDP2), placing (and under FSDP2 sharding) evaluation-only models like the
policy, choosing the
process group's backend for a multi-process launch on a machine without an accelerator, the context a rollout
is sampled in (`generation_context`), and saying when a requested sharding was not applied. What it does not
own: gathering a rollout (`training.gather`), rewards and metrics (`scoring`, `reporting`, through accelerate) and
the policy's sharding itself
(accelerate, DeepSpeed, FSDP).
"""

from __future__ import annotations

import contextlib
import copy
import os

import torch
from transformers.utils import logging

from .checkpointing import checkpoint_kwargs
from .precision import precision_context

logger = logging.get_logger(__name__)


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


def set_up_process_group(args) -> None:
    """Join the launch's process group before the model is built.

    `TrainingArguments` sets up accelerate's state (and the process group) on its first `device`
    access, which `Trainer.__init__` makes only after the model exists. DeepSpeed ZeRO-3 partitions
    parameters while `from_pretrained` runs (`zero.Init`) and checks its batch sizes against the world
    size then: without the group it sees one process and fails.
    """
    args.device  # noqa: B018 (a cached property with side effects)
    if args.deepspeed and torch.distributed.is_available() and torch.distributed.is_initialized():
        import deepspeed

        # DeepSpeed's own communication layer, which zero.Init asks for the world size, wraps the
        # group just made (on CPU accelerate makes a gloo group and leaves DeepSpeed's uninitialized).
        deepspeed.init_distributed(dist_backend=torch.distributed.get_backend())


def check_deepspeed_batch_fields(args, num_processes: int) -> None:
    """Fail at construction when a DeepSpeed config's batch fields contradict the GSPOConfig's.

    DeepSpeed's micro-batch is GSPO's `per_device_train_batch_size` (completions per process and micro-step);
    its `train_batch_size` is the completions of one optimizer step over every process.
    """
    if not args.deepspeed:
        return
    config = args.deepspeed if isinstance(args.deepspeed, dict) else args.hf_deepspeed_config.config
    expected = {
        "train_micro_batch_size_per_gpu": args.per_device_train_batch_size,
        "gradient_accumulation_steps": args.gradient_accumulation_steps,
        "train_batch_size": args.per_device_train_batch_size * args.gradient_accumulation_steps * num_processes,
    }
    wrong = [
        f"{name}={config[name]} (GSPOConfig implies {value})"
        for name, value in expected.items()
        if isinstance(config.get(name), int) and config[name] != value
    ]
    if wrong:
        raise ValueError(
            f"The DeepSpeed config contradicts GSPOConfig on {num_processes} process(es): {', '.join(wrong)}. "
            "per_device_train_batch_size counts completions per process and micro-step, and train_batch_size = "
            "per_device_train_batch_size × gradient_accumulation_steps × num_processes. Set these DeepSpeed "
            'fields to "auto" (or to the values above).'
        )


def is_partitioned(module: torch.nn.Module) -> bool:
    """Whether DeepSpeed ZeRO-3 manages `module`'s own parameters."""
    return any(getattr(p, "ds_status", None) is not None for p in module.parameters(recurse=False))


def prepare_frozen_model(model: torch.nn.Module, accelerator, scored_by_logprobs: bool = False) -> torch.nn.Module:
    """Place a model that is only evaluated (the reference, a reward model) like the policy.

    Under DeepSpeed ZeRO-3 its parameters were partitioned while it loaded, and only a DeepSpeed engine
    gathers them for a forward: it gets an inference engine (no optimizer), sharded like the policy. Under
    FSDP2 (accelerate's evaluation-mode preparation leaves it whole on every process) it is sharded block by
    block (`shard_frozen_model`); `scored_by_logprobs` (the reference): its root keeps its parameters after its
    forward, since `logprobs` projects the LM head, a root parameter, right after it and then reshards the root
    (one gather of the root per pass instead of two). Otherwise accelerate's evaluation-mode preparation (device
    placement, autocast).
    """
    fsdp = getattr(accelerator.state, "fsdp_plugin", None)
    if fsdp is not None and getattr(fsdp, "fsdp_version", 1) == 2:
        mesh = getattr(accelerator, "torch_device_mesh", None)
        if mesh is not None and accelerator.parallelism_config is not None:
            mesh = mesh[tuple(accelerator.parallelism_config.fsdp_dim_names)]
        return shard_frozen_model(
            model,
            mesh=mesh,
            mp_policy=fsdp.mixed_precision_policy,
            offload_policy=fsdp.cpu_offload,
            block_names=fsdp.transformer_cls_names_to_wrap,
            reshard_root_after_forward=not scored_by_logprobs,
        )
    plugin = accelerator.state.deepspeed_plugin
    if plugin is None or plugin.zero_stage != 3:
        return accelerator.prepare_model(model, evaluation_mode=True)
    import deepspeed

    config = copy.deepcopy(plugin.deepspeed_config)
    for training_only in ("optimizer", "scheduler"):
        config.pop(training_only, None)
    config["zero_optimization"].pop("offload_optimizer", None)
    engine, *_ = deepspeed.initialize(model=model, config=config)
    engine.eval()
    return engine


def shard_frozen_model(
    model: torch.nn.Module,
    *,
    mesh=None,
    mp_policy=None,
    offload_policy=None,
    block_names=None,
    reshard_root_after_forward: bool = True,
) -> torch.nn.Module:
    """Shard a model that is only evaluated with FSDP2 (`fully_shard`): each transformer block (the classes
    `block_names` names, by default the model's `_no_split_modules`) and then the root, every one resharded after
    its forward (the root only with `reshard_root_after_forward`; otherwise whoever runs it calls `reshard()`). At
    rest each process holds 1/N of the weights; a forward gathers one block at a time, so its peak is one whole
    block beside the root's own parameters (embeddings, final norm, LM head), not the whole model, as when only the
    root is sharded (TRL's `prepare_fsdp`). Its parameters stop requiring gradients; evaluation mode.
    `mp_policy` / `offload_policy` / `mesh`: the policy's FSDP2 settings (None: FSDP2's defaults)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    if isinstance(mp_policy, dict):  # accelerate's plugin before it converts its settings
        mp_policy = MixedPrecisionPolicy(**mp_policy)
    if not isinstance(offload_policy, OffloadPolicy):
        offload_policy = CPUOffloadPolicy() if offload_policy else OffloadPolicy()
    names = set(block_names or getattr(model, "_no_split_modules", None) or [])
    settings = {
        "reshard_after_forward": True,
        "mp_policy": mp_policy or MixedPrecisionPolicy(),
        "offload_policy": offload_policy,
    }
    if mesh is not None:
        settings["mesh"] = mesh
    model.requires_grad_(False)
    for module in list(model.modules())[1:]:
        if type(module).__name__ in names and not fsdp2_modules(module):
            fully_shard(module, **settings)
    fully_shard(model, **{**settings, "reshard_after_forward": reshard_root_after_forward})
    return model.eval()


def warn_if_fsdp_dropped(args, accelerator) -> None:
    """FSDP asked for but not set up (accelerate leaves it out on CPU): say so, since each process then
    holds the whole model, as under DDP."""
    if args.fsdp and getattr(accelerator.state, "fsdp_plugin", None) is None:
        logger.warning(
            f"fsdp={args.fsdp!r} is set, but accelerate did not enable FSDP for this run (it does not on CPU, "
            f"use_cpu={args.use_cpu}): training runs data-parallel, every process holding the whole model. Use "
            "GPUs for FSDP, or DeepSpeed ZeRO-3 (`deepspeed=...`), which shards on CPU too."
        )


def weights_for_generation(model_wrapped: torch.nn.Module, accelerator, gather_zero3: bool, checkpointing_kwargs=None):
    """The context generation runs in: under DeepSpeed ZeRO-3 with `gather_zero3`, every parameter is
    gathered once for the whole rollout (and ZeRO-3's per-module hooks are lifted meanwhile) instead of
    layer by layer at every decoding step, through TRL's own context, so `ds3_gather_for_generation`
    means what it means in TRL; under FSDP2 the same flag gathers once too (`fsdp2_whole_weights`). Elsewhere
    nothing (the backend unwraps the model itself)."""
    if gather_zero3 and fsdp2_modules(model_wrapped):
        return fsdp2_whole_weights(model_wrapped)
    plugin = accelerator.state.deepspeed_plugin
    if not gather_zero3 or plugin is None or plugin.zero_stage != 3:
        return contextlib.nullcontext()
    from trl.models.utils import unwrap_model_for_generation

    return unwrap_model_for_generation(
        model_wrapped, accelerator, gather_deepspeed3_params=True, gradient_checkpointing_kwargs=checkpointing_kwargs
    )


def has_sharded_parameters(model: torch.nn.Module) -> bool:
    """Whether `model` holds parameter shards that every forward gathers with the other processes (DeepSpeed ZeRO-3,
    FSDP2's DTensors, FSDP1's flat parameters): each process must then run the same forwards."""
    return any(
        hasattr(p, "ds_id") or type(p).__name__ in ("DTensor", "FlatParameter")
        for p in unwrap_model(model).parameters()
    )


def fsdp2_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules of `model` that FSDP2 (`fully_shard`) shards, outermost first (empty without FSDP2)."""
    return [module for module in model.modules() if is_fsdp2_module(module)]


def is_fsdp2_module(module: torch.nn.Module) -> bool:
    """Whether FSDP2 (`fully_shard`) made `module` a sharded unit of its own."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return False
    return isinstance(module, FSDPModule)


def unshard_fsdp2_owner(model: torch.nn.Module, module: torch.nn.Module) -> torch.nn.Module | None:
    """Under FSDP2, all-gather `module`'s parameters when they are sharded now (its owner, the innermost sharded
    module holding it, resharded them after its forward: `reshard_after_forward=True` on the root), so that a
    computation outside the model's forward (the LM head of `logprobs`) uses whole parameters whose gradients
    FSDP2 reduces across processes like any other. Returns the owner the caller must reshard when no backward pass
    follows (None if none): the one it gathered, or a frozen model's owner that kept its parameters after its
    forward (`shard_frozen_model` without resharding the root), which no backward pass will ever reshard."""
    sharded = hasattr(getattr(module, "weight", None), "full_tensor")
    if not sharded and not is_fsdp2_module(model):  # no FSDP2 here (its root is always a unit): nothing to look up
        return None
    owners = [owner for owner in fsdp2_modules(model) if any(sub is module for sub in owner.modules())]
    if not owners:
        return None
    owner = owners[-1]
    if sharded:
        owner.unshard()
        return owner
    return None if any(p.requires_grad for p in owner.parameters()) else owner


@contextlib.contextmanager
def fsdp2_whole_weights(model: torch.nn.Module):
    """Under FSDP2, every sharded module's parameters all-gathered once for the block and kept whole through
    its forwards, then sharded again with each module's own `reshard_after_forward` restored: a rollout then
    costs one gather per module instead of one per module per decoding step. The setting lives in FSDP2's
    private state; where a torch version has it elsewhere, nothing is gathered up front and each forward
    gathers as usual (slower, same results)."""
    modules = fsdp2_modules(model)
    try:
        if modules:  # before the first forward: let the root decide now (no resharding after its own forward), so
            # that restoring the settings below does not undo that choice (the root's parameters, freed after every
            # forward, then crashed a backward through them that did not use the model's own output)
            modules[0]._get_fsdp_state()._lazy_init()
        saved = [
            (
                state,
                state._auto_reshard_after_forward,
                [group.post_forward_mesh_info for group in state._fsdp_param_groups],
            )
            for state in (module._get_fsdp_state() for module in modules)
        ]
    except AttributeError:
        logger.warning_once(
            "FSDP2: this torch version keeps reshard_after_forward elsewhere; generation gathers "
            "the sharded parameters at every forward"
        )
        yield
        return
    for module in modules:
        module.set_reshard_after_forward(False, recurse=False)
        module.unshard()
    try:
        yield
    finally:
        for module in modules:
            module.reshard()
        for state, automatic, infos in saved:
            state._auto_reshard_after_forward = automatic
            for group, info in zip(state._fsdp_param_groups, infos):
                group.post_forward_mesh_info = info


def fsdp_deferral(trainer):
    """The trainer's own `no_sync` for a model FSDP2-sharded at load time, as its training loop picks it; None
    otherwise (Accelerate's `no_sync` applies)."""
    if not getattr(trainer, "is_distributed_loading_by_transformers", False):
        return None
    from transformers.integrations.fsdp import is_fsdp_managed_module

    return trainer._defer_fsdp_gradient_reduction if is_fsdp_managed_module(trainer.model) else None


@contextlib.contextmanager
def gradients_held(accelerator, model: torch.nn.Module, defer_fsdp_reduction=None):
    """Back-propagate without synchronising gradients across processes, as in an accumulation window's earlier
    micro-steps: for the passes of a micro-batch before its last (`passes`). Inside a micro-step that does not
    synchronise anyway, nothing changes. Otherwise DDP's and FSDP's reductions wait (``defer_fsdp_reduction``:
    the trainer's own context for a model sharded at load time), and DeepSpeed sees no accumulation boundary
    (Accelerate's ``sync_gradients``), so that it neither reduces nor steps."""
    if not accelerator.sync_gradients:
        yield
        return
    accelerator.gradient_state._set_sync_gradients(False)
    try:
        with defer_fsdp_reduction() if defer_fsdp_reduction is not None else accelerator.no_sync(model):
            yield
    finally:
        accelerator.gradient_state._set_sync_gradients(True)


def generation_context(model_wrapped, accelerator, args, on_training_model: bool) -> contextlib.AbstractContextManager:
    """What sampling on the trained model (`on_training_model`) runs under: the training precision and
    `weights_for_generation`; nothing for an engine with weights of its own."""
    if not on_training_model:
        return contextlib.nullcontext()
    stack = contextlib.ExitStack()
    stack.enter_context(precision_context(accelerator))
    kwargs = checkpoint_kwargs(args)
    stack.enter_context(weights_for_generation(model_wrapped, accelerator, args.ds3_gather_for_generation, kwargs))
    return stack


def gather_ragged(values: torch.Tensor, accelerator) -> torch.Tensor:
    """Every process's 1-D `values` concatenated, whatever their lengths (e.g. the valid tokens' entropies)."""
    if accelerator.num_processes == 1:
        return values
    lengths = accelerator.gather(torch.tensor([values.numel()], device=values.device))
    padded = accelerator.gather(accelerator.pad_across_processes(values, dim=0))
    longest = int(lengths.max())
    return torch.cat([padded[rank * longest : rank * longest + int(n)] for rank, n in enumerate(lengths.tolist())])


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

"""The policy's weights as a vLLM server loads them: Hugging Face names, LoRA merged in, written as safetensors.

Owns turning the training model (plain, PEFT/LoRA, ZeRO-3-partitioned, a 4-bit/8-bit base dequantized) into (name,
tensor) pairs in the base model's checkpoint names, without changing the training weights (LoRA deltas are added to
a copy, never merged in and out of the live weights, which would leave rounding drift behind), gathering one module
at a time under ZeRO-3 (never the whole model at once), and writing the snapshot directory the server reloads from.
What it does not own: telling the server to load it (`client`), deciding when to sync (`backend`).
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator

import torch

from ..models.distributed import unwrap_model
from ..models.quantization import dequantized
from .collective import sync_group

SHARD_BYTES = 2 * 1024**3


def _gathered(module: torch.nn.Module, recurse: bool):
    """Under ZeRO-3, the module's parameters gathered on every process for the duration (read-only)."""
    params = list(module.parameters(recurse=recurse))
    if not any(getattr(p, "ds_status", None) is not None for p in params):
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(params, modifier_rank=None)


def _peft_classes():
    try:
        from peft.tuners.lora import LoraLayer
        from peft.utils import ModulesToSaveWrapper
    except ImportError:  # peft is a dependency; keep this module importable without it all the same
        return (), ()
    return (LoraLayer,), (ModulesToSaveWrapper,)


def _lora_merged_weight(layer) -> torch.Tensor:
    """W + Σ ΔW of the active, unmerged adapters, computed on a copy (W dequantized from a quantized base)."""
    weight = dequantized(layer.get_base_layer().weight).detach().clone()
    if not getattr(layer, "merged", False) and not getattr(layer, "disable_adapters", False):
        adapters = layer.active_adapters if isinstance(layer.active_adapters, list) else [layer.active_adapters]
        for adapter in adapters:
            if adapter in layer.lora_A or adapter in getattr(layer, "lora_embedding_A", {}):
                weight += layer.get_delta_weight(adapter).to(weight.dtype)
    return weight


def named_weights(
    model: torch.nn.Module, dtype: torch.dtype | None = None, merge_lora: bool = True, to_cpu: bool = True
) -> Iterator[tuple[str, torch.Tensor]]:
    """(checkpoint name, tensor) for every parameter of the policy as the base model would save it; LoRA layers
    with their adapter merged in, or, with `merge_lora=False`, the frozen base weights alone. `to_cpu`: each tensor
    a CPU copy (for a snapshot); False: where the weight lives, uncopied where no conversion is needed (for an
    engine in this process, which copies it into its own weights at once).

    Every process must iterate (ZeRO-3 gathers are collective); the tensors are only worth keeping on one.
    A tied LM head is the embedding's parameter and is yielded once, under the embedding's name.
    """
    model = unwrap_model(model)
    lora_types, wrapper_types = _peft_classes()
    base = model.get_base_model() if hasattr(model, "get_base_model") and hasattr(model, "peft_config") else model
    seen: set[int] = set()
    done_prefixes: list[str] = []

    def out(tensor: torch.Tensor) -> torch.Tensor:
        gathered = getattr(tensor, "ds_status", None) is not None  # its storage is freed when the gather ends
        tensor = dequantized(tensor).detach()  # a 4-bit/8-bit base weight as the floats its layer multiplies by
        if hasattr(tensor, "full_tensor"):  # an FSDP2 shard (DTensor): all-gathered, a collective like ZeRO-3's
            tensor = tensor.full_tensor()
        if dtype is not None and tensor.is_floating_point():
            tensor = tensor.to(dtype)
        if to_cpu:
            return tensor.to("cpu", copy=True).contiguous()
        return tensor.clone() if gathered else tensor.contiguous()

    for module_name, module in base.named_modules():
        if any(module_name.startswith(prefix) for prefix in done_prefixes):
            continue
        prefix = f"{module_name}." if module_name else ""
        if lora_types and isinstance(module, lora_types):
            done_prefixes.append(prefix)
            base_layer = module.get_base_layer()
            with _gathered(module, recurse=True):
                if id(base_layer.weight) not in seen:
                    seen.add(id(base_layer.weight))
                    weight = _lora_merged_weight(module) if merge_lora else base_layer.weight
                    yield f"{prefix}weight", out(weight)
                if getattr(base_layer, "bias", None) is not None:
                    yield f"{prefix}bias", out(base_layer.bias)
            continue
        if wrapper_types and isinstance(module, wrapper_types):
            done_prefixes.append(prefix)
            active = (
                module.modules_to_save[module.active_adapter] if not module.disable_adapters else module.original_module
            )
            with _gathered(active, recurse=True):
                for name, param in active.named_parameters():
                    if id(param) not in seen:
                        seen.add(id(param))
                        yield f"{prefix}{name}", out(param)
            continue
        own = [(name, param) for name, param in module.named_parameters(recurse=False) if id(param) not in seen]
        if not own:
            continue
        with _gathered(module, recurse=False):
            for name, param in own:
                seen.add(id(param))
                yield f"{prefix}{name}", out(param)


def adapter_sync_unsupported_reason(model: torch.nn.Module, max_lora_rank: int | None) -> str | None:
    """Why the policy's LoRA adapter alone cannot be sent to the server (None: it can)."""
    model = unwrap_model(model)
    peft_config = getattr(model, "peft_config", {}).get(getattr(model, "active_adapter", "default"))
    if peft_config is None or str(getattr(peft_config, "peft_type", "")).upper().split(".")[-1] != "LORA":
        return "the policy is not a LoRA model"
    if max_lora_rank is None:
        return "the server was started without --enable-lora"
    if peft_config.r > max_lora_rank:
        return f"the adapter's rank {peft_config.r} exceeds the server's --max-lora-rank {max_lora_rank}"
    if getattr(peft_config, "use_dora", False) or getattr(peft_config, "use_rslora", False):
        return "vLLM does not load DoRA or rsLoRA adapters"
    if getattr(peft_config, "modules_to_save", None):
        return "the adapter has modules_to_save, which vLLM does not load"
    targets = peft_config.target_modules
    names = [targets] if isinstance(targets, str) else list(targets or [])
    if any(name in ("lm_head", "embed_tokens") or name.endswith((".lm_head", ".embed_tokens")) for name in names):
        return "the adapter targets the embedding or the LM head"
    if any(getattr(p, "ds_status", None) is not None or hasattr(p, "full_tensor") for p in model.parameters()):
        return "the parameters are sharded (ZeRO-3 / FSDP2)"
    return None


def write_adapter(model: torch.nn.Module, directory: str) -> None:
    """The active LoRA adapter as PEFT saves it (adapter_config.json + adapter_model.safetensors), replacing the
    last."""
    shutil.rmtree(directory, ignore_errors=True)
    unwrap_model(model).save_pretrained(directory)


def write_snapshot(
    model: torch.nn.Module, directory: str, is_writer: bool, dtype: torch.dtype | None = None, merge_lora: bool = True
) -> int:
    """Write the policy's weights as safetensors shards into `directory` (emptied first); returns the bytes written.

    Every process must call it (ZeRO-3 gathers are collective); only `is_writer` keeps tensors and writes.
    """
    from safetensors.torch import save_file

    if is_writer:
        os.makedirs(directory, exist_ok=True)
        for entry in os.listdir(directory):
            if entry.endswith(".safetensors") or entry.endswith(".safetensors.index.json"):
                os.remove(os.path.join(directory, entry))
    shard: dict[str, torch.Tensor] = {}
    shard_bytes, total, index = 0, 0, 0

    def flush():
        nonlocal shard, shard_bytes, index
        if shard:
            save_file(shard, os.path.join(directory, f"model-{index:05d}.safetensors"), metadata={"format": "pt"})
            index += 1
        shard, shard_bytes = {}, 0

    for name, tensor in named_weights(model, dtype, merge_lora):
        if not is_writer:
            continue
        shard[name] = tensor
        size = tensor.numel() * tensor.element_size()
        shard_bytes, total = shard_bytes + size, total + size
        if shard_bytes >= SHARD_BYTES:
            flush()
    if is_writer:
        flush()
    return total


def weight_chunks(
    weights: Iterator[tuple[str, torch.Tensor]], max_bytes: int
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """`weights` in consecutive chunks of at most `max_bytes`, never splitting a `sync_group` (a group larger than
    `max_bytes` is a chunk of its own). A group's weights arrive together, as `named_weights` walks the module tree."""
    chunk: list[tuple[str, torch.Tensor]] = []
    group: list[tuple[str, torch.Tensor]] = []
    chunk_bytes = group_bytes = 0
    group_name = None
    for name, tensor in weights:
        if sync_group(name) != group_name:
            if chunk and chunk_bytes + group_bytes > max_bytes:
                yield chunk
                chunk, chunk_bytes = [], 0
            chunk, chunk_bytes = chunk + group, chunk_bytes + group_bytes
            group, group_bytes, group_name = [], 0, sync_group(name)
        group.append((name, tensor))
        group_bytes += tensor.numel() * tensor.element_size()
    if chunk and chunk_bytes + group_bytes > max_bytes:
        yield chunk
        chunk = []
    if chunk or group:
        yield chunk + group


def serialize_chunk(chunk: list[tuple[str, torch.Tensor]]) -> bytes:
    """A chunk as the bytes of a safetensors file."""
    from safetensors.torch import save

    return save(dict(chunk), metadata={"format": "pt"})

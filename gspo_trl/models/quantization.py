"""A quantized base under a LoRA adapter (QLoRA): bitsandbytes 4-bit (or 8-bit) weights, frozen; the adapter learns.

Owns what a quantized policy needs beyond a plain one: the `quantization_config` put into the loading kwargs (the
trainer's argument or `model_init_kwargs["quantization_config"]`, as TRL takes them), the refusal of full fine-tuning
of a quantized model, peft's `prepare_model_for_kbit_training`, one forward path for every pass on CPU
(`keep_one_cpu_path`), and a quantized weight dequantized for the vLLM weight sync. What it does not own: loading
the model and wrapping it with the adapter (`models`), the snapshot's names and merge (`vllm.weight_sync`).
"""

from __future__ import annotations

import importlib.util

import torch

INSTALL = "pip install 'gspo-trl[qlora]' (which installs bitsandbytes)"


def quantized_load_kwargs(model_init_kwargs: dict | None, quantization_config) -> dict:
    """`model_init_kwargs` for `from_pretrained` with the trainer's `quantization_config` put in; a bitsandbytes
    config (a `BitsAndBytesConfig` or its dict) needs the package, which is checked here with the fix named."""
    kwargs = dict(model_init_kwargs or {})
    if quantization_config is not None:
        if kwargs.get("quantization_config") is not None:
            raise ValueError(
                "quantization_config is set both as a GSPOTrainer argument and in model_init_kwargs: set it in one "
                "place only."
            )
        kwargs["quantization_config"] = quantization_config
    config = kwargs.get("quantization_config")
    if config is None:
        return kwargs
    from transformers import BitsAndBytesConfig
    from transformers.quantizers.auto import AutoQuantizationConfig

    if isinstance(config, dict):
        config = kwargs["quantization_config"] = AutoQuantizationConfig.from_dict(dict(config))
    if isinstance(config, BitsAndBytesConfig) and importlib.util.find_spec("bitsandbytes") is None:
        raise ImportError(
            f"quantization_config asks for a bitsandbytes-quantized model, but bitsandbytes is missing: {INSTALL}."
        )
    return kwargs


def refuse_sharded(args) -> None:
    """A quantized base under DeepSpeed ZeRO-3 or FSDP is refused: their partitioning flattens bitsandbytes' packed
    weights apart from the quantization state that decodes them."""
    import os

    from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

    environ = os.environ
    accelerate_zero3 = environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() == "true" and (
        environ.get("ACCELERATE_DEEPSPEED_ZERO_STAGE") == "3"
    )
    sharding = "DeepSpeed ZeRO-3" if is_deepspeed_zero3_enabled() or accelerate_zero3 else None
    if getattr(args, "fsdp", None) or environ.get("ACCELERATE_USE_FSDP", "").lower() == "true":
        sharding = "FSDP"
    if sharding:
        raise ValueError(
            f"A quantized base (quantization_config, QLoRA) cannot be trained under {sharding}: gspo-trl does not "
            "shard 4-bit/8-bit weights. Train QLoRA with one process per GPU under DDP (each holds the whole "
            f"quantized base, which QLoRA makes small), or drop quantization_config to use {sharding}."
        )


def check_device_map(model_init_kwargs: dict | None, use_cpu: bool) -> None:
    """With `use_cpu=True`, a `device_map` in `model_init_kwargs` must leave the model on the CPU: transformers would
    place it on a GPU, where the CPU training step cannot reach it."""
    device_map = (model_init_kwargs or {}).get("device_map")
    if not use_cpu or device_map is None:
        return
    placements = list(device_map.values()) if isinstance(device_map, dict) else [device_map]
    automatic = ("auto", "balanced", "balanced_low_0", "sequential")
    has_accelerator = torch.cuda.is_available() or (hasattr(torch, "xpu") and torch.xpu.is_available())
    off_cpu = [
        p
        for p in placements
        if not (str(p) in ("cpu", "disk") or (str(p) in automatic and not has_accelerator))  # "auto" finds no GPU
    ]
    if off_cpu:
        raise ValueError(
            f"model_init_kwargs['device_map']={device_map!r} places the model on {off_cpu[0]!r}, but use_cpu=True "
            "trains on the CPU. Remove device_map (or set it to 'cpu'), or set use_cpu=False to train on the GPU."
        )


def is_quantized(model: torch.nn.Module) -> bool:
    """Whether `model` (or the model under its PEFT wrapper) was loaded with bitsandbytes 4-bit or 8-bit weights."""
    return bool(getattr(model, "is_loaded_in_4bit", False) or getattr(model, "is_loaded_in_8bit", False))


def prepare_quantized(model: torch.nn.Module, peft_config, has_adapter: bool) -> torch.nn.Module:
    """A quantized policy made ready for its adapter (a plain one returned as it is); refused without an adapter.

    `prepare_model_for_kbit_training` freezes the base and keeps its unquantized parameters (embeddings, norms, LM
    head) in fp32. It is not asked to switch gradient checkpointing on: the trainer does that itself, with
    `activation_checkpointing` and its kwargs, and `models.apply_peft` makes the inputs require grads for it.
    """
    if not is_quantized(model):
        return model
    if peft_config is None and not has_adapter:
        raise ValueError(
            "The model is quantized (quantization_config, or a model loaded in 4-bit/8-bit), and a quantized model "
            "cannot be fully fine-tuned: its weights are frozen integers. Pass a peft_config (e.g. "
            "peft.LoraConfig(target_modules='all-linear')) to train a LoRA adapter on it (QLoRA)."
        )
    keep_one_cpu_path(model)
    if has_adapter:
        return model
    from peft import prepare_model_for_kbit_training

    return prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)


def keep_one_cpu_path(model: torch.nn.Module) -> None:
    """Every forward of the 4-bit layers on CPU through bitsandbytes' dequantize-and-multiply path.

    On a CPU with AVX512-BF16, bitsandbytes (0.50) repacks a 4-bit weight in place at the first eval-mode forward
    without grad (a rollout's) and from then on multiplies in bf16 with a kernel that has no backward: measured on the
    tiny test Llama, log-probs then differ from the training forward's by bf16 rounding (logits by 2e-3), and the
    gradient that flows back through the quantized layers to the earlier LoRA layers is silently wrong (an input
    gradient's norm 389 instead of 1229). Switching the repacking off keeps sampling, π_old, the reference and the
    training forward on one path, equal bit for bit. A model repacked already is refused: the repacking rounds the
    block scales to bf16, and bitsandbytes' own inverse does not restore them.
    """
    repacked = [name for name, module in model.named_modules() if _repacked(getattr(module, "weight", None))]
    if repacked:
        raise ValueError(
            f"{len(repacked)} 4-bit layers of the model (e.g. {repacked[0]!r}) were repacked by bitsandbytes for its "
            "bf16 CPU kernel, which a forward in eval mode without gradients does on a CPU with AVX512-BF16; that "
            "kernel has no backward and the repacking rounds the weights' scales. Pass the quantized model before "
            "running it, or pass its path with quantization_config."
        )
    for module in model.modules():
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False


def _repacked(weight) -> bool:
    return bool(getattr(getattr(weight, "quant_state", None), "packing_format_for_cpu", False))


def dequantized(weight: torch.Tensor) -> torch.Tensor:
    """A bitsandbytes 4-bit or 8-bit weight as the floating-point matrix its layer multiplies by; any other tensor as
    it is."""
    quant_state = getattr(weight, "quant_state", None)
    if quant_state is not None:  # Params4bit: packed nf4/fp4 codes and their per-block scales
        import bitsandbytes.functional as bnb_functional

        if _repacked(weight):  # never in training (`keep_one_cpu_path`)
            raise ValueError("dequantized: a 4-bit weight in bitsandbytes' repacked CPU layout (keep_one_cpu_path).")
        return bnb_functional.dequantize_4bit(weight.data, quant_state)
    if getattr(weight, "SCB", None) is not None and weight.dtype == torch.int8:  # Int8Params: int8 rows, row scales
        import bitsandbytes.functional as bnb_functional

        return bnb_functional.int8_vectorwise_dequant(weight.data, weight.SCB)
    return weight

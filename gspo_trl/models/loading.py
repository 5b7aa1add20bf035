"""Loading the policy, its tokenizer and the reference model.

Owns turning the `model` argument (a path/id or a `PreTrainedModel`) into a trainable causal LM,
wrapping it with PEFT, switching dropout off, and providing reference log-probabilities for the KL
term: the base weights with the adapter disabled under PEFT (no second copy), otherwise a frozen
copy; and loading a checkpoint to resume from whose weight names are not the model's. What it does
not own: generation, the objective, a quantized base's details (`quantization`).
"""

from __future__ import annotations

import contextlib
import copy
import json
import os

import torch
from safetensors import safe_open
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    AutoProcessor,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)
from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled
from transformers.utils import SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME

from .distributed import unwrap_model
from .multimodal import is_processor, is_vision_config
from .precision import cast_lm_head_to_fp32, check_precision
from .quantization import check_device_map, is_quantized, prepare_quantized, quantized_load_kwargs, refuse_sharded


def load_policy(
    model, model_init_kwargs: dict | None, trust_remote_code: bool = False, quantization_config=None
) -> PreTrainedModel:
    """The policy: loaded from a path or Hub id (`model_init_kwargs`, whose `trust_remote_code` wins over the config
    field's, and the trainer's `quantization_config`, as in TRL), or the model given, checked."""
    if isinstance(model, str):
        kwargs = quantized_load_kwargs(model_init_kwargs, quantization_config)
        kwargs.setdefault("trust_remote_code", trust_remote_code)
        dtype = kwargs.get("dtype", "auto")
        if isinstance(dtype, str) and dtype != "auto":
            kwargs["dtype"] = getattr(torch, dtype)
        config = AutoConfig.from_pretrained(model, trust_remote_code=kwargs.get("trust_remote_code", False))
        auto_class = AutoModelForImageTextToText if is_vision_config(config) else AutoModelForCausalLM
        return auto_class.from_pretrained(model, **kwargs)
    if model_init_kwargs:
        raise ValueError(
            "model_init_kwargs is set but `model` is already instantiated: the kwargs would be ignored. Pass the "
            "model as a path/id string, or drop model_init_kwargs."
        )
    if quantization_config is not None:
        raise ValueError(
            "quantization_config is set but `model` is already instantiated: it would be ignored. Pass the model as a "
            "path/id string, or pass the model already quantized (e.g. loaded with from_pretrained(..., "
            "quantization_config=...)) without quantization_config."
        )
    if not isinstance(model, torch.nn.Module):
        raise TypeError(
            f"`model` must be a path/id string or a transformers PreTrainedModel, got {type(model).__name__}."
        )
    if not hasattr(model, "generate"):
        raise TypeError(f"`model` ({type(model).__name__}) has no `generate` method: pass a causal language model.")
    return model


def load_tokenizer(
    processing_class, model: PreTrainedModel, trust_remote_code: bool = False
) -> tuple[PreTrainedTokenizerBase, object]:
    """(the tokenizer every text step uses, the multimodal processor or None): a vision-language model's processor
    renders and encodes prompts with images; its `tokenizer` does everything else."""
    if processing_class is None:
        path = model.config._name_or_path
        loader = AutoProcessor if is_vision_config(model.config) else AutoTokenizer
        processing_class = loader.from_pretrained(path, trust_remote_code=trust_remote_code)
    processor = processing_class if is_processor(processing_class) else None
    tokenizer = processor.tokenizer if processor is not None else processing_class
    if not isinstance(tokenizer, PreTrainedTokenizerBase):
        raise TypeError(
            "processing_class must be a transformers tokenizer or a multimodal processor holding one (a "
            f"ProcessorMixin with a `tokenizer`), got {type(processing_class).__name__}."
        )
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer, processor


def disable_dropout(model: torch.nn.Module) -> None:
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0


def apply_peft(model: PreTrainedModel, peft_config, gradient_checkpointing: bool):
    if peft_config is None:
        return model
    from peft import get_peft_model

    if gradient_checkpointing:
        # Inputs need grads so that checkpointed blocks of a frozen base still backpropagate to LoRA.
        model.enable_input_require_grads()
    return get_peft_model(model, peft_config)


def router_aux_loss_coef(model: PreTrainedModel, coef: float | None) -> float:
    """The weight of the MoE load-balancing loss: the user's, else the model config's (0 for dense models)."""
    text_config = unwrap_model(model).config.get_text_config()
    returns_router_logits = hasattr(text_config, "output_router_logits")
    if coef and not returns_router_logits:
        raise ValueError(
            f"router_aux_loss_coef={coef} is set, but {type(unwrap_model(model)).__name__} is not a Mixture-of-Experts "
            "model that returns router logits: there is no load-balancing loss to weigh. "
            "Leave router_aux_loss_coef=None."
        )
    if not returns_router_logits:
        return 0.0
    return float(getattr(text_config, "router_aux_loss_coef", 0.0) if coef is None else coef)


def is_peft_model(model) -> bool:
    try:
        from peft import PeftModel
    except ImportError:
        return False
    return isinstance(model, PeftModel)


def prepare_weights(model: PreTrainedModel, args) -> None:
    """What the policy and a reference loaded beside it both get: dropout off, the fp32 LM head."""
    if args.disable_dropout:
        disable_dropout(model)
    if args.cast_lm_head_to_fp32:
        cast_lm_head_to_fp32(model)


def create_reference_model(model: PreTrainedModel, source, args) -> PreTrainedModel | None:
    """A frozen copy of the policy, or None under PEFT (the adapter is disabled instead).

    Under DeepSpeed ZeRO-3 the policy's parameters are partitioned and cannot be copied, so the
    reference is loaded again from `source` (the `model` argument as a path or Hub id), partitioned the
    same way, and prepared like the policy.
    """
    if is_peft_model(model):
        return None
    if is_deepspeed_zero3_enabled():
        if not isinstance(source, str):
            raise ValueError(
                "beta > 0 under DeepSpeed ZeRO-3 needs the reference model loaded partitioned, from a path: pass "
                "`model` to GSPOTrainer as a path or Hub id (with model_init_kwargs), not as an instance."
            )
        reference = load_policy(source, args.model_init_kwargs, args.trust_remote_code)
        prepare_weights(reference, args)
    else:
        # A forward another library set on the instance (TRL's SFTTrainer adds its fused LM head that way) closes over
        # the policy's own bound forward: copied, the reference would run the policy's weights. It gets its class's.
        instance_forward = model.__dict__.pop("forward", None)
        try:
            reference = copy.deepcopy(model)
        finally:
            if instance_forward is not None:
                model.forward = instance_forward
    for parameter in reference.parameters():
        parameter.requires_grad_(False)
    return reference.eval()


@contextlib.contextmanager
def reference_weights(policy, reference):
    """Yield the module that computes reference log-probabilities."""
    if reference is not None:
        yield reference
        return
    with unwrap_model(policy).disable_adapter():
        yield policy


def load_policy_and_tokenizer(
    model, processing_class, peft_config, args, quantization_config=None
) -> tuple[PreTrainedModel, object, object]:
    """The policy to train (loaded, quantized with `quantization_config` if given, prepared, under a PEFT adapter with
    `peft_config`, its precision checked), its tokenizer, and its multimodal processor (None for a text model)."""
    check_device_map(args.model_init_kwargs, args.use_cpu)
    if quantization_config is not None or (args.model_init_kwargs or {}).get("quantization_config") is not None:
        refuse_sharded(args)  # before loading: ZeRO-3 partitions the weights as they load
    model = load_policy(model, args.model_init_kwargs, args.trust_remote_code, quantization_config)
    if is_quantized(model):
        refuse_sharded(args)
    model = prepare_quantized(model, peft_config, has_adapter=is_peft_model(model))
    tokenizer, processor = load_tokenizer(processing_class, model, args.trust_remote_code)
    prepare_weights(model, args)
    model = apply_peft(model, peft_config, args.activation_checkpointing)
    check_precision(model, args)
    return model, tokenizer, processor


def load_renamed_checkpoint(model, checkpoint_dir: str) -> bool:
    """Load the weights of a full (not PEFT) policy whose checkpoint names them otherwise than the model does, from a
    checkpoint to resume from; False for any other model, which `Trainer` loads itself.

    transformers saves some models under their checkpoint's original key names and renames or re-fuses them only in
    `from_pretrained`: vision-language models (`model.layers.*`, `visual.*` for Qwen2.5-VL), Mixture-of-Experts
    models whose experts it holds fused (`experts.gate_up_proj`) but saves one by one (`experts.0.gate_proj.weight`:
    Qwen2/3-MoE, OLMoE, Mixtral, DeepSeek-V3), GPT-NeoX's head (`embed_out`). `Trainer` loads the file with
    `load_state_dict`, non-strict: those weights would be reported missing and stay as they were. The checkpoint is
    loaded with `from_pretrained` instead and copied parameter by parameter."""
    model = unwrap_model(model)
    if is_peft_model(model):
        return False
    saved_names = checkpoint_weight_names(checkpoint_dir)
    if not is_vision_config(model.config) and (saved_names is None or saved_names <= set(model.state_dict())):
        return False
    saved = type(model).from_pretrained(checkpoint_dir, dtype=model.dtype).state_dict()
    state = model.state_dict()
    missing = sorted(set(state) - set(saved))
    if missing:
        raise ValueError(f"{checkpoint_dir} lacks weights of the policy, e.g. {missing[:3]}: cannot resume from it.")
    with torch.no_grad():
        for name, value in state.items():
            value.copy_(saved[name])
    return True


def checkpoint_weight_names(checkpoint_dir: str) -> set[str] | None:
    """The weight names of a checkpoint's safetensors file (or sharded files), read from its header or index; None
    without one."""
    index = os.path.join(checkpoint_dir, SAFE_WEIGHTS_INDEX_NAME)
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as handle:
            return set(json.load(handle)["weight_map"])
    single = os.path.join(checkpoint_dir, SAFE_WEIGHTS_NAME)
    if not os.path.isfile(single):
        return None
    with safe_open(single, framework="pt") as weights:
        return set(weights.keys())

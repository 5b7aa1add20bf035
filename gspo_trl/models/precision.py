"""Numeric precision: the one mixed-precision context, the fp32 LM head, and precision checks.

Owns how dtypes meet. Every forward of the policy or the reference model (the training step, the
old- and reference-log-prob passes, generation, evaluation) runs under `precision_context`, the
accelerator's autocast, so old and new log-probabilities are computed by the same arithmetic and
bf16 rounding cannot leak into the importance ratio. accelerate's mixed-precision wrapper hands
back fp32 hidden states next to bf16 weights; under the context the LM head projection meets them
in bf16 exactly as TRL's does. `Float32LMHead` is TRL's `cast_lm_head_to_fp32`: the head's weight
and its projection stay fp32, outside autocast. What it does not own: the log-softmax (fp32 in
`logprobs`) and the choice of `bf16` / `fp16` (the config's).
"""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.nn.functional as F
from transformers.utils import logging

logger = logging.get_logger(__name__)


def precision_context(accelerator) -> contextlib.AbstractContextManager:
    """The mixed-precision context of training (a no-op without `bf16` / `fp16`)."""
    return accelerator.autocast()


class Float32LMHead(torch.nn.Linear):
    """An LM head that keeps its weight in fp32 and projects in fp32 whatever autocast says.

    Swapped in as the class of the model's existing `nn.Linear` head, so parameter names, tying,
    `deepcopy` (the reference model) and `save_pretrained` are unchanged.
    """

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return project_in_fp32(hidden_states, self.weight, self.bias)


def project_in_fp32(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    with torch.autocast(hidden.device.type, enabled=False):
        return F.linear(hidden.float(), weight.float(), None if bias is None else bias.float())


def _cast_output(module, inputs, output, dtype):
    return output.to(dtype)


def cast_lm_head_to_fp32(model) -> None:
    """TRL's `cast_lm_head_to_fp32` (the ScaleRL recipe): the LM head in fp32 for precise log-probs.

    A tied head shares its weight with the input embedding, which then becomes fp32 too; its output
    is cast back to the rest of the model's dtype so the transformer layers see what they saw before.
    """
    head = model.get_output_embeddings()
    if type(head) is not torch.nn.Linear:
        raise ValueError(
            f"cast_lm_head_to_fp32=True needs a plain nn.Linear LM head; this model's is {type(head).__name__} "
            "(a PEFT adapter on lm_head?). Remove lm_head from the adapter's target modules, or set "
            "cast_lm_head_to_fp32=False."
        )
    body_dtype = model.get_input_embeddings().weight.dtype
    head.float()
    head.__class__ = Float32LMHead
    embeddings = model.get_input_embeddings()
    if embeddings.weight.dtype != body_dtype:  # tied: the embedding was cast with the head
        embeddings.register_forward_hook(functools.partial(_cast_output, dtype=body_dtype))


def check_precision(model, args) -> None:
    """Fail fast on precision settings that would crash at the first optimizer step."""
    if args.fp16:
        half = [name for name, p in model.named_parameters() if p.requires_grad and p.dtype == torch.float16]
        if half:
            raise ValueError(
                f"fp16=True trains fp32 master weights with a loss scaler, but {len(half)} trainable parameters are "
                f"float16 (e.g. {half[0]!r}), which the scaler cannot unscale. Load the model in fp32 "
                "(model_init_kwargs={'dtype': 'float32'}) and keep fp16=True, or use bf16=True with a bf16 model."
            )


def warn_if_fp32_head_is_cast_by_fsdp2(args, accelerator) -> None:
    """`cast_lm_head_to_fp32=True` under FSDP2 with a bf16/fp16 mixed-precision policy: FSDP2 casts every unit's
    parameters, the head's too, to the policy's `param_dtype` for the forward, so the head projects with bf16/fp16
    copies of its fp32 weights (and reduces its gradient in `reduce_dtype`). Say so: it is not what was asked for."""
    plugin = getattr(accelerator.state, "fsdp_plugin", None)
    if not getattr(args, "cast_lm_head_to_fp32", False) or plugin is None or getattr(plugin, "fsdp_version", 1) != 2:
        return
    dtype = getattr(plugin.mixed_precision_policy, "param_dtype", None)
    if dtype in (torch.bfloat16, torch.float16):
        logger.warning(
            f"cast_lm_head_to_fp32=True under FSDP2 with a {dtype} mixed-precision policy: FSDP2 casts the LM head's "
            f"weight to {dtype} for every forward like any other unit's, so the projection is not computed from fp32 "
            "weights. Use DDP or DeepSpeed for an fp32 head, or set cast_lm_head_to_fp32=False."
        )

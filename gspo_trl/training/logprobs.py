"""Per-token log-probabilities of completion tokens, without full-vocabulary logits.

Owns the forward pass that turns (prompt + completion) ids into log π(y_t | x, y_<t) for each
completion token, plus the token entropy for logging. It never builds the (batch, length,
vocabulary) logits tensor: the model returns its final hidden states, only the valid completion
positions are kept, and those are projected through the LM head a chunk of tokens at a time. In
training the chunks whose logits fit `kept_logits_mb` keep them for the backward pass; the rest are
checkpointed, so their logits exist only while that chunk is being processed (forward, then again in
backward). What it does not own: which tokens count (the caller's mask) and anything about the
objective. With `padding_free`, the forward runs on the packed layout built by `packing` instead of
padded rows (two forwards when `packing.plan_forwards` cuts the micro-batch); padded rows take the position ids
of `positions`, as the decoding loop samples with them. A vision-language prompt's images (`multimodal.VisionInputs`)
go to the forward of padded rows, encoded once per prompt (`vision_features`); the model computes its own positions
(M-RoPE).
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint
from trl.trainer.utils import maybe_gather_lm_head_ctx

from ..models.distributed import fsdp2_modules, is_fsdp2_module, is_partitioned, unshard_fsdp2_owner, unwrap_model
from ..models.packing import (
    DEFAULT_MAX_ROW_TOKENS,
    attention_mask_dtype,
    pack_shared_prefix,
    plan_forwards,
    relative_attention_cost,
)
from ..models.positions import positions_from_mask, takes_position_ids
from ..models.precision import Float32LMHead, project_in_fp32
from ..models.vision_features import images_encoded_once

if TYPE_CHECKING:
    from ..models.moe.replay import ForwardRouting

DEFAULT_KEPT_LOGITS_MB = 1024  # fp32 logits kept from the forward for the backward pass; the rest are recomputed


class CompletionScores(NamedTuple):
    logps: torch.Tensor  # (B, C) log pi(y_t | x, y_<t), zero where masked
    entropy: torch.Tensor  # (B, C) entropy of pi(. | x, y_<t), zero where masked
    router_aux_loss: torch.Tensor | None  # the MoE load-balancing loss, when asked for


def _chunk_logps_and_entropy(
    hidden: torch.Tensor,  # (N, H)
    head: torch.nn.Module,  # the LM head, (H) -> (V)
    labels: torch.Tensor,  # (N,)
    temperature: float,
    scale: float,
    softcap: float | None,
    entropy_grad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    logits = _project(hidden, head).float()  # (N, V), fp32 for a stable log-softmax
    if scale != 1.0:
        logits = logits * scale
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    if temperature != 1.0:
        logits = logits / temperature
    if not entropy_grad:
        return _LabelLogProbs.apply(logits, labels)
    log_normalizer = torch.logsumexp(logits, dim=-1)  # (N,)
    logps = logits.gather(-1, labels.unsqueeze(-1)).squeeze(-1) - log_normalizer
    probs = torch.softmax(logits, dim=-1)
    entropy = log_normalizer - (probs * logits).sum(-1)
    return logps, entropy


class _LabelLogProbs(torch.autograd.Function):
    """(log softmax(z)[y], entropy of softmax(z)) for each row z of the logits and its label y; the entropy
    is for logging (not differentiated). The backward pass is the closed form d log p_y / dz = onehot(y) − p
    from the probabilities saved in the forward pass: fewer passes over the (N, V) logits than autograd's
    log-sum-exp and gather backward, and only the probabilities are kept."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        probs = torch.log_softmax(logits, dim=-1)  # (N, V) log-probabilities for now; faster on CPU than logsumexp
        logps = probs.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
        log_normalizer = logits.gather(-1, labels.unsqueeze(-1)).squeeze(-1) - logps
        probs.exp_()  # in place: one (N, V) buffer in all
        entropy = log_normalizer - torch.linalg.vecdot(probs, logits)
        ctx.save_for_backward(labels, probs)
        ctx.mark_non_differentiable(entropy)
        return logps, entropy

    @staticmethod
    def backward(ctx, grad_logps: torch.Tensor, _grad_entropy) -> tuple[torch.Tensor, None]:
        labels, probs = ctx.saved_tensors
        grad = probs * -grad_logps.unsqueeze(-1)
        return grad.scatter_add_(-1, labels.unsqueeze(-1), grad_logps.unsqueeze(-1)), None


def _project(hidden: torch.Tensor, head: torch.nn.Module) -> torch.Tensor:
    """The LM head projection, through the head module itself so that its hooks run (DeepSpeed ZeRO-3
    gathers a partitioned weight for the call) and an adapter on the head applies. Under autocast (see
    `precision`) both operands take autocast's dtype; without it, the hidden states take the head's
    dtype, as inside the model's own forward. Three heads are projected by hand instead: a head that is its
    own FSDP2 unit (accelerate's transformer-based wrapping makes one), made whole before the chunks by
    `unshard_fsdp2_owner`: calling it would run FSDP2's hooks once per chunk on top of the model's forward
    (the backward then crashed, gloo); a DTensor one that no FSDP2 module owns (gathered differentiably; a
    head inside an FSDP2 unit is made whole by its owner); and a frozen ZeRO-3 one (LoRA), whose hooks do not
    gather it again when a checkpointed chunk is recomputed in the backward pass: it is gathered here and
    copied, since autograd keeps the weight for the backward and ZeRO-3 empties the parameter on release."""
    fp32_head = isinstance(head, Float32LMHead)
    if not fp32_head and not torch.is_autocast_enabled(hidden.device.type):
        hidden = hidden.to(head.weight.dtype)
    if is_fsdp2_module(head):  # its own FSDP2 unit, whole now: its hooks must not gather and reshard per chunk
        weight, bias = head.weight, head.bias
    elif hasattr(head.weight, "full_tensor"):
        weight = head.weight.full_tensor()
        bias = None if head.bias is None else head.bias.full_tensor()
    elif is_partitioned(head) and not head.weight.requires_grad:
        with maybe_gather_lm_head_ctx(head.weight, head.bias):
            weight = head.weight.detach().clone()
            bias = None if head.bias is None else head.bias.detach().clone()
    else:
        return head(hidden)
    return project_in_fp32(hidden, weight, bias) if fp32_head else F.linear(hidden, weight, bias)


def completion_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,  # (B, P + C) left-padded prompt followed by the completion
    attention_mask: torch.Tensor,  # (B, P + C)
    completion_ids: torch.Tensor,  # (B, C)
    completion_mask: torch.Tensor,  # (B, C) 1 where a log-probability is wanted
    *,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    kept_logits_mb: float = DEFAULT_KEPT_LOGITS_MB,
    padding_free: bool = False,
    max_row_tokens: int = DEFAULT_MAX_ROW_TOKENS,
    entropy_grad: bool = False,
    router_aux_loss: bool = False,
    vision=None,
    routing: ForwardRouting | None = None,
) -> CompletionScores:
    """Log-probabilities and entropies of the completion tokens, each (B, C), zero where masked.

    Log-probabilities are of the temperature-scaled distribution the completions were sampled from,
    so that π_θ and π_θ_old in the importance ratio describe the same sampling policy. The model is
    called through its own `forward` (so DDP, DeepSpeed and PEFT wrappers see the call), asking for the
    logits of a single position only; the last layer's hidden states are read from the decoder's output.

    With `padding_free`, the forward runs on the packed layout of `packing.pack_shared_prefix` (each
    prompt once, no padding inside rows): the same values up to float rounding, for less work. The
    caller checks that the model supports it (`packing.padding_free_unsupported_reason`).

    `kept_logits_mb` bounds the fp32 logits kept for the backward pass (MiB): chunks past it are
    checkpointed and projected again in the backward pass, which costs one more LM-head product each.

    `entropy_grad` keeps the entropies in the graph (for an entropy bonus); `router_aux_loss` asks a
    Mixture-of-Experts model for its load-balancing loss (padded rows only: the loss reads a 2-D mask).
    `vision` (a `multimodal.VisionInputs` of these rows) gives each row its prompt's images, on padded rows;
    `routing` the experts it replays and records (`moe.replay.ForwardRouting`): a replay keeps the rows padded (the
    routes' layout); packed rows record the router's choices for the metrics.
    """
    valid = completion_mask.bool()
    labels_valid = completion_ids[valid]  # (N,)
    packed, aux_loss = None, None
    prompt_length = input_ids.shape[1] - completion_ids.shape[1]
    if (
        padding_free
        and vision is None
        and not router_aux_loss
        and (routing is None or routing.pads_rows is False)  # replayed or kept routes are laid out as padded rows
        and _attends_completion_prefixes(attention_mask[:, prompt_length:], completion_mask)
    ):
        layout = (input_ids[:, :prompt_length], attention_mask[:, :prompt_length], completion_ids, completion_mask)
        pair_cost = relative_attention_cost(unwrap_model(model).config)
        forwards = plan_forwards(*layout, max_row_tokens=max_row_tokens, attention_pair_cost=pair_cost)
        if len(forwards) > 1:  # long and short completions in forwards of their own (each planned again)
            # All of them stay alive until the one backward pass, so they share the kept logits by scored tokens.
            scored = valid.sum().clamp(min=1)
            parts = [
                completion_logprobs(
                    model,
                    input_ids[rows],
                    attention_mask[rows],
                    completion_ids[rows],
                    completion_mask[rows],
                    temperature=temperature,
                    chunk_size=chunk_size,
                    kept_logits_mb=kept_logits_mb * float(valid[rows].sum() / scored),
                    padding_free=True,
                    max_row_tokens=max_row_tokens,
                    entropy_grad=entropy_grad,
                )
                for rows in forwards
            ]
            return CompletionScores(
                _rows_together(forwards, [part.logps for part in parts]),
                _rows_together(forwards, [part.entropy for part in parts]),
                None,
            )
        packed = pack_shared_prefix(*layout, max_row_tokens=max_row_tokens, attention_pair_cost=pair_cost)
    if packed is not None:
        dtype = attention_mask_dtype(unwrap_model(model))
        recording = contextlib.nullcontext()
        if routing is not None:
            recording = routing.applied(model, input_ids.shape, packed.score_index)
        with recording:
            hidden, _ = _final_hidden_states(
                model,
                input_ids=packed.input_ids,
                position_ids=packed.position_ids,
                attention_mask=packed.float_attention_mask(dtype),
            )  # (R, L, H)
        hidden_valid = hidden.flatten(0, 1)[packed.score_index]  # (N, H)
    else:
        # The positions the decoding loop sampled with: a left-padded row counts from its first token, not its first
        # pad (models with learned absolute positions, GPT-2, would otherwise score it at shifted positions).
        positions = {"position_ids": positions_from_mask(attention_mask)} if takes_position_ids(model) else {}
        images = contextlib.nullcontext(positions)
        if vision is not None:  # each prompt's images encoded once; the model's own positions (M-RoPE)
            images = images_encoded_once(model, vision, input_ids)
        with images as inputs, contextlib.nullcontext() if routing is None else routing.applied(model, input_ids.shape):
            hidden, aux_loss = _final_hidden_states(
                model, input_ids=input_ids, attention_mask=attention_mask, router_aux_loss=router_aux_loss, **inputs
            )
        # The hidden state at position t predicts token t + 1, so the completion is scored from the
        # C positions that end one before the last.
        completion_length = completion_ids.shape[1]
        hidden = hidden[:, -completion_length - 1 : -1]  # (B, C, H)
        hidden_valid = hidden[valid]  # (N, H), padding-free from here on

    logps, entropy = _score_hidden_states(
        model, hidden_valid, labels_valid, temperature, chunk_size, kept_logits_mb, entropy_grad
    )
    per_token_logps = hidden.new_zeros(completion_ids.shape, dtype=torch.float32)
    per_token_entropy = torch.zeros_like(per_token_logps)
    if logps is None:
        per_token_logps = per_token_logps + 0.0 * hidden.sum()  # keep the graph (and DDP) connected
    else:
        # masked_scatter keeps the result connected to the graph.
        per_token_logps = per_token_logps.masked_scatter(valid, logps)
        per_token_entropy = per_token_entropy.masked_scatter(valid, entropy)
    return CompletionScores(per_token_logps, per_token_entropy, aux_loss)


def _rows_together(rows_of_each: list[torch.Tensor], parts: list[torch.Tensor]) -> torch.Tensor:
    """Per-row results of several forwards back in batch order (differentiable: index_copy keeps the graph)."""
    total = sum(rows.numel() for rows in rows_of_each)
    out = parts[0].new_zeros((total, *parts[0].shape[1:]))
    for rows, part in zip(rows_of_each, parts):
        out = out.index_copy(0, rows, part)
    return out


def _final_hidden_states(model, router_aux_loss: bool = False, **inputs) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(the last layer's hidden states, the MoE aux loss if asked for), through the model's own forward
    (so DDP, DeepSpeed and PEFT wrappers see the call) with the logits of one position only. The hidden
    states are read from the decoder's output by a forward hook: `output_hidden_states` would also keep
    every layer's output until the forward returns. A model without a separate decoder module falls
    back to `output_hidden_states`."""
    inner = unwrap_model(model)
    decoder = inner.get_decoder()
    extra = {"output_router_logits": True} if router_aux_loss else {}
    if decoder is inner:
        outputs = model(**inputs, output_hidden_states=True, logits_to_keep=1, use_cache=False, **extra)
        return outputs.hidden_states[-1], outputs.aux_loss if router_aux_loss else None
    captured = {}

    def keep_last_hidden_state(module, args, output):
        captured["hidden"] = output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0]

    handle = decoder.register_forward_hook(keep_last_hidden_state)
    try:
        outputs = model(**inputs, logits_to_keep=1, use_cache=False, **extra)
    finally:
        handle.remove()
    hidden = captured["hidden"]
    if outputs.logits.requires_grad and fsdp2_modules(inner):
        hidden = _WithModelOutput.apply(hidden, outputs.logits)
    return hidden, outputs.aux_loss if router_aux_loss else None


class _WithModelOutput(torch.autograd.Function):
    """The hidden states, unchanged, with the model's own output (its one-position logits) attached to the graph
    with a zero gradient. FSDP2 re-gathers, before the backward pass needs them, the parameters a module freed
    after its forward (`reshard_after_forward`) when the gradient reaches that module's output; the loss here is
    built from the decoder's hidden states instead, so without this the root's own parameters (the final norm's)
    were read freed in the backward pass (SIGSEGV, root resharding after its forward with the LM head a unit of
    its own)."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, output: torch.Tensor) -> torch.Tensor:
        ctx.output_like = (output.shape, output.dtype, output.device)
        return hidden.view_as(hidden)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        shape, dtype, device = ctx.output_like
        return grad, torch.zeros(shape, dtype=dtype, device=device)


def output_logit_scale(text_config) -> float:
    """The factor some architectures apply to the LM head's output inside their forward, which the
    projection here must apply too: Cohere's `logit_scale`, Falcon-H1's `lm_head_multiplier`, an
    `output_multiplier`, and `logits_scaling` (Granite and MiniCPM3 divide by it, HyperCLOVA X multiplies)."""
    for name in ("logit_scale", "output_multiplier", "lm_head_multiplier"):
        value = getattr(text_config, name, None)
        if value is not None:
            return float(value)
    scaling = getattr(text_config, "logits_scaling", None)
    if scaling is not None:
        return float(scaling) if getattr(text_config, "model_type", "") == "hyperclovax" else 1.0 / float(scaling)
    return 1.0


def _attends_completion_prefixes(completion_attention: torch.Tensor, completion_mask: torch.Tensor) -> bool:
    """Whether every completion is attended as one prefix covering its scored tokens: the packed
    layout assumes it (rollouts always have it; other masks take the padded path)."""
    is_prefix = bool((completion_attention[:, 1:] <= completion_attention[:, :-1]).all())
    return is_prefix and not bool((completion_mask.bool() & ~completion_attention.bool()).any())


def _score_hidden_states(
    model, hidden_valid, labels_valid, temperature, chunk_size, kept_logits_mb, entropy_grad=False
):
    """(log-probs, entropies) of `labels_valid` from the final hidden states, a chunk at a time. With gradients,
    the chunks whose fp32 logits fit `kept_logits_mb` together keep them for the backward pass; later chunks are
    checkpointed (their logits projected again in the backward pass)."""
    head = unwrap_model(model).get_output_embeddings()
    owner = unshard_fsdp2_owner(unwrap_model(model), head)  # a head resharded after the forward: whole again, once
    text_config = unwrap_model(model).config.get_text_config()
    scale, softcap = output_logit_scale(text_config), getattr(text_config, "final_logit_softcapping", None)
    with_grad = torch.is_grad_enabled() and hidden_valid.requires_grad
    vocab_size = getattr(text_config, "vocab_size", None)
    kept_tokens = int(kept_logits_mb * 2**20) // (4 * vocab_size) if vocab_size else 0
    logps_chunks, entropy_chunks = [], []
    for start in range(0, hidden_valid.shape[0], chunk_size):
        end = min(start + chunk_size, hidden_valid.shape[0])
        args = (hidden_valid[start:end], head, labels_valid[start:end], temperature, scale, softcap, entropy_grad)
        if with_grad and end > kept_tokens:
            logps, entropy = checkpoint(_chunk_logps_and_entropy, *args, use_reentrant=False)
        else:
            logps, entropy = _chunk_logps_and_entropy(*args)
        logps_chunks.append(logps)
        entropy_chunks.append(entropy)
    if owner is not None and not with_grad:  # no backward will reshard it (a reference, a π_old pass)
        owner.reshard()
    if not logps_chunks:
        return None, None
    return torch.cat(logps_chunks), torch.cat(entropy_chunks)


@torch.no_grad()
def logprobs_without_grad(
    model, batch, rows_per_forward: int, context, routing: ForwardRouting | None = None, **options
) -> torch.Tensor:
    """(B, C) per-token log-probs of a whole batch (a `MicroBatch`, or anything with its four model inputs), without a
    gradient, `rows_per_forward` rows at a time, each forward under `context()` (training's precision) and replaying
    its rows of `routing`; `options` go to `completion_logprobs`."""
    chunks = []
    for start in range(0, batch.input_ids.shape[0], rows_per_forward):
        rows = slice(start, start + rows_per_forward)
        with context():
            scores = completion_logprobs(
                model,
                batch.input_ids[rows],
                batch.attention_mask[rows],
                batch.completion_ids[rows],
                batch.completion_mask[rows],
                vision=None if getattr(batch, "vision", None) is None else batch.vision.select(rows),
                routing=None if routing is None else routing.rows(rows),
                **options,
            )
        chunks.append(scores.logps)
    return torch.cat(chunks)

"""Per-token log-probabilities of completion tokens, without full-vocabulary logits.

Owns the forward pass that turns (prompt + completion) ids into log π(y_t | x, y_<t) for each
completion token, plus the token entropy for logging. It never builds the (batch, length,
vocabulary) logits tensor: the model returns its final hidden states, only the valid completion
positions are kept, and those are projected through the LM head a chunk of tokens at a time. In
training each chunk is checkpointed, so its logits exist only while that chunk is being processed
(forward, then again in backward). What it does not own: which tokens count (the caller's mask)
and anything about the objective.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


def _chunk_logps_and_entropy(
    hidden: torch.Tensor,  # (N, H)
    weight: torch.Tensor,  # (V, H)
    bias: torch.Tensor | None,
    labels: torch.Tensor,  # (N,)
    temperature: float,
    softcap: float | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    logits = F.linear(hidden, weight, bias).float()  # (N, V), fp32 for a stable log-softmax
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    logits = logits / temperature
    log_normalizer = torch.logsumexp(logits, dim=-1)  # (N,)
    logps = logits.gather(-1, labels.unsqueeze(-1)).squeeze(-1) - log_normalizer
    with torch.no_grad():
        probs = torch.softmax(logits, dim=-1)
        entropy = log_normalizer - (probs * logits).sum(-1)
    return logps, entropy


def completion_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,  # (B, P + C) left-padded prompt followed by the completion
    attention_mask: torch.Tensor,  # (B, P + C)
    completion_ids: torch.Tensor,  # (B, C)
    completion_mask: torch.Tensor,  # (B, C) 1 where a log-probability is wanted
    *,
    temperature: float = 1.0,
    chunk_size: int = 1024,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probabilities and entropies of the completion tokens, each (B, C), zero where masked.

    Log-probabilities are of the temperature-scaled distribution the completions were sampled from,
    so that π_θ and π_θ_old in the importance ratio describe the same sampling policy. The model is
    called through its own `forward` (so DDP, DeepSpeed and PEFT wrappers see the call), asking for
    hidden states and the logits of a single position only.
    """
    completion_length = completion_ids.shape[1]
    outputs = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        output_hidden_states=True,
        logits_to_keep=1,
        use_cache=False,
    )
    # The hidden state at position t predicts token t + 1, so the completion is scored from the
    # C positions that end one before the last.
    hidden = outputs.hidden_states[-1][:, -completion_length - 1 : -1]  # (B, C, H)
    valid = completion_mask.bool()
    hidden_valid = hidden[valid]  # (N, H), padding-free from here on
    labels_valid = completion_ids[valid]  # (N,)

    head = _unwrap(model).get_output_embeddings()
    softcap = getattr(_unwrap(model).config.get_text_config(), "final_logit_softcapping", None)
    use_checkpoint = torch.is_grad_enabled() and hidden_valid.requires_grad
    logps_chunks, entropy_chunks = [], []
    for start in range(0, hidden_valid.shape[0], chunk_size):
        args = (
            hidden_valid[start : start + chunk_size],
            head.weight,
            head.bias,
            labels_valid[start : start + chunk_size],
            temperature,
            softcap,
        )
        if use_checkpoint:
            logps, entropy = checkpoint(_chunk_logps_and_entropy, *args, use_reentrant=False)
        else:
            logps, entropy = _chunk_logps_and_entropy(*args)
        logps_chunks.append(logps)
        entropy_chunks.append(entropy)

    per_token_logps = hidden.new_zeros(completion_ids.shape, dtype=torch.float32)
    per_token_entropy = torch.zeros_like(per_token_logps)
    if logps_chunks:
        # masked_scatter keeps the result connected to the graph even when it scatters nothing.
        per_token_logps = per_token_logps.masked_scatter(valid, torch.cat(logps_chunks))
        per_token_entropy = per_token_entropy.masked_scatter(valid, torch.cat(entropy_chunks))
    else:
        per_token_logps = per_token_logps + 0.0 * hidden.sum()
    return per_token_logps, per_token_entropy


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The module that owns `get_output_embeddings` under DDP / DeepSpeed wrappers."""
    while hasattr(model, "module") and not hasattr(model, "get_output_embeddings"):
        model = model.module
    return model

"""Training passes: one micro-batch trained as several forward/backward passes of bounded size.

The activations a backward pass needs grow with the positions its forward ran on, and on a GPU they are most of the
training step's peak memory (about 2.5 MB per position for a 1.7B model in bf16, by our arithmetic). Every term of
the loss belongs to one row (`loss.policy_loss` only averages at the end), so a micro-batch can be cut into row
slices, each forwarded and back-propagated on its own, with each slice's loss divided by the whole micro-batch's
counts (`policy_loss(num_sequences=..., num_tokens=...)`): the slices' gradients then add up to the micro-batch's,
and the optimizer step is the same, for the activations of one slice at a time. verl's dynamic batch size does the
same with a token budget per GPU.

Owns which rows go into which pass (`plan_passes`, `micro_batch_passes`), cutting a pass out of a micro-batch with
the padding only its own rows need (`take_pass`), the default budget and when a configuration cannot be cut
(`pass_budget`). What it does not own: running the passes (the trainer) and holding gradients between them
(`distributed.gradients_held`).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from .micro_batch import MicroBatch

# Positions per pass on a CUDA device when `max_tokens_per_pass` is unset: at 1.7B parameters (bf16, no
# checkpointing) about 20 GB of activations; passes this large cost the 1.7B/1024-token benchmark cell 5% of its
# training-phase speed against one pass (docs/benchmarks.md, "SmolLM2-1.7B architecture on an H200").
DEFAULT_CUDA_PASS_TOKENS = 8192


def resolve_max_tokens_per_pass(setting: int | None, device_type: str) -> int | None:
    """The positions budget of one pass: the user's (0: no limit), or by default `DEFAULT_CUDA_PASS_TOKENS` on a
    CUDA device and no limit elsewhere (CPU training is compute-bound and its memory is the host's)."""
    if setting is None:
        return DEFAULT_CUDA_PASS_TOKENS if device_type == "cuda" else None
    return setting or None


def passes_unsupported_reason(top_entropy_quantile: float, router_aux_loss: bool) -> str | None:
    """Why a micro-batch of this configuration must stay one pass, or None: the terms that are not sums over rows."""
    if top_entropy_quantile < 1.0:
        return "top_entropy_quantile < 1 selects tokens by a quantile over the whole micro-batch"
    if router_aux_loss:
        return "a Mixture-of-Experts load-balancing loss is computed over the whole micro-batch's tokens"
    return None


def pass_budget(args, device_type: str, router_aux_loss: bool) -> int | None:
    """`max_tokens_per_pass` of a `GSPOConfig` as it applies on `device_type`: None where a micro-batch must stay
    one pass. A budget set by hand where it cannot apply is a `ValueError`."""
    reason = passes_unsupported_reason(args.top_entropy_quantile, router_aux_loss)
    if reason is not None and args.max_tokens_per_pass:
        raise ValueError(
            f"max_tokens_per_pass={args.max_tokens_per_pass} cannot train a micro-batch in several "
            f"passes here: {reason}. Set max_tokens_per_pass=0 (one pass per micro-batch)."
        )
    return None if reason is not None else resolve_max_tokens_per_pass(args.max_tokens_per_pass, device_type)


def micro_batch_passes(
    micro_batch: MicroBatch, max_tokens: int | None, most_of_all: Callable[[int], int] | None = None
) -> list[torch.Tensor]:
    """The rows of each training pass of a micro-batch: one pass within the budget (or without one), else
    `plan_passes` over its rows' padded positions. ``most_of_all`` maps this process's number of passes to the
    largest over all processes (a collective: every process calls it, with the same rows per micro-batch)."""
    rows = micro_batch.rows
    if max_tokens is None or rows < 2:
        return [torch.arange(rows)]
    positions = padded_positions(micro_batch.attention_mask, micro_batch.completion_mask)  # (B,)
    passes = len(plan_passes(positions, max_tokens))
    if most_of_all is not None:
        passes = most_of_all(passes)
    return plan_passes(positions, max_tokens, min_passes=passes)


def passes_on_every_process(micro_batch: MicroBatch, max_tokens: int | None, accelerator) -> list[torch.Tensor]:
    """`micro_batch_passes`, where every process runs as many passes as the process that needs most."""

    def most_of_all(passes: int) -> int:
        return int(accelerator.reduce(torch.tensor(passes, device=accelerator.device), "max"))

    return micro_batch_passes(micro_batch, max_tokens, most_of_all if accelerator.num_processes > 1 else None)


def trained_lengths(completion_mask: torch.Tensor) -> torch.Tensor:
    """(B,) the completion columns each row needs: up to and including its last trained token (0 for none)."""
    positions = torch.arange(1, completion_mask.shape[1] + 1, device=completion_mask.device)
    return (completion_mask.bool() * positions).amax(1)


def padded_positions(attention_mask: torch.Tensor, completion_mask: torch.Tensor) -> torch.Tensor:
    """(B,) the positions each row takes in a pass: the prompt columns (left padding included, see `take_pass`)
    plus its completion up to its last trained token."""
    return attention_mask.shape[1] - completion_mask.shape[1] + trained_lengths(completion_mask)


def plan_passes(row_positions: torch.Tensor, max_tokens: int | None, min_passes: int = 1) -> list[torch.Tensor]:
    """Rows (index tensors) of each pass: rows sorted by length, cut into K contiguous slices of equal row counts.

    K is the least number of passes that keeps every slice's padded size (its rows × its longest row) within
    `max_tokens`, at least `min_passes` (what another process needs, so that all run the same number of passes),
    and at most one row per pass. Sorting puts rows of similar length together, so a pass pads little.
    """
    rows = row_positions.numel()
    order = torch.sort(row_positions.cpu(), stable=True).indices
    if rows == 0:
        return [order]
    lengths = row_positions.cpu()[order]
    passes = max(min_passes, 1)
    if max_tokens is not None:
        passes = max(passes, math.ceil(rows * int(lengths[-1]) / max_tokens))
        while (
            passes < rows
            and max(int(part.numel()) * int(lengths[part[-1]]) for part in torch.arange(rows).tensor_split(passes))
            > max_tokens
        ):
            passes += 1
    passes = min(passes, rows)
    return [order[part] for part in torch.arange(rows).tensor_split(passes)]


def take_pass(micro_batch: MicroBatch, rows: torch.Tensor, last: bool, multiple: int | None = None) -> MicroBatch:
    """The rows of one pass, without the completion columns after its rows' last trained token (rounded up to a
    multiple of `multiple`: `pad_to_multiple_of`), and what the loss of a part needs: the whole micro-batch's rows and
    valid completion tokens, and whether this pass is the micro-batch's last."""
    completion_mask = micro_batch.completion_mask
    completion_width = max(int(trained_lengths(completion_mask[rows.to(completion_mask.device)]).amax()), 1)
    if multiple is not None:
        completion_width = min(-(-completion_width // multiple) * multiple, completion_mask.shape[1])
    # Only the completion's tail is cut: positions after a row's last trained token change none of its scores
    # (causal attention), while the prompt's left padding stays, so that every token keeps the position ids of
    # the micro-batch's π_old forward.
    part = micro_batch.select(rows, completion_width)
    part.micro_batch_rows = completion_mask.shape[0]
    part.micro_batch_tokens = completion_mask.sum()
    part.last_pass = last
    return part

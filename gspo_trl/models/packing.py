"""Shared-prefix packing: the layout of a padding-free training (and old-log-prob) forward.

A GSPO micro-batch holds G completions of each prompt. The padded layout runs every (prompt +
completion) row padded to the longest one, so each prompt is processed G times and short
completions drag padding along. This module lays the same micro-batch out as a few packed rows:

    row: [prompt_a, completion_a1, completion_a2, ..., prompt_b, completion_b1, ...]

Each prompt appears once per row, followed by the completions that share it. A block-tree
attention mask lets a completion token see its own prompt and its own earlier tokens only, and
position ids restart for every completion right after its prompt, so each completion token gets
exactly the hidden state it gets in its own padded row (up to float rounding). Only the end of the
last rows is padding. When every row holds one prompt and one completion (completions longer than half a row),
the block tree is plain causal attention: no mask is built and the model runs its own causal kernel.

A micro-batch whose completion lengths differ widely is packed as two forwards (`plan_forwards`): its
longest completions, and the rest in rows of their own length, instead of every row padded to the longest.

What it owns: the packed token layout, its attention mask and position ids, the index of the
hidden state that predicts each scored completion token, and which completions share a forward. What it does not own:
running the model
(`logprobs`), and deciding whether a model can take a custom mask (`padding_free_unsupported_reason`
answers that from the config).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, eager_mask, sdpa_mask
from transformers.utils import logging

from .positions import takes_position_ids

logger = logging.get_logger(__name__)

DEFAULT_MAX_ROW_TOKENS = 2048  # bounds the (rows, 1, L, L) mask and the attention of one row
DEFAULT_ATTENTION_PAIR_COST = 1 / 3000  # about SmolLM2-135M's; see relative_attention_cost
SPLIT_MIN_SAVING = 0.1  # plan_forwards cuts a micro-batch in two forwards only for this share of its estimated cost


@dataclass
class PackedBatch:
    """A micro-batch in packed layout. R rows of L positions."""

    input_ids: torch.Tensor  # (R, L)
    position_ids: torch.Tensor  # (R, L), counting on through the padding at a row's end
    # (R, 1, L, L) bool, True where query (dim 2) may attend to key (dim 3); None when every row holds one prompt
    # and one completion, where the block-tree mask is plain causal attention (the model's own, fused kernel).
    attention_mask: torch.Tensor | None
    score_index: torch.Tensor  # (N,) flat index into R × L of the hidden state predicting each scored token,
    #                             in the row-major order of the completion mask's True entries
    num_real_tokens: int  # non-padding positions

    @property
    def num_positions(self) -> int:
        return self.input_ids.numel()

    @property
    def num_padding_tokens(self) -> int:
        return self.num_positions - self.num_real_tokens

    def float_attention_mask(self, dtype: torch.dtype) -> torch.Tensor | None:
        """The mask as an additive bias (0 where allowed, the dtype's minimum elsewhere): what both
        the eager and the SDPA attention of transformers take as a custom 4D mask. None for causal rows."""
        if self.attention_mask is None:
            return None
        bias = torch.zeros(self.attention_mask.shape, dtype=dtype, device=self.attention_mask.device)
        return bias.masked_fill_(~self.attention_mask, torch.finfo(dtype).min)


@dataclass
class _Unit:
    """One prompt followed by some of the completions that share it."""

    prompt: torch.Tensor  # (P,)
    rows: list[int]  # micro-batch row of each completion
    completions: list[torch.Tensor]  # input tokens of each completion

    @property
    def length(self) -> int:
        return self.prompt.numel() + sum(c.numel() for c in self.completions)


def pack_shared_prefix(
    prompt_ids: torch.Tensor,  # (B, P) left-padded
    prompt_mask: torch.Tensor,  # (B, P)
    completion_ids: torch.Tensor,  # (B, C)
    completion_mask: torch.Tensor,  # (B, C) 1 where a log-probability is wanted
    *,
    max_row_tokens: int = DEFAULT_MAX_ROW_TOKENS,
    attention_pair_cost: float | None = None,
    pad_token_id: int = 0,
) -> PackedBatch | None:
    """Pack a micro-batch, sharing each distinct prompt among the completions that follow it.

    The log-probability of completion token t comes from the hidden state of token t - 1 (of the
    last prompt token for t = 0), so a completion's input stops one token before its last scored
    token, and a row with nothing to score contributes no tokens. Rows that share a prompt are found
    by comparing prompt tokens, so any row order works; whole groups in one micro-batch share best.

    Attention inside a packed row is computed densely, so rows are kept short enough that masked-out
    pairs cost little: `_assign_rows` weighs positions against attention pairs (`attention_pair_cost`,
    see `relative_attention_cost`) and never exceeds `max_row_tokens` per row (unless one prompt plus
    one completion is longer). Returns None when nothing in the micro-batch is scored.
    """
    if max_row_tokens < 1:
        raise ValueError(f"max_row_tokens must be >= 1, got {max_row_tokens}.")
    if attention_pair_cost is None:
        attention_pair_cost = DEFAULT_ATTENTION_PAIR_COST
    _, rows = _assign_rows(
        prompt_ids, prompt_mask, completion_ids, completion_mask, max_row_tokens, attention_pair_cost
    )
    if not rows:
        return None
    length = max(sum(unit.length for unit in row) for row in rows)
    device = completion_ids.device

    input_ids = torch.full((len(rows), length), pad_token_id, dtype=completion_ids.dtype, device=device)
    position_ids = torch.zeros((len(rows), length), dtype=torch.long, device=device)
    # Per position: which unit it belongs to (-1 for padding) and which completion (-1 for a prompt).
    unit_of = torch.full((len(rows), length), -1, dtype=torch.long, device=device)
    branch_of = torch.full((len(rows), length), -1, dtype=torch.long, device=device)
    predictor = torch.full(completion_ids.shape, -1, dtype=torch.long, device=device)  # (B, C)

    unit_number = 0
    for r, row in enumerate(rows):
        cursor = 0
        for unit in row:
            prompt_length = unit.prompt.numel()
            input_ids[r, cursor : cursor + prompt_length] = unit.prompt
            position_ids[r, cursor : cursor + prompt_length] = torch.arange(prompt_length, device=device)
            unit_of[r, cursor : cursor + prompt_length] = unit_number
            last_prompt_position = r * length + cursor + prompt_length - 1
            cursor += prompt_length
            for batch_row, completion in zip(unit.rows, unit.completions):
                n = completion.numel()
                input_ids[r, cursor : cursor + n] = completion
                position_ids[r, cursor : cursor + n] = torch.arange(prompt_length, prompt_length + n, device=device)
                unit_of[r, cursor : cursor + n] = unit_number
                branch_of[r, cursor : cursor + n] = batch_row
                # Token 0 is predicted by the last prompt token, token t by completion input t - 1.
                flat = torch.arange(r * length + cursor, r * length + cursor + n, device=device)
                predictor[batch_row, : n + 1] = torch.cat([flat.new_tensor([last_prompt_position]), flat])
                cursor += n
            unit_number += 1
        # Padding continues the last position, so a row of one sequence reads as one sequence to the model.
        position_ids[r, cursor:] = (
            torch.arange(cursor, length, device=device) + position_ids[r, cursor - 1] + 1 - cursor
        )

    attention_mask = None
    if any(len(row) > 1 or len(row[0].completions) > 1 for row in rows):
        attention_mask = _block_tree_mask(unit_of, branch_of).unsqueeze(1)
    # else one prompt and one completion per row, then padding: causal attention is exact for every real token, and
    # measured 1.2x faster than the same layout under a dense mask at 1-4k tokens on CPU (docs/design/performance.md).

    score_index = predictor[completion_mask.bool()]
    if (score_index < 0).any():  # a bug here would silently score the wrong hidden states
        raise RuntimeError("pack_shared_prefix left a scored completion token without a predicting position.")
    return PackedBatch(
        input_ids=input_ids,
        position_ids=position_ids,
        attention_mask=attention_mask,
        score_index=score_index,
        num_real_tokens=int((unit_of >= 0).sum()),
    )


def _block_tree_mask(unit_of: torch.Tensor, branch_of: torch.Tensor) -> torch.Tensor:
    """(R, L, L): a query sees the keys of its own unit that are its prompt or its own completion, up to itself."""
    length = unit_of.shape[1]
    same_unit = (unit_of.unsqueeze(2) == unit_of.unsqueeze(1)) & (unit_of.unsqueeze(2) >= 0)
    key_is_prompt_or_same_branch = (branch_of.unsqueeze(1) == -1) | (branch_of.unsqueeze(2) == branch_of.unsqueeze(1))
    causal = torch.ones(length, length, dtype=torch.bool, device=unit_of.device).tril()
    # padding queries see themselves: no empty rows
    diagonal = torch.eye(length, dtype=torch.bool, device=unit_of.device)
    return (same_unit & key_is_prompt_or_same_branch & causal) | diagonal


def _assign_rows(
    prompt_ids, prompt_mask, completion_ids, completion_mask, max_row_tokens, attention_pair_cost
) -> tuple[float, list[list[_Unit]]]:
    """Completions to rows: few positions, little padding, bounded attention. Returns (cost, rows).

    For a few row counts from the fewest that can hold the micro-batch, completions go longest first
    to the row they lengthen least (a row that already holds their prompt saves the prompt), or whole
    prompt groups go, largest first, to the row they lengthen least; the cheapest candidate wins,
    counting a row of L positions as L + attention_pair_cost × L² (attention inside a row is dense).
    So a micro-batch that fits one row still takes one row per prompt group when the attention that
    saves outweighs the padding added at the row ends. Rows stay
    within `max_row_tokens`, or within the longest prompt + completion where that is longer: every
    row is padded to the longest anyway, so filling the others up to it costs no positions.
    """
    prompts: dict[tuple[int, ...], torch.Tensor] = {}
    items: list[tuple[int, tuple[int, ...], torch.Tensor]] = []
    scored = completion_mask.bool()
    for row in range(completion_ids.shape[0]):
        positions = scored[row].nonzero().flatten()
        if positions.numel() == 0:
            continue
        prompt = prompt_ids[row][prompt_mask[row].bool()]
        if prompt.numel() == 0:
            raise ValueError(
                f"pack_shared_prefix: row {row} has an empty prompt (zero tokens), so nothing predicts its first "
                "completion token. Remove empty prompts from the dataset (e.g. dataset.filter(lambda r: r['prompt']))."
            )
        key = tuple(prompt.tolist())
        prompts.setdefault(key, prompt)
        items.append((row, key, completion_ids[row, : int(positions[-1])]))  # inputs stop before the last scored token
    if not items:
        return 0.0, []
    items.sort(key=lambda item: (-item[2].numel(), item[0]))
    total = sum(c.numel() for _, _, c in items) + sum(p.numel() for p in prompts.values())
    longest = max(prompts[key].numel() + c.numel() for _, key, c in items)
    # Every row is padded to the longest, so a prompt + completion longer than max_row_tokens makes room in the others.
    capacity = max(max_row_tokens, longest)
    # A few row counts from the fewest that hold everything: more rows add padding (and repeated prompts)
    # but shrink the dense attention, so one prompt's group per row can beat one row for the whole batch.
    fewest = min(len(items), math.ceil(total / capacity))
    groups: dict[tuple[int, ...], list] = {}
    for item in items:
        groups.setdefault(item[1], []).append(item)
    by_completion = [[item] for item in items]
    whole_groups = sorted(groups.values(), key=lambda group: -sum(c.numel() for _, _, c in group))
    best = None
    for num_rows in range(fewest, min(len(items), fewest + 3) + 1):
        # Completion by completion, or each prompt's group kept whole, to the row it lengthens least.
        for batches in [by_completion] + ([whole_groups] if num_rows <= len(groups) else []):
            rows: list[dict[tuple[int, ...], _Unit]] = [{} for _ in range(num_rows)]
            lengths = [0] * num_rows
            for batch in batches:
                key = batch[0][1]
                added = sum(c.numel() for _, _, c in batch)
                grown = [lengths[r] + added + (0 if key in rows[r] else prompts[key].numel()) for r in range(num_rows)]
                r = min(range(num_rows), key=grown.__getitem__)
                unit = rows[r].setdefault(key, _Unit(prompt=prompts[key], rows=[], completions=[]))
                for row, _, completion in batch:
                    unit.rows.append(row)
                    unit.completions.append(completion)
                lengths[r] = grown[r]
            length = max(lengths)
            rank = (length > capacity, num_rows * length * (1 + attention_pair_cost * length))
            if best is None or rank < best[0]:
                best = (rank, [list(units.values()) for units in rows if units])
    return best[0][1], best[1]


def plan_forwards(
    prompt_ids: torch.Tensor,  # (B, P) left-padded
    prompt_mask: torch.Tensor,  # (B, P)
    completion_ids: torch.Tensor,  # (B, C)
    completion_mask: torch.Tensor,  # (B, C)
    *,
    max_row_tokens: int = DEFAULT_MAX_ROW_TOKENS,
    attention_pair_cost: float | None = None,
    min_saving: float = SPLIT_MIN_SAVING,
) -> list[torch.Tensor]:
    """The micro-batch's rows as one packed forward, or as two: its longest completions, and the rest.

    Every row of a packed forward is padded to its longest row, and attention inside a row is dense, so
    one long completion stretches every row of the micro-batch to its length: with a 4,096-token
    completion among 150-token ones, the short ones pay thousands of padded or masked-out positions
    each. Cut between the k longest completions and the others (k where the next completion is at most
    3/4, 1/2, 1/4 or 1/8 of the longest), each side costed as `_assign_rows` costs its rows; the cut
    is taken when it saves at least `min_saving` of the one-forward cost. Returns the batch rows of
    each forward (1-D index tensors, longest completions first); the caller plans each side again, so a
    side can be cut once more. A row with nothing to score goes with the short side.
    """
    if attention_pair_cost is None:
        attention_pair_cost = DEFAULT_ATTENTION_PAIR_COST
    everything = [torch.arange(completion_ids.shape[0], device=completion_ids.device)]
    scored = completion_mask.bool()
    last = torch.where(scored.any(1), completion_ids.shape[1] - scored.flip(1).int().argmax(1) - 1, 0)
    lengths = (prompt_mask.sum(1) + last) * scored.any(1)  # prompt + completion input per row, 0 if nothing scored
    order = torch.sort(lengths, descending=True, stable=True).indices
    sorted_lengths = lengths[order].tolist()
    if len(sorted_lengths) < 2 or sorted_lengths[1] == 0:
        return everything

    def cost(rows: torch.Tensor) -> float:
        return _assign_rows(
            prompt_ids[rows],
            prompt_mask[rows],
            completion_ids[rows],
            completion_mask[rows],
            max_row_tokens,
            attention_pair_cost,
        )[0]

    whole = cost(everything[0])
    cuts = sorted(
        {
            next((k for k, n in enumerate(sorted_lengths) if n <= sorted_lengths[0] * share), 0)
            for share in (3 / 4, 1 / 2, 1 / 4, 1 / 8)
        }
        - {0}
    )
    best = None
    for k in cuts:
        if sorted_lengths[k] == 0:
            continue  # nothing to score on the short side
        long, short = order[:k].sort().values, order[k:].sort().values
        split = cost(long) + cost(short)
        if split <= whole * (1 - min_saving) and (best is None or split < best[0]):
            best = (split, [long, short])
    return everything if best is None else best[1]


def relative_attention_cost(config) -> float:
    """Forward cost of one attended (query, key) pair relative to one token through a decoder layer's
    linear weights: 4·heads·head_dim FLOPs against 2·(weights per layer)."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    try:
        hidden, heads = config.hidden_size, config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or hidden // heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        weights = hidden * head_dim * 2 * (heads + kv_heads) + 3 * hidden * config.intermediate_size
    except (AttributeError, TypeError):
        return DEFAULT_ATTENTION_PAIR_COST
    return 2 * heads * head_dim / weights


def packing_pays_on(device_type: str) -> bool:
    """Whether the packed layout is the faster default on this kind of device.

    On CPU it is (docs/benchmarks.md: training phase 0.28× TRL's, no padding). On a GPU, SDPA with a
    dense (rows, 1, L, L) mask cannot use its flash kernel: measured on an H100 (bf16,
    SmolLM2-1.7B architecture, 1024-token completions) the packed training phase took 1.26× TRL's and
    padded rows 1.02×, with more memory. So accelerators default to padded rows until packing has a
    kernel that takes the block-tree layout without a dense mask.
    """
    return device_type == "cpu"


DENSE_MASKS_NEEDED = "needs one that applies a dense 4-D attention mask, such as 'sdpa' or 'eager'"


def attention_mask_dtype(model: torch.nn.Module) -> torch.dtype:
    """The dtype of a float attention mask that meets the attention's queries: autocast's where autocast is on for the
    model's device, else the lowest-precision floating dtype among its parameters. Not the input embedding's:
    `cast_lm_head_to_fp32` makes a tied one float32 beside bf16 layers, and CUDA's memory-efficient SDPA refuses a mask
    whose dtype is not the queries'."""
    dtypes = {
        parameter.dtype: parameter.device.type for parameter in model.parameters() if parameter.is_floating_point()
    }
    if not dtypes:
        return torch.float32
    device = next(iter(dtypes.values()))
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return min(dtypes, key=lambda dtype: torch.finfo(dtype).bits)


def takes_dense_masks(implementation: str | None) -> bool:
    """Whether attention implementation `implementation` applies a custom dense (rows, 1, queries, keys) mask: those
    transformers builds dense masks for (`sdpa_mask`, `eager_mask`), whatever they are registered as. Flash
    attention (2-D padding masks or none), flex attention (block masks) and kernels without a mask function of
    transformers' would ignore or refuse one."""
    mask_function = ALL_MASK_ATTENTION_FUNCTIONS.get(implementation) if implementation is not None else None
    return mask_function is sdpa_mask or mask_function is eager_mask


def uses_alibi(model: torch.nn.Module) -> bool:
    """Whether `model` adds ALiBi position biases, which its forward builds from a 2-D padding mask (Falcon-RW, BLOOM,
    MPT): a custom 4-D mask leaves it none to build them from."""
    config = model.config
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    return bool(getattr(text_config, "alibi", False)) or getattr(text_config, "model_type", "") in ("bloom", "mpt")


def padding_free_unsupported_reason(model: torch.nn.Module) -> str | None:
    """Why `model` cannot run the packed layout exactly, or None if it can.

    The packed layout needs a decoder-only model that takes explicit position ids and a custom 4D
    attention mask (transformers' eager and SDPA attention do), with full attention in every layer:
    a sliding window, ALiBi biases or flash-attention kernels would not see the block-tree mask.
    """
    config = model.config
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    if getattr(config, "is_encoder_decoder", False):
        return "it is an encoder-decoder model"
    if getattr(config, "vision_config", None) is not None:
        return "it is a vision-language model, whose image inputs are per padded row"
    implementation = getattr(config, "_attn_implementation", None)
    if not takes_dense_masks(implementation):
        return f"its attention implementation is {implementation!r} (padding-free {DENSE_MASKS_NEEDED})"
    layer_types = getattr(text_config, "layer_types", None) or []
    sliding = getattr(text_config, "sliding_window", None) is not None and getattr(
        text_config, "use_sliding_window", True
    )
    if sliding or any("sliding" in str(kind) for kind in layer_types):
        return "it uses sliding-window attention"
    if uses_alibi(model):
        return "it uses ALiBi position biases"
    if not takes_position_ids(model):
        return "its forward takes no position_ids"
    return None


def padding_free_in_use(setting: bool | None, device_type: str, model: torch.nn.Module) -> bool:
    """Whether training packs rows: the `padding_free` setting (None: where it pays, `packing_pays_on`), and only
    on a model that supports it (`model`, under a PEFT adapter or not; a warning says why not)."""
    wanted = packing_pays_on(device_type) if setting is None else setting
    base_model = model.get_base_model() if hasattr(model, "get_base_model") else model  # a PEFT model's base
    reason = padding_free_unsupported_reason(base_model)
    if wanted and reason is not None:
        logger.warning(f"padding_free is not used: {reason}. Training runs on padded rows.")
    return bool(wanted) and reason is None

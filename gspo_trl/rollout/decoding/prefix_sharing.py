"""Prefill for a batch of prompts that share prefixes: each shared prefix runs through the model once.

A rollout repeats each prompt `num_generations` times, and the later turns of multi-turn episodes repeat
their group's prompt followed by what each episode did since. Owns which rows share which prefix
(`shared_prefix_groups`, pure), and the KV cache that holds, for every row, all of its prompt but the last
token, ready for a decoding loop to continue from it:

- `prefill`: every row once (what the others build on).
- `prefill_shared_prompts`: rows that are identical (turn 1): one prefill per distinct row, copied to its rows.
- `prefill_shared_prefixes`: rows that share a prefix and then differ: one prefill per shared prefix, copied to
  its rows, then each row's own tail on top. The rows are laid out as [prefix | gap | tail | last token]: the
  gap is masked out and position ids follow the attention mask, so each row is its own sequence, contiguous.
- `prefill_after_states`: rows that continue an earlier call's rows (the next turn of episodes): each row's
  prefix is its own previous turn, whose KV cache the decoding loop kept (`dynamic.RowState`); only what came
  after (the end of the turn, the environment's reply) runs through the model.

What it does not own: the decoding loops (`dynamic`, `static`), tokenization (`rollout`).
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from ...models.positions import positions_from_mask
from .kv_cache import cache_kwargs

# The least share of the prefill positions that sharing must save to be used: it costs a second forward.
MIN_SAVING = 0.125


def shared_prefix_groups(rows: list[list[int]]) -> list[tuple[list[int], int]]:
    """Rows grouped by a prefix they share: a list of (row indices, prefix length), every row in one group.

    A group's prefix is at most each member's length minus one (the last token starts decoding). Rows are
    sorted so that rows with long common prefixes are neighbours; the groups are the runs of that order that
    save the most prefill, Σ (members - 1) × prefix length. A row sharing nothing is a group of its own whose
    prefix is the row but its last token.
    """
    order = sorted(range(len(rows)), key=lambda index: rows[index])
    common = [0] + [_common_prefix(rows[a], rows[b]) for a, b in zip(order, order[1:])]  # with the row before
    # best[j]: the largest saving over the first j rows of `order`; start[j]: where the last group begins.
    best, start = [0] * (len(order) + 1), [0] * (len(order) + 1)
    for end in range(1, len(order) + 1):
        best[end], start[end] = best[end - 1], end - 1  # the row alone
        prefix = len(rows[order[end - 1]]) - 1
        for first in range(end - 2, -1, -1):  # groups order[first:end] of two rows or more
            prefix = min(prefix, common[first + 1], len(rows[order[first]]) - 1)
            if prefix <= 0:
                break
            saving = best[first] + (end - 1 - first) * prefix
            if saving > best[end]:
                best[end], start[end] = saving, first
    groups, end = [], len(order)
    while end > 0:
        members = order[start[end] : end]
        groups.append(
            (
                members,
                min(len(rows[index]) for index in members) - 1 if len(members) == 1 else _group_prefix(rows, members),
            )
        )
        end = start[end]
    return groups[::-1]


def _common_prefix(a: list[int], b: list[int]) -> int:
    length = 0
    for x, y in zip(a, b):
        if x != y:
            break
        length += 1
    return length


def _group_prefix(rows: list[list[int]], members: list[int]) -> int:
    first = rows[members[0]]
    return min(
        min(_common_prefix(first, rows[index]) for index in members[1:]), min(len(rows[index]) for index in members) - 1
    )


def _left_pad(sequences: list[list[int]], width: int, pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.full((len(sequences), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for row, sequence in enumerate(sequences):
        if sequence:
            ids[row, width - len(sequence) :] = torch.tensor(sequence)
            mask[row, width - len(sequence) :] = 1
    return ids, mask


@torch.no_grad()
def prefill_shared_prefixes(model, rows: list[list[int]], pad_token_id: int):
    """(prompt_ids, prompt_mask, cache) for the token-id rows, laid out [prefix | gap | tail | last token], with
    `cache` holding every column but the last; or None when sharing would save less than `MIN_SAVING` of the
    prefill (counted in padded positions: the distinct prefixes' plus every row's tail, against every row padded
    to the longest).

    The model must take position ids and an attention mask with gaps (`packing.padding_free_unsupported_reason`
    says which do not)."""
    if not rows or min(len(row) for row in rows) < 2:
        return None
    groups = shared_prefix_groups(rows)
    group_of, prefix_length = [0] * len(rows), [0] * len(rows)
    for group, (members, length) in enumerate(groups):
        for index in members:
            group_of[index], prefix_length[index] = group, length
    prefix_width = max(length for _, length in groups)
    tail_width = max(len(row) - 1 - length for row, length in zip(rows, prefix_length))
    plain = len(rows) * (max(len(row) for row in rows) - 1)
    if len(groups) == len(rows) or len(groups) * prefix_width + len(rows) * tail_width > (1 - MIN_SAVING) * plain:
        return None

    device = model.device
    prefix_ids, prefix_mask = _left_pad(
        [rows[members[0]][:length] for members, length in groups], prefix_width, pad_token_id
    )
    prefix_positions = positions_from_mask(prefix_mask)
    cache = DynamicCache(config=model.config)
    model(
        input_ids=prefix_ids.to(device),
        attention_mask=prefix_mask.to(device),
        position_ids=prefix_positions.to(device),
        **cache_kwargs(model, cache),
        use_cache=True,
        logits_to_keep=1,
    )
    group_of_row = torch.tensor(group_of)
    cache.reorder_cache(group_of_row.to(device))
    return _continue_rows(
        model, cache, prefix_ids[group_of_row], prefix_mask[group_of_row], rows, prefix_length, pad_token_id
    )


@torch.no_grad()
def prefill_after_states(model, rows: list[list[int]], states: list, pad_token_id: int):
    """(prompt_ids, prompt_mask, cache) for rows that continue earlier ones: `states[i]` (`dynamic.RowState`) holds
    the KV cache of the first `states[i].length` tokens of row i (its previous turn, as the decoding loop left
    it), so only the rest of each row runs through the model. Same layout as `prefill_shared_prefixes`, the
    states in the prefix part; None when a state does not leave its row a token to decode from."""
    lengths = [state.length for state in states]
    if any(length >= len(row) for row, length in zip(rows, lengths)):
        return None
    width = max(lengths)
    cache = DynamicCache(config=model.config)
    for layer in range(len(states[0].layers)):
        keys, values = states[0].layers[layer]
        batch_keys = keys.new_zeros((len(rows), keys.shape[0], width, keys.shape[2]))
        batch_values = values.new_zeros((len(rows), values.shape[0], width, values.shape[2]))
        for row, (state, length) in enumerate(zip(states, lengths)):
            batch_keys[row, :, width - length :], batch_values[row, :, width - length :] = state.layers[layer]
        cache.update(batch_keys, batch_values, layer)
    prefix_ids, prefix_mask = _left_pad([row[:length] for row, length in zip(rows, lengths)], width, pad_token_id)
    return _continue_rows(model, cache, prefix_ids, prefix_mask, rows, lengths, pad_token_id)


def _continue_rows(model, cache, prefix_ids, prefix_mask, rows, prefix_lengths, pad_token_id):
    """Lay each row out as [its prefix (`prefix_ids`, whose KV `cache` holds) | gap | tail | last token], run the
    tails through the model on top of the cache, and return (ids, mask, cache)."""
    device = model.device
    tails = [row[length:-1] for row, length in zip(rows, prefix_lengths)]
    tail_width = max(len(tail) for tail in tails)
    tail_ids, tail_mask = _left_pad(tails, tail_width, pad_token_id)
    last = torch.tensor([[row[-1]] for row in rows])
    ids = torch.cat([prefix_ids, tail_ids, last], dim=1).to(device)
    mask = torch.cat([prefix_mask, tail_mask, torch.ones_like(last)], dim=1).to(device)
    positions = positions_from_mask(mask)
    if tail_width:
        prefix_width = prefix_ids.shape[1]
        columns = slice(prefix_width, prefix_width + tail_width)
        model(
            input_ids=ids[:, columns],
            attention_mask=mask[:, : prefix_width + tail_width],
            position_ids=positions[:, columns],
            **cache_kwargs(model, cache),
            use_cache=True,
            logits_to_keep=1,
        )
    return ids, mask, cache


@torch.no_grad()
def prefill(model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> DynamicCache | None:
    """KV cache of every left-padded prompt row but its last token (None when a row has fewer than two prompt
    tokens: nothing would be left to prefill)."""
    if prompt_ids.shape[1] < 2 or int(prompt_mask.sum(1).min()) < 2:
        return None
    positions = positions_from_mask(prompt_mask)
    cache = DynamicCache(config=model.config)
    model(
        input_ids=prompt_ids[:, :-1],
        attention_mask=prompt_mask[:, :-1],
        position_ids=positions[:, :-1],
        **cache_kwargs(model, cache),
        use_cache=True,
        logits_to_keep=1,
    )
    return cache


@torch.no_grad()
def prefill_shared_prompts(model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> DynamicCache | None:
    """KV cache of every prompt row but its last token, computed once per distinct prompt.

    The rows of a rollout repeat each prompt num_generations times; prefilling the distinct ones
    and copying their cache rows (`reorder_cache`) saves (G - 1)/G of the prefill. `generate` then
    starts from the last prompt token, exactly as after its own prefill. Returns None (plain
    `generate`) when no prompt repeats or a prompt is too short to leave a token for `generate`.
    """
    rows = torch.cat([prompt_ids, prompt_mask], dim=1)
    distinct, inverse = torch.unique(rows, dim=0, return_inverse=True)
    if distinct.shape[0] == rows.shape[0]:
        return None
    cache = prefill(model, distinct[:, : prompt_ids.shape[1]], distinct[:, prompt_ids.shape[1] :])
    if cache is not None:
        cache.reorder_cache(inverse.to(prompt_ids.device))
    return cache

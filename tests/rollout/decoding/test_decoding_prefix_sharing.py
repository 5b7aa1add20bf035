"""gspo_trl.rollout.decoding.prefix_sharing: which rows share which prefix (by hand), and the cache built from shared
prefixes
against a plain forward of every whole row; the loop sampling from it is tested in test_decoding_dynamic.py."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from gspo_trl.rollout.decoding.kv_cache import cache_kwargs
from gspo_trl.rollout.decoding.prefix_sharing import (
    prefill,
    prefill_shared_prefixes,
    prefill_shared_prompts,
    shared_prefix_groups,
)


def as_sets(groups):
    return sorted((sorted(members), length) for members, length in groups)


def test_groups_by_hand():
    rows = [
        [1, 2, 3, 4, 5, 6],  # 0: shares 1 2 3 4 with 2 and 4
        [7, 8, 9],  # 1: shares nothing
        [1, 2, 3, 4, 9, 9],  # 2
        [1, 2, 3, 4, 5, 6],  # 3: equal to 0
        [1, 2, 3, 4, 5, 7],  # 4: shares 1..5 with 0 and 3
    ]
    # {0, 3, 4} share 5 tokens: 2 rows x 5 = 10 tokens saved; {0, 2, 3, 4} share 4: 3 x 4 = 12, the larger saving.
    assert as_sets(shared_prefix_groups(rows)) == [([0, 2, 3, 4], 4), ([1], 2)]
    # Two families with long prefixes and a short one in common: each family keeps its long prefix.
    family_a, family_b = [5, 1, 1, 1, 1, 1], [5, 2, 2, 2, 2, 2]
    rows = [family_a + [10], family_b + [11], family_a + [12, 13], family_b + [14], family_a + [15]]
    assert as_sets(shared_prefix_groups(rows)) == [([0, 2, 4], 6), ([1, 3], 6)]


def test_a_prefix_leaves_each_member_its_last_token():
    rows = [[1, 2, 3], [1, 2, 3], [1, 2, 3, 4]]
    assert as_sets(shared_prefix_groups(rows)) == [([0, 1, 2], 2)]
    assert as_sets(shared_prefix_groups([[4], [4]])) == [([0], 0), ([1], 0)]  # nothing to share before the last
    assert shared_prefix_groups([]) == []


def test_nothing_shared_or_nothing_saved_gives_none(tiny_model):
    assert prefill_shared_prefixes(tiny_model, [[1, 2, 3], [4, 5, 6]], 0) is None  # no shared prefix
    assert prefill_shared_prefixes(tiny_model, [[1, 2], [1]], 0) is None  # a row of one token
    # Two rows share 2 tokens, a third nothing: the distinct prefixes padded to 31 (2 x 31) and every tail padded
    # to 29 (3 x 29) cost more than every row padded to 31 (3 x 31).
    assert prefill_shared_prefixes(tiny_model, [[1, 1] + [2] * 30, [1, 1, 3], [9] * 32], 0) is None
    # Two rows of 68 tokens share 3: 3 + 2 x 65 positions against 2 x 68 saves 2%, not worth a second forward.
    assert prefill_shared_prefixes(tiny_model, [[1, 2, 3] + [4] * 65, [1, 2, 3] + [5] * 65], 0) is None
    assert prefill_shared_prefixes(tiny_model, [[1, 2, 3] + [4] * 5, [1, 2, 3] + [5] * 5], 0) is not None


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_the_shared_prefix_cache_continues_each_row_as_a_plain_forward_would(tiny_model, attention):
    tiny_model.config._attn_implementation = attention
    torch.manual_seed(0)
    prompt_a, prompt_b = torch.randint(5, 200, (40,)).tolist(), torch.randint(5, 200, (25,)).tolist()
    rows = [
        prompt_a + [7, 8, 9, 10, 11],  # the later turns of episodes: the group's prompt, then their own tokens
        prompt_a + [12, 13],
        prompt_b + [14, 15, 16, 17, 18, 19, 20, 21],
        prompt_a + [22, 23, 24],
        prompt_b + [25],
        prompt_a + [7, 8, 9],
    ]
    assert_continues_each_row_as_a_plain_forward(tiny_model, rows, *prefill_shared_prefixes(tiny_model, rows, 0))


def assert_continues_each_row_as_a_plain_forward(model, rows, ids, mask, cache):
    for row, expected in enumerate(rows):  # each row is its own tokens once the gaps are dropped
        assert ids[row][mask[row].bool()].tolist() == expected
    assert cache.get_seq_length() == ids.shape[1] - 1
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
    logits = model(
        input_ids=ids[:, -1:],
        attention_mask=mask,
        position_ids=positions[:, -1:],
        **cache_kwargs(model, cache),
        use_cache=True,
    ).logits[:, -1]
    for row, tokens in enumerate(rows):
        plain = model(input_ids=torch.tensor([tokens])).logits[0, -1]
        torch.testing.assert_close(logits[row], plain, atol=1e-5, rtol=1e-5)


def test_the_prefixes_run_once(tiny_model):
    prompt = list(range(10, 60))
    rows = [prompt + [1, 2, 3], prompt + [4], prompt + [5, 6]]
    shapes = []
    hook = tiny_model.model.embed_tokens.register_forward_hook(lambda m, i, o: shapes.append(tuple(o.shape[:2])))
    try:
        ids, _, cache = prefill_shared_prefixes(tiny_model, rows, pad_token_id=0)
    finally:
        hook.remove()
    # The 50-token prompt once, then the rows' tails (all but the last token: at most 2, left-padded).
    assert shapes == [(1, 50), (3, 2)]
    assert isinstance(cache, DynamicCache) and ids.shape == (3, 50 + 2 + 1)


def test_rows_continue_from_the_states_the_decoding_loop_kept(tiny_model, tiny_tokenizer):
    # The next turn of an episode: the KV cache the loop kept for each row that ended with an EOS (its prompt and
    # completion but the EOS) continues the row with the environment's reply, as a plain forward of it all would.
    from test_decoding_dynamic import FavourEos
    from transformers import LogitsProcessorList

    from gspo_trl.rollout.decoding.dynamic import sample
    from gspo_trl.rollout.decoding.prefix_sharing import prefill_after_states

    eos, pad = tiny_tokenizer.eos_token_id, tiny_tokenizer.pad_token_id
    encoded = tiny_tokenizer(
        ["What is 2 + 3?", "Hi", "Solve: 7 - 4, then add 2"], return_tensors="pt", padding=True, padding_side="left"
    )
    torch.manual_seed(0)
    decoded = sample(
        tiny_model,
        encoded.input_ids,
        encoded.attention_mask,
        max_new_tokens=30,
        eos_token_ids=[eos],
        pad_token_id=pad,
        processors=LogitsProcessorList([FavourEos(eos)] * 2),
        keep_states=True,
    )
    completions, states = decoded.completion_ids, decoded.states
    rows, kept = [], []
    for row, state in enumerate(states):
        completion = completions[row].tolist()
        if eos not in completion:
            assert state is None  # no EOS, nothing to continue from
            continue
        history = (
            encoded.input_ids[row][encoded.attention_mask[row].bool()].tolist()
            + completion[: completion.index(eos) + 1]
        )
        assert state.length == len(history) - 1  # the EOS was sampled, never run through the model
        rows.append(history + [11, 12, 13][: 1 + row])  # the environment's reply
        kept.append(state)
    assert len(rows) >= 2
    assert_continues_each_row_as_a_plain_forward(tiny_model, rows, *prefill_after_states(tiny_model, rows, kept, pad))


def test_prefill_refuses_rows_with_a_single_prompt_token(tiny_model, tiny_tokenizer):
    encoded = tiny_tokenizer(["Hi there", "x", "x"], return_tensors="pt", padding=True, padding_side="left")
    assert int(encoded.attention_mask.sum(1).min()) == 1
    assert prefill(tiny_model, encoded.input_ids, encoded.attention_mask) is None
    assert prefill_shared_prompts(tiny_model, encoded.input_ids, encoded.attention_mask) is None  # "x" repeats

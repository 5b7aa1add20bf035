"""Tests for gspo_trl.rollout.episodes: the multi-turn loop's token bookkeeping, budget and endings, with a
scripted sampler (the loop's boundary with a backend) and with the tiny model itself."""

from types import SimpleNamespace

import pytest
import torch

from gspo_trl.rollout import HFGenerateBackend, Rollout, RolloutBackend, completion_mask_from_eos
from gspo_trl.rollout.environments.chat import ObservationEncoder
from gspo_trl.rollout.episodes import EpisodeRunner
from gspo_trl.training.logprobs import completion_logprobs


def episode_args(**overrides):
    values = dict(
        max_prompt_length=None,
        chat_template_kwargs=None,
        max_completion_length=40,
        max_turns=None,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        min_p=None,
        repetition_penalty=1.0,
        cache_implementation=None,
        generation_kwargs=None,
        decode_loop="gspo",
        decode_cuda_graphs=True,
        decode_logprobs_as_old=None,
        bf16=False,
        fp16=False,
        decode_max_rows=None,
        cpu_decoding_kernels="auto",
        full_determinism=False,
    )
    values.update(overrides)
    return SimpleNamespace(**values)


class ScriptedSampler(RolloutBackend):
    """Answers each turn with the next scripted token lists (one per live episode) and records what it was asked."""

    def __init__(self, turns, eos_token_id, pad_token_id):
        self.turns, self.calls = list(turns), []
        self.eos_token_ids, self.pad = [eos_token_id], pad_token_id

    def generate(self, prompts, stream_keys=None):
        raise AssertionError("episodes sample from token ids")

    def generate_from_ids(self, prompt_ids, max_new_tokens, stream_keys=None, states=None):
        self.calls.append(([list(p) for p in prompt_ids], max_new_tokens))
        answers = [ids[:max_new_tokens] for ids in self.turns.pop(0)]
        assert len(answers) == len(prompt_ids)
        width = max(len(a) for a in answers)
        ids = torch.full((len(answers), width), self.pad)
        for row, answer in enumerate(answers):
            ids[row, : len(answer)] = torch.tensor(answer)
        mask, truncated = completion_mask_from_eos(ids, self.eos_token_ids)
        empty = torch.zeros(len(answers), 1, dtype=torch.long)
        return Rollout(empty, empty, ids, mask, truncated)


class Scripted:
    """Step rewards 1, 2, 3, ...; terminates when the action contains 'stop'."""

    def reset(self, seed=None, options=None):
        self.seed, self.turn = seed, 0
        return "", {}

    def step(self, action):
        self.turn += 1
        return "no", float(self.turn), "stop" in action, False, {}


def test_turns_and_observations_are_concatenated_as_token_ids(tiny_tokenizer):
    tok = tiny_tokenizer
    eos = tok.eos_token_id
    hello, stop, world = tok.encode("hello"), tok.encode("stop"), tok.encode("world")
    sampler = ScriptedSampler(
        [
            [hello + [eos], world + [eos]],  # turn 0: both go on
            [stop + [eos], hello + [eos]],  # turn 1: row 0 stops
            [world + [eos]],  # turn 2: row 1 hits max_turns
        ],
        eos,
        tok.pad_token_id,
    )
    runner = EpisodeRunner(Scripted, tok, episode_args(max_turns=3))
    rows = [{"prompt": [{"role": "user", "content": "Go."}]}] * 2
    batch = runner.run(sampler, rows, seeds=[5, 5])

    observation = ObservationEncoder(tok, True, [eos])("no")
    prompt = tok.apply_chat_template(rows[0]["prompt"], tokenize=True, add_generation_prompt=True, return_dict=False)
    first = [hello + [eos], world + [eos]]
    # What each turn was sampled from: the prompt and the episode so far, never re-tokenized.
    assert sampler.calls[0][0] == [prompt, prompt]
    assert sampler.calls[1][0] == [prompt + first[0] + observation, prompt + first[1] + observation]
    assert sampler.calls[2][0] == [prompt + first[1] + observation + hello + [eos] + observation]

    row0 = first[0] + observation + stop + [eos]
    row1 = first[1] + observation + hello + [eos] + observation + world + [eos]
    rollout = batch.rollout
    assert rollout.completion_ids[0, : len(row0)].tolist() == row0
    assert rollout.completion_ids[1].tolist() == row1
    assert rollout.completion_mask.sum(1).tolist() == [len(row0), len(row1)]
    expected_env = [1] * len(first[0]) + [0] * len(observation) + [1] * (len(stop) + 1)
    assert rollout.env_mask[0, : len(row0)].tolist() == expected_env
    assert rollout.turn_ids[0, : len(row0)].tolist() == (
        [0] * len(first[0]) + [-1] * len(observation) + [1] * (len(stop) + 1)
    )
    assert (rollout.turn_ids[1][rollout.env_mask[1].bool()].unique().tolist()) == [0, 1, 2]
    assert batch.ends == ["terminated", "max_turns"]
    assert batch.turn_rewards.tolist() == [[1.0, 2.0, 0.0], [1.0, 2.0, 3.0]]
    assert batch.reached.tolist() == [[True, True, False], [True, True, True]]
    assert rollout.is_truncated.tolist() == [False, False]
    # Reward functions see the conversation after the prompt.
    assert [m["role"] for m in batch.completions[1]] == ["assistant", "user", "assistant", "user", "assistant"]
    assert batch.completions[0][-1]["content"] == "stop"
    assert [env.seed for env in batch.environments] == [5, 5]


def test_the_completion_budget_counts_every_turn_and_observation(tiny_tokenizer):
    tok = tiny_tokenizer
    eos = tok.eos_token_id
    observation = ObservationEncoder(tok, True, [eos])("no")
    budget = 2 * 3 + len(observation) + 2  # two 3-token turns, one observation, 2 tokens to spare
    sampler = ScriptedSampler(
        [
            [[7, 8, eos], [7, 8, eos]],
            [[9, 10, eos], [9, 9, 9, 9, 9]],  # row 1 runs past its 5 tokens of room: cut, no end-of-turn token
        ],
        eos,
        tok.pad_token_id,
    )
    runner = EpisodeRunner(Scripted, tok, episode_args(max_completion_length=budget))
    batch = runner.run(sampler, [{"prompt": [{"role": "user", "content": "Go."}]}] * 2, seeds=[0, 0])
    room = budget - 3 - len(observation)
    assert sampler.calls[1][1] == room  # the most any live episode may still sample
    # Row 0 ended its turn with room left, but the next observation would leave no token for a reply.
    assert batch.ends == ["budget", "length"]
    assert batch.rollout.completion_mask.sum(1).tolist() == [3 + len(observation) + 3, budget]
    assert batch.rollout.is_truncated.tolist() == [True, True]


def test_reset_observation_joins_the_prompt_and_rows_without_prompt_start_from_it(tiny_tokenizer):
    class Greets(Scripted):
        def reset(self, seed=None, options=None):
            super().reset(seed, options)
            return " (level 3)", {}

    runner = EpisodeRunner(Greets, tiny_tokenizer, episode_args())
    prompts = runner.initial_prompts(
        [{"prompt": [{"role": "user", "content": "Go."}]}, {"prompt": "Go."}, {"task": 1}],
        [" (level 3)", " (level 3)", "Level 3."],
    )
    assert prompts == [
        [{"role": "user", "content": "Go. (level 3)"}],
        "Go. (level 3)",
        [{"role": "user", "content": "Level 3."}],
    ]


def test_env_factory_is_checked_at_construction(tiny_tokenizer):
    with pytest.raises(TypeError, match="env_factory must be a callable"):
        EpisodeRunner(Scripted(), tiny_tokenizer, episode_args())

    class NoReset:
        def step(self, action):
            return "", 0.0, True, False, {}

    with pytest.raises(TypeError, match=r"NoReset without a reset\(\) method"):
        EpisodeRunner(NoReset, tiny_tokenizer, episode_args())


class Forever:
    """Never ends an episode by itself."""

    def reset(self, seed=None, options=None):
        return "", {}

    def step(self, action):
        return "Again.", 0.0, False, False, {}


@pytest.mark.parametrize("padding_free", [False, True])
def test_trainer_log_probs_of_episodes_match_the_sampling_contexts(tiny_model, tiny_tokenizer, padding_free):
    # Every sampled token is scored in the padded (or packed) training batch from exactly the context it was
    # sampled from: the prompt, earlier turns and observations. Recomputed here one turn at a time.
    tok = tiny_tokenizer
    torch.manual_seed(0)
    # The random model seldom ends a turn by itself: favour its end-of-turn token so that episodes have turns.
    args = episode_args(
        max_completion_length=30, max_turns=3, generation_kwargs={"sequence_bias": [[[tok.eos_token_id], 3.0]]}
    )
    backend = HFGenerateBackend(lambda: tiny_model, tok, args)
    runner = EpisodeRunner(Forever, tok, args)
    rows = [{"prompt": [{"role": "user", "content": "What is 2 + 3?"}]}] * 2  # one group: the same prompt
    batch = runner.run(backend, rows, seeds=[1, 1])
    r = batch.rollout
    assert r.env_mask.sum() < r.completion_mask.sum()  # some observations were appended
    sampled = r.completion_mask * r.env_mask
    scores = completion_logprobs(
        tiny_model,
        torch.cat([r.prompt_ids, r.completion_ids], 1),
        torch.cat([r.prompt_mask, r.completion_mask], 1),
        r.completion_ids,
        sampled,
        padding_free=padding_free,
    ).logps
    with torch.no_grad():
        for row in range(2):
            prompt = r.prompt_ids[row][r.prompt_mask[row].bool()].tolist()
            completion = r.completion_ids[row][r.completion_mask[row].bool()].tolist()
            logits = tiny_model(torch.tensor([prompt + completion])).logits[0, len(prompt) - 1 : -1]
            direct = torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(completion)[:, None])[:, 0]
            keep = sampled[row, : len(completion)].bool()
            torch.testing.assert_close(scores[row, : len(completion)][keep], direct[keep], atol=2e-5, rtol=0)


def test_the_examples_retry_environment_rewards_an_early_right_answer():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).parents[2] / "examples" / "train_retry_agent.py"
    spec = importlib.util.spec_from_file_location("train_retry_agent", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    env = example.RetryArithmeticEnv()
    assert env.reset(seed=0, options={"answer": "7"}) == ("", {})
    observation, reward, terminated, truncated, _ = env.step("3 + 4 = 8")
    assert (reward, terminated, truncated) == (0.0, False, False) and "Try again" in observation
    _, reward, terminated, _, _ = env.step("3 + 4 = 7")
    assert reward == pytest.approx(0.7) and terminated


def test_later_turns_reuse_the_turn_cache_or_shared_prefixes_and_play_the_same_episodes(tiny_model, tiny_tokenizer):
    # From the second turn on, an episode's row is its previous row, the end of its turn and the environment's
    # reply. Continuing from the KV cache the decoding loop kept (`Rollout.states`) prefills only the new tokens;
    # without it, the group's shared prompt is prefilled once (prefix_sharing). With the same sampling streams,
    # both play the episodes of a backend that prefills every row whole.
    from test_decoding_dynamic import FavourEos
    from transformers import LogitsProcessorList

    from gspo_trl.rollout import stream_keys

    tok = tiny_tokenizer
    args = episode_args(max_completion_length=60, max_turns=3)
    backend = HFGenerateBackend(lambda: tiny_model, tok, args)
    assert backend.use_decode_loop
    # The random model seldom ends a turn by itself: favour its end-of-turn token so that episodes have turns.
    backend.processors = LogitsProcessorList([FavourEos(tok.eos_token_id)] * 2 + list(backend.processors))
    runner = EpisodeRunner(Forever, tok, args)
    rows = [{"prompt": [{"role": "user", "content": "What is 2 + 3? Answer in one line."}]}] * 3 + [
        {"prompt": [{"role": "user", "content": "Name a colour, please."}]}
    ] * 3
    keys = stream_keys(5, torch.arange(len(rows)))

    def play(reuse_turn_cache, share_prefixes):
        backend.reuse_turn_cache, backend.share_prefixes = reuse_turn_cache, share_prefixes
        forwards = []
        hook = tiny_model.model.embed_tokens.register_forward_hook(lambda m, i, o: forwards.append(tuple(o.shape[:2])))
        try:
            batch = runner.run(backend, rows, seeds=[1] * 6, keys=keys)
        finally:
            hook.remove()
        return batch, [shape for shape in forwards if shape[1] > 1]  # the prefills

    cached, cached_prefills = play(True, True)
    shared, shared_prefills = play(False, True)
    whole, whole_prefills = play(False, False)
    backend.max_decode_rows = 4  # decode_max_rows: each turn in slices of at most 4 rows, the turn cache kept
    sliced, _ = play(True, True)
    assert whole.reached[:, 1].sum() >= 4  # episodes had later turns
    for batch in (cached, shared, sliced):
        assert torch.equal(batch.rollout.completion_ids, whole.rollout.completion_ids)
        assert torch.equal(batch.rollout.completion_mask, whole.rollout.completion_mask)
    positions = lambda prefills: sum(rows * length for rows, length in prefills)  # noqa: E731
    assert positions(cached_prefills) < positions(shared_prefills) < positions(whole_prefills)
    # Without the turn cache, the second turn starts with one forward of the groups' shared prefixes (their
    # prompts and more): fewer rows than the episodes that played it, longer than the first turn's prompts.
    first_turn, second_turn = shared_prefills[:2]
    assert second_turn[0] < int(shared.reached[:, 1].sum()) and second_turn[1] > first_turn[1]
    # With it, a later turn runs only the tokens after the cache: the turn's EOS and the reply ("Again.").
    reply = len(ObservationEncoder(tok, True, [tok.eos_token_id])("Again."))
    assert all(length <= 1 + reply for _, length in cached_prefills[1:])
    # The loop's log-probs of every turn, stitched along the episode (decode_logprobs_as_old): what training scores
    # for the sampled tokens, 0 on the environment's.
    r = cached.rollout
    sampled = r.sampled_mask.bool()
    scores = completion_logprobs(
        tiny_model,
        torch.cat([r.prompt_ids, r.completion_ids], 1),
        torch.cat([r.prompt_mask, r.completion_mask], 1),
        r.completion_ids,
        r.sampled_mask,
    ).logps
    assert r.sampled_by_policy and (r.sampling_logps[~sampled] == 0).all()
    torch.testing.assert_close(r.sampling_logps[sampled], scores[sampled], atol=2e-5, rtol=0)


@pytest.mark.parametrize("precision", ["bf16 weights", "bf16 autocast"])
def test_the_turn_cache_in_bf16(tiny_model, tiny_tokenizer, precision):
    # The GPU recipes: bf16 weights, or fp32 weights under bf16 autocast (the cache then holds bf16 keys/values).
    from test_decoding_dynamic import FavourEos
    from transformers import LogitsProcessorList

    from gspo_trl.rollout import stream_keys

    tok = tiny_tokenizer
    model = tiny_model.to(torch.bfloat16) if precision == "bf16 weights" else tiny_model
    args = episode_args(max_completion_length=60, max_turns=3)
    backend = HFGenerateBackend(lambda: model, tok, args)
    backend.processors = LogitsProcessorList([FavourEos(tok.eos_token_id)] * 2 + list(backend.processors))
    prefills = []
    hook = model.model.embed_tokens.register_forward_hook(
        lambda m, i, o: prefills.append(o.shape[1]) if o.shape[1] > 1 else None
    )
    context = torch.autocast("cpu", dtype=torch.bfloat16) if precision == "bf16 autocast" else torch.no_grad()
    try:
        with context:
            batch = EpisodeRunner(Forever, tok, args).run(
                backend,
                [{"prompt": [{"role": "user", "content": "Hi"}]}] * 4,
                seeds=[1] * 4,
                keys=stream_keys(5, torch.arange(4)),
            )
    finally:
        hook.remove()
    assert batch.reached[:, 1:].sum() >= 2  # later turns were played ...
    reply = len(ObservationEncoder(tok, True, [tok.eos_token_id])("Again."))
    assert len(prefills) >= 2 and all(length <= reply for length in prefills[1:])  # ... from the turn cache


def test_a_truncating_sampler_stitches_its_kept_mass_along_the_episode(tiny_model, tiny_tokenizer):
    # top-p in every turn: the loop's renormalised log-probs and kept log-mass are stitched along the episode (0 on
    # the environment's tokens); their sum is the policy's log-prob, what training scores (float32 rounding: 2e-5).
    from test_decoding_dynamic import FavourEos
    from transformers import LogitsProcessorList

    from gspo_trl.rollout import stream_keys
    from gspo_trl.rollout.decoding.truncation import policy_logps

    tok = tiny_tokenizer
    args = episode_args(max_completion_length=40, max_turns=2, top_p=0.6)
    backend = HFGenerateBackend(lambda: tiny_model, tok, args)
    backend.processors = LogitsProcessorList([FavourEos(tok.eos_token_id)] * 2 + list(backend.processors))
    rows = [{"prompt": [{"role": "user", "content": "What is 2 + 3?"}]}] * 4
    batch = EpisodeRunner(Forever, tok, args).run(backend, rows, seeds=[1] * 4, keys=stream_keys(3, torch.arange(4)))
    r = batch.rollout
    assert batch.reached[:, 1].any()  # a second turn was played
    sampled = r.sampled_mask.bool()
    assert (r.kept_log_mass[sampled] < 0).all() and (r.kept_log_mass[~sampled] == 0).all()
    scores = completion_logprobs(
        tiny_model,
        torch.cat([r.prompt_ids, r.completion_ids], 1),
        torch.cat([r.prompt_mask, r.completion_mask], 1),
        r.completion_ids,
        r.sampled_mask,
    ).logps
    policy = policy_logps(r.sampling_logps, r.kept_log_mass)
    torch.testing.assert_close(policy[sampled], scores[sampled], atol=2e-5, rtol=0)

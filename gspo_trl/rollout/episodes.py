"""The multi-turn loop: a batch of episodes played turn by turn.

Each turn, every live episode's next assistant turn is sampled in one batch by the rollout backend (from the
episode's token ids so far); then the environments step on the turns' texts, and an episode that goes on gets the
observation's tokens appended (`chat.ObservationEncoder`). An episode ends when its environment terminates or
truncates it, at `max_turns`, when a turn runs out of the completion budget without its end-of-turn token, or when
the next observation would not fit the budget (`max_completion_length` counts every turn and every observation
token, as TRL does for tool results).

Owns the token bookkeeping of episodes: the sampled tokens (`env_mask`), the turn of each (`turn_ids`), the reward
after each turn, and how each episode ended. Does not own environments' conventions (`text_env`), reward functions,
advantages or the loss.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from .environments import text_env
from .environments.chat import ObservationEncoder
from .streams import stream_keys
from .types import EpisodeBatch, Rollout, RolloutBackend, is_conversational_prompt, tokenize_prompts

# Why an episode ended. "length" and "budget" mean the completion budget ran out: they are the episode's
# `is_truncated` (what mask_truncated_completions drops).
END_REASONS = ("terminated", "env_truncated", "max_turns", "length", "budget")
BUDGET_ENDS = ("length", "budget")


@dataclass(eq=False)
class Episode:
    env: Any
    prompt_ids: list[int]
    completion_ids: list[int] = field(default_factory=list)
    env_mask: list[int] = field(default_factory=list)  # 1: sampled by the model, 0: the environment's
    turn_ids: list[int] = field(default_factory=list)  # the assistant turn of each sampled token, -1 elsewhere
    sampling_logps: list[float] = field(default_factory=list)
    kept_log_mass: list[float] = field(default_factory=list)  # 0 where the sampler cut nothing (observations too)
    rewards: list[float] = field(default_factory=list)  # one per assistant turn
    messages: list[dict] = field(default_factory=list)  # the conversation after the prompt
    end: str | None = None
    state: Any = None  # what the backend kept after the last turn to continue from (`Rollout.states`)

    def add_turn(self, ids: list[int], logps: list[float], turn: int, log_mass: list[float] | None = None) -> None:
        self.completion_ids += ids
        self.env_mask += [1] * len(ids)
        self.turn_ids += [turn] * len(ids)
        self.sampling_logps += logps
        self.kept_log_mass += [0.0] * len(ids) if log_mass is None else log_mass

    def add_observation(self, ids: list[int]) -> None:
        self.completion_ids += ids
        self.env_mask += [0] * len(ids)
        self.turn_ids += [-1] * len(ids)
        self.sampling_logps += [0.0] * len(ids)
        self.kept_log_mass += [0.0] * len(ids)


def episode_runner_for(tool_episodes, env_factory, tokenizer, args) -> EpisodeRunner | None:
    """The runner of a trainer's episodes: TRL's tools/environments (turns bounded by `max_tool_calling_iterations`
    + 1 and `max_turns`), a gym-style `env_factory`, or None for single-turn rollouts."""
    episodes = tool_episodes is not None or env_factory is not None
    if episodes and args.use_vllm and args.vllm_mode == "colocate" and args.vllm_tensor_parallel_size > 1:
        raise ValueError(
            "Multi-turn episodes with a colocated engine and vllm_tensor_parallel_size > 1: each process plays its own "
            "number of turns, while the engine's group samples together (a process done early would leave the others "
            "waiting). Set vllm_tensor_parallel_size=1."
        )
    if tool_episodes is not None:
        iterations = args.max_tool_calling_iterations
        max_turns = args.max_turns if iterations is None else min(args.max_turns or iterations + 1, iterations + 1)
        return EpisodeRunner(tool_episodes, tokenizer, args, max_turns=max_turns)
    return None if env_factory is None else EpisodeRunner(env_factory, tokenizer, args)


class EpisodeRunner:
    """Plays gym-style text environments from `env_factory` (`text_env`); environments are reused across rollouts."""

    def __init__(self, env_factory, tokenizer, args, max_turns: int | None = None):
        if not callable(env_factory):
            raise TypeError(
                f"env_factory must be a callable returning an environment, got {type(env_factory).__name__}."
            )
        self.env_factory = env_factory
        self.tokenizer = tokenizer
        self.args = args
        self.max_turns = args.max_turns if max_turns is None else max_turns
        self._encoders: dict[bool, ObservationEncoder] = {}
        self.pool: list = [text_env.make_environment(env_factory)]  # fail at construction, not at the first rollout

    def _environments(self, count: int) -> list:
        while len(self.pool) < count:
            self.pool.append(text_env.make_environment(self.env_factory))
        return self.pool[:count]

    def _encoder(self, conversational: bool, end_of_turn_ids: list[int]) -> ObservationEncoder:
        if conversational not in self._encoders:
            self._encoders[conversational] = ObservationEncoder(
                self.tokenizer, conversational, end_of_turn_ids, self.args.chat_template_kwargs
            )
        return self._encoders[conversational]

    def initial_prompts(self, rows: list[dict], observations: list[str]) -> list:
        """Each row's prompt with its reset observation appended (to the last message's text, as TRL does); a row
        without a prompt starts from the observation alone, as a user message when the tokenizer has a chat template."""
        prompts = []
        for row, observation in zip(rows, observations):
            prompt = row.get("prompt")
            if prompt is None:
                chat = getattr(self.tokenizer, "chat_template", None) is not None
                prompts.append([{"role": "user", "content": observation}] if chat else observation)
            elif isinstance(prompt, str):
                prompts.append(prompt + observation)
            elif observation:
                prompts.append(prompt[:-1] + [{**prompt[-1], "content": prompt[-1]["content"] + observation}])
            else:
                prompts.append(prompt)
        return prompts

    def run(
        self, backend: RolloutBackend, rows: list[dict], seeds: list[int], keys: torch.Tensor | None = None
    ) -> EpisodeBatch:
        """Play one episode per row; the rows of a group share their seed, so they start from the same state.

        `keys`: per-row sampling streams (`rollout.stream_keys`); each turn draws from its own stream."""
        args, tokenizer = self.args, self.tokenizer
        envs = self._environments(len(rows))
        observations = [text_env.reset(env, seed, row) for env, seed, row in zip(envs, seeds, rows)]
        prompts = self.initial_prompts(rows, observations)
        conversational = is_conversational_prompt(prompts[0])
        # Environments whose tools the chat template presents itself (`tools.ToolEnvironment`) say which.
        tools = [getattr(env, "template_tools", None) for env in envs]
        prompt_ids, prompt_mask = tokenize_prompts(
            prompts, tokenizer, args.max_prompt_length, args.chat_template_kwargs, tools
        )
        episodes = [Episode(env, ids[mask.bool()].tolist()) for env, ids, mask in zip(envs, prompt_ids, prompt_mask)]
        encoder = self._encoder(conversational, backend.eos_token_ids)
        budget = args.max_completion_length
        turn = 0
        while True:
            live_rows = [row for row, episode in enumerate(episodes) if episode.end is None]
            if not live_rows:
                break
            live = [episodes[row] for row in live_rows]
            room = [budget - len(episode.completion_ids) for episode in live]
            turn_keys = None if keys is None else stream_keys(turn, keys[torch.tensor(live_rows)])
            rollout = backend.generate_from_ids(
                [episode.prompt_ids + episode.completion_ids for episode in live],
                max(room),
                turn_keys,
                [episode.state for episode in live],
            )
            actions, finished_turn = [], []
            for row, (episode, space) in enumerate(zip(live, room)):
                episode.state = None if rollout.states is None else rollout.states[row]
                length = int(rollout.completion_mask[row].sum())
                ids = rollout.completion_ids[row, :length].tolist()
                logps = (
                    [0.0] * length if rollout.sampling_logps is None else rollout.sampling_logps[row, :length].tolist()
                )
                log_mass = None if rollout.kept_log_mass is None else rollout.kept_log_mass[row, :length].tolist()
                ended = not bool(rollout.is_truncated[row]) and length <= space
                history = episode.prompt_ids + episode.completion_ids
                episode.add_turn(ids[:space], logps[:space], turn, None if log_mass is None else log_mass[:space])
                text = tokenizer.decode(ids[:space], skip_special_tokens=True)
                episode.messages.append({"role": "assistant", "content": text})
                actions.append(text_env.TurnText(text, ids[:space], history))
                finished_turn.append(ended)
            results = text_env.step_all([episode.env for episode in live], actions)
            for episode, result, ended in zip(live, results, finished_turn):
                episode.rewards.append(result.reward)
                if result.terminated:
                    episode.end = "terminated"
                elif result.truncated:
                    episode.end = "env_truncated"
                elif not ended:
                    episode.end = "length"
                elif self.max_turns is not None and turn + 1 >= self.max_turns:
                    episode.end = "max_turns"
                else:
                    observation_ids = encoder(result.observation)
                    # The next turn needs at least one token of room.
                    if len(episode.completion_ids) + len(observation_ids) >= budget:
                        episode.end = "budget"
                    else:
                        episode.add_observation(observation_ids)
                        if isinstance(result.observation, str):
                            episode.messages.append({"role": "user", "content": result.observation})
                        else:
                            episode.messages.extend(result.observation)
                if episode.end is not None:
                    episode.state = None  # nothing to continue: free it now
            turn += 1
        return _batch(
            episodes,
            prompts,
            prompt_ids,
            prompt_mask,
            conversational,
            tokenizer,
            rollout.sampling_logps is not None,
            rollout.sampled_by_policy,
            rollout.decoding_loop,
            rollout.kept_log_mass is not None,
        )


def _batch(
    episodes,
    prompts,
    prompt_ids,
    prompt_mask,
    conversational,
    tokenizer,
    has_sampling_logps,
    sampled_by_policy,
    decoding_loop=None,
    truncated=False,
) -> EpisodeBatch:
    rows, width = len(episodes), max(1, max(len(e.completion_ids) for e in episodes))
    turns = max(len(e.rewards) for e in episodes)
    completion_ids = torch.full((rows, width), tokenizer.pad_token_id, dtype=torch.long)
    completion_mask = torch.zeros((rows, width), dtype=torch.long)
    env_mask = torch.zeros((rows, width), dtype=torch.long)
    turn_ids = torch.full((rows, width), -1, dtype=torch.long)
    sampling_logps = torch.zeros((rows, width), dtype=torch.float32)
    kept_log_mass = torch.zeros((rows, width), dtype=torch.float32)
    turn_rewards = torch.zeros((rows, turns), dtype=torch.float32)
    reached = torch.zeros((rows, turns), dtype=torch.bool)
    for row, episode in enumerate(episodes):
        n = len(episode.completion_ids)
        completion_ids[row, :n] = torch.tensor(episode.completion_ids, dtype=torch.long)
        completion_mask[row, :n] = 1
        env_mask[row, :n] = torch.tensor(episode.env_mask, dtype=torch.long)
        turn_ids[row, :n] = torch.tensor(episode.turn_ids, dtype=torch.long)
        sampling_logps[row, :n] = torch.tensor(episode.sampling_logps, dtype=torch.float32)
        kept_log_mass[row, :n] = torch.tensor(episode.kept_log_mass, dtype=torch.float32)
        turn_rewards[row, : len(episode.rewards)] = torch.tensor(episode.rewards, dtype=torch.float32)
        reached[row, : len(episode.rewards)] = True
    is_truncated = torch.tensor([episode.end in BUDGET_ENDS for episode in episodes])
    rollout = Rollout(
        prompt_ids,
        prompt_mask,
        completion_ids,
        completion_mask,
        is_truncated,
        sampling_logps if has_sampling_logps else None,
        env_mask,
        turn_ids,
        sampled_by_policy=has_sampling_logps and sampled_by_policy,
        decoding_loop=decoding_loop,
        kept_log_mass=kept_log_mass if truncated else None,
    )
    if conversational:
        completions = [episode.messages for episode in episodes]
    else:
        completions = [tokenizer.decode(episode.completion_ids, skip_special_tokens=True) for episode in episodes]
    return EpisodeBatch(
        rollout=rollout,
        prompts=prompts,
        turn_rewards=turn_rewards,
        reached=reached,
        completions=completions,
        completion_ids=[episode.completion_ids for episode in episodes],
        # A wrapper (e.g. `tools.ToolEnvironment`) shows reward functions the environment it wraps, as TRL does.
        environments=[getattr(episode.env, "unwrapped", episode.env) for episode in episodes],
        tool_calls=torch.tensor([getattr(episode.env, "tool_calls", 0) for episode in episodes]),
        tool_failures=torch.tensor([getattr(episode.env, "tool_failures", 0) for episode in episodes]),
        ends=[episode.end for episode in episodes],
    )


def end_codes(ends: list[str]) -> torch.Tensor:
    """(N,) the index of each episode's end reason in `END_REASONS`."""
    return torch.tensor([END_REASONS.index(end) for end in ends], dtype=torch.long)

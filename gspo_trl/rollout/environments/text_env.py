"""Gym-style text environments (AgileRL's convention) and the checks on what they return.

An environment is any object with

* ``reset(seed=None, options=None) -> (observation, info)``: ``options`` is the dataset row the episode plays;
  ``observation`` (a string, possibly empty) joins the row's prompt;
* ``step(action) -> (observation, reward, terminated, truncated, info)``: ``action`` is the text of the assistant's
  turn; ``observation`` is shown to the model as the next user message unless the episode ended (or, as a list of
  chat messages such as tool results, as those messages).

Either method may be ``async def``; the steps of one turn then run concurrently. Owns creating environments,
calling them and checking their answers (an error names the class and the method). Does not own the episode loop.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import numbers
from dataclasses import dataclass
from typing import Any


class TurnText(str):
    """An action: the text of an assistant turn, which also carries the token ids it was decoded from
    (`token_ids`) and those of the conversation before it (`prefix_ids`), for tool-call parsers that read tokens
    (a tokenizer's response template). To an environment it is just the string."""

    token_ids: list[int]
    prefix_ids: list[int]

    def __new__(cls, text: str, token_ids: list[int], prefix_ids: list[int]):
        turn = super().__new__(cls, text)
        turn.token_ids, turn.prefix_ids = token_ids, prefix_ids
        return turn


@dataclass
class StepResult:
    observation: str | list[dict]
    reward: float
    terminated: bool
    truncated: bool
    info: dict


def make_environment(env_factory) -> Any:
    """A new environment from `env_factory`, checked to have callable ``reset`` and ``step``."""
    env = env_factory()
    name = type(env).__name__
    for method in ("reset", "step"):
        if not callable(getattr(env, method, None)):
            raise TypeError(
                f"env_factory returned a {name} without a {method}() method. A gym-style text environment defines "
                "reset(seed=None, options=None) -> (observation, info) and step(action) -> (observation, reward, "
                "terminated, truncated, info)."
            )
    return env


def _await(result):
    if inspect.isawaitable(result):
        return _run(result)
    return result


def _run(awaitable):
    async def wrapped():
        return await awaitable

    return asyncio.run(wrapped())


def reset(env, seed: int, row: dict) -> str:
    """The observation `env.reset(seed=seed, options=row)` starts the episode with ("" for none)."""
    name = type(env).__name__
    try:
        result = _await(env.reset(seed=seed, options=row))
    except Exception as error:
        raise RuntimeError(f"{name}.reset(seed={seed}, options=<dataset row>) raised {error!r}") from error
    if not (isinstance(result, tuple) and len(result) == 2):
        raise TypeError(f"{name}.reset must return (observation, info), got {_show(result)}.")
    return _observation(result[0], f"{name}.reset")


def step_all(envs: list, actions: list[str]) -> list[StepResult]:
    """`env.step(action)` for every pair, checked; ``async def step`` ones run concurrently."""
    results: list[Any] = [None] * len(envs)
    pending = []
    for index, (env, action) in enumerate(zip(envs, actions)):
        try:
            result = env.step(action)
        except Exception as error:
            raise RuntimeError(f"{type(env).__name__}.step raised {error!r}") from error
        if inspect.isawaitable(result):
            pending.append((index, result))
        else:
            results[index] = result
    if pending:

        async def gather():
            return await asyncio.gather(*(awaitable for _, awaitable in pending), return_exceptions=True)

        for (index, _), result in zip(pending, asyncio.run(gather())):
            if isinstance(result, BaseException):
                raise RuntimeError(f"{type(envs[index]).__name__}.step raised {result!r}") from result
            results[index] = result
    return [_check_step(env, result) for env, result in zip(envs, results)]


def _check_step(env, result) -> StepResult:
    where = f"{type(env).__name__}.step"
    if not (isinstance(result, tuple) and len(result) == 5):
        raise TypeError(f"{where} must return (observation, reward, terminated, truncated, info), got {_show(result)}.")
    observation, reward, terminated, truncated, info = result
    if isinstance(reward, bool) or not isinstance(reward, numbers.Real) or not math.isfinite(float(reward)):
        raise ValueError(f"{where} returned reward {reward!r}; it must be a finite number.")
    for flag_name, flag in (("terminated", terminated), ("truncated", truncated)):
        if not isinstance(flag, (bool, numbers.Integral)) and type(flag).__name__ != "bool_":
            raise TypeError(f"{where} returned {flag_name}={flag!r}; it must be a bool.")
    return StepResult(
        _observation(observation, where, messages_allowed=True),
        float(reward),
        bool(terminated),
        bool(truncated),
        info if isinstance(info, dict) else {},
    )


def _observation(value, where: str, messages_allowed: bool = False) -> str | list[dict]:
    if value is None:
        return ""
    if (
        messages_allowed
        and isinstance(value, list)
        and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in value
        )
    ):
        return value
    if not isinstance(value, str):
        kinds = (
            "a string or a list of chat messages ({'role': ..., 'content': str})" if messages_allowed else "a string"
        )
        raise TypeError(f"{where} returned observation {_show(value)}; text environments return {kinds}.")
    return value


def _show(value) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:120]}{'...' if len(text) > 120 else ''}"

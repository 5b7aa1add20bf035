"""Tests for gspo_trl.rollout.environments.text_env: the gym-style convention and its error messages."""

import asyncio

import pytest

from gspo_trl.rollout.environments import text_env


class Echo:
    def reset(self, seed=None, options=None):
        self.seed, self.row = seed, options
        return "start", {}

    def step(self, action):
        return f"you said {action}", 1.0, False, False, {"n": 1}


def test_reset_passes_seed_and_row_and_returns_the_observation():
    env = Echo()
    assert text_env.reset(env, 7, {"prompt": "p"}) == "start"
    assert env.seed == 7 and env.row == {"prompt": "p"}


def test_step_all_checks_and_converts():
    results = text_env.step_all([Echo(), Echo()], ["a", "b"])
    assert [r.observation for r in results] == ["you said a", "you said b"]
    assert results[0].reward == 1.0 and results[0].terminated is False and results[0].info == {"n": 1}


def test_async_steps_of_one_turn_run_concurrently():
    # Each step waits until every step of the turn has started: run one after another, they would time out.
    started = []

    class Waiting:
        async def step(self, action):
            started.append(action)
            for _ in range(200):
                if len(started) == 3:
                    return "", 0.5, True, False, {}
                await asyncio.sleep(0.01)
            raise TimeoutError("the other steps never started")

        def reset(self, seed=None, options=None):
            return "", {}

    results = text_env.step_all([Waiting(), Waiting(), Waiting()], ["a", "b", "c"])
    assert [r.reward for r in results] == [0.5, 0.5, 0.5]


class NoStep:
    def reset(self, seed=None, options=None):
        return "", {}


class BadReset(Echo):
    def reset(self, seed=None, options=None):
        return "just a string"


class FourTuple(Echo):
    def step(self, action):
        return "obs", 1.0, False, {}


class NanReward(Echo):
    def step(self, action):
        return "obs", float("nan"), False, False, {}


class ListObservation(Echo):
    def step(self, action):
        return ["obs"], 1.0, False, False, {}


class Raises(Echo):
    def step(self, action):
        raise KeyError("boom")


def test_environment_without_step_is_refused_at_creation():
    with pytest.raises(TypeError, match=r"NoStep without a step\(\) method"):
        text_env.make_environment(NoStep)


@pytest.mark.parametrize(
    "env, call, error, match",
    [
        (BadReset(), "reset", TypeError, r"BadReset.reset must return \(observation, info\)"),
        (
            FourTuple(),
            "step",
            TypeError,
            r"FourTuple.step must return \(observation, reward, terminated, truncated, info\)",
        ),
        (NanReward(), "step", ValueError, r"NanReward.step returned reward nan"),
        (ListObservation(), "step", TypeError, r"ListObservation.step returned observation list"),
        (Raises(), "step", RuntimeError, r"Raises.step raised KeyError\('boom'\)"),
    ],
)
def test_bad_answers_name_the_class_and_method(env, call, error, match):
    with pytest.raises(error, match=match):
        if call == "reset":
            text_env.reset(env, 0, {})
        else:
            text_env.step_all([env], ["x"])

"""A vision-language model learns from GSPO's reward on CPU: a tiny random Gemma 3, warmed up to answer "What colour
is the shape?" with a colour word at chance (`gspo_trl.demo.vision_tasks`), must name the colour of the shape in the
image
well above chance after a short GSPO run (benchmarks/vision_learning.py; its longer runs are in
docs/vision-language.md)."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
STEPS = 240
LAST = 120  # rollouts averaged at the end: the second half of the run


def _benchmark():
    spec = importlib.util.spec_from_file_location("vision_learning", ROOT / "benchmarks" / "vision_learning.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow  # a learning run
def test_reward_rises_above_chance_on_a_tiny_gemma3(tmp_path):
    # beta=0.1 keeps the answers from collapsing to fixed ones before the mapping is learned: without it, 2 of 3 seeds
    # stayed at chance (docs/vision-language.md). This is seed 0 of the recorded runs (0.869 over its last 120 rollouts
    # there).
    result = _benchmark().run(seed=0, max_steps=STEPS, output_dir=str(tmp_path), beta=0.1)
    rewards, chance = result["reward"], result["chance"]
    assert len(rewards) == STEPS and chance == 0.25
    # The bound a model that ignores the image cannot pass. Each rollout holds 16 images (groups), drawn without
    # replacement from a dataset with each colour equally often. If the policy's answer does not depend on the image,
    # a group's mean reward r is in [0, 1] with E[r] = (1/4) x (its mass on single colour words) <= p = 1/4, so
    # Var(r) <= p(1 - p) = 3/16 whatever the policy, and groups are independent (negatively correlated, drawn
    # without replacement). The mean over the last LAST rollouts (n = 16 x LAST = 1920 groups) has a standard error
    # of at most sqrt(3/16 / n) = 0.0099; the test asks for chance + 4 standard errors = 0.290. A policy blind to the
    # image passes with probability below exp(-2 n (4 SE)^2) = exp(-6) = 0.0025 (Hoeffding), 3e-5 by the normal
    # approximation. With learning_rate 0 (benchmarks/results/vision_learning_lr0.json, seed 0) the last 120
    # rollouts averaged 0.187: the test fails when nothing is learned.
    # A policy that learns: the ten recorded seeds (benchmarks/results/vision_learning.json; the run-to-run variation
    # to expect, since CPU kernels are chosen by timing and CI runs on other CPUs) reached 0.376 to 0.925 over their
    # last 120 rollouts: mean 0.648, standard deviation 0.175 between seeds (each mean's own standard error is at most
    # sqrt(1/4 / 1920) = 0.011). The bar is 2.04 deviations below the mean: a false failure in about 2% of runs by a
    # normal fit, far above the project's 1e-4 per run; these settings cannot reach it (seed 7 rose to ~0.47 and fell
    # back, 0.376; seed 8 learned slowly, 0.462). The 120-step version of this test (its last 60 rollouts, bar 0.306)
    # is worse: 1.53 deviations over rollouts 61-120 of the same runs, ~6%; three seeds recorded earlier (0.606,
    # 0.537, 0.468) had understated the spread.
    groups = 16 * LAST
    bound = chance + 4 * math.sqrt(chance * (1 - chance) / groups)
    final = sum(rewards[-LAST:]) / LAST
    assert final > bound, (final, bound, rewards)
    # The warm-up gave the format and no more: the first rollout is at chance, within the same 4 standard errors of
    # one rollout (16 groups).
    assert rewards[0] < chance + 4 * math.sqrt(chance * (1 - chance) / 16), rewards

"""A vision-language model learns from GSPO's reward on CPU: a tiny random Gemma 3, warmed up to answer "What colour
is the shape?" with a colour word at chance (`gspo_trl.demo.vision_tasks`), must name the colour of the shape in the
image well above chance after a short GSPO run (benchmarks/vision_learning.py; its longer runs are in
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


SEEDS = (0, 1, 2)  # tried in turn until one passes: a sequential test (its error rates below)


@pytest.mark.slow  # a learning run
def test_reward_rises_above_chance_on_a_tiny_gemma3(tmp_path):
    # beta=0.1 keeps the answers from collapsing to fixed ones before the mapping is learned: without it, 2 of 3 seeds
    # stayed at chance (docs/vision-language.md).
    #
    # One run's bar, a bound a model that ignores the image cannot pass. Each rollout holds 16 images (groups), drawn
    # without replacement from a dataset with each colour equally often. If the policy's answer does not depend on the
    # image, a group's mean reward r is in [0, 1] with E[r] = (1/4) x (its mass on single colour words) <= p = 1/4, so
    # Var(r) <= p(1 - p) = 3/16 whatever the policy, and groups are independent (negatively correlated, drawn without
    # replacement). The mean over the last LAST rollouts (n = 16 x LAST = 1920 groups) has a standard error of at most
    # sqrt(3/16 / n) = 0.0099; a run passes above chance + 4 standard errors = 0.290. A blind policy passes one run
    # with probability below exp(-2 n (4 SE)^2) = exp(-6) = 0.0025 (Hoeffding), 3e-5 by the normal approximation, and
    # so the test, over its three tries, below 0.0075 and 1e-4. With learning_rate 0
    # (benchmarks/results/vision_learning_lr0.json, the three seeds of the test) the last 120 rollouts averaged 0.187,
    # 0.186 and 0.168: every try fails when nothing is learned.
    #
    # A policy that learns: the ten recorded seeds (benchmarks/results/vision_learning.json; the run-to-run variation
    # to expect, since CPU kernels are chosen by timing and CI runs on other CPUs) reached 0.376 to 0.925 over their
    # last 120 rollouts: mean 0.648, standard deviation 0.175 between seeds (each mean's own standard error is at most
    # sqrt(1/4 / 1920) = 0.011). One run falls under the bar, 2.05 deviations below the mean, in about q = 2% of runs
    # by a normal fit (none of the ten did); these settings cannot do better (seed 7 rose to ~0.47 and fell back,
    # 0.376; seed 8 learned slowly, 0.462). So the test tries another seed when a run falls short, up to three: it
    # fails falsely when all three do, q^3 = 8e-6 per suite run, and stays under the project's 1e-4 for any q up to
    # 0.046 (a deviation between seeds up to 0.21). A learning run takes 2-4 minutes; the second and third run in
    # about 2% and 0.04% of suites.
    groups = 16 * LAST
    bound = 0.25 + 4 * math.sqrt(0.25 * 0.75 / groups)
    tries = []
    for seed in SEEDS:
        result = _benchmark().run(seed=seed, max_steps=STEPS, output_dir=str(tmp_path / f"seed{seed}"), beta=0.1)
        rewards, chance = result["reward"], result["chance"]
        assert len(rewards) == STEPS and chance == 0.25
        # The warm-up gave the format and no more: each run's first rollout is at chance, within the same 4 standard
        # errors of one rollout (16 groups).
        assert rewards[0] < chance + 4 * math.sqrt(chance * (1 - chance) / 16), (seed, rewards)
        tries.append((seed, sum(rewards[-LAST:]) / LAST))
        if tries[-1][1] > bound:
            return
    pytest.fail(f"no seed's last {LAST} rollouts averaged above {bound:.3f}: (seed, mean) {tries}")

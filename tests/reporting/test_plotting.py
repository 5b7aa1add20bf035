"""The reward-curve figure says what it shows: read from the figure's artists, not by eye."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from gspo_trl.reporting.plotting import plot_reward_curve, reward_curve_figure  # noqa: E402


def _history(steps, rewards):
    return [{"step": s, "reward": r} for s, r in zip(steps, rewards)]


def _drawn(figure):
    """(legend label, x, y) of every line on the figure's one axis, and the legend's texts."""
    axis = figure.axes[0]
    lines = [(line.get_label(), list(line.get_xdata()), list(line.get_ydata())) for line in axis.get_lines()]
    legend = [text.get_text() for text in axis.get_legend().get_texts()]
    return lines, legend


def test_the_demo_cadence_ten_rollouts_every_four_steps_draws_no_empty_average():
    # The demo: 10 rollouts of 4 optimizer steps each, the reward logged at steps 4, 8, ..., 40.
    steps, rewards = list(range(4, 44, 4)), [0.1 * i for i in range(10)]
    figure = reward_curve_figure(_history(steps, rewards), window=10)
    lines, legend = _drawn(figure)
    plt.close(figure)
    assert lines == [("mean reward per rollout (every 4 steps)", steps, rewards)]
    assert legend == ["mean reward per rollout (every 4 steps)"]  # every legend entry has a drawn line


def test_the_moving_average_is_drawn_once_it_spans_more_than_one_point():
    steps, rewards = list(range(4, 44, 4)), [float(i % 3) for i in range(10)]
    figure = reward_curve_figure(_history(steps, rewards), window=3)
    lines, legend = _drawn(figure)
    plt.close(figure)
    assert (
        [label for label, _, _ in lines]
        == legend
        == ["mean reward per rollout (every 4 steps)", "moving average (3 rollouts)"]
    )
    _, x, y = lines[1]
    assert x == steps[2:]  # the average is placed at the last point it covers
    assert y == pytest.approx([sum(rewards[i - 2 : i + 1]) / 3 for i in range(2, 10)], rel=1e-12)


def test_a_reward_logged_every_step_is_labelled_per_step():
    steps = list(range(1, 13))
    figure = reward_curve_figure(_history(steps, [0.5] * 12), window=5)
    lines, legend = _drawn(figure)
    plt.close(figure)
    assert legend == ["mean reward per logged step", "moving average (5 steps)"]
    assert figure.axes[0].get_xlabel() == "optimizer step"


def test_plot_reward_curve_writes_a_png(tmp_path):
    path = plot_reward_curve(_history([4, 8], [0.2, 0.4]), str(tmp_path / "curve.png"))
    assert open(path, "rb").read(8) == b"\x89PNG\r\n\x1a\n"

"""The reward-curve PNG a run leaves behind: the mean reward at each logged step, and a moving average of it
once there are enough points for one to mean something."""

from __future__ import annotations


def _cadence(steps: list[int]) -> int | None:
    """The common spacing of the logged steps (4 when one rollout trains 4 optimizer steps), None if uneven."""
    gaps = {b - a for a, b in zip(steps, steps[1:])}
    return gaps.pop() if len(gaps) == 1 else None


def reward_curve_figure(history: list[dict], window: int = 5):
    """A matplotlib Figure of `history` (entries with "step" and "reward", one per logged rollout). The moving
    average over `window` logged points is drawn only when it spans at least `window + 1` points, so the legend
    never names a line that is a single point or absent."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [entry["step"] for entry in history]
    rewards = [entry["reward"] for entry in history]
    cadence = _cadence(steps)
    if cadence is None or cadence == 1:
        unit, points = "mean reward per logged step", "steps"
    else:
        unit, points = f"mean reward per rollout (every {cadence} steps)", "rollouts"
    figure, axis = plt.subplots(figsize=(7, 4))
    axis.plot(steps, rewards, marker="o", markersize=4, alpha=0.6, label=unit)
    if len(rewards) >= 2 * window:
        smoothed = [sum(rewards[i - window + 1 : i + 1]) / window for i in range(window - 1, len(rewards))]
        axis.plot(steps[window - 1 :], smoothed, linewidth=2, label=f"moving average ({window} {points})")
    axis.set_xlabel("optimizer step")
    axis.set_ylabel("reward")
    axis.set_title("GSPO training reward")
    axis.grid(alpha=0.3)
    axis.legend()
    figure.tight_layout()
    return figure


def plot_reward_curve(history: list[dict], path: str, window: int = 5) -> str:
    """Write `reward_curve_figure(history, window)` to `path` as a PNG; returns `path`."""
    figure = reward_curve_figure(history, window)  # selects the Agg backend before pyplot is imported here
    import matplotlib.pyplot as plt

    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path

"""The reward-curve PNG a run leaves behind: per-step mean reward and its moving average."""

from __future__ import annotations


def plot_reward_curve(history: list[dict], path: str, window: int = 10) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [entry["step"] for entry in history]
    rewards = [entry["reward"] for entry in history]
    figure, axis = plt.subplots(figsize=(7, 4))
    axis.plot(steps, rewards, marker=".", alpha=0.5, label="mean reward per step")
    if len(rewards) >= window:
        smoothed = [sum(rewards[i - window + 1 : i + 1]) / window for i in range(window - 1, len(rewards))]
        axis.plot(steps[window - 1 :], smoothed, linewidth=2, label=f"moving average ({window} steps)")
    axis.set_xlabel("optimizer step")
    axis.set_ylabel("reward")
    axis.set_title("GSPO training reward")
    axis.grid(alpha=0.3)
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path

"""GSPO, SAPO, CISPO and GRPO side by side on the demo task: same model, prompts, seed and budget.

Each objective trains SmolLM2-135M-Instruct on the demo's reasoning-gym task in a fresh process, with
the paper's schedule (one rollout of 64 completions = 8 prompts x 8, trained on in 4 optimizer steps,
so steps 2-4 of every rollout are off-policy and the clip / gate acts). Only the objective changes.
Writes one JSON per objective (the run's log history and wall-clock) under --out, then the comparison
table (`render_table`, also used by tests/test_docs.py to check docs/objective.md) and a plot.

    .venv/bin/python benchmarks/objectives.py                 # the four runs, ~10 min each on 2 cores
    .venv/bin/python benchmarks/objectives.py --report_only   # table and plot from existing results
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "objectives"
PLOT = ROOT / "docs" / "objectives_reward.png"

# name: (GSPOConfig overrides, the metric that says what the objective's clip or gate did)
OBJECTIVES = {
    "GSPO": ({}, "clip_ratio/region"),
    "SAPO": ({"loss_type": "sapo"}, "sapo/gate_weight"),
    "CISPO": ({"loss_type": "cispo"}, "cispo_clip_ratio"),
    "GRPO": ({"importance_sampling_level": "token"}, "clip_ratio/region"),
}
BUDGET = {
    "max_steps": 40,
    "steps_per_generation": 4,
    "per_device_train_batch_size": 16,
    "num_generations": 8,
    "max_completion_length": 48,
    "learning_rate": 2e-5,
    "seed": 0,
}


def run(name: str, out: Path) -> None:
    overrides, _ = OBJECTIVES[name]
    flags = [f"--{key}={value}" for key, value in {**BUDGET, **overrides}.items()]
    run_dir = Path("/tmp/gspo-objectives") / name  # the saved model (0.5 GB) stays out of the repository
    command = [
        sys.executable,
        "-m",
        "gspo_trl.demo.cli",
        "train",
        f"--output_dir={run_dir}",
        f"--metrics_file={run_dir}.metrics.json",
        f"--plot_file={run_dir}.png",
        *flags,
    ]
    start = time.perf_counter()
    subprocess.run(command, check=True, cwd=ROOT)
    wall = time.perf_counter() - start
    metrics = json.loads(Path(f"{run_dir}.metrics.json").read_text())
    result = {
        "objective": name,
        "overrides": overrides,
        "budget": BUDGET,
        "wall_clock_s": wall,
        "date": time.strftime("%Y-%m-%d"),
        "log_history": metrics["log_history"],
    }
    (out / f"{name}.json").write_text(json.dumps(result, indent=1))


def summarize(result: dict) -> dict:
    _, gate_metric = OBJECTIVES[result["objective"]]
    steps = [e for e in result["log_history"] if "loss" in e]
    rewards = [e["reward"] for e in steps if "reward" in e]  # one per rollout
    off_policy = [e[gate_metric] for e in steps if gate_metric in e and e["step"] % BUDGET["steps_per_generation"] != 1]
    return {
        "first": sum(rewards[:3]) / 3,
        "last": sum(rewards[-3:]) / 3,
        "rollouts": len(rewards),
        "gate_metric": gate_metric,
        "gate_off_policy": sum(off_policy) / max(len(off_policy), 1),
        "wall_min": result["wall_clock_s"] / 60,
    }


def render_table(results: dict[str, dict]) -> str:
    lines = [
        "| objective | reward, first 3 rollouts | reward, last 3 rollouts | clip / gate on off-policy steps | "
        "wall-clock |",
        "|---|---|---|---|---|",
    ]
    for name, result in results.items():
        s = summarize(result)
        lines.append(
            f"| {name} | {s['first']:.3f} | {s['last']:.3f} | `{s['gate_metric']}` = {s['gate_off_policy']:.3f} "
            f"| {s['wall_min']:.1f} min |"
        )
    return "\n".join(lines)


def load_results(out: Path = RESULTS) -> dict[str, dict]:
    return {
        name: json.loads((out / f"{name}.json").read_text()) for name in OBJECTIVES if (out / f"{name}.json").exists()
    }


def plot(results: dict[str, dict], path: Path = PLOT) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7, 4))
    for name, result in results.items():
        points = [(e["step"], e["reward"]) for e in result["log_history"] if "loss" in e and "reward" in e]
        axis.plot(*zip(*points), marker="o", label=name)
    axis.set_xlabel("optimizer step (a rollout every 4)")
    axis.set_ylabel("mean reward of the rollout")
    axis.set_title("SmolLM2-135M on the demo task: same budget, four objectives")
    axis.grid(alpha=0.3)
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--objectives", nargs="*", default=list(OBJECTIVES))
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--report_only", action="store_true")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if not args.report_only:
        for name in args.objectives:
            run(name, args.out)
    results = load_results(args.out)
    plot(results)
    print(render_table(results))


if __name__ == "__main__":
    main()

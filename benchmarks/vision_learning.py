"""GSPO learns a visual task on CPU: name the colour of a shape whose colour is only in the image.

    python benchmarks/vision_learning.py --seeds 0,1,2,3,4,5,6,7,8,9 --plot docs/vision_reward_curve.png

A tiny random Gemma 3 (the test suite's, `tests/vlm_models.py`: 64-wide, 2 layers, a one-layer SigLIP tower, the
test tokenizer) is first warmed up on transcripts where every image is answered with every colour word
(`gspo_trl.demo.vision_tasks.warm_up`): it learns to answer with one colour word, each equally likely whatever the
image,
so it starts at chance (1/4). GSPO then trains it with `colour_reward` (1 for the right colour, 0 otherwise), one
rollout of 16 images x 8 completions per optimizer step, with a KL term towards the warmed-up model (`--beta`, 0.1:
without it the answers collapse to fixed ones in most seeds). Writes every rollout's reward per seed to a JSON file and
the mean curve over seeds to a PNG (`--plot`). `run` is what tests/test_learning_vision.py runs (seed 0).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


def run(
    seed: int,
    max_steps: int,
    learning_rate: float = 5e-3,
    warm_up_steps: int = 96,
    output_dir: str | None = None,
    **config: float,
) -> dict:
    """Warm up then train one tiny Gemma 3 with `seed`; returns its per-rollout metrics and timings. `config`: more
    `GSPOConfig` fields (`beta`, `entropy_coef`, ...)."""
    import torch

    sys.path.insert(0, str(REPO_ROOT / "tests"))
    from vlm_models import build_tiny_gemma3

    from gspo_trl import GSPOConfig, GSPOTrainer
    from gspo_trl.demo.vision_tasks import chance_accuracy, colour_dataset, colour_reward, warm_up

    output_dir = output_dir or tempfile.mkdtemp(prefix="vision-learning-")
    model, processor = build_tiny_gemma3(seed=seed)
    start, cpu_start = time.perf_counter(), time.process_time()
    warm_up_losses = warm_up(model, processor, warm_up_steps, seed=1000 + seed)
    warm_up_cpu = time.process_time() - cpu_start
    args = GSPOConfig(
        output_dir=output_dir,
        per_device_train_batch_size=128,  # 16 images x 8 completions, one optimizer step per rollout
        num_generations=8,
        steps_per_generation=1,
        max_completion_length=8,
        max_steps=max_steps,
        learning_rate=learning_rate,
        lr_scheduler_type="constant",
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        seed=seed,
        disable_tqdm=True,
        **config,
    )
    trainer = GSPOTrainer(
        model,
        colour_reward,
        args=args,
        train_dataset=colour_dataset(size=16 * max_steps, seed=seed),
        processing_class=processor,
    )
    trainer.train()
    rollouts = [entry for entry in trainer.state.log_history if "reward" in entry]
    return {
        "seed": seed,
        "config": {"learning_rate": learning_rate, "warm_up_steps": warm_up_steps, **config},
        "chance": chance_accuracy(),
        "warm_up_loss_first_last": [round(warm_up_losses[0], 4), round(warm_up_losses[-1], 4)],
        "reward": [round(entry["reward"], 4) for entry in rollouts],
        "entropy": [round(entry["entropy"], 4) for entry in rollouts],
        "frac_reward_zero_std": [round(entry["frac_reward_zero_std"], 4) for entry in rollouts],
        "step": [entry["step"] for entry in rollouts],
        "wall_seconds": round(time.perf_counter() - start, 1),
        "cpu_seconds_warm_up": round(warm_up_cpu, 1),
        "cpu_seconds": round(time.process_time() - cpu_start, 1),
        "torch_threads": torch.get_num_threads(),
    }


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as file:
            return next(line.split(":", 1)[1].strip() for line in file if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.machine()


def _commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated seeds, one run each")
    parser.add_argument("--max_steps", type=int, default=240, help="GSPO optimizer steps (one rollout each)")
    parser.add_argument("--learning_rate", type=float, default=5e-3)
    parser.add_argument("--warm_up_steps", type=int, default=96, help="supervised steps of 2 images x 4 colours")
    parser.add_argument("--beta", type=float, default=0.1, help="KL coefficient towards the warmed-up model")
    parser.add_argument("--entropy_coef", type=float, default=0.0, help="entropy bonus")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: as under pytest -n 2)")
    parser.add_argument("--out", default=str(REPO_ROOT / "benchmarks" / "results" / "vision_learning.json"))
    parser.add_argument("--plot", default=None, help="write the mean reward curve over seeds to this PNG")
    cli = parser.parse_args()
    import torch

    torch.set_num_threads(cli.threads)
    runs = []
    for seed in (int(seed) for seed in cli.seeds.split(",")):
        runs.append(
            run(seed, cli.max_steps, cli.learning_rate, cli.warm_up_steps, beta=cli.beta, entropy_coef=cli.entropy_coef)
        )
        print(f"seed {seed}: rewards {runs[-1]['reward']}", flush=True)
    record = {
        "command": "python benchmarks/vision_learning.py " + " ".join(sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d"),
        "commit": _commit(),
        "machine": f"{os.cpu_count()} CPU cores, {_cpu_model()} (use_cpu=True)",
        "torch": torch.__version__,
        "runs": runs,
    }
    Path(cli.out).write_text(json.dumps(record, indent=2) + "\n")
    if cli.plot:
        from gspo_trl.reporting.plotting import plot_reward_curve

        steps = runs[0]["step"]
        mean = [sum(run["reward"][index] for run in runs) / len(runs) for index in range(len(steps))]
        plot_reward_curve([{"step": step, "reward": reward} for step, reward in zip(steps, mean)], cli.plot, window=8)


if __name__ == "__main__":
    main()

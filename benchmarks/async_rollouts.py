#!/usr/bin/env python
"""Wall-clock of GSPO training with and without `async_rollouts`, same work, each run a fresh process.

The work is the step-time benchmark's (SmolLM2-135M-Instruct, the demo task, 8 prompts × 8 completions = 64 per
rollout, 4 optimizer steps per rollout, up to `--max_completion_length` new tokens, fp32 on CPU or bf16 on
`--device cuda`), for `--rounds` rollouts. Both modes sample with per-completion streams
(`layout_independent_sampling`), so they draw the same first rollout. Runs alternate sync, async, sync, ...
(`--repeats` pairs):

    python benchmarks/async_rollouts.py                 # 4 rollouts (16 optimizer steps), 2 pairs
    python benchmarks/async_rollouts.py --device cuda --model PATH

Reported per run: the whole `train()` time; the steady-state time per round (a rollout's sampling and its 4
optimizer steps), over the rounds between the first (whose sampling overlaps nothing) and the last (which has no
next rollout to overlap); the mean staleness; the rewards and mean completion lengths. Results go to `--out` (JSON)
and a table on stdout.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
MODES = ("sync", "async")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=4, help="rollouts per run, at least 3")
    parser.add_argument("--max_completion_length", type=int, default=64)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--model", default=None, help="default: the cached SmolLM2-135M-Instruct")
    parser.add_argument("--out", default=str(HERE / "results" / "async_rollouts.json"))
    parser.add_argument("--worker", choices=MODES, help=argparse.SUPPRESS)  # one run, in this process
    return parser.parse_args(argv)


def run_once(args) -> dict:
    import torch
    from transformers import TrainerCallback

    from gspo_trl import GSPOConfig, GSPOTrainer
    from gspo_trl.demo.default_model import default_model_path
    from gspo_trl.demo.tasks import default_task_dataset, default_task_reward

    steps_per_rollout = 4
    step_ends = []

    class StepClock(TrainerCallback):
        def on_step_end(self, *unused, **kwargs):
            step_ends.append(time.perf_counter())

    config = GSPOConfig(
        output_dir=tempfile.mkdtemp(prefix="gspo-async-bench-"),
        per_device_train_batch_size=16,
        num_generations=8,
        steps_per_generation=steps_per_rollout,
        max_steps=args.rounds * steps_per_rollout,
        max_completion_length=args.max_completion_length,
        learning_rate=1e-6,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=args.device == "cpu",
        bf16=args.device == "cuda",
        seed=0,
        layout_independent_sampling=True,
        async_rollouts=args.worker == "async",
    )
    trainer = GSPOTrainer(
        args.model or default_model_path(),
        default_task_reward(),
        args=config,
        train_dataset=default_task_dataset(64, seed=0),
        callbacks=[StepClock()],
    )
    start = time.perf_counter()
    trainer.train()
    total = time.perf_counter() - start
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    rewards = [entry["reward"] for entry in logs if "reward" in entry]
    round_ends = step_ends[steps_per_rollout - 1 :: steps_per_rollout]  # after each rollout's last step
    return {
        "mode": args.worker,
        "train_seconds": total,
        "seconds_per_round": (round_ends[-2] - round_ends[0]) / (len(round_ends) - 2),
        # Only async_rollouts logs it; the synchronous trainer's would be 0..3 in every rollout.
        "mean_staleness": statistics.mean(e["rollout/staleness"] for e in logs) if args.worker == "async" else None,
        "rewards_per_rollout": rewards,
        # Rollouts differ between the modes after the first: the lengths say how much work each round sampled.
        "mean_completion_length_per_rollout": [
            entry["completions/mean_length"] for entry in logs if "completions/mean_length" in entry
        ],
        "torch_threads": torch.get_num_threads(),
    }


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.rounds < 3:
        raise SystemExit("--rounds must be at least 3: the steady state is measured between the first and last rounds.")
    if args.worker:
        print("RESULT " + json.dumps(run_once(args)), flush=True)
        return
    runs = []
    for repeat in range(args.repeats):
        for mode in MODES:
            command = [
                sys.executable,
                __file__,
                "--worker",
                mode,
                "--rounds",
                str(args.rounds),
                "--device",
                args.device,
                "--max_completion_length",
                str(args.max_completion_length),
            ]
            if args.model:
                command += ["--model", args.model]
            output = subprocess.run(command, capture_output=True, text=True, check=True).stdout
            result = json.loads(next(line for line in output.splitlines() if line.startswith("RESULT "))[7:])
            result["repeat"] = repeat
            runs.append(result)
            print(
                f"{mode:5s} repeat {repeat}: {result['train_seconds']:.1f} s, {result['seconds_per_round']:.2f} s per "
                "round",
                flush=True,
            )
    summary = {}
    for mode in MODES:
        mine = [r for r in runs if r["mode"] == mode]
        summary[mode] = {key: statistics.median(r[key] for r in mine) for key in ("train_seconds", "seconds_per_round")}
        summary[mode]["mean_staleness"] = (
            None if mode == "sync" else statistics.median(r["mean_staleness"] for r in mine)
        )
    summary["async/sync, seconds per round"] = (
        summary["async"]["seconds_per_round"] / summary["sync"]["seconds_per_round"]
    )
    record = {
        "date": _dt.date.today().isoformat(),
        "machine": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "device": args.device,
        "rounds": args.rounds,
        "max_completion_length": args.max_completion_length,
        "runs": runs,
        "median": summary,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record, indent=2) + "\n")
    print("| mode | train() (s), median | s per round, steady state | mean staleness (optimizer steps) |")
    print("|---|---|---|---|")
    for mode in MODES:
        row = summary[mode]
        staleness = "not logged" if row["mean_staleness"] is None else f"{row['mean_staleness']:.2f}"
        print(f"| {mode} | {row['train_seconds']:.1f} | {row['seconds_per_round']:.2f} | {staleness} |")
    print(f"async/sync per round: {summary['async/sync, seconds per round']:.2f}")


if __name__ == "__main__":
    main()

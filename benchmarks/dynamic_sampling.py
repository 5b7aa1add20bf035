"""The demo task trained with and without `dynamic_sampling`: same model, prompts, seed and budget of optimizer steps.

Each variant trains SmolLM2-135M-Instruct on the demo's reasoning-gym task (`gspo-trl train`'s defaults) in a fresh
process, the variants alternating. Every logged step records the wall-clock since training started and the tokens
sampled so far (`num_tokens`, which counts every generation round), so reward can be read against either. Writes
one JSON file: the machine, the library versions, the settings and every run's log.

    .venv/bin/python benchmarks/dynamic_sampling.py                          # 2 variants x 1 repeat, 40 steps each
    .venv/bin/python benchmarks/dynamic_sampling.py --max_steps 4 --out /tmp/smoke.json   # a quick check
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "dynamic_sampling.json"
VARIANTS = {
    "off": {},
    "on": {"dynamic_sampling": True, "dynamic_sampling_max_rounds": 4},
}
BUDGET = {
    "steps_per_generation": 4,
    "per_device_train_batch_size": 16,
    "num_generations": 8,
    "max_completion_length": 48,
    "learning_rate": 2e-5,
    "seed": 0,
    "logging_steps": 1,
}
LOGGED = (
    "step",
    "reward",
    "frac_reward_zero_std",
    "num_tokens",
    "wall_s",
    "rollout/dynamic_sampling_rounds",
    "rollout/dynamic_sampling_groups_dropped",
    "rollout/dynamic_sampling_filler_groups",
    "rollout/sampled_tokens_per_trained_token",
)


def worker(variant: str, overrides: dict, out: str) -> None:
    """One training run in this process; writes its log entries (with `wall_s`) to `out`."""
    from transformers import TrainerCallback

    from gspo_trl import GSPOTrainer
    from gspo_trl.demo.cli import build_run, parse_train_args

    class WallClock(TrainerCallback):
        """The seconds since training began at each optimizer step's log."""

        def __init__(self):
            self.seconds: dict[int, float] = {}

        def on_train_begin(self, args, state, control, **kwargs):
            self.start = time.perf_counter()

        def on_log(self, args, state, control, logs=None, **kwargs):
            self.seconds.setdefault(state.global_step, time.perf_counter() - self.start)

    settings = {**BUDGET, **VARIANTS[variant], **overrides}
    with tempfile.TemporaryDirectory() as output_dir:
        flags = [f"--output_dir={output_dir}", "--save_strategy=no", "--report_to=none"]
        run_args, config = parse_train_args(flags + [f"--{key}={value}" for key, value in settings.items()])
        model, dataset, reward_funcs, env_factory = build_run(run_args)
        clock = WallClock()
        trainer = GSPOTrainer(
            model, reward_funcs, args=config, train_dataset=dataset, env_factory=env_factory, callbacks=[clock]
        )
        trainer.train()
    entries = [{**e, "wall_s": clock.seconds.get(e["step"])} for e in trainer.state.log_history if "loss" in e]
    steps = [{k: e[k] for k in LOGGED if k in e} for e in entries]
    Path(out).write_text(json.dumps({"variant": variant, "settings": settings, "steps": steps}, indent=1))


def versions() -> dict:
    import torch
    import transformers

    import gspo_trl

    return {"gspo_trl": gspo_trl.__version__, "torch": torch.__version__, "transformers": transformers.__version__}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max_steps", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=1, help="runs of each variant, alternating")
    parser.add_argument("--out", default=str(RESULTS))
    parser.add_argument("--model_name_or_path", help="default: the embedded SmolLM2-135M-Instruct")
    parser.add_argument("--max_completion_length", type=int, default=BUDGET["max_completion_length"])
    parser.add_argument("--worker", nargs=2, metavar=("VARIANT", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    overrides = {"max_steps": args.max_steps, "max_completion_length": args.max_completion_length}
    if args.model_name_or_path:
        overrides["model_name_or_path"] = args.model_name_or_path
    if args.worker:
        worker(args.worker[0], overrides, args.worker[1])
        return
    runs = []
    with tempfile.TemporaryDirectory() as scratch:
        for repeat in range(args.repeats):
            for variant in VARIANTS:
                path = Path(scratch) / f"{variant}_{repeat}.json"
                flags = [f"--{key}={value}" for key, value in overrides.items()]
                command = [sys.executable, __file__, *flags, "--worker", variant, str(path)]
                subprocess.run(command, check=True, cwd=ROOT)
                runs.append({**json.loads(path.read_text()), "repeat": repeat})
                last = runs[-1]["steps"][-1]
                print(f"{variant} #{repeat}: {last.get('wall_s', 0):.0f} s, {last.get('num_tokens')} tokens")
    result = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": {"processor": platform.processor() or platform.machine(), "python": platform.python_version()},
        "versions": versions(),
        "overrides": overrides,
        "runs": runs,
    }
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

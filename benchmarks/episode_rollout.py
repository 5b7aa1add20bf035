#!/usr/bin/env python
"""Sampling time of one rollout of multi-turn episodes: later turns from the turn cache, from shared prefixes, or whole.

Builds the run `gspo-trl train --env ENV` builds (model, dataset, environments, sampling settings) and times
the trainer's sampling of one rollout: `--prompts` prompts × `num_generations` episodes, every turn through
`HFGenerateBackend` with gspo-trl's decoding loop. Three modes alternate, `--repeats` times each after one
untimed warm-up each, in one process, with the same per-episode random streams (so all play the same
episodes up to float rounding):

- `turn cache` (the default): a later turn continues each row from the KV cache the decoding loop kept at the
  end of its previous turn (`prefix_sharing.prefill_after_states`); only the turn's EOS and the environment's
  reply are prefilled.
- `shared prefixes`: each turn prefills every prefix its rows share once (`prefix_sharing.prefill_shared_prefixes`);
  from the second turn on, the rows of a group share their prompt, then differ.
- `identical rows`: only identical rows share a prefill (the behaviour before both).

    python benchmarks/episode_rollout.py --env retry
    python benchmarks/episode_rollout.py --env calculator --model PATH   # a model after the calculator warm-up

Prints seconds per rollout (min / median), the positions run through the model in prefills (forwards of more
than one token per row, padding included), turns per episode and completion tokens; JSON to `--out`.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
MODES = {"turn cache": (True, True), "shared prefixes": (False, True), "identical rows": (False, False)}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--env", choices=("retry", "calculator"), default="retry")
    parser.add_argument("--model", default=None, help="default: the cached SmolLM2-135M-Instruct")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max_completion_length", type=int, default=None, help="default: the environment's")
    parser.add_argument("--out", default=None, help="default: benchmarks/results/episode_rollout_<env>.json")
    return parser.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    from gspo_trl import GSPOTrainer
    from gspo_trl.demo.cli import build_run, parse_train_args

    flags = ["--env", args.env, "--output_dir", "/tmp/episode-rollout-benchmark", "--report_to", "none"]
    if args.model:
        flags += ["--model_name_or_path", args.model]
    if args.max_completion_length:
        flags += ["--max_completion_length", str(args.max_completion_length)]
    run_args, config = parse_train_args(flags)
    model, dataset, reward_funcs, env_factory = build_run(run_args)
    tools = {"environment_factory": env_factory} if args.env == "calculator" else {"env_factory": env_factory}
    trainer = GSPOTrainer(model, reward_funcs, args=config, train_dataset=dataset, **tools)
    backend, runner = trainer.rollout_backend, trainer.episode_runner
    batch = [dict(row) for row in dataset.select(range(args.prompts)) for _ in range(config.num_generations)]

    prefill_positions = []
    embed = trainer.accelerator.unwrap_model(trainer.model).get_input_embeddings()

    def count(module, inputs, output):
        if output.shape[1] > 1:
            prefill_positions[-1] += output.shape[0] * output.shape[1]

    embed.register_forward_hook(count)
    runs = {mode: [] for mode in MODES}
    for repeat in range(args.repeats + 1):  # the first round warms up
        for mode in MODES:
            backend.reuse_turn_cache, backend.share_prefixes = MODES[mode]
            prefill_positions.append(0)
            torch.manual_seed(repeat)
            start = time.perf_counter()
            sampled = trainer._sample(backend, runner, batch, "train", step=repeat, keyed=True)
            seconds = time.perf_counter() - start
            episodes = sampled.episodes
            record = {
                "seconds": seconds,
                "prefill_positions": prefill_positions[-1],
                "turns_per_episode": episodes.reached.sum(1).float().mean().item(),
                "completion_tokens": int(sampled.rollout.sampled_mask.sum()),
            }
            print(f"{'warm-up' if repeat == 0 else f'repeat {repeat}'} {mode}: {record}", flush=True)
            if repeat:
                runs[mode].append(record)

    summary = {
        mode: {
            "seconds_min": min(r["seconds"] for r in records),
            "seconds_median": statistics.median(r["seconds"] for r in records),
            "prefill_positions_median": statistics.median(r["prefill_positions"] for r in records),
            "turns_per_episode": statistics.mean(r["turns_per_episode"] for r in records),
            "completion_tokens": statistics.mean(r["completion_tokens"] for r in records),
        }
        for mode, records in runs.items()
    }
    print("| later turns | rollout (s), min | median | prefill positions | turns per episode | completion tokens |")
    print("|---|---|---|---|---|---|")
    for mode, row in summary.items():
        print(
            f"| {mode} | {row['seconds_min']:.2f} | {row['seconds_median']:.2f} | "
            f"{row['prefill_positions_median']:.0f} | {row['turns_per_episode']:.2f} | {row['completion_tokens']:.0f} |"
        )
    out = Path(args.out or HERE / "results" / f"episode_rollout_{args.env}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "command": "python benchmarks/episode_rollout.py " + " ".join(argv or os.sys.argv[1:]),
                "date": _dt.date.today().isoformat(),
                "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores, torch {torch.__version__}",
                "episodes": len(batch),
                "summary": summary,
                "runs": runs,
            },
            indent=2,
        )
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

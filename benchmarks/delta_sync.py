#!/usr/bin/env python
"""How much of a weight sync a delta would save: the fraction of the weights, cast to the bf16 a bf16 vLLM server
holds, that one rollout's optimizer steps leave bit-identical, on the demo's bf16 recipe.

Trains the embedded demo (SmolLM2-135M-Instruct on its reasoning-gym task, `bf16=True` on CPU: fp32 weights, bf16
autocast) for `--max_steps` steps at each `--learning_rates`, and at every sync point (before each rollout, every
`steps_per_generation` optimizer steps) compares the bf16 cast of every weight with the last sync's. For each sync it
records the unchanged fraction and the bytes three encodings would send:

- dense: every element in bf16 (2 bytes), what the transports send today;
- indices: the changed elements as int32 flat index + bf16 value (6 bytes each);
- bitmask: one bit per element + the changed values in bf16;

and the time this process took to find the changed elements and build the bitmask encoding (what a delta adds on
the trainer's side before anything is sent).

    python benchmarks/delta_sync.py --learning_rates 1e-6,2e-5 --max_steps 8

Results go to `--out` (JSON) and a table on stdout.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import platform
import subprocess
import time
from pathlib import Path

import torch
from transformers import TrainerCallback

from gspo_trl.vllm.delta import encode

HERE = Path(__file__).resolve().parent


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--learning_rates", default="1e-6,2e-5")
    parser.add_argument("--max_steps", type=int, default=8)
    parser.add_argument("--out", default=str(HERE / "results" / "delta_sync.json"))
    parser.add_argument("--output_dir", default="/tmp/gspo-delta-sync")
    return parser.parse_args(argv)


def bf16_weights(model) -> dict[str, torch.Tensor]:
    """The weights a bf16 server would receive: each parameter cast to bf16 (a tied head once)."""
    seen, weights = set(), {}
    for name, parameter in model.named_parameters():
        if parameter.data_ptr() in seen:
            continue
        seen.add(parameter.data_ptr())
        weights[name] = parameter.detach().to(torch.bfloat16).clone()
    return weights


def compare(last: dict[str, torch.Tensor], now: dict[str, torch.Tensor]) -> dict:
    """The unchanged fraction (bit for bit) and the bytes of each encoding; the seconds the bitmask encoding took."""
    start = time.perf_counter()
    elements = changed = 0
    sent = 0
    for name, tensor in now.items():
        packed, values = encode(last[name], tensor)  # what `vllm_weight_sync_delta` sends for this tensor
        sent += packed.numel() + values.numel() * values.element_size()
        elements += tensor.numel()
        changed += int(values.numel())
    seconds = time.perf_counter() - start
    return {
        "elements": elements,
        "changed": changed,
        "unchanged_fraction": 1 - changed / elements,
        "dense_mb": 2 * elements / 2**20,
        "indices_mb": 6 * changed / 2**20,
        "bitmask_mb": sent / 2**20,  # each tensor's mask padded to whole bytes
        "encode_s": seconds,
    }


class SyncPoints(TrainerCallback):
    """Compares the bf16 weights at each sync point (every `every` optimizer steps) with the last one's."""

    def __init__(self, every: int):
        self.every, self.last, self.syncs = every, None, []

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.last = bf16_weights(model)

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if state.global_step % self.every == 0:
            now = bf16_weights(model)
            self.syncs.append({"step": state.global_step, **compare(self.last, now)})
            self.last = now


def run(learning_rate: float, max_steps: int, output_dir: str) -> dict:
    from gspo_trl import GSPOTrainer
    from gspo_trl.demo.cli import build_run, parse_train_args

    run_args, config = parse_train_args(
        ["--output_dir", output_dir, "--max_steps", str(max_steps), "--learning_rate", str(learning_rate)]
        + ["--bf16", "true", "--disable_tqdm", "true"]
    )
    model, dataset, reward_funcs, _ = build_run(run_args)
    trainer = GSPOTrainer(model, reward_funcs, args=config, train_dataset=dataset)
    points = SyncPoints(config.steps_per_generation)
    trainer.add_callback(points)
    start = time.perf_counter()
    trainer.train()
    return {
        "learning_rate": learning_rate,
        "steps_per_sync": config.steps_per_generation,
        "wall_s": time.perf_counter() - start,
        "syncs": points.syncs,
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=HERE).stdout
    runs = [run(float(lr), args.max_steps, args.output_dir) for lr in args.learning_rates.split(",")]
    result = {
        "command": "python benchmarks/delta_sync.py "
        f"--learning_rates {args.learning_rates} --max_steps {args.max_steps}",
        "date": _dt.date.today().isoformat(),
        "commit": commit.strip(),
        "machine": f"{platform.machine()}, {torch.get_num_threads()} threads, CPU only",
        "torch": torch.__version__,
        "model": "SmolLM2-135M-Instruct, bf16=True (fp32 weights, bf16 autocast), weights compared in bf16",
        "runs": runs,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(
        f"{'lr':>8} {'step':>5} {'unchanged':>10} {'dense MB':>9} {'indices MB':>11} {'bitmask MB':>11} {'encode s':>9}"
    )
    for entry in runs:
        for sync in entry["syncs"]:
            print(
                f"{entry['learning_rate']:>8.0e} {sync['step']:>5} {sync['unchanged_fraction']:>10.4f} "
                f"{sync['dense_mb']:>9.1f} {sync['indices_mb']:>11.1f} {sync['bitmask_mb']:>11.1f} "
                f"{sync['encode_s']:>9.2f}"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

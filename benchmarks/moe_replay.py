#!/usr/bin/env python
"""Routing replay on an off-policy schedule: GSPO and GRPO, each with routing_replay 'none' and 'rollout'.

The model is a tiny random Qwen3-MoE (`MODEL`: 4 layers of 8 experts, 2 per token) on the tests' tokenizer; the
reward the fraction of digits in the completion, which it learns within a few rollouts. Each rollout is trained on in
4 optimizer steps, so all but the first are off-policy. Every run has the same prompts and budget; only the
objective, `routing_replay` and the seed change. Each run is a fresh process; the per-step log histories and
wall-clocks go to benchmarks/results/moe_replay.json, the table (`render_table`) between the
`<!-- results:moe_replay -->` markers of docs/moe.md.

    .venv/bin/python benchmarks/moe_replay.py                 # the 4 settings x seeds 0 and 1, 3-15 min a run
    .venv/bin/python benchmarks/moe_replay.py --report_only   # rewrite the table in docs/moe.md from the JSON
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the tests' tokenizer (conftest.build_tiny_tokenizer)
RESULT = ROOT / "benchmarks" / "results" / "moe_replay.json"
DOC = ROOT / "docs" / "moe.md"
WORK = Path("/tmp/gspo-moe-replay")  # the model and the runs' output directories, outside the repository

# A tiny random Qwen3-MoE on the tests' tokenizer (vocabulary 400): 8 experts, 2 per token, in each of 4 layers.
MODEL = dict(
    hidden_size=128,
    intermediate_size=256,
    moe_intermediate_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    num_experts=8,
    num_experts_per_tok=2,
    max_position_embeddings=256,
)
SEEDS = (0, 1)
RUNS = {
    "GSPO, none": {"routing_replay": "none"},
    "GSPO, rollout": {"routing_replay": "rollout"},
    "GRPO, none": {"importance_sampling_level": "token", "routing_replay": "none"},
    "GRPO, rollout": {"importance_sampling_level": "token", "routing_replay": "rollout"},
}
BUDGET = {
    "max_steps": 24,
    "steps_per_generation": 4,  # a rollout of 4 prompts x 8 completions, trained on in 4 optimizer steps
    "per_device_train_batch_size": 8,
    "num_generations": 8,
    "max_completion_length": 16,
    "learning_rate": 3e-4,
}


def build_model(out_dir: Path) -> None:
    """Save the random-init model (seed 0) and the tests' tokenizer to `out_dir`."""
    import torch
    from conftest import build_tiny_tokenizer
    from transformers import AutoConfig, AutoModelForCausalLM

    tokenizer = build_tiny_tokenizer()
    ids = dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    config = AutoConfig.for_model("qwen3_moe", vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id, **ids)
    for key, value in MODEL.items():
        setattr(config, key, value)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    for name, value in {**ids, "pad_token_id": tokenizer.pad_token_id}.items():
        setattr(model.generation_config, name, value)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def digit_share(completions, **kwargs):
    """The fraction of a completion's characters that are digits (the tests' `count_digits`)."""
    return [sum(char.isdigit() for char in text) / max(len(text), 1) for text in completions]


def train_one(name: str, seed: int, out: Path) -> None:
    """Train one run in this process; its log history and wall-clock to `out` (JSON)."""
    import torch
    from datasets import Dataset

    from gspo_trl import GSPOConfig, GSPOTrainer

    torch.set_num_threads(2)
    run_dir = WORK / f"{name.replace(', ', '_')}_seed{seed}"
    args = GSPOConfig(
        output_dir=str(run_dir),
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        use_cpu=True,
        seed=seed,
        **BUDGET,
        **RUNS[name],
    )
    prompts = Dataset.from_dict({"prompt": [f"What is {i} + {i + 1}?" for i in range(64)]})
    trainer = GSPOTrainer(str(WORK / "model"), digit_share, args=args, train_dataset=prompts)
    start = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - start
    out.write_text(
        json.dumps({"run": name, "seed": seed, "wall_clock_s": wall, "log_history": trainer.state.log_history})
    )


def summarize(history: list[dict]) -> dict:
    """Means over a run's off-policy steps (all but the first of each rollout), and its rewards per rollout."""
    steps = [entry for entry in history if "loss" in entry]
    off = [entry for entry in steps if (entry["step"] - 1) % BUDGET["steps_per_generation"]]

    def mean(values) -> float:
        values = list(values)
        return sum(values) / max(len(values), 1)

    return {
        "route_mismatch": mean(entry["moe/route_mismatch"] for entry in off),
        "route_mismatch_first": mean(
            entry["moe/route_mismatch"] for entry in steps if (entry["step"] - 1) % BUDGET["steps_per_generation"] == 0
        ),
        "clip": mean(entry["clip_ratio/region"] for entry in off),
        "ratio_spread": mean(entry["ratio/max"] - entry["ratio/min"] for entry in off),
        "log_ratio": mean(entry["ratio/log_abs_mean"] for entry in off),
        "rewards": [entry["reward"] for entry in steps if "reward" in entry],
    }


def render_table(results: dict[str, list[dict]]) -> str:
    """One row per objective and replay setting: each figure the mean over the seeds (its range in brackets)."""
    lines = [
        "| objective, `routing_replay` | route mismatch: on-policy steps / off-policy steps | clip fraction | "
        "ratio max − min | mean abs log-ratio | reward: first 2 rollouts → last 2 | wall-clock per run |",
        "|---|---|---|---|---|---|---|",
    ]

    def cell(values, fmt) -> str:
        mean = sum(values) / len(values)
        return f"{mean:{fmt}} ({min(values):{fmt}}–{max(values):{fmt}})" if len(values) > 1 else f"{mean:{fmt}}"

    for name, runs in results.items():
        rows = [summarize(run["log_history"]) for run in runs]
        first = [sum(row["rewards"][:2]) / 2 for row in rows]
        last = [sum(row["rewards"][-2:]) / 2 for row in rows]
        lines.append(
            f"| {name} | {cell([r['route_mismatch_first'] for r in rows], '.3f')} / "
            f"{cell([r['route_mismatch'] for r in rows], '.3f')} | {cell([r['clip'] for r in rows], '.3f')} | "
            f"{cell([r['ratio_spread'] for r in rows], '.3f')} | {cell([r['log_ratio'] for r in rows], '.4f')} | "
            f"{cell(first, '.3f')} → {cell(last, '.3f')} | "
            f"{sum(run['wall_clock_s'] for run in runs) / len(runs) / 60:.1f} min |"
        )
    return "\n".join(lines)


def write_table(results: dict[str, list[dict]], doc: Path = DOC) -> None:
    text = doc.read_text()
    pattern = re.compile(r"(<!-- results:moe_replay -->\n)(?:.*?\n)?(<!-- /results:moe_replay -->)", flags=re.DOTALL)
    doc.write_text(pattern.sub(lambda match: f"{match.group(1)}{render_table(results)}\n{match.group(2)}", text))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", nargs="*", default=list(RUNS))
    parser.add_argument("--seeds", nargs="*", type=int, default=list(SEEDS))
    parser.add_argument("--report_only", action="store_true")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # a single run, in the child process
    parser.add_argument("--seed", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one is not None:
        train_one(args.one, args.seed, args.out)
        return
    results = json.loads(RESULT.read_text())["runs"] if RESULT.exists() else {}
    if not args.report_only:
        if not (WORK / "model" / "config.json").exists():
            build_model(WORK / "model")
        environment = {**os.environ, "PYTHONPATH": str(ROOT)}  # this checkout's gspo_trl
        for seed in args.seeds:  # every setting once before the next seed: a cut-short experiment stays balanced
            for name in args.runs:
                out = WORK / f"{name.replace(', ', '_')}_seed{seed}.json"
                command = [sys.executable, __file__, "--one", name, "--seed", str(seed), "--out", str(out)]
                subprocess.run(command, check=True, cwd=ROOT, env=environment)
                runs = [run for run in results.get(name, []) if run["seed"] != seed]
                results[name] = sorted([*runs, json.loads(out.read_text())], key=lambda run: run["seed"])
                seeds = sorted({run["seed"] for runs in results.values() for run in runs})
                setup = {"model": {"model_type": "qwen3_moe", **MODEL}, "budget": BUDGET, "seeds": seeds}
                RESULT.write_text(json.dumps({"setup": setup, "date": time.strftime("%Y-%m-%d"), "runs": results}))
    write_table(results)
    print(render_table(results))


if __name__ == "__main__":
    main()

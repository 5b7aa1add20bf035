#!/usr/bin/env python
"""Training-phase cost per completion token against completion length: one forward + backward of
`completion_logprobs` (the training loss's forward) on a micro-batch of one prompt and its completions, packed
(`padding_free=True`) and padded, each length in a fresh process (peak RSS is per process).

    python benchmarks/train_length.py                          # 256, 1024, 2048, 4096 tokens; SmolLM2-135M, CPU
    python benchmarks/train_length.py --lengths 256 1024 --completions 4 --layouts packed
    python benchmarks/train_length.py --layouts packed --checkpointing full keep_attention

`--checkpointing`: none (every activation kept, the default), full (activation checkpointing, every operator
recomputed in the backward pass) or keep_attention (checkpointing that keeps SDPA's output:
`gspo_trl.models.checkpointing`,
GSPOConfig's default with activation checkpointing on).

Completions are random token ids of exactly the given length (the cost does not depend on their values), after a
60-token prompt; the timed pass is the second of two. Results go to `--out` (JSON) and a table on stdout.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
PROMPT_TOKENS = 60
CHECKPOINTING = ("none", "full", "keep_attention")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[256, 1024, 2048, 4096])
    parser.add_argument("--completions", type=int, default=1, help="completions of the prompt per micro-batch")
    parser.add_argument("--layouts", nargs="+", choices=("packed", "padded"), default=["packed", "padded"])
    parser.add_argument("--checkpointing", nargs="+", choices=CHECKPOINTING, default=["none"])
    parser.add_argument("--model", default=None, help="default: the cached SmolLM2-135M-Instruct")
    parser.add_argument("--out", default=str(HERE / "results" / "train_length.json"))
    parser.add_argument("--worker", nargs=3, metavar=("LENGTH", "LAYOUT", "CHECKPOINTING"), help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def enable_checkpointing(model, checkpointing: str) -> None:
    from types import SimpleNamespace

    from gspo_trl.models.checkpointing import checkpoint_kwargs

    if checkpointing == "none":
        return
    model.train()  # transformers checkpoints in training mode only
    settings = SimpleNamespace(
        activation_checkpointing=True,
        activation_checkpointing_kwargs={"use_reentrant": False},
        activation_checkpointing_keep_attention=checkpointing == "keep_attention",
    )
    model.activation_checkpointing_enable(activation_checkpointing_kwargs=checkpoint_kwargs(settings))


def run_once(args, length: int, packed: bool, checkpointing: str = "none") -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from gspo_trl.demo.default_model import default_model_path
    from gspo_trl.training.cpu_memory import pool_freed_memory
    from gspo_trl.training.logprobs import completion_logprobs

    pool_freed_memory()  # as the trainer does on CPU
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(args.model or default_model_path(), attn_implementation="sdpa")
    enable_checkpointing(model, checkpointing)
    vocab = model.config.vocab_size
    prompt = torch.randint(100, vocab, (1, PROMPT_TOKENS)).repeat(args.completions, 1)
    completions = torch.randint(100, vocab, (args.completions, length))
    input_ids = torch.cat([prompt, completions], dim=1)
    ones = torch.ones_like(input_ids)
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        scores = completion_logprobs(
            model, input_ids, ones, completions, torch.ones_like(completions), padding_free=packed
        )
        scores.logps.sum().backward()
        seconds = time.perf_counter() - start
    tokens = args.completions * length
    return {
        "length": length,
        "layout": "packed" if packed else "padded",
        "checkpointing": checkpointing,
        "seconds": seconds,
        "tokens": tokens,
        "ms_per_token": 1000 * seconds / tokens,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "threads": torch.get_num_threads(),
    }


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.worker:
        length, layout, checkpointing = args.worker
        print("RESULT " + json.dumps(run_once(args, int(length), layout == "packed", checkpointing)), flush=True)
        return
    rows = []
    for length, layout, checkpointing in (
        (length, layout, checkpointing)
        for length in args.lengths
        for layout in args.layouts
        for checkpointing in args.checkpointing
    ):
        command = [
            sys.executable,
            __file__,
            "--worker",
            str(length),
            layout,
            checkpointing,
            "--completions",
            str(args.completions),
        ]
        if args.model:
            command += ["--model", args.model]
        completed = subprocess.run(command, capture_output=True, text=True)
        lines = [line for line in completed.stdout.splitlines() if line.startswith("RESULT ")]
        row = (
            json.loads(lines[0][7:])
            if lines
            else {
                "length": length,
                "layout": layout,
                "checkpointing": checkpointing,
                "failed": f"exit status {completed.returncode}",
            }
        )
        rows.append(row)
        print(row, flush=True)
    record = {
        "date": _dt.date.today().isoformat(),
        "machine": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "completions": args.completions,
        "prompt_tokens": PROMPT_TOKENS,
        "rows": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record, indent=2) + "\n")
    print("| completion length | layout | checkpointing | fwd+bwd (s) | ms per completion token | peak RSS (MiB) |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        cells = f"| {row['length']} | {row['layout']} | {row['checkpointing']} |"
        if "failed" in row:
            print(f"{cells} {row['failed']} | | |")
        else:
            print(f"{cells} {row['seconds']:.2f} | {row['ms_per_token']:.2f} | {row['peak_rss_mib']:.0f} |")


if __name__ == "__main__":
    main()

#!/usr/bin/env python
"""The GPU comparison with TRL: every (architecture, completion length) cell of the grid, one command.

Each cell is a `step_time.py` driver run (ours and TRL alternating, each run a fresh process, the
device synchronised at phase boundaries) on a random-init model of SmolLM2's sizes with the SmolLM2
tokenizer, in the bf16 GPU recipe of both libraries. The suite writes each cell's JSON under
`--out_dir`, then one table of ours/TRL ratios: the window (a generation round and its optimizer
steps), generation, the training phase, its MFU, and peak GPU memory.

    python benchmarks/gpu_suite.py --tokenizer .bench/smollm2-tokenizer          # on the GPU machine
    python benchmarks/gpu_suite.py --device cpu --smoke                           # CPU, seconds: it runs
    python benchmarks/gpu_suite.py --tokenizer ... --architectures smollm2-1.7b --lengths 256,4096 \
        --gradient_checkpointing                                                  # the long-completion cells

Lengths whose run fails (out of memory, say) are reported as failed for that library, not dropped.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
DEFAULT_OUT = HERE / "results" / "gpu"

# (figure, label): the ratios the summary table shows.
SUMMARY = [
    ("round_s", "window"),
    ("generate_s", "generation"),
    ("train_s", "training phase"),
    ("mfu", "training MFU"),
    ("peak_gpu_mem_gib", "peak GPU memory"),
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--architectures", default="smollm2-135m,smollm2-1.7b")
    parser.add_argument("--lengths", default="256,1024,4096", help="max_completion_length of each cell.")
    parser.add_argument("--repeats", type=int, default=1, help="Pairs of runs per cell.")
    parser.add_argument("--tokenizer", default=None, help="SmolLM2 tokenizer directory (see benchmarks/README.md).")
    parser.add_argument("--out_dir", default=str(DEFAULT_OUT))
    parser.add_argument("--timeout", type=float, default=None, help="Seconds before one worker is killed.")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="A tiny model, 8 tokens, no warm-up: checks that every part runs (figures meaningless).",
    )
    parser.add_argument(
        "--gradient_checkpointing",
        action="store_true",
        help="Activation checkpointing in both "
        "libraries (the 1.7B architecture at 4,096 tokens needs it on an 80 GB GPU).",
    )
    parser.add_argument("--impls", default="ours,trl", help="Which libraries run, e.g. 'ours' where TRL cannot.")
    parser.add_argument("--python", default=sys.executable)
    return parser


def cell_command(args, architecture: str, length: int, out: Path) -> list[str]:
    command = [
        args.python,
        str(HERE / "step_time.py"),
        "--device",
        args.device,
        "--architecture",
        architecture,
        "--max_completion_length",
        str(length),
        "--repeats",
        str(args.repeats),
        "--out",
        str(out),
        # The work: 16 completions per optimizer step, 4 optimizer steps per generation round.
        "--per_device_train_batch_size",
        "16",
        "--steps_per_generation",
        "4",
        "--num_generations",
        "8",
        "--dataset_size",
        "64",
        "--impls",
        args.impls,
    ]
    if args.gradient_checkpointing:
        command.append("--gradient_checkpointing")
    if args.smoke:
        command += ["--warmup_rounds", "0", "--rounds", "1"]
    if args.tokenizer:
        command += ["--tokenizer", args.tokenizer]
    if args.timeout:
        command += ["--timeout", str(args.timeout)]
    return command


def cell_summary(result_path: Path) -> dict:
    data = json.loads(result_path.read_text(encoding="utf-8"))
    summary = data["summary"]
    row = {}
    for key, _ in SUMMARY:
        per_impl = {impl: summary["per_impl"].get(impl, {}).get(key, {}).get("median") for impl in ("ours", "trl")}
        row[key] = {**per_impl, "ratio": summary["ratio_ours_over_trl"].get(key, {}).get("median")}
    row["failed"] = [f"{r['impl']} ({r['error']})" for r in data["runs"] if "error" in r]
    row["impls"] = sorted({r["impl"] for r in data["runs"]})
    return row


def format_summary(rows: dict) -> str:
    def cell(values, key, impls):
        unit = {"round_s": " s", "generate_s": " s", "train_s": " s", "peak_gpu_mem_gib": " GiB"}.get(key, "")
        scale = 100 if key == "mfu" else 1
        unit = "%" if key == "mfu" else unit
        if "trl" not in impls:  # ours alone (--impls ours)
            return "failed" if values["ours"] is None else f"ours {values['ours'] * scale:.3g}{unit}"
        if values["ratio"] is None:
            return "failed" if values["ours"] is None or values["trl"] is None else "-"
        return f"{values['ratio']:.2f} ({values['ours'] * scale:.3g} vs {values['trl'] * scale:.3g}{unit})"

    lines = ["| model, completion length | " + " | ".join(f"{label} ours/TRL" for _, label in SUMMARY) + " |"]
    lines.append("|---" * (len(SUMMARY) + 1) + "|")
    for (architecture, length), row in rows.items():
        cells = [cell(row[key], key, row["impls"]) for key, _ in SUMMARY]
        lines.append(f"| {architecture}, {length} | " + " | ".join(cells) + " |")
        if row["failed"]:
            lines.append(f"| (failed: {', '.join(row['failed'])}) |" + " |" * len(SUMMARY))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    architectures = ["tiny"] if args.smoke else args.architectures.split(",")
    lengths = [8] if args.smoke else [int(x) for x in args.lengths.split(",")]
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rows, status = {}, 0
    for architecture in architectures:
        for length in lengths:
            out = out_dir / f"{architecture}_{length}.json"
            print(f"=== {architecture}, {length} tokens", flush=True)
            code = subprocess.call(cell_command(args, architecture, length, out))
            status = status or code
            if out.exists():
                rows[(architecture, length)] = cell_summary(out)
    table = format_summary(rows)
    (out_dir / "summary.md").write_text(table + "\n", encoding="utf-8")
    print(table)
    return status


if __name__ == "__main__":
    sys.exit(main())

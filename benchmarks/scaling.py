#!/usr/bin/env python
"""Scaling run: step time and peak memory of gspo-trl and TRL at several maximum completion lengths.

Runs `step_time.py` (same work, same alternation, one JSON per length) for every length in
`--lengths`, then writes `scaling.json` (one row per length and implementation) and `scaling.png`
(seconds per optimizer step and peak RSS against the maximum completion length):

    python benchmarks/scaling.py                       # 64, 256, 1024 tokens
    python benchmarks/scaling.py --plot_only           # redraw from the JSON files already there

Every other setting is step_time.py's default work (SmolLM2-135M, 16 completions per step, G = 8,
4 steps per rollout, temperature 1.0, full fine-tuning). At temperature 1.0 completions end at EOS
well before a long cap, so the mean completion length is recorded next to each point.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
DEFAULT_DIR = HERE / "results" / "scaling"


def run_length(args, length: int) -> Path:
    out = Path(args.out_dir) / f"step_time_max{length}.json"
    if args.reuse and out.exists():
        print(f"[scaling] {out} exists, reused")
        return out
    command = [
        sys.executable,
        str(HERE / "step_time.py"),
        "--max_completion_length",
        str(length),
        "--repeats",
        str(args.repeats),
        "--rounds",
        str(args.rounds),
        "--warmup_rounds",
        str(args.warmup_rounds),
        "--impls",
        args.impls,
        "--seed",
        str(args.seed),
        "--out",
        str(out),
    ] + (["--gradient_checkpointing"] if args.gradient_checkpointing else [])
    print("[scaling] " + " ".join(command), flush=True)
    # A worker that fails (e.g. killed for memory) is recorded in the JSON; the other lengths still run.
    subprocess.run(command, check=False)
    return out


def _source(path: Path) -> str:
    """The JSON file's path relative to the repository, or as given when it lies outside."""
    path = path.resolve()
    return str(path.relative_to(HERE.parent)) if path.is_relative_to(HERE.parent) else str(path)


def collect(paths: dict[int, Path]) -> list[dict]:
    rows = []
    for length, path in sorted(paths.items()):
        data = json.loads(path.read_text())
        for run in data["runs"]:
            if run.get("error"):
                rows.append(
                    {
                        "max_completion_length": length,
                        "impl": run["impl"],
                        "error": run["error"],
                        "source": _source(path),
                    }
                )
        for impl, figures in data["summary"]["per_impl"].items():
            if "step_s" not in figures:
                continue
            rows.append(
                {
                    "max_completion_length": length,
                    "impl": impl,
                    "step_s": figures["step_s"]["median"],
                    "generate_s_per_round": figures["generate_s"]["median"],
                    "train_step_s": figures["train_step_s"]["median"],
                    "round_s": figures["round_s"]["median"],
                    "completion_tokens": figures["completion_tokens"]["median"],
                    "peak_rss_mb": figures["peak_rss_mb"]["median"],
                    "mean_completion_length": figures["mean_completion_length"]["median"],
                    "padding_share": figures.get("padding_share", {}).get("median"),
                    "runs": len(figures["step_s"]["values"]),
                    "source": _source(path),
                }
            )
    return rows


def plot(rows: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for impl, style in (("ours", "o-"), ("trl", "s--")):
        points = [r for r in rows if r["impl"] == impl and "error" not in r]
        if not points:
            continue
        label = "gspo-trl" if impl == "ours" else "TRL 1.16 (GSPO mode)"
        lengths = [r["max_completion_length"] for r in points]
        left.plot(lengths, [r["step_s"] for r in points], style, label=label)
        right.plot(lengths, [r["peak_rss_mb"] / 1024 for r in points], style, label=label)
        for r in points:
            left.annotate(
                f"{r['mean_completion_length']:.0f}",
                (r["max_completion_length"], r["step_s"]),
                textcoords="offset points",
                xytext=(4, 4),
                fontsize=7,
            )
    for r in rows:
        if "error" in r:
            left.annotate(
                f"{r['impl']}: {r['error']}",
                (r["max_completion_length"], 0),
                textcoords="offset points",
                xytext=(-120, 8),
                fontsize=7,
                color="red",
            )
    for axis in (left, right):
        axis.set_xscale("log", base=2)
        axis.set_xlabel("max completion length (tokens)")
        axis.grid(alpha=0.3)
        axis.legend()
    left.set_ylabel("seconds per optimizer step")
    left.set_title("Step time (labels: mean completion length)", fontsize=9)
    right.set_ylabel("peak RSS (GiB)")
    right.set_title("Peak memory", fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    print(f"[scaling] wrote {out}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="64,256,1024", help="Comma-separated max completion lengths.")
    parser.add_argument("--impls", default="ours,trl")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--warmup_rounds", type=int, default=1)
    parser.add_argument("--out_dir", default=str(DEFAULT_DIR))
    parser.add_argument("--gradient_checkpointing", action="store_true", help="Activation checkpointing in training.")
    parser.add_argument("--seed", type=int, default=0, help="step_time.py's seed (prompts' order, sampling).")
    parser.add_argument("--reuse", action="store_true", help="Skip lengths whose JSON already exists.")
    parser.add_argument("--plot_only", action="store_true", help="Only redraw from existing JSON files.")
    args = parser.parse_args(argv)

    out_dir = Path(args.out_dir).resolve()  # sources are recorded relative to the repository
    out_dir.mkdir(parents=True, exist_ok=True)
    lengths = [int(x) for x in args.lengths.split(",")]
    if args.plot_only:
        paths = {
            n: out_dir / f"step_time_max{n}.json" for n in lengths if (out_dir / f"step_time_max{n}.json").exists()
        }
    else:
        paths = {n: run_length(args, n) for n in lengths}
    rows = collect(paths)
    (out_dir / "scaling.json").write_text(json.dumps(rows, indent=1) + "\n")
    plot(rows, out_dir / "scaling.png")
    for r in rows:
        if "error" in r:
            print(f"  max {r['max_completion_length']:>5}  {r['impl']:<4}  failed: {r['error']}")
            continue
        print(
            f"  max {r['max_completion_length']:>5}  {r['impl']:<4}  {r['step_s']:7.2f} s/step  "
            f"{r['peak_rss_mb']:7.0f} MiB  mean completion {r['mean_completion_length']:.1f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

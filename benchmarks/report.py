#!/usr/bin/env python
"""Rewrite the result tables of docs/benchmarks.md from the benchmark JSON files.

Only the text between `<!-- results:NAME -->` and `<!-- /results:NAME -->` markers is replaced; the
prose around the tables is written by hand. NAME is `main` (full fine-tuning and LoRA side by side,
from `results/step_time_full.json` and `results/step_time_lora.json`), `decode_loop` (full fine-tuning
again with the decoding loop, from `results/step_time_full_decode_loop.json`), `decoded_old` (π_old from the
decoding loop against the π_old pass and TRL, from `results/step_time_decoded_old.json`), `scaling` (from
`results/scaling/scaling.json`) or `scaling_decode_loop` (from `results/scaling_decode_loop*/scaling.json`).

    python benchmarks/report.py            # rewrite docs/benchmarks.md in place
    python benchmarks/report.py --check    # exit 1 if the tables are not what the JSON files say
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
DOC = ROOT / "docs" / "benchmarks.md"

# (figure key, row label, format, what the ratio means)
MAIN_ROWS = [
    ("step_s", "**per optimizer step (s)**", "{:.2f}"),
    ("generate_s", "generate, per round of 64 (s)", "{:.2f}"),
    ("old_logps_s", "old log-probs, per round (s)", "{:.2f}"),
    ("train_step_s", "training fwd+bwd+optim, per step (s)", "{:.2f}"),
    ("logprob_positions", "positions in log-prob forwards, per round", "{:.0f}"),
    ("padding_share", "of which padding", "{:.1%}"),
    ("train_gflop_per_s", "training phase, useful GFLOP/s", "{:.1f}"),
    ("mfu", "training-phase MFU (vs fp32 matmul peak)", "{:.1%}"),
    ("matmul_peak_gflop_per_s", "fp32 matmul peak, GFLOP/s", "{:.0f}"),
    ("completion_tokens", "completion tokens per round", "{:.0f}"),
    ("peak_rss_mb", "peak RSS (MiB)", "{:.0f}"),
]


def _median(summary: dict, impl: str, key: str):
    figure = summary["per_impl"].get(impl, {}).get(key)
    return None if figure is None else figure["median"]


def _cell(value, fmt: str) -> str:
    return "—" if value is None else fmt.format(value)


def _row(columns, key: str, label: str, fmt: str) -> str:
    row = f"| {label} |"
    for _, data in columns:
        summary = data["summary"]
        ours, trl = _median(summary, "ours", key), _median(summary, "trl", key)
        ratios = [r for r in summary["ratio_ours_over_trl"].get(key, {}).get("per_pair", []) if r is not None]
        ratio = _ratio_cell(ratios) if ratios and key not in ("matmul_peak_gflop_per_s", "padding_share") else ""
        if key == "step_s" and ratio:
            ratio = f"**{ratio}**"
        row += f" {_cell(ours, fmt)} | {_cell(trl, fmt)} | {ratio} |"
    return row


def _ratio_cell(ratios: list[float]) -> str:
    return f"{sorted(ratios)[len(ratios) // 2]:.2f} ({min(ratios):.2f}–{max(ratios):.2f})"


def _normalized_row(columns) -> str:
    """Round time per 1000 sampled completion tokens: the step time with the token count divided out
    (sampling diverges after the warm-up round, so the two trainers do not sample equally long completions)."""
    row = "| **round time per 1000 completion tokens (s)** |"
    for _, data in columns:
        per_pair: dict[int, dict[str, float]] = {}
        for run in data["runs"]:
            figures = run.get("result", {}).get("figures")
            if figures:
                per_pair.setdefault(run["pair"], {})[run["impl"]] = 1000 * figures["round_s"] / figures["completion_tokens"]
        ours = sorted(v["ours"] for v in per_pair.values() if "ours" in v)
        trl = sorted(v["trl"] for v in per_pair.values() if "trl" in v)
        ratios = [v["ours"] / v["trl"] for v in per_pair.values() if "ours" in v and "trl" in v]
        row += f" {ours[len(ours) // 2]:.2f} | {trl[len(trl) // 2]:.2f} | **{_ratio_cell(ratios)}** |"
    return row


def main_table() -> str:
    return step_time_table((("step_time_full.json", "full fine-tune"), ("step_time_lora.json", "LoRA r=16")))


def decode_loop_table() -> str:
    return step_time_table((("step_time_full_decode_loop.json", "full fine-tune"),))


def step_time_table(files) -> str:
    columns = [(label, json.loads((RESULTS / name).read_text())) for name, label in files]
    header = "| median over runs |"
    rule = "|---|"
    for label, data in columns:
        runs = len(data["summary"]["per_impl"]["ours"]["step_s"]["values"])
        header += f" {label}: ours | TRL | ours/TRL (min–max over {runs} pairs) |"
        rule += "---|---|---|"
    lines = [header, rule, _row(columns, *MAIN_ROWS[0])]
    lines.append(_normalized_row(columns))
    for key, label, fmt in MAIN_ROWS[1:]:
        lines.append(_row(columns, key, label, fmt))
    return "\n".join(lines)


def decoded_old_table() -> str:
    """Three implementations from one run of alternating workers: gspo-trl with π_old from the decoding loop (the
    default), gspo-trl with the π_old forward pass (`ours_recompute`), and TRL; ratios to TRL pair by pair."""
    data = json.loads((RESULTS / "step_time_decoded_old.json").read_text())
    figures: dict[str, dict[int, dict]] = {}
    for run in data["runs"]:
        if "result" in run:
            found = dict(run["result"]["figures"])
            found["round_per_1000_tokens_s"] = 1000 * found["round_s"] / found["completion_tokens"]
            figures.setdefault(run["impl"], {})[run["pair"]] = found
    impls = ("ours", "ours_recompute", "trl")
    pairs = sorted(set.intersection(*(set(figures.get(impl, {})) for impl in impls)))
    rows = [MAIN_ROWS[0], ("round_per_1000_tokens_s", "**round time per 1000 completion tokens (s)**", "{:.2f}"),
            *MAIN_ROWS[1:]]
    lines = [f"| median over {len(pairs)} runs each | ours (π_old from the loop) | ours, π_old pass | TRL "
             "| ours/TRL (min–max) | ours, π_old pass/TRL (min–max) |", "|---|---|---|---|---|---|"]
    for key, label, fmt in rows:
        values = {impl: sorted(figures[impl][pair][key] for pair in pairs) for impl in impls}
        cells = [_cell(v[len(v) // 2] if v else None, fmt) for v in values.values()]
        for impl in ("ours", "ours_recompute"):
            ratios = [figures[impl][p][key] / figures["trl"][p][key] for p in pairs if figures["trl"][p][key]]
            cells.append(_ratio_cell(ratios) if ratios and key not in ("matmul_peak_gflop_per_s", "padding_share")
                         else "")
        if key == "step_s":
            cells[3] = f"**{cells[3]}**"
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def scaling_table() -> str:
    rows = json.loads((RESULTS / "scaling" / "scaling.json").read_text())
    lines = [
        "| max completion length | mean sampled: ours / TRL | s/step: ours | TRL | ours/TRL | per completion token: ours/TRL "
        "| peak RSS (MiB): ours | TRL |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for length in sorted({r["max_completion_length"] for r in rows}):
        failed = {r["impl"]: r["error"] for r in rows if r["max_completion_length"] == length and "error" in r}
        got = {r["impl"]: r for r in rows if r["max_completion_length"] == length and "error" not in r}
        ours, trl = got.get("ours"), got.get("trl")
        mean = " / ".join(f"{got[i]['mean_completion_length']:.1f}" if i in got else "—" for i in ("ours", "trl"))
        ratio = per_token = "—"
        if ours and trl:
            ratio = f"{ours['step_s'] / trl['step_s']:.2f}"
            per_token = f"{(ours['step_s'] / ours['mean_completion_length']) / (trl['step_s'] / trl['mean_completion_length']):.2f}"
        def step(impl, row):
            return f"failed ({failed[impl]})" if impl in failed else _cell(row and row["step_s"], "{:.2f}")

        def rss(impl, row):
            return "—" if impl in failed else _cell(row and row["peak_rss_mb"], "{:.0f}")

        lines.append(
            f"| {length} | {mean} | {step('ours', ours)} | {step('trl', trl)} "
            f"| {ratio} | {per_token} | {rss('ours', ours)} | {rss('trl', trl)} |"
        )
    return "\n".join(lines)


def scaling_decode_loop_table() -> str:
    """gspo-trl alone with the decoding loop: buffers sized for the longest row up front (before) or growing."""
    lines = [
        "| max completion length | KV buffers | mean completion (tokens) | s/step | generate per round (s) "
        "| ms per completion token (round) | × the 256-token figure | peak RSS (MiB) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for folder, label in (("scaling_decode_loop_full_buffers", "longest row up front"),
                          ("scaling_decode_loop", "growing"),
                          ("scaling_decode_loop_checkpointing", "growing, activation checkpointing"),
                          ("scaling_decode_loop_decoded_old", "growing, checkpointing, packing fix, π_old from the loop"),
                          ("scaling_decode_loop_plan_forwards", "the same + long and short completions in separate forwards")):
        rows = [r for r in json.loads((RESULTS / folder / "scaling.json").read_text()) if r["impl"] == "ours"]
        base = next((r for r in rows if r["max_completion_length"] == 256 and "error" not in r), None)
        for row in sorted(rows, key=lambda r: r["max_completion_length"]):
            if "error" in row:
                lines.append(f"| {row['max_completion_length']} | {label} | failed ({row['error']}) | — | — | — | — | — |")
                continue
            per_token = 1000 * row["round_s"] / row["completion_tokens"]
            relative = per_token / (1000 * base["round_s"] / base["completion_tokens"]) if base else None
            lines.append(
                f"| {row['max_completion_length']} | {label} | {row['mean_completion_length']:.1f} | {row['step_s']:.2f} "
                f"| {row['generate_s_per_round']:.1f} | {per_token:.1f} | {_cell(relative, '{:.2f}')} "
                f"| {row['peak_rss_mb']:.0f} |"
            )
    return "\n".join(lines)


def render(text: str) -> str:
    for name, build in (("main", main_table), ("decode_loop", decode_loop_table), ("decoded_old", decoded_old_table),
                        ("scaling", scaling_table),
                        ("scaling_decode_loop", scaling_decode_loop_table)):
        pattern = re.compile(rf"(<!-- results:{name} -->\n)(?:.*?\n)?(<!-- /results:{name} -->)", re.S)
        if not pattern.search(text):
            raise SystemExit(f"report.py: no <!-- results:{name} --> markers in {DOC}")
        table = build()
        text = pattern.sub(lambda m: m.group(1) + table + "\n" + m.group(2), text)
    return text


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="Fail if docs/benchmarks.md is out of date.")
    args = parser.parse_args(argv)
    current = DOC.read_text(encoding="utf-8")
    updated = render(current)
    if args.check:
        if updated != current:
            print("docs/benchmarks.md tables differ from the benchmark JSON files; run benchmarks/report.py")
            return 1
        return 0
    DOC.write_text(updated, encoding="utf-8")
    print(f"wrote {DOC.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

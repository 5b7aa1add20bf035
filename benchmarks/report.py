#!/usr/bin/env python
"""Rewrite the result tables of docs/benchmarks.md from the benchmark JSON files.

Only the text between `<!-- results:NAME -->` and `<!-- /results:NAME -->` markers is replaced; the
prose around the tables is written by hand. Each NAME and its files under `benchmarks/results/`:

- `current`: gspo-trl against TRL with today's defaults on CPU (`step_time_zen4_head_rows.json`)
- `main`: full fine-tuning and LoRA against TRL on CPU (`step_time_full.json`, `step_time_lora.json`)
- `decode_step`: one decoding step, transformers' forward against the loop's (`decode_step_compiled.json`)
- `scaling_seeds`: 256 against 4096 new tokens, per seed (`scaling_keep_attention_seed*/`)
- `scaling`: gspo-trl against TRL at 64, 256 and 1024 new tokens (`scaling/`)
- `train_length`: one completion's training pass by length (`train_length_checkpointing*.json`)
- `gpu_h200`, `gpu_h100`: the GPU cells (`gpu/smollm2-*.json`)
- `gpu_decoding_step`: decoding steps on a GPU (`gpu/static_decoding_timing.json`)
- `gpu_lm_head`: the LM head and loss against liger's fused loss (`gpu/logprob_head_liger.json`)
- `mfu_memory`: training-phase MFU and peak memory, from the step-time files above

The decoding-rollout table is printed by `benchmarks/decoding.py` and checked by tests/test_docs.py.

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

# (figure key, row label, format) of the step-time tables; the JSON files hold every other figure too
MAIN_ROWS = [
    ("step_s", "**per optimizer step (s)**", "{:.2f}"),
    ("generate_s", "generate, per round of 64 (s)", "{:.2f}"),
    ("old_logps_s", "old log-probs, per round (s)", "{:.2f}"),
    ("train_step_s", "training fwd+bwd+optim, per step (s)", "{:.2f}"),
    ("logprob_positions", "positions in log-prob forwards, per round", "{:.0f}"),
    ("padding_share", "of which padding", "{:.1%}"),
    ("mfu", "training-phase MFU (vs fp32 matmul peak)", "{:.1%}"),
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
                per_pair.setdefault(run["pair"], {})[run["impl"]] = (
                    1000 * figures["round_s"] / figures["completion_tokens"]
                )
        ours = sorted(v["ours"] for v in per_pair.values() if "ours" in v)
        trl = sorted(v["trl"] for v in per_pair.values() if "trl" in v)
        ratios = [v["ours"] / v["trl"] for v in per_pair.values() if "ours" in v and "trl" in v]
        row += f" {ours[len(ours) // 2]:.2f} | {trl[len(trl) // 2]:.2f} | **{_ratio_cell(ratios)}** |"
    return row


def main_table() -> str:
    return step_time_table((("step_time_full.json", "full fine-tune"), ("step_time_lora.json", "LoRA r=16")))


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


def scaling_table() -> str:
    rows = json.loads((RESULTS / "scaling" / "scaling.json").read_text())
    lines = [
        "| max completion length | mean sampled: ours / TRL | s/step: ours | TRL | ours/TRL "
        "| per completion token: ours/TRL | peak RSS (MiB): ours | TRL |",
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
            ours_per_token = ours["step_s"] / ours["mean_completion_length"]
            per_token = f"{ours_per_token / (trl['step_s'] / trl['mean_completion_length']):.2f}"

        def step(impl, row):
            return f"failed ({failed[impl]})" if impl in failed else _cell(row and row["step_s"], "{:.2f}")

        def rss(impl, row):
            return "—" if impl in failed else _cell(row and row["peak_rss_mb"], "{:.0f}")

        lines.append(
            f"| {length} | {mean} | {step('ours', ours)} | {step('trl', trl)} "
            f"| {ratio} | {per_token} | {rss('ours', ours)} | {rss('trl', trl)} |"
        )
    return "\n".join(lines)


def current_table() -> str:
    return step_time_table((("step_time_zen4_head_rows.json", "full fine-tune"),))


def _load(path: str):
    return json.loads((RESULTS / path).read_text())


def scaling_seeds_table() -> str:
    """gspo-trl alone at 256 and 4096 new tokens, one run per length and seed; ms per completion token of the whole
    round (generation, then the round's optimizer steps), and the 4096/256 ratio per seed and pooled over seeds."""
    lines = [
        "| seed | 256: tokens, ms per token (generation, training) | 4096: tokens, ms per token "
        "(generation, training) | 4096 / 256 |",
        "|---|---|---|---|",
    ]
    pooled = {256: [0.0, 0.0], 4096: [0.0, 0.0]}  # round seconds, tokens
    seeds = sorted(
        int(p.name.removeprefix("scaling_keep_attention_seed")) for p in RESULTS.glob("scaling_keep_attention_seed*")
    )
    for seed in seeds:
        rows = {r["max_completion_length"]: r for r in _load(f"scaling_keep_attention_seed{seed}/scaling.json")}
        cells, per_token = [], {}
        for length in (256, 4096):
            row = rows[length]
            steps = json.loads((ROOT / row["source"]).read_text())["optimizer_steps_per_round"]
            tokens = row["completion_tokens"]
            per_token[length] = 1000 * row["round_s"] / tokens
            cells.append(
                f"{tokens:,.0f}: {per_token[length]:.1f} ({1000 * row['generate_s_per_round'] / tokens:.1f}, "
                f"{1000 * steps * row['train_step_s'] / tokens:.1f})"
            )
            pooled[length][0] += row["round_s"]
            pooled[length][1] += tokens
        lines.append(f"| {seed} | {cells[0]} | {cells[1]} | {per_token[4096] / per_token[256]:.2f} |")
    short, long = (1000 * pooled[n][0] / pooled[n][1] for n in (256, 4096))
    lines.append(
        f"| pooled, seeds {seeds[0]}–{seeds[-1]} | {pooled[256][1]:,.0f}: {short:.1f} "
        f"| {pooled[4096][1]:,.0f}: {long:.1f} | **{long / short:.2f}** |"
    )
    return "\n".join(lines)


def train_length_table() -> str:
    """One completion's forward + backward under activation checkpointing, by length: every operator recomputed
    against the attention output kept. Each run of a cell is shown, the first file's first."""
    runs: dict[tuple[int, str], list[dict]] = {}
    for name in ("train_length_checkpointing.json", "train_length_checkpointing_rerun.json"):
        for row in _load(name)["rows"]:
            runs.setdefault((row["length"], row["checkpointing"]), []).append(row)

    def cell(length: int, mode: str) -> str:
        return "; again ".join(f"{r['ms_per_token']:.2f} ({r['peak_rss_mib']:,.0f})" for r in runs[(length, mode)])

    lines = [
        "| completion length | checkpointing, every operator recomputed | attention output kept (the default) |",
        "|---|---|---|",
    ]
    for length in sorted({length for length, _ in runs}):
        lines.append(f"| {length} | {cell(length, 'full')} | {cell(length, 'keep_attention')} |")
    return "\n".join(lines)


def decode_step_table() -> str:
    """One decoding step: transformers' forward with `F.linear` and SDPA against the decoding loop's own step, by rows
    (lines) and positions in the KV cache (columns)."""
    steps = _load("decode_step_compiled.json")["steps"]
    contexts = sorted({s["context"] for s in steps})
    lines = [
        "| rows | " + " | ".join(f"{c:,} positions: transformers → loop (ms)" for c in contexts) + " |",
        "|---|" + "---|" * len(contexts),
    ]
    for rows in sorted({s["rows"] for s in steps}):
        cells = []
        for context in contexts:
            step = next(s for s in steps if s["rows"] == rows and s["context"] == context)
            plain, own = step["plain_ms"], step["step_forward_ms"]
            cells.append(f"{plain:.1f} → {own:.1f} ({own / plain:.2f}×)")
        lines.append(f"| {rows} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def dynamic_sampling_table() -> str:
    """The demo trained with and without dynamic sampling: per run, the rollouts' mean reward (all of them, the first
    and last half), the completion and prompt tokens sampled, and the rounds per rollout."""
    lines = [
        "| dynamic_sampling | rollouts | mean reward: all (first 5 → last 5) "
        "| tokens, prompt + completion (`num_tokens`) | rounds per rollout "
        "| sampled per trained token | groups of equal rewards sampled |",
        "|---|---|---|---|---|---|---|",
    ]
    for run in _load("dynamic_sampling.json")["runs"]:
        rollouts = [step for step in run["steps"] if "reward" in step]
        rewards = [step["reward"] for step in rollouts]
        half = len(rewards) // 2

        def mean(values: list[float]) -> float:
            return sum(values) / len(values)

        rounds = [step.get("rollout/dynamic_sampling_rounds", 1.0) for step in rollouts]
        ratio = [step.get("rollout/sampled_tokens_per_trained_token", 1.0) for step in rollouts]
        zero = mean([step["frac_reward_zero_std"] for step in rollouts])
        lines.append(
            f"| {run['variant']} | {len(rollouts)} | {mean(rewards):.3f} ({mean(rewards[:half]):.3f} → "
            f"{mean(rewards[half:]):.3f}) | {run['steps'][-1]['num_tokens']:,} | {mean(rounds):.1f} | "
            f"{mean(ratio):.2f} | {zero:.0%} |"
        )
    return "\n".join(lines)


# (figure, column, cell format) of the GPU tables; every figure is the mean over a run's timed rounds.
GPU_COLUMNS = [
    ("round_s", "window (s)", "{:.2f}"),
    ("generate_s", "generation (s)", "{:.2f}"),
    ("old_logps_s", "π_old pass (s)", "{:.2f}"),
    ("train_s", "training phase (s)", "{:.2f}"),
    ("mfu", "training MFU", "{:.1%}"),
    ("peak_gpu_mem_gib", "peak GPU memory (GiB)", "{:.2f}"),
    ("train_us_per_token", "training µs per completion token", "{:.1f}"),
]


def _gpu_figures(name: str, impl: str) -> tuple[dict, int]:
    data = _load(f"gpu/{name}")
    figures = dict(next(r["result"]["figures"] for r in data["runs"] if r["impl"] == impl and "result" in r))
    figures["train_us_per_token"] = 1e6 * figures["train_s"] / figures["completion_tokens"]
    return figures, data["settings"]["rounds"]


def gpu_table(rows) -> str:
    """`rows`: (label, results file under gpu/, implementation), or (label, None, None) for the ratio of the two rows
    above it (ours over TRL)."""
    lines = [
        "| run | timed rounds | " + " | ".join(label for _, label, _ in GPU_COLUMNS) + " |",
        "|---|---|" + "---|" * len(GPU_COLUMNS),
    ]
    done: list[dict] = []
    for label, name, impl in rows:
        if name is None:
            trl, ours = done[-2], done[-1]
            lines.append(
                f"| **{label}** | | "
                + " | ".join(
                    f"**{ours[key] / trl[key]:.2f}**"
                    if key in ("round_s", "peak_gpu_mem_gib")
                    else f"{ours[key] / trl[key]:.2f}"
                    for key, _, _ in GPU_COLUMNS
                )
                + " |"
            )
            continue
        figures, rounds = _gpu_figures(name, impl)
        done.append(figures)
        lines.append(
            f"| {label} | {rounds} | " + " | ".join(fmt.format(figures[key]) for key, _, fmt in GPU_COLUMNS) + " |"
        )
    return "\n".join(lines)


def gpu_h200_table() -> str:
    return gpu_table(
        [
            ("1024, TRL", "smollm2-1.7b_1024_passes_trl.json", "trl"),
            ("1024, gspo-trl, defaults", "smollm2-1.7b_1024_passes_ours.json", "ours"),
            ("1024, gspo-trl / TRL", None, None),
            ("1024, gspo-trl, `max_tokens_per_pass=0`", "smollm2-1.7b_1024_one_pass_ours.json", "ours"),
            ("1024, gspo-trl, `use_liger_kernel=True`", "smollm2-1.7b_1024_passes_liger_ours.json", "ours"),
            ("256, gspo-trl, defaults", "smollm2-1.7b_256_passes_ours.json", "ours"),
            ("4096, gspo-trl, defaults", "smollm2-1.7b_4096_passes_ours.json", "ours"),
        ]
    )


def gpu_h100_table() -> str:
    return gpu_table(
        [
            ("256, TRL", "smollm2-135m_256.json", "trl"),
            ("256, gspo-trl", "smollm2-135m_256.json", "ours"),
            ("256, gspo-trl / TRL", None, None),
            ("4096, gspo-trl, one training pass", "smollm2-135m_4096_ours.json", "ours"),
        ]
    )


def gpu_decoding_step_table() -> str:
    timing = _load("gpu/static_decoding_timing.json")["timing"]
    return "\n".join(
        [
            "| decoding loop | ms per step |",
            "|---|---|",
            f"| transformers' `generate` | {timing['generate_ms_per_step']:.2f} |",
            "| gspo-trl's loop without graphs (`decode_cuda_graphs=False`) "
            f"| {timing['dynamic_loop_ms_per_step']:.2f} |",
            "| gspo-trl's loop, static cache and CUDA graphs (the default) "
            f"| **{timing['static_graphs_ms_per_step']:.2f}** |",
        ]
    )


def gpu_lm_head_table() -> str:
    data = _load("gpu/logprob_head_liger.json")
    lines = [
        "| LM head and GSPO loss, forward + backward | median (ms) | memory above the inputs (GiB) |",
        "|---|---|---|",
    ]
    for key, label in (
        ("ours", "gspo-trl's chunked head and `policy_loss`"),
        ("liger", 'liger\'s `LigerFusedLinearGRPOLoss(importance_sampling_level="sequence")`'),
    ):
        lines.append(f"| {label} | {data[key]['median_ms']:.1f} | {data[key]['peak_extra_gib']:.2f} |")
    return "\n".join(lines)


def mfu_memory_table() -> str:
    """Training-phase MFU and peak memory, ours against TRL, from the step-time files of the tables above."""
    lines = [
        "| work, machine | training-phase MFU: gspo-trl | TRL | peak memory: gspo-trl | TRL | ours/TRL |",
        "|---|---|---|---|---|---|",
    ]
    summary = _load("step_time_zen4_head_rows.json")["summary"]
    ours, trl = (_median(summary, impl, "mfu") for impl in ("ours", "trl"))
    ours_rss, trl_rss = (_median(summary, impl, "peak_rss_mb") for impl in ("ours", "trl"))
    ratios = sorted(summary["ratio_ours_over_trl"]["peak_rss_mb"]["per_pair"])
    lines.append(
        f"| SmolLM2-135M fp32, 64 tokens, CPU (medians of 3 pairs) | {ours:.1%} | {trl:.1%} "
        f"| {ours_rss:,.0f} MiB RSS | {trl_rss:,.0f} MiB RSS | {ratios[len(ratios) // 2]:.2f} |"
    )
    trl_gpu, _ = _gpu_figures("smollm2-1.7b_1024_passes_trl.json", "trl")
    for label, name in (
        ("1.7B bf16, 1024 tokens, GPU, defaults", "smollm2-1.7b_1024_passes_ours.json"),
        ("the same, `max_tokens_per_pass=0`", "smollm2-1.7b_1024_one_pass_ours.json"),
    ):
        ours_gpu, _ = _gpu_figures(name, "ours")
        ours_mem, trl_mem = ours_gpu["peak_gpu_mem_gib"], trl_gpu["peak_gpu_mem_gib"]
        lines.append(
            f"| {label} | {ours_gpu['mfu']:.1%} | {trl_gpu['mfu']:.1%} | {ours_mem:.2f} GiB "
            f"| {trl_mem:.2f} GiB | {ours_mem / trl_mem:.2f} |"
        )
    return "\n".join(lines)


RENDERERS = (
    ("current", current_table),
    ("main", main_table),
    ("decode_step", decode_step_table),
    ("scaling_seeds", scaling_seeds_table),
    ("scaling", scaling_table),
    ("train_length", train_length_table),
    ("dynamic_sampling", dynamic_sampling_table),
    ("gpu_h200", gpu_h200_table),
    ("gpu_h100", gpu_h100_table),
    ("gpu_decoding_step", gpu_decoding_step_table),
    ("gpu_lm_head", gpu_lm_head_table),
    ("mfu_memory", mfu_memory_table),
)


def render(text: str) -> str:
    for name, build in RENDERERS:
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

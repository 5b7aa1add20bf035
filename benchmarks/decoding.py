#!/usr/bin/env python
"""Generation time of one rollout: gspo-trl's decoding loop against transformers' `generate`, same work.

Times `HFGenerateBackend.generate` (tokenisation, shared-prompt prefill, sampling) on the step-time
benchmark's rollout: SmolLM2-135M-Instruct, 8 prompts of the demo task × 8 completions = 64 rows, up to
`--max_completion_length` new tokens at temperature 1.0, fp32 on CPU (or bf16 on `--device cuda`). The two
loops alternate, `--repeats` times each after one untimed warm-up each, in one process:

    python benchmarks/decoding.py                          # 64 new tokens, 3 repeats
    python benchmarks/decoding.py --max_completion_length 256 --layout_independent_sampling
    python benchmarks/decoding.py --loops gspo,gspo_full_buffers --layout_independent_sampling  # KV buffers A/B
    python benchmarks/decoding.py --loops gspo,gspo_plain_linears --layout_independent_sampling  # linear forms A/B
    python benchmarks/decoding.py --loops gspo,gspo_module_forward --layout_independent_sampling  # step forward A/B
    python benchmarks/decoding.py --loops gspo,gspo_unpacked --layout_independent_sampling  # packed weights A/B
    python benchmarks/decoding.py --loops gspo,gspo_sdpa --layout_independent_sampling  # attention kernel A/B

`generate` here already shares each prompt's prefill (gspo-trl's backend); TRL's `generate` path does not.
Each row of the output gives seconds per rollout (min / median), the mean completion length and the number
of decoding steps the longest completion needed. Results go to `--out` (JSON) and a table on stdout.
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
LOOPS = ("gspo", "generate")
# The gspo loop with its KV buffers sized for the longest possible row at the first step (as before 2026-11-24)
# instead of growing: an A/B of the buffers alone (same tokens with --layout_independent_sampling).
FULL_BUFFERS = "gspo_full_buffers"
# The gspo loop with every linear layer in `F.linear`'s form (as before 2026-11-25): an A/B of `cpu.linear`.
PLAIN_LINEARS = "gspo_plain_linears"
# The gspo loop with transformers' forward at every step instead of `cpu.forward`'s (as before 2026-11-26).
MODULE_FORWARD = "gspo_module_forward"
# The gspo loop with `cpu.linear` choosing between `F.linear` and the transposed form only, still measured up to
# 64 rows: an A/B of the packed form.
UNPACKED = "gspo_unpacked"
# The gspo loop without the compiled kernels (`cpu.kernel`: SDPA's attention at every step, no compiled products or
# rotation; as before 2026-11-26): an A/B of the kernels.
SDPA_ATTENTION = "gspo_sdpa"


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max_completion_length", type=int, default=64)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--num_generations", type=int, default=8)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--layout_independent_sampling", action="store_true")
    parser.add_argument(
        "--loops",
        default=",".join(LOOPS),
        help=f"comma-separated, from {LOOPS + (FULL_BUFFERS, PLAIN_LINEARS, MODULE_FORWARD, UNPACKED, SDPA_ATTENTION)}",
    )
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--model", default=None, help="default: the cached SmolLM2-135M-Instruct")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(HERE / "results" / "dynamic.json"))
    return parser.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from gspo_trl import GSPOConfig
    from gspo_trl.demo.default_model import default_model_path
    from gspo_trl.demo.tasks import default_task_dataset
    from gspo_trl.rollout import HFGenerateBackend, stream_keys
    from gspo_trl.rollout.decoding import cpu, dynamic
    from gspo_trl.rollout.decoding.cpu import kernel

    model_path = args.model or default_model_path()
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).to(args.device)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    rows = args.prompts * args.num_generations
    prompts = [row["prompt"] for row in default_task_dataset(args.prompts, seed=args.seed)]
    prompts = [p for p in prompts for _ in range(args.num_generations)]
    loops = args.loops.split(",")
    backends = {}
    for loop in loops:
        config = GSPOConfig(
            output_dir="/tmp/gspo-decoding-bench",
            per_device_train_batch_size=rows,
            num_generations=args.num_generations,
            max_completion_length=args.max_completion_length,
            temperature=args.temperature,
            decode_loop="generate" if loop == "generate" else "gspo",
            use_cpu=args.device == "cpu",
            bf16=args.device == "cuda",
            report_to="none",
        )
        backends[loop] = HFGenerateBackend(lambda: model, tokenizer, config)
        assert backends[loop].use_decode_loop == (loop != "generate")
        if args.device == "cpu":  # each A/B loop with one lever of the CPU kernels off
            backends[loop].cpu_kernels = cpu.CPUKernels(
                linear_forms=loop != PLAIN_LINEARS,
                step_forward=loop != MODULE_FORWARD,
                packing=loop != UNPACKED,
                compiled=loop != SDPA_ATTENTION,
            )
    growing_room = dynamic.INITIAL_ROOM
    kernel_built = args.device == "cpu" and kernel.available()

    def once(loop: str, repeat: int) -> dict:
        torch.manual_seed(args.seed + repeat)
        keys = stream_keys(args.seed, repeat, torch.arange(rows)) if args.layout_independent_sampling else None
        if args.device == "cuda":
            torch.cuda.synchronize()
        dynamic.INITIAL_ROOM = 1 << 40 if loop == FULL_BUFFERS else growing_room  # room capped at the longest row
        start = time.perf_counter()
        rollout = backends[loop].generate(prompts, keys)
        if args.device == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        lengths = rollout.completion_mask.sum(1).float()
        return {"seconds": seconds, "mean_length": lengths.mean().item(), "steps": rollout.completion_ids.shape[1]}

    runs = {loop: [] for loop in loops}
    for loop in loops:
        once(loop, -1)  # warm-up
    for repeat in range(args.repeats):
        for loop in loops:
            runs[loop].append(once(loop, repeat))
            print(f"[decoding] {loop:8s} repeat {repeat}: {runs[loop][-1]}", flush=True)

    summary = {}
    for loop, results in runs.items():
        seconds = [r["seconds"] for r in results]
        summary[loop] = {
            "min_s": min(seconds),
            "median_s": statistics.median(seconds),
            "mean_length": statistics.mean(r["mean_length"] for r in results),
            "steps": statistics.mean(r["steps"] for r in results),
        }
    if {"gspo", "generate"} <= summary.keys():
        summary["speedup_median"] = summary["generate"]["median_s"] / summary["gspo"]["median_s"]
    record = {
        "date": _dt.date.today().isoformat(),
        "device": args.device,
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "args": vars(args),
        "decode_kernel_built": kernel_built,
        "runs": runs,
        "summary": summary,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record, indent=1))
    print(render_table(record))
    print(f"[decoding] wrote {args.out}")


def render_table(record: dict) -> str:
    s = record["summary"]
    lines = [
        "| loop | rollout (s), min | median | mean completion (tokens) | decoding steps |",
        "|---|---|---|---|---|",
    ]
    for loop in record["runs"]:
        lines.append(
            f"| {loop} | {s[loop]['min_s']:.2f} | {s[loop]['median_s']:.2f} | {s[loop]['mean_length']:.1f} | "
            f"{s[loop]['steps']:.1f} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()

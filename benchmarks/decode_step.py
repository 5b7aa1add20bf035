#!/usr/bin/env python
"""One decoding step's time by rows and context length, in four forms: `F.linear` with transformers' SDPA attention,
`cpu.linear`'s measured linear forms, those with `cpu.attention`'s packed query heads (transformers' forward, as the
loop ran every step before 2026-11-26), and that computation in `cpu.forward`'s step (the loop's now): the levers of
`gspo_trl.rollout.decoding.cpu.CPUKernels`, switched on one after the other.

A step is one forward of one new token per row over a KV cache of `--contexts` positions (random keys and values,
held at that length), as the decoding loop runs it: SmolLM2-135M-Instruct fp32 on
CPU, the loop's growing KV buffers, `logits_to_keep=1`. For each (rows, context) the four forms run one after the
other, the median of `--repeats` steps each after two untimed ones, in one process:

    python benchmarks/decode_step.py                                  # rows 1,2,4,8,16 x contexts 128,2048
    python benchmarks/decode_step.py --rows 1,2,3,4 --contexts 1024,4000
    python benchmarks/decode_step.py --rows 4,16,64 --contexts 128 --unpacked   # cpu.linear without packed weights
    python benchmarks/decode_step.py --no_compiled   # without the compiled kernels (SDPA, no compiled products)

Prints a table and writes `--out` (JSON). The choices `cpu.linear` measured for the model are recorded too. The
last two forms attend through `cpu.kernel`'s compiled loop where it was timed faster than SDPA, unless
`--no_compiled` (the record says which).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as _dt
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,2,4,8,16")
    parser.add_argument("--contexts", default="128,2048")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--model", default=None, help="default: the cached SmolLM2-135M-Instruct")
    parser.add_argument(
        "--unpacked",
        action="store_true",
        help="cpu.linear's F.linear and transposed forms only, without packed weights",
    )
    parser.add_argument("--no_compiled", action="store_true", help="without the compiled kernels (cpu.kernel)")
    parser.add_argument("--out", default=str(HERE / "results" / "decode_step.json"))
    return parser.parse_args(argv)


def filled_cache(model, rows: int, context: int):
    """A KV cache of `context` positions per row, random keys and values (a step's cost does not depend on them), in
    the decoding loop's growing buffers."""
    from transformers import DynamicCache

    from gspo_trl.rollout.decoding.dynamic import preallocate

    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    cache = DynamicCache(config=config)
    for layer in range(config.num_hidden_layers):
        keys = torch.randn(rows, config.num_key_value_heads, context, head_dim)
        cache.update(keys, torch.randn_like(keys), layer)
    preallocate(cache, context + 1)
    return cache


@torch.no_grad()
def step_ms(model, cache, rows: int, context: int, repeats: int, step_forward=None) -> float:
    """The median milliseconds of `model`'s forward, or of `step_forward` (a `cpu.forward.StepForward`)."""
    from gspo_trl.rollout.decoding.kv_cache import cache_kwargs

    vocab = model.config.vocab_size
    token, mask = torch.randint(0, vocab, (rows, 1)), torch.ones(rows, context + 1, dtype=torch.long)
    positions = torch.full((rows, 1), context)
    times = []
    for _ in range(repeats + 2):
        start = time.perf_counter()
        if step_forward is None:
            model(
                input_ids=token,
                attention_mask=mask,
                position_ids=positions,
                **cache_kwargs(model, cache),
                use_cache=True,
                logits_to_keep=1,
            )
        else:
            step_forward(token, mask, positions, cache)
        times.append(time.perf_counter() - start)
        for layer in cache.layers:  # back to `context` positions: the next step writes the same slot
            layer._expose(context)
    return 1e3 * statistics.median(times[2:])


def main(argv=None) -> None:
    args = parse_args(argv)
    from distributed import cpu_model  # benchmarks/, on the path when this script runs
    from transformers import AutoModelForCausalLM

    from gspo_trl.demo.default_model import default_model_path
    from gspo_trl.rollout.decoding import cpu
    from gspo_trl.rollout.decoding.cpu import kernel, linear

    model = AutoModelForCausalLM.from_pretrained(args.model or default_model_path(), dtype=torch.float32).eval()
    kernels = cpu.CPUKernels(packing=not args.unpacked, compiled=not args.no_compiled)
    linears_only = dataclasses.replace(kernels, packed_attention=False, step_forward=False)
    results = []
    for context in (int(c) for c in args.contexts.split(",")):
        for rows in (int(r) for r in args.rows.split(",")):
            cache = filled_cache(model, rows, context)
            plain = step_ms(model, cache, rows, context, args.repeats)
            with torch.no_grad(), cpu.accelerate(model, linears_only):
                fast = step_ms(model, cache, rows, context, args.repeats)
            with torch.no_grad(), cpu.accelerate(model, kernels) as step_forward:
                packed = step_ms(model, cache, rows, context, args.repeats)
                own = None if step_forward is None else step_ms(model, cache, rows, context, args.repeats, step_forward)
            results.append(
                {
                    "rows": rows,
                    "context": context,
                    "plain_ms": plain,
                    "decode_linear_ms": fast,
                    "packed_gqa_ms": packed,
                    "step_forward_ms": own,
                }
            )
            print(
                f"[decode_step] rows {rows} context {context}: F.linear {plain:.1f} ms, cpu.linear {fast:.1f} ms, "
                f"with packed GQA heads {packed:.1f} ms, cpu.forward's step "
                + ("(does not apply)" if own is None else f"{own:.1f} ms"),
                flush=True,
            )
    choices = {
        f"{out}x{inp}": linear.describe_forms(by_rows)
        for (out, inp), by_rows in next(iter(linear._choices.values()), {}).items()
    }
    record = {
        "date": _dt.date.today().isoformat(),
        "cpus": os.cpu_count(),
        "processor": cpu_model(),
        "decode_kernel": not args.no_compiled and kernel.available(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "args": vars(args),
        "decode_linear_forms_by_shape": choices,
        "steps": results,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record, indent=1))
    print(render_table(record))
    print(f"[decode_step] wrote {args.out}")


def render_table(record: dict) -> str:
    lines = [
        "| rows | context | `F.linear` (ms) | `decode_linear` (ms) | ratio | + packed GQA heads (ms) | ratio "
        "| `decode_forward` (ms) | ratio |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for step in record["steps"]:
        plain, fast = step["plain_ms"], step["decode_linear_ms"]
        packed = step.get("packed_gqa_ms")  # absent from records made before decode_attention
        own = step.get("step_forward_ms")  # absent before decode_forward, None where it does not apply
        lines.append(
            f"| {step['rows']} | {step['context']} | {plain:.1f} | {fast:.1f} | {fast / plain:.2f} | "
            + ("– | – |" if packed is None else f"{packed:.1f} | {packed / plain:.2f} |")
            + (" – | – |" if own is None else f" {own:.1f} | {own / plain:.2f} |")
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()

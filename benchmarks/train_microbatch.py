#!/usr/bin/env python
"""Time of one training micro-batch of the step-time benchmark's shape: forward + backward of
`completion_logprobs` (the training loss's forward) on SmolLM2-135M (CPU), under several settings in turn.

    python benchmarks/train_microbatch.py                       # the four settings below, 5 rounds
    PYTHONPATH=/path/to/older/checkout python benchmarks/train_microbatch.py --settings default --out /tmp/before.json

The micro-batch is 2 prompts of 44 tokens × 8 completions whose inputs are 5–64 tokens long (seeded; random token
ids, the cost does not depend on their values), packed as the trainer packs it on CPU. Settings, each run once per
round, rounds alternating so that drift on the machine spreads over all of them:

    default    the code's defaults
    recompute  `kept_logits_mb=0`: every LM-head chunk checkpointed and projected again in the backward pass
    one_row    the packing planner's attention cost set to 0, so the micro-batch takes one packed row
    one_row_recompute  both (the layout and head of the code before 2026-11-26)

Settings a checkout does not know (an older one without `kept_logits_mb`) are skipped. Prints the median seconds
per setting and the packed layout; writes every time to `--out`.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import inspect
import json
import platform
import statistics
import time

SETTINGS = ("default", "recompute", "one_row", "one_row_recompute")
GROUPS, GROUP_SIZE, PROMPT_TOKENS, MAX_COMPLETION = 2, 8, 44, 64


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--settings", nargs="+", choices=SETTINGS, default=list(SETTINGS))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--model", default=None, help="default: the cached SmolLM2-135M-Instruct")
    parser.add_argument("--out", default=None, help="JSON file for every time (default: none)")
    args = parser.parse_args(argv)

    import torch
    from transformers import AutoModelForCausalLM

    import gspo_trl.training.logprobs as logprobs
    from gspo_trl.demo.default_model import default_model_path
    from gspo_trl.models import packing
    from gspo_trl.training.cpu_memory import pool_freed_memory

    pool_freed_memory()  # as the trainer does on CPU
    model = AutoModelForCausalLM.from_pretrained(args.model or default_model_path(), attn_implementation="sdpa")
    model.train()
    generator = torch.Generator().manual_seed(0)
    rows = GROUPS * GROUP_SIZE
    vocab = model.config.vocab_size
    prompts = torch.randint(5, vocab, (GROUPS, PROMPT_TOKENS), generator=generator).repeat_interleave(GROUP_SIZE, 0)
    completions = torch.randint(5, vocab, (rows, MAX_COMPLETION), generator=generator)
    lengths = torch.randint(5, MAX_COMPLETION + 1, (rows,), generator=generator)
    completion_mask = (torch.arange(MAX_COMPLETION)[None] < lengths[:, None]).long()
    input_ids = torch.cat([prompts, completions], 1)
    attention_mask = torch.cat([torch.ones_like(prompts), completion_mask], 1)
    knows_kept = "kept_logits_mb" in inspect.signature(logprobs.completion_logprobs).parameters
    settings = [s for s in args.settings if knows_kept or "recompute" not in s]
    pair_cost = logprobs.relative_attention_cost

    def layout(one_row: bool):
        cost = 0.0 if one_row else pair_cost(model.config)
        packed = packing.pack_shared_prefix(
            prompts, torch.ones_like(prompts), completions, completion_mask, attention_pair_cost=cost
        )
        return list(packed.input_ids.shape), packed.num_real_tokens

    def run(setting: str) -> float:
        kwargs = {"kept_logits_mb": 0} if "recompute" in setting else {}
        logprobs.relative_attention_cost = (lambda config: 0.0) if setting.startswith("one_row") else pair_cost
        model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        scores = logprobs.completion_logprobs(
            model, input_ids, attention_mask, completions, completion_mask, padding_free=True, **kwargs
        )
        scores.logps.sum().backward()
        return time.perf_counter() - start

    for setting in settings:  # warm-up
        run(setting)
    times = {setting: [] for setting in settings}
    for _ in range(args.rounds):
        for setting in settings:
            times[setting].append(run(setting))
    logprobs.relative_attention_cost = pair_cost

    layouts = {"planner": layout(False), "one_row": layout(True)}
    print(
        f"micro-batch: {rows} completions, {int(lengths.sum())} completion tokens; packed rows x positions, real "
        f"tokens: planner {layouts['planner']}, one row {layouts['one_row']}"
    )
    for setting in settings:
        values = times[setting]
        print(f"{setting:18s} median {statistics.median(values):.3f} s  (min {min(values):.3f}, max {max(values):.3f})")
    if args.out:
        record = {
            "benchmark": "train_microbatch",
            "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "machine": {
                "cpu_model": platform.processor() or platform.machine(),
                "threads": torch.get_num_threads(),
                "torch": torch.__version__,
            },
            "knows_kept_logits_mb": knows_kept,
            "layouts": layouts,
            "times_s": times,
            "median_s": {setting: statistics.median(values) for setting, values in times.items()},
        }
        with open(args.out, "w") as handle:
            json.dump(record, handle, indent=1)


if __name__ == "__main__":
    main()

#!/usr/bin/env python
"""Memory and time of one training micro-batch of mixed completion lengths, packed: forward + backward of
`completion_logprobs` (the training loss's forward), repeated in one process, on SmolLM2-135M (CPU).

    python benchmarks/packed_microbatch.py                                     # 2 x 4096 + 14 x 150 tokens
    python benchmarks/packed_microbatch.py --lengths 2048,2048 --short 14 --passes 4 --no_checkpointing
    python benchmarks/packed_microbatch.py --one_forward      # as before packing.plan_forwards: one forward

The default micro-batch is the shape of one 16-completion micro-batch of the 4096-token scaling run: a few
completions that ran to the limit beside many short ones, after one 60-token prompt (random token ids: the cost
does not depend on their values). Prints, per pass, the seconds and the resident size after the forward and after
the backward (current and peak, MiB), and the packed layout (rows x positions, real tokens).
"""

from __future__ import annotations

import argparse
import json
import resource
import time

PROMPT_TOKENS = 60


def resident_mib() -> int:
    with open("/proc/self/status") as status:
        return int(next(line for line in status if line.startswith("VmRSS")).split()[1]) // 1024


def peak_mib() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", default="4096,4096", help="comma-separated lengths of the long completions")
    parser.add_argument("--short", type=int, default=14, help="how many short completions")
    parser.add_argument("--short_length", type=int, default=150)
    parser.add_argument("--passes", type=int, default=2)
    parser.add_argument("--no_checkpointing", action="store_true")
    parser.add_argument("--no_pool", action="store_true", help="skip gspo_trl.training.cpu_memory.pool_freed_memory()")
    parser.add_argument(
        "--one_forward",
        action="store_true",
        help="pack the whole micro-batch into one forward "
        "(the layout before packing.plan_forwards cut long and short completions apart)",
    )
    parser.add_argument("--model", default=None, help="default: the cached SmolLM2-135M-Instruct")
    args = parser.parse_args(argv)

    import torch
    from transformers import AutoModelForCausalLM

    import gspo_trl.training.logprobs
    from gspo_trl.demo.default_model import default_model_path
    from gspo_trl.models.packing import pack_shared_prefix, relative_attention_cost
    from gspo_trl.training.cpu_memory import pool_freed_memory
    from gspo_trl.training.logprobs import completion_logprobs

    if args.one_forward:
        gspo_trl.training.logprobs.plan_forwards = lambda prompt_ids, *rest, **kwargs: [
            torch.arange(prompt_ids.shape[0])
        ]

    if not args.no_pool:
        pool_freed_memory()  # as the trainer does on CPU
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(args.model or default_model_path(), attn_implementation="sdpa")
    if not args.no_checkpointing:
        model.activation_checkpointing_enable()
    model.config.use_cache = False
    model.train()
    lengths = [int(x) for x in args.lengths.split(",")] + [args.short_length] * args.short
    vocab, width = model.config.vocab_size, max(lengths)
    prompt = torch.randint(100, vocab, (1, PROMPT_TOKENS)).repeat(len(lengths), 1)
    completions = torch.randint(100, vocab, (len(lengths), width))
    completion_mask = (torch.arange(width) < torch.tensor(lengths).unsqueeze(1)).long()
    input_ids = torch.cat([prompt, completions], dim=1)
    attention_mask = torch.cat([torch.ones_like(prompt), completion_mask], dim=1)
    pair_cost = relative_attention_cost(model.config)
    forwards = gspo_trl.training.logprobs.plan_forwards(
        prompt, torch.ones_like(prompt), completions, completion_mask, attention_pair_cost=pair_cost
    )
    layout = []  # the first level of the plan (completion_logprobs plans each side again)
    for rows in forwards:
        packed = pack_shared_prefix(
            prompt[rows],
            torch.ones_like(prompt[rows]),
            completions[rows],
            completion_mask[rows],
            attention_pair_cost=pair_cost,
        )
        layout.append(
            {
                "completions": len(rows),
                "rows": packed.input_ids.shape[0],
                "positions_per_row": packed.input_ids.shape[1],
                "real_tokens": packed.num_real_tokens,
                "dense_mask": packed.attention_mask is not None,
            }
        )
    print(
        json.dumps(
            {"lengths": lengths, "checkpointing": not args.no_checkpointing, "pool": not args.no_pool, "layout": layout}
        ),
        flush=True,
    )
    for number in range(args.passes):
        model.zero_grad(set_to_none=False)
        start = time.perf_counter()
        scores = completion_logprobs(model, input_ids, attention_mask, completions, completion_mask, padding_free=True)
        after_forward = {"resident_mib": resident_mib(), "peak_mib": peak_mib()}
        scores.logps.sum().backward()
        del scores
        print(
            json.dumps(
                {
                    "pass": number,
                    "seconds": round(time.perf_counter() - start, 1),
                    "after_forward": after_forward,
                    "after_backward": {"resident_mib": resident_mib(), "peak_mib": peak_mib()},
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()

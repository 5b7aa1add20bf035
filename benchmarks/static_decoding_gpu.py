#!/usr/bin/env python
"""CUDA-graph decoding on a GPU: does it sample what the eager loops sample, and how fast is a decoding step.

1. Agreement, on a random-init SmolLM2-135M architecture with per-row keyed uniforms and 1,000 stop tokens that make
   rows end at different steps (so windows grow and the batch is compacted): the graph-replayed static loop
   against the same static loop run eagerly (must be token-identical: the same kernels) and against
   `dynamic.sample` (the dynamic loop; identical in fp32 up to summation order), in fp32, in bf16 weights, and
   in fp32 weights under bf16 autocast (accelerate's mixed-precision recipe).
2. Time per decoding step for 64 rows on a random-init SmolLM2-1.7B architecture in bf16 (no EOS: every row
   runs all steps): transformers' `generate`, `dynamic.sample`, and the static loop with graphs.

    python benchmarks/static_decoding_gpu.py --tokenizer .bench/smollm2-tokenizer --out $OUT/static.json
    python benchmarks/static_decoding_gpu.py --device cpu --smoke      # CPU, seconds: it runs (no graphs there)
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from architectures import build_random_model, smollm2_tokenizer_dir  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, LogitsProcessorList  # noqa: E402

from gspo_trl.rollout import keyed_uniform, stream_keys  # noqa: E402
from gspo_trl.rollout.decoding import dynamic, static
from gspo_trl.rollout.decoding.prefix_sharing import prefill  # noqa: E402


def prompts(tokenizer, rows: int, device):
    texts = [f"What is {i % 7} + {3 * (i % 5)}? Explain step by step." for i in range(rows)]
    chats = [
        tokenizer.apply_chat_template([{"role": "user", "content": t}], tokenize=False, add_generation_prompt=True)
        for t in texts
    ]
    encoded = tokenizer(chats, return_tensors="pt", padding=True, padding_side="left")
    return encoded.input_ids.to(device), encoded.attention_mask.to(device)


def max_abs_diff(a: torch.Tensor | None, b: torch.Tensor | None) -> float | None:
    if a is None or b is None or a.shape != b.shape:
        return None
    return float((a - b).abs().max())


def agreement(model_dir, tokenizer, device, new_tokens: int, rows: int = 32) -> dict:
    ids, mask = prompts(tokenizer, rows, device)
    keys = stream_keys(7, torch.arange(ids.shape[0], device=device))
    # A random model's next token is close to uniform over the vocabulary: with 1,000 token ids that end a row,
    # about 2% of the rows end at each step, so rows end at many different steps.
    stops = [tokenizer.eos_token_id, *range(1000, 2000)]
    processors = dynamic.logits_processors(
        GenerationConfig(do_sample=True, temperature=0.9, top_p=0.95, repetition_penalty=1.1)
    )
    kwargs = dict(
        max_new_tokens=new_tokens,
        eos_token_ids=stops,
        pad_token_id=tokenizer.pad_token_id,
        processors=processors,
        uniforms=lambda rows, t: keyed_uniform(keys[rows], t, 1).squeeze(1),
        logp_temperature=0.9,  # record each token's log-prob and the mass top-p kept (truncation-aware)
    )
    results = {}
    for name, dtype, autocast in [
        ("fp32", torch.float32, False),
        ("bf16 weights", torch.bfloat16, False),
        ("fp32 weights, bf16 autocast", torch.float32, True),
    ]:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
        with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            graphed_out = static.sample(
                model, ids, mask, graphs=device.type == "cuda", window_block=64, check_every=4, **kwargs
            )
            eager_out = static.sample(model, ids, mask, graphs=False, window_block=64, check_every=4, **kwargs)
            dynamic_out = dynamic.sample(model, ids, mask, **kwargs)
        graphed, eager, from_dynamic = graphed_out.completion_ids, eager_out.completion_ids, dynamic_out.completion_ids
        ended = torch.isin(graphed, torch.tensor(stops, device=device))
        lengths = torch.where(ended.any(1), ended.float().argmax(1) + 1, graphed.shape[1])
        results[name] = {
            "graphs_equal_eager_static": bool(torch.equal(graphed, eager)),
            "token_agreement_with_dynamic": float((graphed == from_dynamic).float().mean())
            if graphed.shape == from_dynamic.shape
            else None,
            "shapes": [list(graphed.shape), list(from_dynamic.shape)],
            # The same kernels on the same tokens: the recorded log-probs and kept masses are equal too.
            "logps_max_abs_diff_graphs_vs_eager": max_abs_diff(graphed_out.logps, eager_out.logps),
            "kept_log_mass_max_abs_diff_graphs_vs_eager": max_abs_diff(
                graphed_out.kept_log_mass, eager_out.kept_log_mass
            ),
            "mean_kept_log_mass": None
            if graphed_out.kept_log_mass is None
            else float(graphed_out.kept_log_mass[graphed != tokenizer.pad_token_id].mean()),
            "rows_that_ended": int(ended.any(1).sum()),
            "distinct_lengths": len(set(lengths.tolist())),
        }
        print(name, results[name], flush=True)
    return results


def timing(model_dir, tokenizer, device, rows: int, new_tokens: int) -> dict:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).to(device).eval()
    ids, mask = prompts(tokenizer, rows, device)
    no_eos = [-1]  # random weights; and no row may stop, so every method does the same number of steps
    kwargs = dict(
        max_new_tokens=new_tokens,
        eos_token_ids=no_eos,
        pad_token_id=tokenizer.pad_token_id,
        processors=LogitsProcessorList(),
    )

    def clock(fn):
        fn()  # warm-up (captures graphs, loads kernels)
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        return (time.perf_counter() - start) / new_tokens * 1000

    config = GenerationConfig(
        do_sample=True,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    with torch.no_grad():
        out = {
            "generate_ms_per_step": clock(
                lambda: model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
            ),
            "dynamic_loop_ms_per_step": clock(
                lambda: dynamic.sample(model, ids, mask, cache=prefill(model, ids, mask), **kwargs)
            ),
            "static_graphs_ms_per_step": clock(
                lambda: static.sample(model, ids, mask, graphs=device.type == "cuda", **kwargs)
            ),
        }
    out.update(rows=rows, new_tokens=new_tokens, prompt_length=ids.shape[1])
    print(out, flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--tokenizer",
        default=None,
        help="SmolLM2 tokenizer directory (default: taken from the demo model, cached in a temp dir)",
    )
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--timing_architecture", default="smollm2-1.7b")
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--new_tokens", type=int, default=256)
    parser.add_argument("--agreement_tokens", type=int, default=96)
    parser.add_argument("--skip_timing", action="store_true")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="tiny architecture, 4 rows, 8 tokens, no timing: checks that the script runs",
    )
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    device = torch.device(args.device)
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer_dir = args.tokenizer or smollm2_tokenizer_dir(Path(tmp))
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
        small = build_random_model("tiny" if args.smoke else "smollm2-135m", tokenizer_dir, Path(tmp) / "small")
        result = {
            "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
            "torch": torch.__version__,
            "agreement": agreement(
                small, tokenizer, device, 8 if args.smoke else args.agreement_tokens, rows=4 if args.smoke else 32
            ),
        }
        if not (args.skip_timing or args.smoke):
            big = build_random_model(args.timing_architecture, tokenizer_dir, Path(tmp) / "big")
            result["timing"] = {
                "architecture": args.timing_architecture,
                **timing(big, tokenizer, device, args.rows, args.new_tokens),
            }
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()

#!/usr/bin/env python
"""Do liger-kernel's layer kernels (`use_liger_kernel=True`) change gspo-trl's log-probs? (GPU)

`GSPOConfig(use_liger_kernel=True)` makes `Trainer` patch the model with liger's RMSNorm, SwiGLU and
RoPE kernels (`transformers.integrations.liger.apply_liger_kernel`, the call Trainer makes). This
script scores the same completions with `logprobs.completion_logprobs` on a random-init SmolLM2-135M
architecture in bf16, before and after the patch, and compares the per-token log-probs and the
gradient. For scale it also reports how far bf16 itself is from an fp32 copy of the same model.

    python benchmarks/liger_agreement_gpu.py --tokenizer .bench/smollm2-tokenizer --out $OUT/liger_agreement.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

sys.path.insert(0, str(Path(__file__).resolve().parent))

from architectures import build_random_model  # noqa: E402

from gspo_trl.training.logprobs import completion_logprobs  # noqa: E402


def score(model, batch, padding_free: bool):
    model.zero_grad(set_to_none=True)
    scores = completion_logprobs(model, *batch, padding_free=padding_free)
    mask = batch[3].bool()
    (scores.logps[mask].sum() / mask.sum()).backward()
    grad = torch.cat([p.grad.float().flatten() for p in model.parameters() if p.grad is not None])
    return scores.logps.detach().float()[mask], grad


def compare(a, b):
    (logps_a, grad_a), (logps_b, grad_b) = a, b
    return {
        "logps_max_abs_diff": float((logps_a - logps_b).abs().max()),
        "logps_mean_abs_diff": float((logps_a - logps_b).abs().mean()),
        "grad_rel_norm_diff": float((grad_a - grad_b).norm() / grad_a.norm()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokenizer", required=True)
    parser.add_argument("--architecture", default="smollm2-135m")
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--completion", type=int, default=256)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM
    from transformers.integrations.liger import apply_liger_kernel

    with tempfile.TemporaryDirectory() as scratch:
        path = build_random_model(args.architecture, args.tokenizer, Path(scratch) / "model")
        fp32 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(DEVICE)
        bf16 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(DEVICE)
    generator = torch.Generator().manual_seed(0)
    vocab = bf16.config.vocab_size
    prompt = torch.randint(3, vocab, (args.rows, args.prompt), generator=generator)
    prompt[:, : args.prompt // 4] = 0  # left padding
    prompt_mask = (torch.arange(args.prompt) >= args.prompt // 4).long().expand(args.rows, -1)
    completion = torch.randint(3, vocab, (args.rows, args.completion), generator=generator)
    lengths = torch.randint(args.completion // 4, args.completion + 1, (args.rows,), generator=generator)
    completion_mask = (torch.arange(args.completion) < lengths[:, None]).long()
    batch = tuple(
        t.to(DEVICE)
        for t in (
            torch.cat([prompt, completion], 1),
            torch.cat([prompt_mask, completion_mask], 1),
            completion,
            completion_mask,
        )
    )

    results = {
        "device": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu",
        "torch": torch.__version__,
        "shape": vars(args),
    }
    before = {}
    for padding_free in (False, True):
        fp32_scores = score(fp32, batch, padding_free)
        before[padding_free] = score(bf16, batch, padding_free)
        results[f"padding_free={padding_free}"] = {"bf16_vs_fp32": compare(fp32_scores, before[padding_free])}
    apply_liger_kernel(bf16, None)  # what Trainer does with use_liger_kernel=True and no liger_kernel_config
    results["patched_mlp"] = (
        type(bf16.model.layers[0].mlp).__name__ + "." + bf16.model.layers[0].mlp.forward.__qualname__
    )
    results["patched_norm"] = bf16.model.norm.forward.__qualname__
    for padding_free in (False, True):
        plain = results[f"padding_free={padding_free}"]
        fp32_scores = score(fp32, batch, padding_free)
        liger = score(bf16, batch, padding_free)
        plain["liger_bf16_vs_fp32"] = compare(fp32_scores, liger)
        plain["liger_bf16_vs_bf16"] = compare(before[padding_free], liger)
    text = json.dumps(results, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()

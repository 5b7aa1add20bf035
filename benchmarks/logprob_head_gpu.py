#!/usr/bin/env python
"""Our chunked log-prob head + GSPO loss against liger-kernel's fused linear GRPO loss (GPU).

Issue 16 asks which LM-head path to keep on a GPU. Both take the final hidden states of a training
micro-batch (bf16), project the completion positions through the LM head and return the sequence-level
GSPO loss; the timer covers forward and backward (gradients for the hidden states and the head). Ours is
`logprobs._chunk_logps_and_entropy` over chunks of `--chunk` tokens, each checkpointed as in training
(it also computes the token entropy, which the trainer logs), then `loss.policy_loss`; liger's is
`LigerFusedLinearGRPOLoss(importance_sampling_level="sequence", loss_type="grpo")`. Same inputs, same
π_old; the losses and the gradients are compared too. Needs liger-kernel (and triton), so a GPU.

    python benchmarks/logprob_head_gpu.py --out $OUT/logprob_head.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from torch.utils.checkpoint import checkpoint

from gspo_trl.objective.loss import policy_loss
from gspo_trl.training.logprobs import _chunk_logps_and_entropy


def ours_loss(hidden, head, labels, old, advantages, mask, chunk, epsilon, epsilon_high):
    rows, length, width = hidden.shape
    flat, flat_labels = hidden.reshape(-1, width), labels.reshape(-1)
    logps, entropy = [], []
    for start in range(0, flat.shape[0], chunk):
        lp, ent = checkpoint(
            _chunk_logps_and_entropy,
            flat[start : start + chunk],
            head,
            flat_labels[start : start + chunk],
            1.0,
            1.0,
            None,
            False,
            use_reentrant=False,
        )
        logps.append(lp)
        entropy.append(ent)
    per_token = torch.cat(logps).view(rows, length)
    loss, _ = policy_loss(
        per_token,
        old,
        advantages,
        mask,
        loss_type="grpo",
        importance_sampling_level="sequence",
        epsilon=epsilon,
        epsilon_high=epsilon_high,
    )
    return loss


def liger_loss_fn(epsilon, epsilon_high, chunk_size):
    from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

    fused = LigerFusedLinearGRPOLoss(
        beta=0.0,
        use_ref_model=False,
        loss_type="grpo",
        epsilon_low=epsilon,
        epsilon_high=epsilon_high,
        importance_sampling_level="sequence",
        temperature=1.0,
        chunk_size=chunk_size,
    )

    def run(hidden, head, labels, old, advantages, mask):
        out = fused(hidden, head.weight, labels, mask, advantages, old_per_token_logps=old)
        return out[0] if isinstance(out, tuple) else out

    return run


def measure(fn, inputs, repeats: int, warmup: int):
    hidden, head = inputs[0], inputs[1]
    times = []
    for index in range(warmup + repeats):
        hidden.grad = None
        head.weight.grad = None
        torch.cuda.synchronize()
        if index == warmup:
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        start = time.perf_counter()
        loss = fn(*inputs)
        loss.backward()
        torch.cuda.synchronize()
        if index >= warmup:
            times.append(time.perf_counter() - start)
    return {
        "median_ms": 1e3 * statistics.median(times),
        "min_ms": 1e3 * min(times),
        "peak_extra_gib": (torch.cuda.max_memory_allocated() - base) / 2**30,
        "loss": float(loss),
        "grad_hidden": hidden.grad.detach().clone(),
        "grad_head": head.weight.grad.detach().clone(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--length", type=int, default=1024)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--chunk", type=int, default=1024, help="Our logprob_chunk_size (tokens).")
    parser.add_argument("--liger_chunk_size", type=int, default=1, help="Liger's chunk_size (rows).")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    torch.manual_seed(0)
    device, dtype = "cuda", torch.bfloat16
    head = torch.nn.Linear(args.hidden, args.vocab, bias=False, device=device, dtype=dtype)
    hidden = torch.randn(args.rows, args.length, args.hidden, device=device, dtype=dtype, requires_grad=True)
    labels = torch.randint(0, args.vocab, (args.rows, args.length), device=device)
    mask = torch.ones(args.rows, args.length, device=device)
    with torch.no_grad():
        old = torch.log_softmax((hidden @ head.weight.T).float(), -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
        old = old + 1e-4 * torch.randn_like(old)  # ratios near 1, a few clipped
    advantages = torch.randn(args.rows, device=device)
    inputs = (hidden, head, labels, old, advantages, mask)
    epsilon, epsilon_high = 3e-4, 4e-4

    results = {"shape": vars(args), "device": torch.cuda.get_device_name(), "torch": torch.__version__}
    ours = measure(lambda *x: ours_loss(*x, args.chunk, epsilon, epsilon_high), inputs, args.repeats, args.warmup)
    try:
        import liger_kernel

        results["liger_kernel"] = liger_kernel.__version__ if hasattr(liger_kernel, "__version__") else "?"
        liger = measure(liger_loss_fn(epsilon, epsilon_high, args.liger_chunk_size), inputs, args.repeats, args.warmup)
    except Exception as error:  # reported, not hidden: the comparison then has one side
        liger = {"error": f"{type(error).__name__}: {error}"}
    if "error" not in liger:
        for name in ("grad_hidden", "grad_head"):
            a, b = ours[name].float(), liger[name].float()
            results[f"{name}_max_abs_diff"] = float((a - b).abs().max())
            results[f"{name}_rel_norm_diff"] = float((a - b).norm() / a.norm().clamp_min(1e-30))
    for side in (ours, liger):
        side.pop("grad_hidden", None)
        side.pop("grad_head", None)
    results["ours"], results["liger"] = ours, liger
    text = json.dumps(results, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as handle:
            handle.write(text + "\n")


if __name__ == "__main__":
    main()

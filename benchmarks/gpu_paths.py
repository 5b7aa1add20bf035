#!/usr/bin/env python
"""The trainer's paths that only a CUDA device takes, run on tiny random models: does each one run and agree.

CI has no GPU, so these paths are checked here, on the GPU machine, when one is lent:

1. Mixture-of-Experts sampling on CUDA, for each MoE family of the tests: which decoding loop samples (the static
   loop with CUDA graphs, or the dynamic one), whether it records the experts (routing replay needs them), and with
   `routing_replay="rollout"` the largest difference between the loop's log-probs and a training forward that
   replays its routes (fp32).
2. `GSPOTrainer` on CUDA in bf16 (`bf16=True`), two optimizer steps each: a MoE model with and without
   `routing_replay="rollout"`; each vision-language family of the tests; a 4-bit (NF4, bitsandbytes CUDA kernels)
   base with a LoRA adapter. Each reports its losses and the metrics that say the path ran.

Nothing is asserted: the results (or the error each path raised) go to --out as JSON, so that one run reports every
path. The models, tokenizer and processors are the tests' own builders (tests/), built offline.

    python benchmarks/gpu_paths.py --out $OUT/gpu_paths.json      # on the GPU machine
    python benchmarks/gpu_paths.py --device cpu                    # CPU: every path runs (no CUDA graphs there)
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

from conftest import build_tiny_model  # noqa: E402
from helpers import count_digits, small_config, text_dataset  # noqa: E402
from test_architectures import PROMPTS, TEMPERATURE, build, tokenizer  # noqa: E402

from gspo_trl import GSPOTrainer  # noqa: E402
from gspo_trl.models.moe.replay import RoutingReplay  # noqa: E402
from gspo_trl.rollout import HFGenerateBackend, stream_keys  # noqa: E402
from gspo_trl.training.logprobs import completion_logprobs  # noqa: E402
from gspo_trl.training.micro_batch import MicroBatch  # noqa: E402

MOE_FAMILIES = ["qwen3_moe", "mixtral", "olmoe", "gpt_oss", "deepseek_v3"]


def guarded(name: str, results: dict, fn, *args) -> None:
    """Run one check; its result, or the error it raised, goes into `results[name]`."""
    print(f"--- {name}", flush=True)
    try:
        results[name] = fn(*args)
    except Exception as error:  # one path's failure must not hide the others'
        results[name] = {"error": f"{type(error).__name__}: {error}", "traceback": traceback.format_exc()[-3000:]}
    print(json.dumps(results[name], default=str)[:2000], flush=True)


def moe_sampling(family: str, device: str, tmp: Path) -> dict:
    model = build(family, None).to(device)
    out = {}
    for replay in ("none", "rollout"):
        args = small_config(
            tmp / f"{family}-{replay}",
            use_cpu=device == "cpu",
            routing_replay=replay,
            temperature=TEMPERATURE,
            max_completion_length=16,
            decode_logprobs_as_old=True,  # the loop records its log-probs whatever the precision it finds
        )
        backend = HFGenerateBackend(lambda: model, tokenizer(), args)
        rollout = backend.generate(PROMPTS, stream_keys(11, torch.arange(len(PROMPTS))))
        entry = {"decoding_loop": rollout.decoding_loop, "routes_recorded": rollout.sampling_routes is not None}
        entry["tf32_matmul"] = bool(torch.backends.cuda.matmul.allow_tf32)
        if rollout.sampling_logps is None:
            entry["sampling_logps"] = "not recorded"
        elif replay == "rollout" and rollout.sampling_routes is not None:
            fields = dict(
                **rollout.model_inputs(), sampling_logps=rollout.sampling_logps, sampling_routes=rollout.sampling_routes
            )
            batch = MicroBatch(**{name: value.to(device) for name, value in fields.items()}, sampled_by_policy=True)
            metrics = {}
            routing = RoutingReplay(replay, model).training(batch, metrics.__setitem__)
            with torch.no_grad():
                scores = completion_logprobs(model, *batch.model_inputs(), temperature=TEMPERATURE, routing=routing)
            logps = scores.logps
            mask = batch.completion_mask.bool()
            entry["max_abs_logp_difference_replayed"] = float((logps - batch.sampling_logps)[mask].abs().max())
            entry["metrics"] = {name: float(value) for name, value in metrics.items()}
        out[replay] = entry
    return out


def losses(trainer) -> dict:
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    keys = [key for key in logs[-1] if key.startswith(("moe/", "sampling/", "rollout/"))] if logs else []
    return {
        "losses": [entry["loss"] for entry in logs],
        "finite": bool(logs) and all(math.isfinite(entry["loss"]) for entry in logs),
        "last_metrics": {key: logs[-1][key] for key in keys},
        "peak_gpu_mem_mib": torch.cuda.max_memory_allocated() / 2**20 if torch.cuda.is_available() else None,
    }


def moe_trainer(family: str, replay: str, device: str, tmp: Path) -> dict:
    model = build(family, None)
    args = small_config(tmp / f"train-{family}-{replay}", use_cpu=device == "cpu", bf16=True, routing_replay=replay)
    trainer = GSPOTrainer(model, count_digits, args=args, train_dataset=text_dataset(), processing_class=tokenizer())
    trainer.train()
    return losses(trainer)


def vlm_trainer(family: str, device: str, tmp: Path) -> dict:
    from vlm_models import BUILDERS, image_dataset

    model, processor = BUILDERS[family]()
    args = small_config(
        tmp / f"vlm-{family}", use_cpu=device == "cpu", bf16=True, num_generations=2, steps_per_generation=2
    )
    trainer = GSPOTrainer(model, count_digits, args=args, train_dataset=image_dataset(4), processing_class=processor)
    trainer.train()
    return losses(trainer)


def qlora_trainer(device: str, tmp: Path) -> dict:
    from peft import LoraConfig
    from transformers import BitsAndBytesConfig

    model_dir = tmp / "tiny-llama"
    tok = tokenizer()
    build_tiny_model(tok).save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    nf4 = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16)
    args = small_config(tmp / "qlora", use_cpu=device == "cpu", bf16=True, beta=0.04)
    trainer = GSPOTrainer(
        str(model_dir),
        count_digits,
        args=args,
        train_dataset=text_dataset(),
        quantization_config=nf4,
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM"),
    )
    adapter = {name: p.detach().clone() for name, p in trainer.model.named_parameters() if "lora_" in name}
    trainer.train()
    moved = sum(not torch.equal(p, adapter[name]) for name, p in trainer.model.named_parameters() if name in adapter)
    kinds = sorted({type(m).__name__ for m in trainer.model.modules() if "4bit" in type(m).__name__})
    result = losses(trainer)
    result.update(adapter_tensors_moved=f"{moved}/{len(adapter)}", quantized_layer_types=kinds)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--out", default=None)
    parser.add_argument("--only", default=None, help="Comma-separated check-name prefixes to run.")
    args = parser.parse_args()
    results = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu", "torch": torch.__version__}
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 sampling: the loop records its log-probs (no TF32 products)
    checks = [(f"moe_sampling/{f}", moe_sampling, f) for f in MOE_FAMILIES]
    checks += [(f"moe_trainer/qwen3_moe/{r}", moe_trainer, "qwen3_moe", r) for r in ("none", "rollout")]
    from vlm_models import BUILDERS

    checks += [(f"vlm_trainer/{f}", vlm_trainer, f) for f in sorted(BUILDERS)]
    checks += [("qlora_trainer", qlora_trainer)]
    if args.only:
        checks = [check for check in checks if check[0].startswith(tuple(args.only.split(",")))]
    with tempfile.TemporaryDirectory() as tmp:
        for name, fn, *extra in checks:
            guarded(name, results, fn, *extra, args.device, Path(tmp))
            if args.out:  # after every check: a run cut short still reports what it did
                Path(args.out).write_text(json.dumps(results, indent=1, default=str))


if __name__ == "__main__":
    main()

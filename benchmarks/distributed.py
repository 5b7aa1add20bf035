#!/usr/bin/env python
"""Per-rank memory and step time of 1 vs 2 processes (DDP, DeepSpeed ZeRO-2, ZeRO-3, offload, FSDP2) on SmolLM2-135M.

Driver mode (the default) launches one `torchrun --standalone` run per (mode, processes) pair, one after the
other, and writes every rank's figures to `--out` with a table on stdout:

    python benchmarks/distributed.py                                   # ddp/zero2/zero3 × 1 and 2 processes
    python benchmarks/distributed.py --modes zero3 --processes 2       # one cell

Worker mode (`--worker MODE`, started by the driver under torchrun) trains the same GSPO run in every cell:
the same global batch (16 completions per optimizer step, groups of 8, 2 optimizer steps per rollout, 32 new
tokens, layout-independent sampling, so 1 and 2 processes sample and train the same completions), full
fine-tuning in fp32 with AdamW, `--rollouts` rollouts after one untimed warm-up rollout. Each rank reports:

- `peak_rss_mib`: the process's peak resident memory (`ru_maxrss`): the libraries, the Python heap, the
  model states and the activations of its share of the batch.
- `tensor_mib`: after training, the bytes of every live tensor storage in the process (parameters, gradients,
  optimizer states, DeepSpeed's flat buffers; each storage counted once): the model states this rank holds.
- `parameter_share`: the fraction of the model's parameter elements this rank holds (1 unless ZeRO-3 or FSDP2).
- `step_s`: the median wall time of the timed optimizer steps, a rollout's generation included in the first
  step that uses it (the mean over a rollout's steps is `round_s / steps`).

`fsdp2` is accelerate's FSDP2 (`fsdp="full_shard"`, version 2), which accelerate enables on GPUs only: the worker
lifts that gate as `tests/fsdp_on_cpu.py` does for the tests, and runs with 2 processes only (one process is not
a distributed launch there, so it would be plain training).

`zero2_offload` / `zero3_offload` add ZeRO-Offload (optimizer states, and under ZeRO-3 the parameters, in CPU
memory; accelerate then trains with DeepSpeedCPUAdam). `--device cuda` runs the GPU recipe (bf16 weights,
`bf16=True`) and records each rank's peak GPU memory (`torch.cuda.max_memory_allocated`) and what stays allocated
after training; with `--architecture` (and `--tokenizer`, as for step_time.py) the model is a random-init one of
SmolLM2's sizes on synthetic prompts, for a GPU machine without the demo's weights. The GPU row
(one process, ZeRO-3 with and without offload):

    python benchmarks/distributed.py --device cuda --architecture smollm2-1.7b --tokenizer .bench/smollm2-tokenizer \
        --modes zero3,zero3_offload --processes 1 --out benchmarks/results/distributed_gpu.json

Run with nothing else on the machine: the processes share its cores (`OMP_NUM_THREADS` = cores / processes).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import gc
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
# "auto" everywhere transformers fills a value (its recommended way): batch fields from GSPOConfig, bucket sizes
# from the hidden size (hidden² elements); DeepSpeed's own bucket default (5e8 elements) allocates 1.9 GiB per
# bucket on CPU, which `--deepspeed_defaults` measures instead.
AUTO_BATCH = {
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "train_batch_size": "auto",
    "gradient_clipping": "auto",
    "bf16": {"enabled": "auto"},
}  # from GSPOConfig's bf16: on with --device cuda, off on CPU
AUTO_BUCKETS = {
    "zero2": {"reduce_bucket_size": "auto"},
    "zero3": {
        "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto",
        "stage3_gather_16bit_weights_on_model_save": True,
    },
}


# ZeRO-Offload: optimizer states (and, under ZeRO-3, parameters) in CPU memory; accelerate swaps the trainer's AdamW
# for DeepSpeedCPUAdam. On a GPU it moves memory off the device; on CPU the memory stays where it was.
OFFLOAD = {"offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}


def deepspeed_config(mode: str, buckets: bool = True) -> dict | None:
    if not mode.startswith("zero"):
        return None
    stage, _, offload = mode.partition("_")
    zero = {"stage": int(stage[-1]), **(AUTO_BUCKETS[stage] if buckets else {})}
    if offload == "offload":
        zero.update(OFFLOAD if stage == "zero3" else {"offload_optimizer": OFFLOAD["offload_optimizer"]})
    return {"zero_optimization": zero, **AUTO_BATCH}


GLOBAL_BATCH, NUM_GENERATIONS, STEPS_PER_ROLLOUT = 16, 8, 2


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--modes",
        default="ddp,zero2,zero3",
        help="comma-separated, from ddp, zero2, zero3, zero2_offload, zero3_offload, fsdp2",
    )
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="cuda: the GPU recipe (bf16 weights, bf16=True); peak GPU memory per rank is recorded",
    )
    parser.add_argument(
        "--architecture",
        choices=("smollm2-135m", "smollm2-1.7b", "tiny"),
        default=None,
        help="a random-init model of these sizes (benchmarks/architectures.py) instead of --model",
    )
    parser.add_argument("--tokenizer", default=None, help="with --architecture: the SmolLM2 tokenizer directory")
    parser.add_argument("--processes", default="1,2", help="comma-separated process counts")
    parser.add_argument("--rollouts", type=int, default=2, help="timed rollouts after one warm-up rollout")
    parser.add_argument("--max_completion_length", type=int, default=32)
    parser.add_argument(
        "--deepspeed_defaults",
        action="store_true",
        help="leave DeepSpeed's bucket sizes at its own defaults instead of transformers' 'auto'",
    )
    parser.add_argument("--model", default=None, help="default: the cached SmolLM2-135M-Instruct")
    parser.add_argument("--out", default=str(HERE / "results" / "distributed.json"))
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--worker_out", default=None, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


# ----------------------------------------------------------------------------------------------- worker side


def live_tensor_storages() -> dict[int, int]:
    """Bytes of every live tensor storage in this process by address, each counted once (views share one)."""
    import torch

    seen = {}
    for obj in gc.get_objects():
        try:
            if isinstance(obj, torch.Tensor) and obj.device.type == "cpu":
                storage = obj.untyped_storage()
                seen[storage.data_ptr()] = storage.nbytes()
        except Exception:  # objects that look like tensors but cannot give a storage (meta, sparse, ...)
            continue
    return seen


def worker(args) -> None:
    import torch
    from transformers import TrainerCallback

    from gspo_trl import GSPOConfig, GSPOTrainer
    from gspo_trl.demo.default_model import default_model_path
    from gspo_trl.demo.tasks import default_task_dataset, default_task_reward

    processes = int(os.environ.get("WORLD_SIZE", "1"))
    mode = args.worker
    fsdp = {}
    if mode == "fsdp2":
        sys.path.insert(0, str(HERE.parent / "tests"))
        import fsdp_on_cpu  # noqa: F401  (accelerate's FSDP on a CPU launch, as on GPUs)

        fsdp = {"fsdp": "full_shard", "fsdp_config": {"version": 2}}
    step_ends = []

    class StepClock(TrainerCallback):
        def on_step_end(self, *unused, **kwargs):
            step_ends.append(time.perf_counter())

    total_steps = (args.rollouts + 1) * STEPS_PER_ROLLOUT
    gpu = args.device == "cuda"
    config = GSPOConfig(
        output_dir=f"{args.worker_out}.output",
        per_device_train_batch_size=GLOBAL_BATCH // processes,
        gradient_accumulation_steps=1,
        steps_per_generation=STEPS_PER_ROLLOUT,
        num_generations=NUM_GENERATIONS,
        max_completion_length=args.max_completion_length,
        max_steps=total_steps,
        learning_rate=1e-6,
        layout_independent_sampling=True,
        use_cpu=not gpu,
        bf16=gpu,
        model_init_kwargs={"dtype": "bfloat16" if gpu else "float32"},
        deepspeed=deepspeed_config(mode, not args.deepspeed_defaults),
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        seed=0,
        disable_tqdm=True,
        **fsdp,
    )
    model, dataset, reward = args.model or default_model_path(), default_task_dataset(64), default_task_reward()
    if args.architecture:  # the model the driver built; synthetic chat prompts, a length reward
        from architectures import length_reward, synthetic_prompts

        dataset, reward = synthetic_prompts(64), length_reward
    trainer = GSPOTrainer(model, reward, args=config, train_dataset=dataset, callbacks=[StepClock()])
    start = time.perf_counter()
    trainer.train()
    ends = [start] + step_ends
    step_times = [b - a for a, b in zip(ends, ends[1:])][STEPS_PER_ROLLOUT:]  # the warm-up rollout is untimed
    unwrapped = trainer.accelerator.unwrap_model(trainer.model)
    held = sum(
        (p.to_local() if hasattr(p, "to_local") else getattr(p, "ds_tensor", p)).numel() for p in unwrapped.parameters()
    )
    full = sum(getattr(p, "ds_numel", p.numel()) for p in unwrapped.parameters())
    gc.collect()
    storages = live_tensor_storages()
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    if gpu:  # the device's side: its peak over the run, and what stays allocated after training (model states)
        device_figures = {
            "peak_gpu_mib": torch.cuda.max_memory_allocated() / 2**20,
            "gpu_allocated_mib": torch.cuda.memory_allocated() / 2**20,
        }
    else:
        device_figures = {}
    result = {
        "mode": mode,
        "processes": processes,
        "rank": rank,
        "distributed_type": str(trainer.accelerator.distributed_type),
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "tensor_mib": sum(storages.values()) / 2**20,
        "largest_storages_mib": sorted((round(b / 2**20, 1) for b in storages.values()), reverse=True)[:12],
        "parameter_share": held / full,
        "step_s": statistics.median(step_times),
        "round_s": sum(step_times) / args.rollouts,
        "threads": torch.get_num_threads(),
        "reward": [e["reward"] for e in trainer.state.log_history if "reward" in e],
        **device_figures,
    }
    with open(f"{args.worker_out}.rank{rank}.json", "w", encoding="utf-8") as handle:
        json.dump(result, handle)


# ----------------------------------------------------------------------------------------------- driver side


def launch(args, mode: str, processes: int, folder: Path) -> list[dict]:
    out = folder / f"{mode}_{processes}"
    threads = max(1, (os.cpu_count() or 1) // processes)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        str(processes),
        str(Path(__file__).resolve()),
        "--worker",
        mode,
        "--worker_out",
        str(out),
        "--rollouts",
        str(args.rollouts),
        "--max_completion_length",
        str(args.max_completion_length),
        "--device",
        args.device,
    ]
    if args.model:
        command += ["--model", args.model]
    if args.architecture:
        command += ["--architecture", args.architecture]
    if args.deepspeed_defaults:
        command += ["--deepspeed_defaults"]
    print("[distributed] " + " ".join(command), flush=True)
    completed = subprocess.run(command, capture_output=True, text=True, env=env)
    if completed.returncode != 0:
        return [{"mode": mode, "processes": processes, "error": completed.stderr[-3000:]}]
    return [json.loads(Path(f"{out}.rank{rank}.json").read_text()) for rank in range(processes)]


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def load_rows(path: str | Path = HERE / "results" / "distributed.json") -> list[dict]:
    return json.loads(Path(path).read_text())["rows"]


def table(rows: list[dict]) -> str:
    gpu = any("peak_gpu_mib" in r for r in rows)
    lines = [
        "| mode | processes | rank | peak RSS (MiB) | live tensors (MiB) | parameter share | step (s) |"
        + (" peak GPU (MiB) | GPU after training (MiB) |" if gpu else ""),
        "|---|---|---|---|---|---|---|" + ("---|---|" if gpu else ""),
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['mode']} | {r['processes']} | — | failed | | | |" + (" | |" if gpu else ""))
            continue
        lines.append(
            f"| {r['mode']} | {r['processes']} | {r['rank']} | {r['peak_rss_mib']:.0f} | "
            f"{r['tensor_mib']:.0f} | {r['parameter_share']:.2f} | {r['step_s']:.2f} |"
            + (f" {r['peak_gpu_mib']:.0f} | {r['gpu_allocated_mib']:.0f} |" if gpu else "")
        )
    return "\n".join(lines)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return
    import tempfile

    from gspo_trl.demo.default_model import default_model_path

    rows = []
    with tempfile.TemporaryDirectory() as folder:
        if args.architecture:  # one random-init checkpoint for every cell
            from architectures import build_random_model, smollm2_tokenizer_dir

            tokenizer = args.tokenizer or smollm2_tokenizer_dir(HERE.parent / ".bench")
            args.model = build_random_model(args.architecture, tokenizer, Path(folder) / "model")
        args.model = args.model or default_model_path()  # build the cached checkpoint once, before any launch
        for mode in args.modes.split(","):
            for processes in (int(p) for p in args.processes.split(",")):
                if mode == "fsdp2" and processes == 1:
                    print("[distributed] fsdp2 runs with 2 or more processes only", flush=True)
                    continue
                rows += launch(args, mode, processes, Path(folder))
    import torch

    record = {
        "date": _dt.date.today().isoformat(),
        "machine": cpu_model(),
        "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None,
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "work": {
            "model": args.architecture and f"{args.architecture} (random init)" or args.model,
            "device": args.device,
            "global_batch": GLOBAL_BATCH,
            "num_generations": NUM_GENERATIONS,
            "steps_per_rollout": STEPS_PER_ROLLOUT,
            "max_completion_length": args.max_completion_length,
            "timed_rollouts": args.rollouts,
        },
        "deepspeed": {
            mode: deepspeed_config(mode, not args.deepspeed_defaults)
            for mode in args.modes.split(",")
            if mode.startswith("zero")
        },
        "rows": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record, indent=1))
    print(table(rows))
    print(f"[distributed] wrote {args.out}")


if __name__ == "__main__":
    main()

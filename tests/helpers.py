"""Toy rewards, prompts and a small-run config shared by the trainer tests and the torchrun workers
(importable as `helpers`: pytest and torchrun both put tests/ on sys.path)."""

from __future__ import annotations

import math
import os
import sys

import pytest
import torch
from datasets import Dataset

from gspo_trl import GSPOConfig


def count_digits(completions, **kwargs):
    """A dense toy reward: the fraction of characters that are digits."""
    texts = [c if isinstance(c, str) else c[0]["content"] for c in completions]
    return [sum(ch.isdigit() for ch in t) / max(len(t), 1) for t in texts]


def length_reward(completion_ids, **kwargs):
    return [len(ids) / 16 for ids in completion_ids]


EVAL_SCORES = {1: 0.25, 2: 0.75, 3: 0.5, 4: 0.125}  # evaluation reward after each step (exact in fp32): step 2 best


def scored_by_step(prompts, completions, trainer_state, **kwargs):
    """Training prompts: count_digits. Evaluation prompts ("Check ..."): EVAL_SCORES of the step just trained, so
    `load_best_model_at_end` (metric "reward") must end on step 2's weights."""
    if str(prompts[0]).startswith("Check"):
        return [EVAL_SCORES[trainer_state.global_step]] * len(completions)
    return count_digits(completions)


def text_dataset(n=8):
    return Dataset.from_dict(
        {"prompt": [f"What is {i} + {i + 1}?" for i in range(n)], "answer": [str(2 * i + 1) for i in range(n)]}
    )


def close(value, tolerance: float):
    """`pytest.approx` for a logged number of two runs that differ only in float rounding: within `tolerance` of
    max(1, |value|). Float32 rounding scales with a value's magnitude (an entropy near 6 carries 8x the rounding of
    one near 0.7), so values of order one or more are compared relatively; values near zero (a KL before the first
    update, a clip fraction) absolutely."""
    return pytest.approx(value, rel=tolerance, abs=tolerance)


def small_config(output_dir, **overrides) -> GSPOConfig:
    """A run of a few seconds on the tiny model: CPU, no saving, no logging backend, a log every step."""
    values = dict(
        output_dir=str(output_dir),
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=12,
        max_steps=2,
        learning_rate=1e-3,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        seed=0,
    )
    values.update(overrides)
    return GSPOConfig(**values)


def frequency_tolerance(probs: torch.Tensor, rows: int, failure_rate: float = 1e-4) -> torch.Tensor:
    """How far each outcome's frequency over `rows` independent draws may stray from its probability `probs` (a
    tensor) so that any of them strays further with probability at most `failure_rate`. Bernstein's inequality,
    P(|f - p| >= t) <= 2 exp(-rows t^2 / (2 p (1 - p) + 2 t / 3)), holds for every p (the normal approximation
    underrates the tails of rare outcomes); each of the k outcomes with p > 0 gets failure_rate / k (a union bound)."""
    outcomes = int((probs > 0).sum())
    log_term = math.log(2 * outcomes / failure_rate)
    variance = probs * (1 - probs)
    return (log_term / 3 + torch.sqrt((log_term / 3) ** 2 + 2 * rows * variance * log_term)) / rows


def worker_env() -> dict:
    """The environment a test launches torchrun workers in: this process's, with Python's fault handler on (a rank
    that aborts prints every thread's Python stack)."""
    return {**os.environ, "PYTHONFAULTHANDLER": "1"}


def leave_worker() -> None:
    """End a torchrun worker whose results are written: every rank together, the process group destroyed, then out
    without the interpreter's teardown. In full-suite runs a rank has aborted in that teardown, after its results
    were written ("terminate called without an active exception": a C++ thread still joinable while the process
    exits; seen three times, in ddp+scripted, ddp+seeded and the schedule worker, never in 54 reruns of those alone),
    which failed a finished run. The launchers set PYTHONFAULTHANDLER, so an abort before this point shows its stack."""
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def sampler_with_rows_ending_apart(model, tokenizer, prompts: list[str]):
    """A call that runs the decoding loop on `prompts` (left-padded), seeded per row, with EOS favoured so rows end
    at different steps and the last one decodes alone; returns (the call, the encoded prompts)."""
    from transformers import GenerationConfig, LogitsProcessorList

    from gspo_trl.rollout import keyed_uniform, stream_keys
    from gspo_trl.rollout.decoding import cpu
    from gspo_trl.rollout.decoding.dynamic import logits_processors, sample

    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    encoded = tokenizer(prompts, return_tensors="pt", padding=True, padding_side="left")
    keys = stream_keys(11, torch.arange(len(prompts)))

    def favour_eos(ids, scores):
        return scores + 3.0 * (torch.arange(scores.shape[-1]) == eos)

    processors = LogitsProcessorList(
        [favour_eos, *logits_processors(GenerationConfig(do_sample=True, temperature=0.8))]
    )

    def run(cpu_kernels=cpu.ALL):
        return sample(
            model,
            encoded.input_ids,
            encoded.attention_mask,
            max_new_tokens=16,
            eos_token_ids=[eos],
            pad_token_id=pad,
            processors=processors,
            logp_temperature=0.8,
            uniforms=lambda rows, t: keyed_uniform(keys[rows], t, 1).squeeze(1),
            cpu_kernels=cpu_kernels,
        )

    return run, encoded


def force_choices(monkeypatch, form: str, calls: list | None = None):
    """Every model qualifies, and every weight shape takes `form` ("linear", "transposed", "packed" or "compiled") at
    every row count up to MAX_ROWS, whatever this machine would measure (a tiny model's weights stay in cache, where
    the measurement means nothing). The compiled form computes up to `kernel.MAX_LINEAR_ROWS` rows; more rows in it
    take `F.linear`."""
    from gspo_trl.rollout.decoding.cpu import kernel as decode_kernel
    from gspo_trl.rollout.decoding.cpu import linear as decode_linear
    from gspo_trl.rollout.decoding.cpu.linear import MAX_ROWS

    assert form in (decode_linear.LINEAR, decode_linear.TRANSPOSED, decode_linear.PACKED, decode_linear.COMPILED), form
    # The pinned CPU torch runs oneDNN, and CI's machine has a C compiler: a test of the packed or compiled form must
    # not pass by quietly running another.
    assert form != decode_linear.PACKED or decode_linear.packing_available()
    assert form != decode_linear.COMPILED or decode_kernel.available()

    def measure(weights, **offered):
        if calls is not None:
            calls.append([tuple(weight.shape) for weight in weights])
        return {tuple(weight.shape): dict.fromkeys(range(1, MAX_ROWS + 1), form) for weight in weights}

    monkeypatch.setattr(decode_linear, "MIN_WEIGHT_BYTES", 0)
    monkeypatch.setattr(decode_linear, "_choices", {})
    monkeypatch.setattr(decode_linear, "measure_choices", measure)


def force_attention_kernel(monkeypatch):
    """The packed attention of every decoding loop in the compiled kernel wherever it takes the tensors, whatever this
    machine would time (CI's machine has a C compiler: a test of the kernel must not pass by quietly running SDPA)."""
    from gspo_trl.rollout.decoding.cpu import attention, kernel

    assert kernel.available()
    monkeypatch.setattr(attention, "_choices", {})
    everywhere = attention.KernelChoice.everywhere()
    monkeypatch.setattr(attention, "measure_kernel_choice", lambda *shape, **kwargs: everywhere)

#!/usr/bin/env python
"""Step-time benchmark: gspo-trl's `GSPOTrainer` against TRL's `GRPOTrainer` in GSPO mode, same work.

Driver mode (the default) runs each implementation in its own fresh subprocess, alternating
ours, TRL, ours, TRL, ... for `--repeats` pairs, then prints a table (min / median / max of every
figure per implementation, and the ours/TRL ratio pair by pair) and writes everything to `--out`:

    python benchmarks/step_time.py --repeats 3

Worker mode (`--impl ours` or `--impl trl`) trains once and prints one JSON line prefixed with
`STEP_TIME_RESULT ` on stdout. The driver starts workers itself; run one by hand to debug:

    python benchmarks/step_time.py --impl trl --max_completion_length 16 --rounds 1 --warmup_rounds 0

What is timed: whole generation rounds (one rollout of `per_device_train_batch_size ×
steps_per_generation` completions plus the optimizer steps trained on it) after `--warmup_rounds`
untimed rounds. Round and step boundaries come from a `TrainerCallback` (`on_step_begin` /
`on_step_end`), which both trainers call the same way. Phases are timed by wrapping, in the
worker process only, the methods that do them (neither library is edited):

    phase          TRL 1.16 GRPOTrainer                             gspo-trl GSPOTrainer
    rollout        _generate_and_score_completions                  _generate_and_score
    generate       _generate (tokenize + model.generate + decode)   rollout_backend.generate (tokenize + generate)
    reward         _calculate_rewards                               gspo_trl.scoring.score.compute_rewards
    old_logps      _get_per_token_logps_and_entropies in rollout    _score_without_grad (counted in rollout)
    train_forward  compute_loss                                     compute_loss

`train` = round time − rollout: the training forward, backward, optimizer step, logging and data
loading of the round's optimizer steps.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RESULT_PREFIX = "STEP_TIME_RESULT "
REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO_ROOT / "benchmarks" / "results" / "step_time.json"
# "ours_recompute": gspo-trl with decode_logprobs_as_old=False, π_old from a forward pass as before 2026-11-24.
IMPLS = ("ours", "trl", "ours_recompute")

# (key, label, unit, format) of the figures the table shows, in order. Every figure is per timed
# generation round unless its label says otherwise.
FIGURES = [
    ("round_s", "round (rollout + its optimizer steps)", "s", "{:.2f}"),
    ("step_s", "per optimizer step (round / steps)", "s", "{:.2f}"),
    ("rollout_s", "  rollout (generate+reward+old logps+rest)", "s", "{:.2f}"),
    ("generate_s", "    generate", "s", "{:.2f}"),
    ("reward_s", "    reward", "s", "{:.3f}"),
    ("old_logps_s", "    old log-probs (no grad)", "s", "{:.2f}"),
    ("rollout_other_s", "    rest of rollout", "s", "{:.3f}"),
    ("train_s", "  train (round - rollout)", "s", "{:.2f}"),
    ("train_forward_s", "    forward + loss (compute_loss)", "s", "{:.2f}"),
    ("train_backward_etc_s", "    backward + optimizer + logging", "s", "{:.2f}"),
    ("train_step_s", "  train per optimizer step", "s", "{:.2f}"),
    ("logprob_positions", "positions in log-prob forwards (train + old)", "tok", "{:.0f}"),
    ("padding_share", "  of which padding", "", "{:.3f}"),
    ("train_tflop", "useful training FLOPs per round", "TFLOP", "{:.2f}"),
    ("train_gflop_per_s", "  achieved in the training phase", "GFLOP/s", "{:.1f}"),
    ("matmul_peak_gflop_per_s", "  matmul peak (same process; fp32 CPU, bf16 GPU)", "GFLOP/s", "{:.1f}"),
    ("mfu", "  training-phase MFU", "", "{:.3f}"),
    ("completion_tokens", "completion tokens per round", "tok", "{:.0f}"),
    ("mean_completion_length", "mean completion length", "tok", "{:.1f}"),
    ("generate_tok_per_s", "completion tokens / generate time", "tok/s", "{:.1f}"),
    ("overall_tok_per_s", "completion tokens / round time", "tok/s", "{:.2f}"),
    ("peak_rss_mb", "peak RSS of the worker", "MiB", "{:.0f}"),
    ("peak_gpu_mem_gib", "peak GPU memory (torch allocator)", "GiB", "{:.2f}"),
    ("setup_s", "trainer construction (untimed)", "s", "{:.1f}"),
]


# ----------------------------------------------------------------------------------------------
# Arguments
# ----------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="Time gspo-trl's GSPOTrainer against TRL's GRPOTrainer (GSPO mode) on identical work.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    bench = parser.add_argument_group("benchmark")
    bench.add_argument(
        "--impl",
        choices=IMPLS,
        default=None,
        help="Worker mode: train once with this implementation "
        "and print one JSON line. Left out: driver mode (starts the workers).",
    )
    bench.add_argument("--repeats", type=int, default=1, help="Pairs of runs (ours, TRL), alternating.")
    bench.add_argument("--impls", default="ours,trl", help="Comma-separated implementations the driver runs per pair.")
    bench.add_argument("--warmup_rounds", type=int, default=1, help="Untimed generation rounds before timing.")
    bench.add_argument("--rounds", type=int, default=2, help="Timed generation rounds.")
    bench.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch.set_num_threads (and OMP/MKL threads) in every worker. Default: all cores this process may use.",
    )
    bench.add_argument("--out", default=str(DEFAULT_OUT), help="JSON file with every run and the summary.")
    bench.add_argument(
        "--logs_dir", default=None, help="Where worker stdout/stderr go. Default: <out stem>_logs/ next to --out."
    )
    bench.add_argument("--python", default=sys.executable, help="Interpreter for the workers.")
    bench.add_argument("--timeout", type=float, default=None, help="Seconds before a worker is killed (default: none).")

    work = parser.add_argument_group("work (identical for both implementations)")
    work.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="cpu: fp32, use_cpu=True. cuda: the "
        "GPU recipe, a bf16 model (model_init_kwargs dtype) with bf16=True; phases timed with the device "
        "synchronised; peak GPU memory and a bf16 matmul peak are recorded.",
    )
    work.add_argument(
        "--architecture",
        choices=("smollm2-135m", "smollm2-1.7b", "tiny"),
        default=None,
        help="Time a random-init model of these sizes with the SmolLM2 tokenizer (benchmarks/"
        "architectures.py) on synthetic chat prompts, instead of --model on the demo's task.",
    )
    work.add_argument(
        "--tokenizer",
        default=None,
        help="With --architecture: a directory holding the SmolLM2 "
        "tokenizer files. Default: saved once from the demo model's GGUF.",
    )
    work.add_argument(
        "--model",
        default=None,
        help="Model directory. Default: the demo's (gspo_trl.demo.default_model.default_model_path(), fp32).",
    )
    work.add_argument("--dataset_size", type=int, default=256, help="Prompts drawn from the demo's reasoning-gym task.")
    work.add_argument("--num_generations", type=int, default=8)
    work.add_argument("--per_device_train_batch_size", type=int, default=16)
    work.add_argument("--gradient_accumulation_steps", type=int, default=1)
    work.add_argument("--steps_per_generation", type=int, default=4)
    work.add_argument("--max_completion_length", type=int, default=64)
    work.add_argument("--temperature", type=float, default=1.0)
    work.add_argument("--learning_rate", type=float, default=1e-6)
    work.add_argument("--epsilon", type=float, default=3e-4)
    work.add_argument("--epsilon_high", type=float, default=4e-4)
    work.add_argument(
        "--gradient_checkpointing",
        action="store_true",
        help="Turn activation (gradient) checkpointing on for both (default: off for both).",
    )
    work.add_argument(
        "--use_liger_kernel",
        action="store_true",
        help="use_liger_kernel=True in both configs (liger-kernel's RMSNorm, SwiGLU and RoPE kernels; GPU only).",
    )
    work.add_argument(
        "--max_tokens_per_pass",
        type=int,
        default=None,
        help="gspo-trl only: GSPOConfig's "
        "max_tokens_per_pass (0: one training pass per micro-batch). Default: the library's.",
    )
    work.add_argument(
        "--cpu_decoding_kernels",
        choices=("auto", "on", "off"),
        default=None,
        help="gspo-trl only: GSPOConfig's cpu_decoding_kernels (CPU decoding accelerations). Default: the library's.",
    )
    work.add_argument("--lora", action="store_true", help="Train a LoRA adapter (r, alpha below, all-linear) in both.")
    work.add_argument("--lora_r", type=int, default=16)
    work.add_argument("--lora_alpha", type=int, default=32)
    work.add_argument("--seed", type=int, default=0)
    return parser


def check_args(args: argparse.Namespace) -> None:
    problems = []
    if args.steps_per_generation % args.gradient_accumulation_steps:
        problems.append(
            "steps_per_generation must be a multiple of gradient_accumulation_steps "
            "(a generation round must hold whole optimizer steps)"
        )
    if (args.per_device_train_batch_size * args.steps_per_generation) % args.num_generations:
        problems.append("per_device_train_batch_size × steps_per_generation must be a multiple of num_generations")
    if args.rounds < 1 or args.warmup_rounds < 0 or args.repeats < 1:
        problems.append("need --rounds >= 1, --warmup_rounds >= 0, --repeats >= 1")
    if problems:
        raise SystemExit("step_time.py: " + "; ".join(problems))


def optimizer_steps_per_round(args) -> int:
    return args.steps_per_generation // args.gradient_accumulation_steps


def default_threads() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


# ----------------------------------------------------------------------------------------------
# Worker
# ----------------------------------------------------------------------------------------------


_synchronize = None  # torch.cuda.synchronize when timing a GPU run


def now() -> float:
    """Wall-clock seconds, after the device has finished the work queued so far (whole phases are timed)."""
    if _synchronize is not None:
        _synchronize()
    return time.perf_counter()


class PhaseRecorder:
    """Intervals (phase, start, end, extra) recorded by the wrappers and the step callback."""

    def __init__(self):
        self.events: list[tuple[str, float, float, dict]] = []
        self.in_rollout = 0
        self.active: list[str] = []  # phases currently running, outermost first
        # (time, "train" | "old", positions, real tokens, attended pairs, LM-head tokens) per model forward
        self.forwards: list[tuple[float, str, int, int, int, int]] = []
        self.last_pack = None  # gspo-trl's packed layout of the forward about to run

    def wrap(self, function, phase: str, extra=None, only_in_rollout: bool | None = None, marks_rollout=False):
        """`function` timed as `phase`; `extra(result)` adds fields; `only_in_rollout` filters by context."""
        recorder = self

        def timed(*args, **kwargs):
            inside = recorder.in_rollout > 0
            if marks_rollout:
                recorder.in_rollout += 1
            recorder.active.append(phase)
            start = now()
            try:
                result = function(*args, **kwargs)
            finally:
                end = now()
                recorder.active.pop()
                if marks_rollout:
                    recorder.in_rollout -= 1
            if only_in_rollout is None or only_in_rollout == inside:
                fields = {"inside_rollout": inside, **(extra(result) if extra else {})}
                recorder.events.append((phase, start, end, fields))
            return result

        timed.__wrapped__ = function
        return timed


def make_step_callback(recorder: PhaseRecorder):
    from transformers import TrainerCallback

    class StepTimes(TrainerCallback):
        """Wall-clock marks at the start and end of every optimizer step (both trainers call these)."""

        def __init__(self):
            self.begin: dict[int, float] = {}
            self.end: dict[int, float] = {}

        def on_step_begin(self, args, state, control, **kwargs):
            self.begin[state.global_step + 1] = now()

        def on_step_end(self, args, state, control, **kwargs):
            self.end[state.global_step] = now()
            if state.global_step == 1:  # Trainer turns checkpointing on inside train(), so look here
                self.checkpointing_during_training = checkpointing_state(kwargs.get("model"))

    return StepTimes()


def instrument_trl(recorder: PhaseRecorder) -> None:
    from trl import GRPOTrainer

    cls = GRPOTrainer
    cls._generate_and_score_completions = recorder.wrap(
        cls._generate_and_score_completions, "rollout", marks_rollout=True
    )
    # _generate returns (prompt_ids, completion_ids, ...); completion ids are cut after the first EOS (kept).
    cls._generate = recorder.wrap(
        cls._generate,
        "generate",
        extra=lambda out: {"tokens": sum(len(ids) for ids in out[1]), "completions": len(out[1])},
    )
    cls._calculate_rewards = recorder.wrap(cls._calculate_rewards, "reward")
    # Inside the rollout it is the old-policy pass (beta=0: no reference pass); in training the
    # same method is the forward of compute_loss, timed there.
    cls._get_per_token_logps_and_entropies = recorder.wrap(
        cls._get_per_token_logps_and_entropies, "old_logps", only_in_rollout=True
    )
    cls.compute_loss = recorder.wrap(cls.compute_loss, "train_forward")


def instrument_ours(recorder: PhaseRecorder) -> None:
    import gspo_trl.trainer as trainer_module
    from gspo_trl.rollout import HFGenerateBackend

    cls = trainer_module.GSPOTrainer
    cls._generate_and_score = recorder.wrap(cls._generate_and_score, "rollout", marks_rollout=True)
    # The completion mask keeps tokens up to and including the first EOS, as TRL's count does.
    HFGenerateBackend.generate = recorder.wrap(
        HFGenerateBackend.generate,
        "generate",
        extra=lambda rollout: {
            "tokens": int(rollout.completion_mask.sum()),
            "completions": int(rollout.completion_ids.shape[0]),
        },
    )
    import gspo_trl.scoring.score as scoring_module

    scoring_module.compute_rewards = recorder.wrap(scoring_module.compute_rewards, "reward")
    cls._score_without_grad = recorder.wrap(cls._score_without_grad, "old_logps")
    cls.compute_loss = recorder.wrap(cls.compute_loss, "train_forward")
    import gspo_trl.training.logprobs as logprobs_module

    pack = logprobs_module.pack_shared_prefix

    def remembered_pack(*args, **kwargs):
        recorder.last_pack = pack(*args, **kwargs)
        return recorder.last_pack

    logprobs_module.pack_shared_prefix = remembered_pack


def model_dimensions(model) -> dict:
    """What the FLOP count needs: linear weights per layer, attention width, vocabulary."""
    config = model.config.get_text_config()
    hidden, layers = config.hidden_size, config.num_hidden_layers
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    attention_weights = hidden * head_dim * (2 * heads + 2 * kv_heads)  # q, o and k, v projections
    mlp_weights = 3 * hidden * config.intermediate_size  # gate, up, down
    return {
        "linear_params": layers * (attention_weights + mlp_weights),
        "attention_flops_per_pair": 4 * heads * head_dim * layers,  # QK^T and AV, forward
        "lm_head_flops_per_token": 2 * config.vocab_size * hidden,
    }


def count_forward_tokens(recorder: PhaseRecorder, model) -> None:
    """Record positions, real tokens and attended pairs of every log-prob forward (training and
    old-log-prob passes; sampling is excluded). Works for TRL's padded rows (2D mask) and for
    gspo-trl's packed rows (4D mask plus the layout recorded by `remembered_pack`)."""

    def pre_hook(module, args, kwargs):
        if "generate" in recorder.active:
            return
        if "train_forward" in recorder.active:
            kind = "train"
        elif "old_logps" in recorder.active:
            kind = "old"
        else:
            return
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        mask = kwargs.get("attention_mask")
        positions = input_ids.numel()
        if mask is not None and mask.dim() == 4:  # packed: additive bias, 0 where attended
            pack = recorder.last_pack
            real = pack.num_real_tokens
            pairs = int((mask == 0).sum()) - pack.num_padding_tokens  # padding only attends to itself
            lm_tokens = int(pack.score_index.numel())
        else:
            mask = mask if mask is not None else input_ids.new_ones(input_ids.shape)
            lengths = mask.sum(1)
            real = int(lengths.sum())
            pairs = int((lengths * (lengths + 1) // 2).sum())  # causal pairs among each row's real tokens
            keep = kwargs.get("logits_to_keep", 0)
            labels = kwargs.get("labels")
            if labels is not None:  # TRL 1.16's fused head scores the positions whose next label is not -100
                lm_tokens = int((labels[:, 1:] != -100).sum())
            else:
                lm_tokens = int(mask[:, -(keep - 1) :].sum()) if isinstance(keep, int) and keep > 1 else 0
        recorder.forwards.append((time.perf_counter(), kind, positions, real, pairs, lm_tokens))

    model.register_forward_pre_hook(pre_hook, with_kwargs=True)


def measure_matmul_peak(device: str = "cpu", seconds: float = 3.0) -> float:
    """Best matmul GFLOP/s of this process, the denominator of the MFU: fp32 at 2048 on CPU (its
    thread count), bf16 at 8192 on CUDA (the precision the GPU recipe trains in)."""
    import torch

    size, dtype = (2048, torch.float32) if device == "cpu" else (8192, torch.bfloat16)
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    a @ b
    best, deadline = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        start = now()
        a @ b
        best = max(best, 2 * size**3 / (now() - start) / 1e9)
    return best


def config_kwargs(args, output_dir: str) -> dict:
    """Every setting that decides the work, given explicitly to both configs (no reliance on defaults)."""
    total_rounds = args.warmup_rounds + args.rounds
    return dict(
        output_dir=output_dir,
        # schedule
        max_steps=total_rounds * optimizer_steps_per_round(args),
        per_device_train_batch_size=args.per_device_train_batch_size,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        steps_per_generation=args.steps_per_generation,  # generation_batch_size = batch × this (both derive it)
        num_generations=args.num_generations,
        num_iterations=1,
        shuffle_dataset=True,
        # sampling
        max_completion_length=args.max_completion_length,
        temperature=args.temperature,
        top_p=1.0,
        top_k=0,
        min_p=None,
        repetition_penalty=1.0,
        generation_kwargs=None,
        cache_implementation=None,
        # objective
        importance_sampling_level="sequence",
        loss_type="grpo",
        epsilon=args.epsilon,
        epsilon_high=args.epsilon_high,
        beta=0.0,
        scale_rewards="group",
        mask_truncated_completions=False,
        disable_dropout=True,
        # optimization
        learning_rate=args.learning_rate,
        lr_scheduler_type="linear",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        optim="adamw_torch_fused",  # the default of both configs
        seed=args.seed,
        # numerics and memory: fp32 on CPU, the bf16 GPU recipe on CUDA (TRL's checkpointing default is True)
        use_cpu=args.device == "cpu",
        bf16=args.device == "cuda",
        fp16=False,
        activation_checkpointing=args.gradient_checkpointing,
        gradient_checkpointing=args.gradient_checkpointing,
        use_liger_kernel=args.use_liger_kernel,
        model_init_kwargs={"dtype": "bfloat16" if args.device == "cuda" else "float32"},
        # bookkeeping
        logging_steps=1,
        save_strategy="no",
        eval_strategy="no",
        report_to="none",
        log_completions=False,
        remove_unused_columns=False,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )


def build_trainer(impl: str, args, model_path: str, dataset, reward, output_dir: str, callback):
    from transformers import set_seed

    kwargs = config_kwargs(args, output_dir)
    peft_config = None
    if args.lora:
        from peft import LoraConfig

        peft_config = LoraConfig(
            r=args.lora_r, lora_alpha=args.lora_alpha, target_modules="all-linear", task_type="CAUSAL_LM"
        )
    # TRL seeds before building the model (LoRA init is random); do the same for both.
    set_seed(args.seed)
    if impl == "trl":
        from trl import GRPOConfig, GRPOTrainer

        config = GRPOConfig(
            **kwargs,
            use_vllm=False,
            use_transformers_continuous_batching=False,
            top_entropy_quantile=1.0,
            entropy_coef=0.0,
            cast_lm_head_to_fp32=False,
            multi_objective_aggregation="sum_then_normalize",
        )
        return GRPOTrainer(
            model_path,
            reward_funcs=[reward],
            args=config,
            train_dataset=dataset,
            peft_config=peft_config,
            callbacks=[callback],
        )
    from gspo_trl import GSPOConfig
    from gspo_trl.trainer import GSPOTrainer

    ours_only = {"decode_logprobs_as_old": False} if impl == "ours_recompute" else {}
    if args.max_tokens_per_pass is not None:
        ours_only["max_tokens_per_pass"] = args.max_tokens_per_pass
    if args.cpu_decoding_kernels is not None:
        ours_only["cpu_decoding_kernels"] = args.cpu_decoding_kernels
    config = GSPOConfig(**kwargs, **ours_only)
    return GSPOTrainer(
        model_path,
        reward_funcs=[reward],
        args=config,
        train_dataset=dataset,
        peft_config=peft_config,
        callbacks=[callback],
    )


RESOLVED_FIELDS = [
    "max_steps",
    "per_device_train_batch_size",
    "gradient_accumulation_steps",
    "steps_per_generation",
    "generation_batch_size",
    "num_generations",
    "num_iterations",
    "max_completion_length",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "importance_sampling_level",
    "loss_type",
    "epsilon",
    "epsilon_high",
    "beta",
    "scale_rewards",
    "mask_truncated_completions",
    "disable_dropout",
    "learning_rate",
    "lr_scheduler_type",
    "optim",
    "weight_decay",
    "max_grad_norm",
    "seed",
    "bf16",
    "fp16",
    "use_cpu",
    "activation_checkpointing",
    "gradient_checkpointing",
    "activation_checkpointing_keep_attention",
    "use_liger_kernel",
    "shuffle_dataset",
    "use_vllm",
    "use_transformers_continuous_batching",
    "cpu_decoding_kernels",
]


def describe_trainer(impl: str, trainer) -> dict:
    """What each trainer actually resolved to, so a reader can check the work really is the same."""
    import torch

    resolved = {name: _plain(getattr(trainer.args, name)) for name in RESOLVED_FIELDS if hasattr(trainer.args, name)}
    model = trainer.model
    unwrapped = trainer.accelerator.unwrap_model(model)
    if impl == "trl":
        generation = trainer.generation_config.to_diff_dict()
        eos = list(trainer.eos_token_ids)
    else:
        generation = trainer.rollout_backend.generation_config.to_diff_dict()
        eos = list(trainer.rollout_backend.eos_token_ids)
    params = list(unwrapped.parameters())
    return {
        "args": resolved,
        "generation_config": {k: _plain(v) for k, v in generation.items()},
        "eos_token_ids": eos,
        "model_class": type(unwrapped).__name__,
        "dtype": str(params[0].dtype),
        "parameters": sum(p.numel() for p in params),
        "trainable_parameters": sum(p.numel() for p in params if p.requires_grad),
        "checkpointing_before_train": checkpointing_state(unwrapped),
        "torch_threads": torch.get_num_threads(),
        "max_tokens_per_pass": getattr(trainer, "max_tokens_per_pass", None),  # gspo-trl's, as it applies
        "decode_kernel": None if impl == "trl" else _decode_kernel_available(),  # gspo-trl's CPU decoding attention
        # the CPU decoding accelerations the rollouts used (`CPUKernels`; None: none)
        "cpu_kernels": None if impl == "trl" else _plain(getattr(trainer.rollout_backend, "cpu_kernels", None)),
    }


def _decode_kernel_available() -> bool:
    from gspo_trl.rollout.decoding.cpu import kernel

    return kernel.available()


def checkpointing_state(model) -> bool | None:
    """Whether activation checkpointing is on (transformers 5 name first, then the deprecated one)."""
    if model is None:
        return None
    for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):
        try:
            return bool(getattr(model, name))
        except AttributeError:
            continue
    return None


def _plain(value):
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    return str(value)


def summarize_worker(args, recorder: PhaseRecorder, callback, dims: dict, matmul_peak_gflops: float) -> dict:
    """Per-round figures of the timed rounds from the step marks and the phase intervals."""
    steps_per_round = optimizer_steps_per_round(args)
    first_timed_step = args.warmup_rounds * steps_per_round + 1
    last_step = (args.warmup_rounds + args.rounds) * steps_per_round
    missing = [s for s in range(1, last_step + 1) if s not in callback.end]
    if missing:
        raise RuntimeError(f"no on_step_end mark for optimizer steps {missing[:5]}...; the run stopped early")

    def mark_before(step: int) -> float:
        # A step starts where the previous one ended (so data loading and logging between steps
        # count); the very first step starts at its on_step_begin.
        return callback.end[step - 1] if step - 1 in callback.end else callback.begin[step]

    step_seconds = [callback.end[s] - mark_before(s) for s in range(first_timed_step, last_step + 1)]
    rounds = []
    for index in range(args.rounds):
        first = first_timed_step + index * steps_per_round
        start, end = mark_before(first), callback.end[first + steps_per_round - 1]
        inside = [e for e in recorder.events if e[1] >= start and e[2] <= end]

        def total(phase):
            return sum(e[2] - e[1] for e in inside if e[0] == phase)

        generate_events = [e for e in inside if e[0] == "generate"]
        round_s = end - start
        # gspo-trl computes old log-probs per micro-batch right after `_generate_and_score` (only for
        # the micro-batches that need them); count those passes as rollout work, as TRL's are.
        rollout = total("rollout") + sum(
            e[2] - e[1] for e in inside if e[0] == "old_logps" and not e[3]["inside_rollout"]
        )
        forward = total("train_forward")
        tokens = sum(e[3].get("tokens", 0) for e in generate_events)
        completions = sum(e[3].get("completions", 0) for e in generate_events)
        forwards = [f for f in recorder.forwards if start <= f[0] <= end]  # (time, kind, positions, ...)
        positions = sum(f[2] for f in forwards)
        real = sum(f[3] for f in forwards)
        train = [f for f in forwards if f[1] == "train"]
        # Useful training FLOPs: the real tokens through the linear layers, the attended pairs, the LM head
        # on scored tokens; backward twice the forward with full fine-tuning, once (input gradients only)
        # for frozen weights under LoRA. Padding, masked-out pairs and recomputation are not counted.
        forward_flops = sum(
            2 * dims["linear_params"] * f[3]
            + dims["attention_flops_per_pair"] * f[4]
            + dims["lm_head_flops_per_token"] * f[5]
            for f in train
        )
        train_flops = forward_flops * (2 if args.lora else 3)
        rounds.append(
            {
                "logprob_positions": positions,
                "padding_share": (positions - real) / positions if positions else float("nan"),
                "train_tflop": train_flops / 1e12,
                "train_gflop_per_s": train_flops / 1e9 / (round_s - rollout),
                "mfu": train_flops / 1e9 / (round_s - rollout) / matmul_peak_gflops,
                "round_s": round_s,
                "rollouts": sum(1 for e in inside if e[0] == "rollout"),
                "rollout_s": rollout,
                "generate_s": total("generate"),
                "reward_s": total("reward"),
                "old_logps_s": total("old_logps"),
                "rollout_other_s": rollout - total("generate") - total("reward") - total("old_logps"),
                "train_s": round_s - rollout,
                "train_forward_s": forward,
                "train_backward_etc_s": round_s - rollout - forward,
                "completion_tokens": tokens,
                "completions": completions,
            }
        )

    def mean(key):
        return statistics.fmean(r[key] for r in rounds)

    figures = {key: mean(key) for key in rounds[0] if key != "rollouts"}
    figures["step_s"] = figures["round_s"] / steps_per_round
    figures["train_step_s"] = figures["train_s"] / steps_per_round
    figures["mean_completion_length"] = (
        figures["completion_tokens"] / figures["completions"] if figures["completions"] else float("nan")
    )
    figures["generate_tok_per_s"] = (
        figures["completion_tokens"] / figures["generate_s"] if figures["generate_s"] else float("nan")
    )
    figures["overall_tok_per_s"] = figures["completion_tokens"] / figures["round_s"]
    return {"figures": figures, "rounds": rounds, "step_seconds": step_seconds}


def the_work(args, scratch_dir: str):
    """(model path, prompt dataset, reward): the demo's model and task, or a random-init architecture."""
    if args.architecture is not None:
        from architectures import build_random_model, length_reward, smollm2_tokenizer_dir, synthetic_prompts

        tokenizer_dir = args.tokenizer or smollm2_tokenizer_dir(Path(scratch_dir))
        model_path = build_random_model(args.architecture, tokenizer_dir, Path(scratch_dir) / "model", args.seed)
        return model_path, synthetic_prompts(args.dataset_size, seed=0), length_reward
    from gspo_trl.demo.tasks import default_task_dataset, default_task_reward

    if args.model is None:
        from gspo_trl.demo.default_model import default_model_path

        model_path = default_model_path()
    else:
        model_path = args.model
    return model_path, default_task_dataset(size=args.dataset_size, seed=0), default_task_reward()


def run_worker(args) -> dict:
    threads = args.threads or default_threads()
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = str(threads)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "warning")
    sys.path.insert(0, str(REPO_ROOT))
    wall_start = time.perf_counter()

    import resource

    import torch

    torch.set_num_threads(threads)

    global _synchronize
    if args.device == "cuda":
        _synchronize = torch.cuda.synchronize

    recorder = PhaseRecorder()
    (instrument_trl if args.impl == "trl" else instrument_ours)(recorder)
    callback = make_step_callback(recorder)
    with tempfile.TemporaryDirectory(prefix=f"step_time_{args.impl}_") as output_dir:
        model_path, dataset, reward = the_work(args, output_dir)
        setup_start = time.perf_counter()
        trainer = build_trainer(args.impl, args, model_path, dataset, reward, output_dir, callback)
        setup_s = time.perf_counter() - setup_start
        described = describe_trainer(args.impl, trainer)
        unwrapped = trainer.accelerator.unwrap_model(trainer.model)
        count_forward_tokens(recorder, unwrapped)
        base = unwrapped.get_base_model() if hasattr(unwrapped, "get_base_model") else unwrapped
        dims = model_dimensions(base)
        matmul_peak_gflops = measure_matmul_peak(args.device)
        if args.device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        train_start = time.perf_counter()
        trainer.train()
        train_wall_s = time.perf_counter() - train_start
        log_history = trainer.state.log_history

    result = summarize_worker(args, recorder, callback, dims, matmul_peak_gflops)
    result["figures"]["matmul_peak_gflop_per_s"] = matmul_peak_gflops
    result["figures"]["setup_s"] = setup_s
    result["figures"]["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # KiB on Linux
    if args.device == "cuda":
        result["figures"]["peak_gpu_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30
        result["gpu"] = torch.cuda.get_device_name()
    rewards = [entry["reward"] for entry in log_history if "reward" in entry]
    result.update(
        {
            "impl": args.impl,
            "model_path": model_path,
            "trainer": described,
            "train_wall_s": train_wall_s,
            "worker_wall_s": time.perf_counter() - wall_start,
            "threads": threads,
            "reward_per_step": rewards,
            "old_logps_calls": sum(1 for e in recorder.events if e[0] == "old_logps"),
            "checkpointing_during_training": getattr(callback, "checkpointing_during_training", None),
            "versions": library_versions(),
        }
    )
    return result


# ----------------------------------------------------------------------------------------------
# Driver
# ----------------------------------------------------------------------------------------------


def library_versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for name in ("torch", "transformers", "trl", "peft", "accelerate", "datasets", "reasoning-gym", "gspo-trl"):
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            found[name] = None
    return found


def machine_info() -> dict:
    cpu_model = None
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            for line in handle:
                if line.lower().startswith("model name"):
                    cpu_model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    mem_gib = None
    try:
        with open("/proc/meminfo", encoding="utf-8") as handle:
            for line in handle:
                if line.startswith("MemTotal:"):
                    mem_gib = int(line.split()[1]) / 1024**2
                    break
    except OSError:
        pass
    return {
        "cpu_model": cpu_model or platform.processor() or None,
        "logical_cores": os.cpu_count(),
        "usable_cores": default_threads(),
        "memory_gib": mem_gib,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "date": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "load_average_at_start": list(os.getloadavg()),
        "versions": library_versions(),
    }


def cpu_times() -> dict | None:
    """Machine-wide busy and steal CPU seconds (/proc/stat) and CPU seconds of finished children."""
    import resource

    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    try:
        with open("/proc/stat", encoding="utf-8") as handle:
            fields = [int(x) for x in handle.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    tick = os.sysconf("SC_CLK_TCK")
    user, nice, system, idle, iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
    return {
        "busy_s": (user + nice + system + irq + softirq) / tick,
        "steal_s": steal / tick,
        "children_cpu_s": children.ru_utime + children.ru_stime,
    }


def other_cpu_load(before: dict | None, after: dict | None, elapsed: float) -> dict | None:
    """Average cores kept busy by anything other than the worker while it ran (0 on a quiet machine)."""
    if not before or not after or elapsed <= 0:
        return None
    worker = after["children_cpu_s"] - before["children_cpu_s"]
    busy = after["busy_s"] - before["busy_s"]
    return {
        "worker_cores": worker / elapsed,
        "other_cores": max(0.0, busy - worker) / elapsed,
        "steal_cores": (after["steal_s"] - before["steal_s"]) / elapsed,
    }


def worker_command(args, impl: str, threads: int) -> list[str]:
    command = [args.python, str(Path(__file__).resolve()), "--impl", impl, "--threads", str(threads)]
    for name in (
        "warmup_rounds",
        "rounds",
        "dataset_size",
        "num_generations",
        "per_device_train_batch_size",
        "gradient_accumulation_steps",
        "steps_per_generation",
        "max_completion_length",
        "temperature",
        "learning_rate",
        "epsilon",
        "epsilon_high",
        "lora_r",
        "lora_alpha",
        "seed",
    ):
        command += [f"--{name}", str(getattr(args, name))]
    command += ["--device", args.device]
    for name in ("model", "architecture", "tokenizer"):
        if getattr(args, name):
            command += [f"--{name}", str(getattr(args, name))]
    if args.max_tokens_per_pass is not None:
        command += ["--max_tokens_per_pass", str(args.max_tokens_per_pass)]
    if args.lora:
        command.append("--lora")
    if args.gradient_checkpointing:
        command.append("--gradient_checkpointing")
    if args.use_liger_kernel:
        command.append("--use_liger_kernel")
    return command


def run_one(args, impl: str, pair: int, threads: int, logs_dir: Path) -> dict:
    command = worker_command(args, impl, threads)
    log_path = logs_dir / f"pair{pair}_{impl}.log"
    env = dict(
        os.environ,
        OMP_NUM_THREADS=str(threads),
        MKL_NUM_THREADS=str(threads),
        TOKENIZERS_PARALLELISM="false",
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        PYTHONUNBUFFERED="1",
    )
    record = {
        "impl": impl,
        "pair": pair,
        "command": command,
        "log": str(log_path),
        "load_average_before": list(os.getloadavg()),
    }
    print(f"[pair {pair}] {impl}: running (log: {log_path})", flush=True)
    cpu_before = cpu_times()
    start = time.perf_counter()
    try:
        completed = subprocess.run(
            command, cwd=str(REPO_ROOT), env=env, capture_output=True, text=True, timeout=args.timeout
        )
        stdout, stderr, returncode = completed.stdout, completed.stderr, completed.returncode
    except subprocess.TimeoutExpired as error:
        stdout = error.stdout.decode() if isinstance(error.stdout, bytes) else (error.stdout or "")
        stderr = error.stderr.decode() if isinstance(error.stderr, bytes) else (error.stderr or "")
        returncode = "timeout"
    record["elapsed_s"] = time.perf_counter() - start
    record["cpu_during_run"] = other_cpu_load(cpu_before, cpu_times(), record["elapsed_s"])
    record["load_average_after"] = list(os.getloadavg())
    log_path.write_text(f"$ {' '.join(command)}\n--- stdout ---\n{stdout}\n--- stderr ---\n{stderr}", encoding="utf-8")
    lines = [line for line in stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    if returncode == 0 and lines:
        record["result"] = json.loads(lines[-1][len(RESULT_PREFIX) :])
        figures = record["result"]["figures"]
        print(
            f"[pair {pair}] {impl}: round {figures['round_s']:.2f} s, step {figures['step_s']:.2f} s "
            f"({record['elapsed_s']:.0f} s wall)",
            flush=True,
        )
    else:
        record["error"] = f"exit status {returncode}"
        record["stderr_tail"] = stderr[-4000:]
        print(
            f"[pair {pair}] {impl}: FAILED ({record['error']}); last lines of stderr:\n"
            + "\n".join(stderr.splitlines()[-15:]),
            flush=True,
        )
    return record


def summarize_runs(runs: list[dict], impls: list[str]) -> dict:
    summary = {"per_impl": {}, "ratio_ours_over_trl": {}}
    for impl in impls:
        results = [r["result"]["figures"] for r in runs if r["impl"] == impl and "result" in r]
        summary["per_impl"][impl] = {}
        for key, *_ in FIGURES:
            values = [f[key] for f in results if key in f]
            if values:
                summary["per_impl"][impl][key] = {
                    "min": min(values),
                    "median": statistics.median(values),
                    "max": max(values),
                    "values": values,
                }
    if "ours" in impls and "trl" in impls:
        pairs = sorted({r["pair"] for r in runs})
        for key, *_ in FIGURES:
            ratios = []
            for pair in pairs:
                got = {r["impl"]: r["result"]["figures"] for r in runs if r["pair"] == pair and "result" in r}
                if "ours" in got and "trl" in got and got["trl"].get(key):
                    ratios.append(got["ours"][key] / got["trl"][key])
                else:
                    ratios.append(None)
            valid = [x for x in ratios if x is not None]
            summary["ratio_ours_over_trl"][key] = {
                "per_pair": ratios,
                "median": statistics.median(valid) if valid else None,
            }
    return summary


def format_table(machine: dict, args, threads: int, summary: dict, impls: list[str], runs: list[dict]) -> str:
    lines = []
    versions = machine["versions"]
    lines.append("GSPO step time: gspo-trl GSPOTrainer vs TRL GRPOTrainer (importance_sampling_level='sequence')")
    lines.append(
        f"machine : {machine['cpu_model']} | {machine['usable_cores']} usable / {machine['logical_cores']} "
        f"logical cores | {machine['memory_gib']:.0f} GiB"
        if machine["memory_gib"]
        else f"machine : {machine['cpu_model']} | {machine['usable_cores']} cores"
    )
    lines.append(
        f"software: torch {versions['torch']}, transformers {versions['transformers']}, trl {versions['trl']}, "
        f"peft {versions['peft']}, gspo-trl {versions['gspo-trl']}, python {machine['python']}"
    )
    lines.append(f"date    : {machine['date']} | load average at start {machine['load_average_at_start'][0]:.2f}")
    gpus = sorted({r["result"]["gpu"] for r in runs if "gpu" in r.get("result", {})})
    if gpus:
        lines.append(f"gpu     : {', '.join(gpus)}")
    generation_batch = args.per_device_train_batch_size * args.steps_per_generation
    model_path = runs[0].get("result", {}).get("model_path", args.model or "default model")
    work = args.architecture + " (random init)" if args.architecture else Path(model_path).name
    lines.append(
        f"work    : {work} "
        f"{'bf16 CUDA' if args.device == 'cuda' else 'fp32 CPU'}, "
        f"{f'LoRA r={args.lora_r} alpha={args.lora_alpha}' if args.lora else 'full fine-tune'}, "
        f"checkpointing {'on' if args.gradient_checkpointing else 'off'}, {threads} threads; "
        f"{generation_batch} completions/round ({generation_batch // args.num_generations} prompts × "
        f"{args.num_generations}), {optimizer_steps_per_round(args)} optimizer steps/round × "
        f"{args.per_device_train_batch_size * args.gradient_accumulation_steps} completions, "
        f"≤{args.max_completion_length} tokens, T={args.temperature}"
    )
    lines.append(
        f"timing  : {args.warmup_rounds} warm-up + {args.rounds} timed rounds per run, {args.repeats} "
        f"pair(s) alternating {' / '.join(impls)}, each run a fresh process; figures are per timed round "
        "(mean over rounds), then min / median / max over runs"
    )
    lines.append("")
    header = f"{'figure':<44}{'unit':>6}"
    for impl in impls:
        header += f" | {impl + ' min / median / max':>26}"
    if "ours" in impls and "trl" in impls:
        header += " | ours/TRL per pair (median)"
    lines.append(header)
    lines.append("-" * len(header))
    for key, label, unit, fmt in FIGURES:
        row = f"{label:<44}{unit:>6}"
        present = False
        for impl in impls:
            stats = summary["per_impl"].get(impl, {}).get(key)
            if stats:
                present = True
                cell = " / ".join(fmt.format(stats[s]) for s in ("min", "median", "max"))
            else:
                cell = "-"
            row += f" | {cell:>26}"
        ratio = summary["ratio_ours_over_trl"].get(key)
        if ratio and ratio["median"] is not None:
            per_pair = " ".join("-" if x is None else f"{x:.2f}" for x in ratio["per_pair"])
            row += f" | {per_pair} ({ratio['median']:.2f})"
        if present:
            lines.append(row)
    lines.extend(alignment_lines(runs, impls))
    failed = [r for r in runs if "error" in r]
    if failed:
        lines.append("")
        lines.append(
            "FAILED runs: " + ", ".join(f"pair {r['pair']} {r['impl']} ({r['error']}, log {r['log']})" for r in failed)
        )
    others = [
        (r["cpu_during_run"]["other_cores"], r["cpu_during_run"]["steal_cores"], r)
        for r in runs
        if r.get("cpu_during_run")
    ]
    if others:
        lines.append("")
        lines.append(
            "other CPU use while each worker ran (average cores busy outside the worker; 0 = quiet): "
            + ", ".join(
                f"pair {r['pair']} {r['impl']} {o:.2f}" + (f" (steal {st:.2f})" if st >= 0.01 else "")
                for o, st, r in others
            )
        )
        if max(o + st for o, st, _ in others) > 0.1:
            lines.append(
                "WARNING: something else used the CPU during the runs; these timings are not "
                "trustworthy. Re-run with nothing else running on the machine."
            )
    return "\n".join(lines)


def alignment_checks(runs: list[dict], impls: list[str]) -> dict:
    """What each implementation resolved to, and every shared setting on which they disagree."""
    first = {}
    for impl in impls:
        done = [r["result"] for r in runs if r["impl"] == impl and "result" in r]
        if done:
            first[impl] = done[0]
    per_impl = {
        impl: {
            "checkpointing_during_training": result.get("checkpointing_during_training"),
            "old_logps_computed": result.get("old_logps_calls", 0) > 0,
            "dtype": result["trainer"]["dtype"],
            "model_class": result["trainer"]["model_class"],
            "trainable_parameters": result["trainer"]["trainable_parameters"],
            "torch_threads": result["trainer"]["torch_threads"],
            "eos_token_ids": result["trainer"]["eos_token_ids"],
        }
        for impl, result in first.items()
    }
    differences = {}
    if "ours" in first and "trl" in first:
        ours, trl = first["ours"]["trainer"], first["trl"]["trainer"]
        for name in sorted(set(ours["args"]) & set(trl["args"])):
            if ours["args"][name] != trl["args"][name]:
                differences[f"args.{name}"] = {"ours": ours["args"][name], "trl": trl["args"][name]}
        for name, values in per_impl["ours"].items():
            if values != per_impl["trl"][name]:
                differences[name] = {"ours": values, "trl": per_impl["trl"][name]}
        # Generation settings that change what is sampled (bookkeeping keys left out).
        ignore = {"transformers_version", "disable_compile", "use_cache", "_from_model_config"}
        ours_gen, trl_gen = ours["generation_config"], trl["generation_config"]
        for name in sorted((set(ours_gen) | set(trl_gen)) - ignore):
            a, b = ours_gen.get(name), trl_gen.get(name)
            if name == "eos_token_id":
                a, b = ([a] if isinstance(a, int) else a), ([b] if isinstance(b, int) else b)
            if a != b:
                differences[f"generation_config.{name}"] = {"ours": ours_gen.get(name), "trl": trl_gen.get(name)}
    return {"per_impl": per_impl, "differences": differences}


def alignment_lines(runs: list[dict], impls: list[str]) -> list[str]:
    checks = alignment_checks(runs, impls)
    lines = ["", "alignment checks (first successful run of each):"]
    for impl, values in checks["per_impl"].items():
        lines.append(
            f"  {impl:<5} dtype {values['dtype']}, {values['model_class']}, "
            f"{values['trainable_parameters']:,} trainable params, "
            f"checkpointing in training {values['checkpointing_during_training']}, old log-probs computed "
            f"{values['old_logps_computed']}, eos {values['eos_token_ids']}, {values['torch_threads']} threads"
        )
    if "ours" in checks["per_impl"] and "trl" in checks["per_impl"]:
        if checks["differences"]:
            for name, values in checks["differences"].items():
                lines.append(f"  DIFFERS {name}: ours {values['ours']!r} vs trl {values['trl']!r}")
        else:
            lines.append("  resolved configs, generation settings, dtype and trainable parameters agree")
    return lines


def run_driver(args) -> int:
    impls = [name.strip() for name in args.impls.split(",") if name.strip()]
    unknown = [name for name in impls if name not in IMPLS]
    if unknown or not impls:
        raise SystemExit(f"--impls: unknown implementation(s) {unknown}; choose from {IMPLS}")
    threads = args.threads or default_threads()
    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    logs_dir = Path(args.logs_dir) if args.logs_dir else out_path.with_name(out_path.stem + "_logs")
    logs_dir.mkdir(parents=True, exist_ok=True)
    machine = machine_info()

    runs = []
    for pair in range(args.repeats):
        for impl in impls:
            runs.append(run_one(args, impl, pair, threads, logs_dir))
    summary = summarize_runs(runs, impls)
    table = format_table(machine, args, threads, summary, impls, runs)
    print()
    print(table)
    report = {
        "benchmark": "step_time",
        "machine": machine,
        "settings": {key: value for key, value in vars(args).items() if key not in ("impl",)},
        "threads": threads,
        "optimizer_steps_per_round": optimizer_steps_per_round(args),
        "figures": {key: {"label": label.strip(), "unit": unit} for key, label, unit, _ in FIGURES},
        "summary": summary,
        "alignment": alignment_checks(runs, impls),
        "runs": runs,
        "table": table,
    }
    out_path.write_text(json.dumps(report, indent=2), encoding="utf-8")
    print(f"\nwrote {out_path}")
    return 0 if all("result" in r for r in runs) else 1


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    check_args(args)
    if args.impl is None:
        return run_driver(args)
    result = run_worker(args)
    print(RESULT_PREFIX + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

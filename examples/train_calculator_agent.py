"""Train SmolLM2-135M-Instruct to multiply with a calculator tool: a short supervised warm-up, then GSPO.

    python examples/train_calculator_agent.py

The task is a product of a three-digit and a two-digit number, which a 135M model gets wrong in its head. The tools
follow TRL's `environment_factory` convention, unchanged (docs/agents.md): `Calculator.reset(**row)` starts an
episode, its public methods `add` and `multiply` are the tools, and the reward function gets the conversation and
checks the final answer (`gspo_trl/demo/calculator.py`, which `gspo-trl train --env calculator` runs too).

Asked cold, SmolLM2-135M-Instruct writes no tool call at all (none in 64 samples, with the Hermes format described in
the prompt or with SmolLM2's own function-calling prompt), so RL would have nothing to reinforce. A short warm-up
(TRL's `SFTTrainer`, 3 steps on transcripts rendered exactly as the episodes are) shows the call format; GSPO then
trains on what the model does with it: pick the right tool (`add` is there too), call it, read the result, answer.
Measured runs: docs/agents.md.
"""

import argparse
import json
import os
import sys
import time

from gspo_trl import GSPOConfig, GSPOTrainer
from gspo_trl.demo.calculator import Calculator, correct_answer, questions, warm_up
from gspo_trl.demo.default_model import default_model_path


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--warm_up_steps",
        type=int,
        default=3,
        help="supervised steps of 8 transcripts (12 steps leave GSPO nothing to learn: every episode is already right)",
    )
    parser.add_argument("--max_steps", type=int, default=12, help="GSPO optimizer steps (4 per rollout)")
    parser.add_argument("--record", default=None, help="write the per-rollout metrics and timings to this JSON file")
    cli = parser.parse_args()
    start = time.perf_counter()
    model, tokenizer = warm_up(default_model_path(), cli.warm_up_steps, "gspo-calculator-sft")
    warm_up_seconds = time.perf_counter() - start
    args = GSPOConfig(
        output_dir="gspo-calculator-agent",
        learning_rate=1e-5,
        per_device_train_batch_size=8,
        num_generations=4,
        max_tool_calling_iterations=1,  # call once, then answer
        max_completion_length=96,
        max_steps=cli.max_steps,
        logging_steps=1,
        use_cpu=True,
        report_to="none",
    )
    trainer = GSPOTrainer(
        model,
        reward_funcs=[correct_answer],
        args=args,
        processing_class=tokenizer,
        train_dataset=questions(size=256, seed=0),
        environment_factory=Calculator,
    )
    trainer.train()
    gspo_seconds = time.perf_counter() - start - warm_up_seconds
    trainer.save_model()
    rollouts = [entry for entry in trainer.state.log_history if "reward" in entry]  # logged once per rollout
    for index, entry in enumerate(rollouts):
        print(
            f"rollout {index}: reward {entry['reward']:.3f}, tool calls per episode "
            f"{entry.get('tools/call_frequency', 0):.2f}"
        )
    if cli.record:
        keys = ("reward", "tools/call_frequency", "tools/failure_frequency", "completions/mean_length")
        record = {
            "command": "python examples/train_calculator_agent.py " + " ".join(sys.argv[1:]),
            "date": time.strftime("%Y-%m-%d"),
            "machine": f"{os.cpu_count()} CPU cores (use_cpu=True)",
            "warm_up_seconds": round(warm_up_seconds, 1),
            "gspo_seconds": round(gspo_seconds, 1),
            "rollouts": [{"step": entry["step"], **{key: entry.get(key) for key in keys}} for entry in rollouts],
        }
        with open(cli.record, "w") as file:
            json.dump(record, file, indent=2)


if __name__ == "__main__":
    main()

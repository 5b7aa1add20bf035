"""Train SmolLM2-135M-Instruct to multiply with a calculator tool: a short supervised warm-up, then GSPO.

    python examples/train_calculator_agent.py

The task is a product of a three-digit and a two-digit number, which a 135M model gets wrong in its head. The tool is
TRL's `environment_factory` convention, unchanged (docs/agents.md): `reset(**row)` starts an episode, the public
method `multiply` is the tool, the reward function gets the conversation and checks the final answer.

Asked cold, SmolLM2-135M-Instruct writes no tool call at all (0 of 32 samples, with the Hermes format described in
the prompt or with SmolLM2's own function-calling prompt), so RL would have nothing to reinforce. A short warm-up
(TRL's `SFTTrainer`, 3 steps on transcripts rendered exactly as the episodes are) shows the call format; GSPO then
trains on what the model does with it: pick the right tool (`add` is there too), call it, read the result, answer.
Measured runs: docs/agents.md.
"""

import argparse
import json
import os
import random
import sys
import time

from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import SFTConfig, SFTTrainer

from gspo_trl import GSPOConfig, GSPOTrainer
from gspo_trl.default_model import default_model_path
from gspo_trl.environments.tools import describe_tools, tool_schema


class Calculator:
    def reset(self, **row):
        self.calls = 0

    def add(self, a: int, b: int) -> int:
        """Add two integers.

        Args:
            a: The first integer.
            b: The second integer.
        """
        self.calls += 1
        return a + b

    def multiply(self, a: int, b: int) -> int:
        """Multiply two integers.

        Args:
            a: The first integer.
            b: The second integer.
        """
        self.calls += 1
        return a * b


def questions(size: int, seed: int) -> Dataset:
    rng = random.Random(seed)
    pairs = [(rng.randint(100, 999), rng.randint(11, 99)) for _ in range(size)]
    return Dataset.from_dict({
        "prompt": [[{"role": "user", "content": f"What is {a} times {b}?"}] for a, b in pairs],
        "answer": [str(a * b) for a, b in pairs],
        "a": [a for a, _ in pairs], "b": [b for _, b in pairs],
    })


def final_number(text: str) -> str | None:
    digits = "".join(ch if ch.isdigit() else " " for ch in text).split()
    return digits[-1] if digits else None


def correct_answer(completions, answer, **kwargs):
    """1 when the last assistant message ends with the right product (after the tool, or without it)."""
    return [float(final_number(messages[-1]["content"]) == expected) for messages, expected in zip(completions, answer)]


def warm_up_transcripts(size: int, seed: int) -> Dataset:
    """Tool-call transcripts rendered as the episodes will be (SmolLM2's template has no tool support: the tools are
    described in the user message, a result comes back as a user message in <tool_response> tags)."""
    calculator = Calculator()
    tools = describe_tools([tool_schema(calculator.add), tool_schema(calculator.multiply)])
    prompts, completions = [], []
    for row in questions(size, seed):
        call = {"name": "multiply", "arguments": {"a": row["a"], "b": row["b"]}}
        prompts.append([{"role": "user", "content": row["prompt"][0]["content"] + tools}])
        completions.append([
            {"role": "assistant", "content": f"<tool_call>{json.dumps(call)}</tool_call>"},
            {"role": "user", "content": f"<tool_response>\n{row['answer']}\n</tool_response>"},
            {"role": "assistant", "content": f"The answer is {row['answer']}."},
        ])
    return Dataset.from_dict({"prompt": prompts, "completion": completions})


def warm_up(model_path: str, steps: int, output_dir: str = "gspo-calculator-sft"):
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    trainer = SFTTrainer(
        AutoModelForCausalLM.from_pretrained(model_path), processing_class=tokenizer,
        train_dataset=warm_up_transcripts(size=8 * steps, seed=1),
        args=SFTConfig(output_dir=output_dir, max_steps=steps, per_device_train_batch_size=8, learning_rate=5e-5,
                       lr_scheduler_type="constant", logging_steps=4, save_strategy="no", report_to="none",
                       use_cpu=True, bf16=False, gradient_checkpointing=False, seed=0),  # TRL defaults: bf16, checkpointing
    )
    trainer.train()
    return trainer.model, tokenizer


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--warm_up_steps", type=int, default=3, help="supervised steps of 8 transcripts (12 steps "
                        "leave GSPO nothing to learn: every episode is already right)")
    parser.add_argument("--max_steps", type=int, default=12, help="GSPO optimizer steps (4 per rollout)")
    parser.add_argument("--record", default=None, help="write the per-rollout metrics and timings to this JSON file")
    cli = parser.parse_args()
    start = time.perf_counter()
    model, tokenizer = warm_up(default_model_path(), cli.warm_up_steps)
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
    trainer = GSPOTrainer(model, reward_funcs=[correct_answer], args=args, processing_class=tokenizer,
                          train_dataset=questions(size=256, seed=0), environment_factory=Calculator)
    trainer.train()
    gspo_seconds = time.perf_counter() - start - warm_up_seconds
    trainer.save_model()
    rollouts = [entry for entry in trainer.state.log_history if "reward" in entry]  # logged once per rollout
    for index, entry in enumerate(rollouts):
        print(f"rollout {index}: reward {entry['reward']:.3f}, tool calls per episode "
              f"{entry.get('tools/call_frequency', 0):.2f}")
    if cli.record:
        keys = ("reward", "tools/call_frequency", "tools/failure_frequency", "completions/mean_length")
        record = {"command": "python examples/train_calculator_agent.py " + " ".join(sys.argv[1:]),
                  "date": time.strftime("%Y-%m-%d"), "machine": f"{os.cpu_count()} CPU cores (use_cpu=True)",
                  "warm_up_seconds": round(warm_up_seconds, 1), "gspo_seconds": round(gspo_seconds, 1),
                  "rollouts": [{"step": entry["step"], **{key: entry.get(key) for key in keys}} for entry in rollouts]}
        with open(cli.record, "w") as file:
            json.dump(record, file, indent=2)


if __name__ == "__main__":
    main()

"""A calculator tool task, in TRL's `environment_factory` convention: products of a three-digit and a two-digit
number, which a 135M model gets wrong in its head.

`Calculator` (its public methods `add` and `multiply` are the tools), `questions` (the dataset), `correct_answer`
(the reward: the conversation's last message ends with the product) and `warm_up`, a few supervised steps with
TRL's `SFTTrainer` on tool-call transcripts rendered as the episodes are: SmolLM2-135M-Instruct writes no tool call
unprompted, so GSPO alone has nothing to reinforce (docs/agents.md). Used by `gspo-trl train --env calculator` and
examples/train_calculator_agent.py. The transcripts are written for chat templates without tool support (SmolLM2's):
the tools described in the user message, a result as a user message in <tool_response> tags.
"""

from __future__ import annotations

import json
import random

from datasets import Dataset
from trl.chat_template_utils import supports_tool_calling

from ..rollout.environments.tools import describe_tools, tool_schema


class Calculator:
    """TRL's convention: reset(**row) starts an episode; the public methods are the tools."""

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
    return Dataset.from_dict(
        {
            "prompt": [[{"role": "user", "content": f"What is {a} times {b}?"}] for a, b in pairs],
            "answer": [str(a * b) for a, b in pairs],
            "a": [a for a, _ in pairs],
            "b": [b for _, b in pairs],
        }
    )


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
        completions.append(
            [
                {"role": "assistant", "content": f"<tool_call>{json.dumps(call)}</tool_call>"},
                {"role": "user", "content": f"<tool_response>\n{row['answer']}\n</tool_response>"},
                {"role": "assistant", "content": f"The answer is {row['answer']}."},
            ]
        )
    return Dataset.from_dict({"prompt": prompts, "completion": completions})


def warm_up(model_path: str, steps: int, output_dir: str):
    """(model, tokenizer) after `steps` supervised steps of 8 transcripts from `model_path` (a path or Hub id)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    if supports_tool_calling(tokenizer):
        raise ValueError(
            f"{model_path}'s chat template renders tools itself; the calculator warm-up transcripts are "
            "written for templates without tool support (tools in the user message)."
        )
    trainer = SFTTrainer(
        AutoModelForCausalLM.from_pretrained(model_path),
        processing_class=tokenizer,
        train_dataset=warm_up_transcripts(size=8 * steps, seed=1),
        args=SFTConfig(
            output_dir=output_dir,
            max_steps=steps,
            per_device_train_batch_size=8,
            learning_rate=5e-5,
            lr_scheduler_type="constant",
            logging_steps=4,
            save_strategy="no",
            report_to="none",
            use_cpu=True,
            bf16=False,
            activation_checkpointing=False,
            seed=0,
        ),  # fp32, as GSPO trains
    )
    trainer.train()
    return trainer.model, tokenizer

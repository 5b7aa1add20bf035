"""Reasoning-gym tasks as TRL-ready training data and reward functions.

This module owns (1) turning a reasoning-gym task into a ``datasets.Dataset`` with a
conversational ``prompt`` column, and (2) a reward callable in TRL's convention that pulls the
answer out of a completion and scores it with the task's own verifier. It also fixes the
library's default task: one the default model (SmolLM2-135M-Instruct) solves sometimes but not
always, so GSPO groups carry a learning signal from the first step. Measured on 2 CPU cores
(16 prompts x 8 samples, 64 new tokens): mean reward 0.29 at temperature 1.0 (0.52 at 0.7) and
no group with 8 equal rewards.
"""

from __future__ import annotations

import json
import re
from typing import Any

DEFAULT_TASK = "basic_arithmetic"
# Two-term "one-digit" addition (reasoning-gym draws the terms from 0..10): the base model gets
# it right about a quarter of the time.
DEFAULT_TASK_KWARGS: dict[str, Any] = {
    "min_terms": 2,
    "max_terms": 2,
    "min_digits": 1,
    "max_digits": 1,
    "operators": ("+",),
    "allow_parentheses": False,
    "allow_negation": False,
}
# For any task: tags make the answer unambiguous when it is not a number.
GENERIC_SYSTEM_PROMPT = (
    "Solve the problem. Reply briefly and end your reply with the final answer inside <answer></answer> tags."
)
# The default task's prompt. SmolLM2-135M rarely emits <answer> tags (3-5% when asked), but often
# ends a short reply with the number; the example has a two-digit term so it is never one of the
# default task's questions.
DEFAULT_SYSTEM_PROMPT = (
    "Solve the problem. Reply with one short line that ends with the final answer, for example: 12 + 5 = 17"
)
DEFAULT_FORMAT_WEIGHT = 0.2

_ANSWER_TAG = re.compile(r"<answer>\s*(.*?)\s*</answer>", flags=re.DOTALL)
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
# A reply is well formed when nothing but whitespace or closing punctuation follows its answer.
_TRAILING_NUMBER = re.compile(r"-?\d+(?:\.\d+)?[\s.!]*$")
_TRAILING_TAG = re.compile(r"<answer>.*?</answer>[\s.!]*$", flags=re.DOTALL)


def reasoning_gym_dataset(
    task: str,
    size: int = 256,
    seed: int = 0,
    system_prompt: str = GENERIC_SYSTEM_PROMPT,
    **difficulty: Any,
):
    """Build a ``datasets.Dataset`` of ``size`` reasoning-gym questions for GRPO/GSPO training.

    Columns: ``prompt`` (system + user chat messages), ``answer`` (the oracle answer, str),
    ``entry_json`` (the full reasoning-gym entry as JSON, which the verifier needs) and ``task``.
    ``difficulty`` is passed to ``reasoning_gym.create_dataset`` (e.g. ``max_digits=1``).
    """
    import datasets
    import reasoning_gym

    source = reasoning_gym.create_dataset(task, size=size, seed=seed, **difficulty)
    rows = [_row_from_entry(task, entry, system_prompt) for entry in source]
    return datasets.Dataset.from_list(rows)


def _row_from_entry(task: str, entry: dict, system_prompt: str) -> dict:
    return {
        "prompt": [
            {"role": "system", "content": system_prompt},
            {"role": "user", "content": entry["question"]},
        ],
        "answer": str(entry["answer"]),
        # Metadata holds nested, mixed-type values Arrow cannot store as columns; JSON keeps it whole.
        "entry_json": json.dumps(entry, default=str),
        "task": task,
    }


def completion_text(completion: str | list[dict]) -> str:
    """The generated text of a completion given as a string or as TRL's list of chat messages."""
    if isinstance(completion, str):
        return completion
    content = completion[-1]["content"] if completion else ""
    if isinstance(content, list):  # multimodal-style content parts
        return "".join(part.get("text", "") for part in content)
    return content


def extract_answer(text: str, numeric: bool = True) -> str | None:
    """The answer a completion gives: the last ``<answer>`` tag, else the last number (or line).

    Falling back to the last number (not the first) matters: replies usually restate the
    question ("4 + 3 = 7") before giving the result.
    """
    tagged = _ANSWER_TAG.findall(text)
    if tagged:
        return tagged[-1]
    if numeric:
        numbers = _NUMBER.findall(text)
        return numbers[-1] if numbers else None
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else None


def ends_with_answer(text: str) -> bool:
    """True when the reply finishes with its answer (a tagged answer or a trailing number)."""
    stripped = text.strip()
    return bool(_TRAILING_TAG.search(stripped) or _TRAILING_NUMBER.search(stripped))


class ReasoningGymReward:
    """TRL reward function: ``(1 - format_weight) * verifier score + format_weight * well formed``.

    Call as ``reward(prompts, completions, completion_ids=None, entry_json=[...], **columns)``;
    returns one float in [0, 1] per completion. A completion with no answer scores 0; a wrong
    answer that ends the reply scores ``format_weight``; a correct one at the end scores 1.
    The instance's ``__name__`` names TRL's logged metrics (``rewards/<name>/mean``).
    """

    def __init__(
        self,
        task: str,
        format_weight: float = DEFAULT_FORMAT_WEIGHT,
        numeric: bool = True,
        name: str | None = None,
        **difficulty: Any,
    ):
        import reasoning_gym

        if not 0.0 <= format_weight <= 1.0:
            raise ValueError(f"format_weight must be in [0, 1], got {format_weight}")
        self.task = task
        self.format_weight = format_weight
        self.numeric = numeric
        self.__name__ = name or f"{task}_reward"
        # Verifiers read only the entry (and sometimes the config), so a one-item dataset suffices.
        self._verifier = reasoning_gym.create_dataset(task, size=1, seed=0, **difficulty)

    def __call__(self, prompts, completions, completion_ids=None, entry_json=None, log_metric=None, **columns):
        if entry_json is None:
            raise KeyError(
                f"{self.__name__} needs the 'entry_json' column; build the dataset with reasoning_gym_dataset()"
            )
        texts = [completion_text(completion) for completion in completions]
        correctness = [self.correctness(text, entry) for text, entry in zip(texts, entry_json, strict=True)]
        well_formed = [float(ends_with_answer(text)) for text in texts]
        if log_metric is not None and texts:
            # Split the shaped reward so logs show whether accuracy or only the format improved.
            log_metric(f"{self.__name__}/accuracy", sum(correctness) / len(texts))
            log_metric(f"{self.__name__}/well_formed", sum(well_formed) / len(texts))
        return [self.combine(score, formed) for score, formed in zip(correctness, well_formed, strict=True)]

    def correctness(self, text: str, entry_json: str) -> float:
        """The task verifier's score in [0, 1] for the answer extracted from ``text``."""
        answer = extract_answer(text, numeric=self.numeric)
        if answer is None:
            return 0.0
        try:
            return float(self._verifier.score_answer(answer, json.loads(entry_json)))
        except Exception:  # a verifier crashing on odd model output must not stop training
            return 0.0

    def combine(self, correctness: float, well_formed: float) -> float:
        return (1.0 - self.format_weight) * correctness + self.format_weight * well_formed


def reasoning_gym_reward(
    task: str, format_weight: float = DEFAULT_FORMAT_WEIGHT, numeric: bool = True, **difficulty: Any
) -> ReasoningGymReward:
    """Factory for :class:`ReasoningGymReward`; pass ``numeric=False`` for tasks with non-number answers."""
    return ReasoningGymReward(task, format_weight=format_weight, numeric=numeric, **difficulty)


def default_task_dataset(size: int = 256, seed: int = 0):
    """The default task's dataset: ``DEFAULT_TASK`` at ``DEFAULT_TASK_KWARGS`` difficulty."""
    return reasoning_gym_dataset(
        DEFAULT_TASK, size=size, seed=seed, system_prompt=DEFAULT_SYSTEM_PROMPT, **DEFAULT_TASK_KWARGS
    )


def default_task_reward() -> ReasoningGymReward:
    """The reward matching :func:`default_task_dataset`."""
    return ReasoningGymReward(DEFAULT_TASK, **DEFAULT_TASK_KWARGS)

"""A reasoning-gym question the model may answer again after feedback: a gym-style text environment.

Each turn's reply is scored by the task's own verifier (`tasks.ReasoningGymReward`: the verifier's score, plus a
small reward for a reply that ends with its answer). A correct reply ends the episode; a wrong one gets feedback and
another try, up to `max_turns`. A later try is worth less (``1 - retry_penalty * attempt``), so the best episodes are
right at once, and an episode's summed reward orders "right first" > "right after a miss" > "never right".
"""

from __future__ import annotations

from typing import Any

from .tasks import DEFAULT_FORMAT_WEIGHT, DEFAULT_TASK, DEFAULT_TASK_KWARGS, ReasoningGymReward, ends_with_answer

FEEDBACK = "That is not correct. Try again: reply with one short line that ends with the final answer."


class ReasoningGymRetryEnv:
    """Rows come from `tasks.reasoning_gym_dataset` (the verifier reads their ``entry_json``)."""

    def __init__(
        self,
        task: str = DEFAULT_TASK,
        retry_penalty: float = 0.3,
        format_weight: float = DEFAULT_FORMAT_WEIGHT,
        **difficulty: Any,
    ):
        if not 0 <= retry_penalty <= 1:
            raise ValueError(f"retry_penalty must be in [0, 1], got {retry_penalty}")
        if task == DEFAULT_TASK and not difficulty:
            difficulty = dict(DEFAULT_TASK_KWARGS)
        self.scorer = ReasoningGymReward(task, format_weight=format_weight, **difficulty)
        self.retry_penalty = retry_penalty
        self.entry_json, self.attempt = None, 0

    def reset(self, seed=None, options=None):
        if not options or "entry_json" not in options:
            raise KeyError(
                "ReasoningGymRetryEnv plays rows of tasks.reasoning_gym_dataset(), which carry 'entry_json'."
            )
        self.entry_json, self.attempt = options["entry_json"], 0
        return "", {}

    def step(self, action: str):
        correct = self.scorer.correctness(action, self.entry_json)
        worth = max(0.0, 1.0 - self.retry_penalty * self.attempt)
        reward = worth * self.scorer.combine(correct, float(ends_with_answer(action)))
        self.attempt += 1
        if correct >= 1.0:
            return "", reward, True, False, {"correct": True}
        return FEEDBACK, reward, False, False, {"correct": False}

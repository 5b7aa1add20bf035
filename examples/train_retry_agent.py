"""Train SmolLM2-135M-Instruct to answer again after feedback: a multi-turn GSPO run with your own environment.

    python examples/train_retry_agent.py

A gym-style text environment (docs/agents.md): `reset(seed, options)` gets the dataset row, `step(text)` scores
the assistant's turn and says what happens next. Each turn gets its own length-normalised ratio and its own
advantage (its return, normalised within the group at that turn). `gspo-trl train --env retry` runs the library's
version of this environment, which scores answers with the reasoning-gym verifier.
"""

from gspo_trl import GSPOConfig, GSPOTrainer
from gspo_trl.demo.default_model import default_model_path
from gspo_trl.demo.tasks import default_task_dataset, extract_answer


class RetryArithmeticEnv:
    """Up to `max_turns` tries at the row's question; a right answer ends the episode, a later one is worth less."""

    def reset(self, seed=None, options=None):
        self.answer, self.tries = options["answer"], 0
        return "", {}  # the row's prompt already asks the question

    def step(self, action: str):
        self.tries += 1
        correct = extract_answer(action) == self.answer
        reward = max(0.0, 1.0 - 0.3 * (self.tries - 1)) if correct else 0.0
        feedback = "That is not correct. Try again: reply with one short line that ends with the final answer."
        return feedback, reward, correct, False, {}  # observation, reward, terminated, truncated, info


def main():
    args = GSPOConfig(
        output_dir="gspo-retry-agent",
        learning_rate=2e-5,
        per_device_train_batch_size=8,
        num_generations=4,
        max_turns=2,
        max_completion_length=128,
        importance_sampling_level="turn",
        advantage_granularity="turn",
        max_steps=12,
        logging_steps=1,
        use_cpu=True,
        report_to="none",
    )
    trainer = GSPOTrainer(
        default_model_path(),
        reward_funcs=None,
        args=args,
        train_dataset=default_task_dataset(size=256, seed=0),
        env_factory=RetryArithmeticEnv,
    )
    trainer.train()
    trainer.save_model()


if __name__ == "__main__":
    main()

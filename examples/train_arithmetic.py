"""Train SmolLM2-135M-Instruct with GSPO on reasoning-gym arithmetic, from Python.

    python examples/train_arithmetic.py

The same run as `gspo-trl train`, written out with the library's API so you can swap in your own
model, dataset and reward functions. Add `peft_config=LoraConfig(...)` to train a LoRA adapter.
"""

from gspo_trl import GSPOConfig, GSPOTrainer
from gspo_trl.default_model import default_model_path
from gspo_trl.tasks import DEFAULT_TASK, DEFAULT_TASK_KWARGS, reasoning_gym_dataset, reasoning_gym_reward


def main():
    dataset = reasoning_gym_dataset(DEFAULT_TASK, size=2000, seed=0, **DEFAULT_TASK_KWARGS)
    reward = reasoning_gym_reward(DEFAULT_TASK, **DEFAULT_TASK_KWARGS)
    args = GSPOConfig(
        output_dir="gspo-arithmetic",
        learning_rate=2e-5,
        per_device_train_batch_size=16,
        num_generations=8,
        max_completion_length=48,
        max_steps=60,
        logging_steps=1,
        use_cpu=True,
        report_to="none",
    )
    trainer = GSPOTrainer(default_model_path(), reward, args=args, train_dataset=dataset)
    trainer.train()
    trainer.save_model()


if __name__ == "__main__":
    main()

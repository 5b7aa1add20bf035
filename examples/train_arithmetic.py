"""Train SmolLM2-135M-Instruct with GSPO on reasoning-gym arithmetic, from Python.

    python examples/train_arithmetic.py

The same run as `gspo-trl train`, written out with the library's API so you can swap in your own
model, dataset and reward functions. Add `peft_config=LoraConfig(...)` to train a LoRA adapter.
"""

from gspo_trl import GSPOConfig, GSPOTrainer
from gspo_trl.demo.default_model import default_model_path
from gspo_trl.demo.tasks import default_task_dataset, default_task_reward


def main():
    dataset = default_task_dataset(size=2000, seed=0)
    reward = default_task_reward()
    args = GSPOConfig(
        output_dir="gspo-arithmetic",
        learning_rate=2e-5,
        per_device_train_batch_size=16,
        num_generations=8,
        max_completion_length=48,
        max_steps=40,
        logging_steps=1,
        use_cpu=True,
        report_to="none",
    )
    trainer = GSPOTrainer(default_model_path(), reward, args=args, train_dataset=dataset)
    trainer.train()
    trainer.save_model()


if __name__ == "__main__":
    main()

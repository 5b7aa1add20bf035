"""The README.md model card written next to a trained model and pushed with `push_to_hub`.

Owns the card's text: what was trained, with which method (GSPO, with the paper's citation),
which reward functions and which key settings (`render_model_card`, pure: settings in, markdown out), and writing
it for a model (`write_model_card`).
"""

from __future__ import annotations

import os

from ..models.loading import is_peft_model

GSPO_CITATION = """@article{zheng2025gspo,
  title   = {Group Sequence Policy Optimization},
  author  = {Chujie Zheng and Shixuan Liu and Mingze Li and Xiong-Hui Chen and Bowen Yu and Chang Gao and
             Kai Dang and Yuqiong Liu and Rui Men and An Yang and Jingren Zhou and Junyang Lin},
  journal = {arXiv preprint arXiv:2507.18071},
  year    = {2025}
}"""

# Settings that define a GSPO run, in the order a reader looks for them.
KEY_SETTINGS = (
    "loss_type",
    "importance_sampling_level",
    "epsilon",
    "epsilon_high",
    "beta",
    "num_generations",
    "max_completion_length",
    "temperature",
    "learning_rate",
    "per_device_train_batch_size",
    "gradient_accumulation_steps",
    "steps_per_generation",
    "num_iterations",
    "scale_rewards",
    "reward_weights",
)


def render_model_card(
    model_name: str,
    base_model: str | None,
    reward_names: list[str],
    args,
    peft: bool,
    library_version: str,
    tags: list[str] | None = None,
) -> str:
    tag_lines = "".join(f"- {tag}\n" for tag in ["gspo", "gspo-trl", "trl", "reinforcement-learning", *(tags or [])])
    base_line = f"base_model: {base_model}\n" if base_model else ""
    settings = "\n".join(f"| `{name}` | `{getattr(args, name)}` |" for name in KEY_SETTINGS)
    rewards = "\n".join(f"- `{name}`" for name in reward_names)
    finetuned = f"a fine-tuned version of `{base_model}`" if base_model else "a model"
    adapter = " It is a LoRA adapter (PEFT)." if peft else ""
    return f"""---
library_name: transformers
{base_line}tags:
{tag_lines}---

# {model_name}

This is {finetuned}, trained with reinforcement learning using **GSPO** (Group Sequence Policy
Optimization, [arXiv 2507.18071](https://arxiv.org/abs/2507.18071)) with
[gspo-trl](https://pypi.org/project/gspo-trl/) {library_version}.{adapter}

GSPO optimizes a clipped objective on the sequence-level importance ratio
$s_i(\\theta) = (\\pi_\\theta(y_i|x) / \\pi_{{\\theta_{{old}}}}(y_i|x))^{{1/|y_i|}}$ with group-relative advantages.

## Reward functions

{rewards}

## Training settings

| setting | value |
|---|---|
{settings}

## Citation

```bibtex
{GSPO_CITATION}
```
"""


def write_model_card(
    output_dir: str, model, model_name: str, reward_names: list[str], args, library_version: str, tags=None
) -> None:
    """Write `output_dir/README.md` for the trained (unwrapped) `model`, naming its base model (under a PEFT adapter,
    the adapted one); a base model loaded from a local path is not named (it means nothing to a Hub reader)."""
    peft = is_peft_model(model)
    base_model = getattr((model.get_base_model() if peft else model).config, "_name_or_path", None)
    if base_model and os.path.isdir(base_model):
        base_model = None
    card = render_model_card(
        model_name=model_name,
        base_model=base_model,
        reward_names=reward_names,
        args=args,
        peft=peft,
        library_version=library_version,
        tags=[tags] if isinstance(tags, str) else tags,
    )
    os.makedirs(output_dir, exist_ok=True)
    with open(os.path.join(output_dir, "README.md"), "w", encoding="utf-8") as handle:
        handle.write(card)


def write_trainer_model_card(trainer, model_name: str | None, tags, library_version: str) -> None:
    """`write_model_card` for a `GSPOTrainer`'s policy, on the main process only (`Trainer.create_model_card`)."""
    if not trainer.is_world_process_zero():
        return
    output_dir = trainer.args.output_dir
    reward_names = [reward_func.name for reward_func in trainer.reward_funcs]
    model = trainer.accelerator.unwrap_model(trainer.model)
    name = model_name or os.path.basename(os.path.normpath(output_dir))
    write_model_card(output_dir, model, name, reward_names, trainer.args, library_version, tags)

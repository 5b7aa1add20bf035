"""Vision-language training side by side with TRL 1.16's `GRPOTrainer` in GSPO mode, on the same tiny Qwen2.5-VL
(`vlm_models`), data, seed and completions.

Both trainers sample with transformers' `generate` but draw from the random generator in different orders, so their
samplers are replaced by one scripted completion per row (a function of the prompt's tokens and the row's copy number).
From the same rollout on, everything is each library's own: encoding the prompts with their images, rewards,
advantages, π_old (a forward, num_iterations=2), the training forward with the images, the loss, the optimizer step.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from helpers import close, count_digits, length_reward
from vlm_models import build_tiny_qwen2_5_vl, image_dataset

from gspo_trl import GSPOConfig, GSPOTrainer

MAX_COMPLETION_LENGTH = 8
# The options both trainers get: GSPO's sequence ratio and clipping, each sequence weighing the same (our defaults,
# spelled out for TRL), one micro-batch per rollout trained twice (the second time off-policy, against π_old).
# Advantages are not divided by the group's std: TRL divides by std + 1e-4, gspo-trl by the std itself (see
# docs/migrating-from-trl.md), 0.1% apart on these groups' stds of ~0.1, which the comparison below would see.
SHARED = dict(
    per_device_train_batch_size=8,
    num_generations=4,
    steps_per_generation=1,
    num_iterations=2,
    max_completion_length=MAX_COMPLETION_LENGTH,
    max_steps=4,
    learning_rate=5e-3,
    loss_type="grpo",
    importance_sampling_level="sequence",
    epsilon=3e-4,
    epsilon_high=4e-4,
    beta=0.0,
    scale_rewards="none",
    mask_truncated_completions=False,
    temperature=1.0,
    logging_steps=1,
    save_strategy="no",
    report_to="none",
    use_cpu=True,
    bf16=False,  # TRL's default is True, ours None (off on CPU): float32 on both sides
    seed=0,
)


def scripted_completion(prompt_ids: list[int], copy: int, eos_token_id: int) -> list[int]:
    """A completion that depends on the prompt's tokens and the copy number only: 3 to 7 ordinary tokens, then EOS
    on even copies; odd copies run to the length limit (truncated)."""
    generator = torch.Generator().manual_seed(hash((tuple(prompt_ids), copy)) % 2**31)
    if copy % 2:
        return torch.randint(4, 300, (MAX_COMPLETION_LENGTH,), generator=generator).tolist()
    length = int(torch.randint(3, 8, (1,), generator=generator))
    return torch.randint(4, 300, (length,), generator=generator).tolist() + [eos_token_id]


def scripted_rows(prompt_ids: list[list[int]], eos_token_id: int) -> list[list[int]]:
    """Each row's scripted completion, rows of one prompt numbered by their order in the batch."""
    copies, rows = {}, []
    for ids in prompt_ids:
        copy = copies[tuple(ids)] = copies.get(tuple(ids), -1) + 1
        rows.append(scripted_completion(ids, copy, eos_token_id))
    return rows


def our_trainer(tmp_path):
    model, processor = build_tiny_qwen2_5_vl()
    trainer = GSPOTrainer(
        model,
        [count_digits, length_reward],
        args=GSPOConfig(output_dir=str(tmp_path / "ours"), **SHARED),
        train_dataset=image_dataset(8),
        processing_class=processor,
    )
    tokenizer = processor.tokenizer
    sampled = []

    def scripted_generate(model, prompt_ids, prompt_mask, keys, max_new_tokens, vision=None):
        rows = [ids[mask.bool()].tolist() for ids, mask in zip(prompt_ids, prompt_mask)]
        sampled.extend(rows)
        completions = scripted_rows(rows, tokenizer.eos_token_id)
        width = max(len(row) for row in completions)
        padded = [row + [tokenizer.pad_token_id] * (width - len(row)) for row in completions]
        return torch.tensor(padded, device=prompt_ids.device)

    trainer.rollout_backend._sample_with_generate = scripted_generate
    return trainer, sampled


def trl_trainer(tmp_path):
    from trl import GRPOConfig, GRPOTrainer

    model, processor = build_tiny_qwen2_5_vl()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = GRPOTrainer(
            model,
            [count_digits, length_reward],
            args=GRPOConfig(output_dir=str(tmp_path / "trl"), **SHARED),
            train_dataset=image_dataset(8),
            processing_class=processor,
        )
    eos_token_id, sampled = processor.tokenizer.eos_token_id, []

    def scripted_generate(prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        sampled.extend(list(ids) for ids in prompt_ids)
        return scripted_rows([list(ids) for ids in prompt_ids], eos_token_id), None

    trainer._generate_single_turn = scripted_generate
    return trainer, sampled


@pytest.mark.slow  # two training runs and TRL's import
def test_trains_the_same_run_as_trl_on_the_same_completions(tmp_path):
    ours, our_prompts = our_trainer(tmp_path)
    theirs, their_prompts = trl_trainer(tmp_path)
    ours.train()
    theirs.train()
    # The same prompts, rendered with their image tokens alike, in the same order (both samplers shuffle by the seed).
    assert our_prompts == their_prompts and len(our_prompts) == 2 * SHARED["per_device_train_batch_size"]
    ours_logs = [entry for entry in ours.state.log_history if "loss" in entry]
    trl_logs = [entry for entry in theirs.state.log_history if "loss" in entry]
    assert len(ours_logs) == len(trl_logs) == SHARED["max_steps"]
    # fp32 on both sides, the same operations in other orders (TRL's chunked log-softmax, the loss's reductions):
    # values of order one agree to a few float32 roundings, ~1e-6; 1e-5 is that with margin. A forward without the
    # images (log-probs 0.1 apart, test_multimodal) fails it by orders of magnitude, and so did TRL under its default
    # bf16 autocast (log-probs 2e-3 apart, the first step's gradient norm 2.3e-4).
    for step, (mine, trl) in enumerate(zip(ours_logs, trl_logs)):
        rollout = ("reward", "reward_std", "completions/mean_length") if step % 2 == 0 else ()  # logged when sampled
        for name in ("loss", "entropy", "grad_norm", *rollout):
            assert mine[name] == close(trl[name], 1e-5), (step, name, mine[name], trl[name])
    # The second use of each rollout is off-policy, against π_old: the ratio moved off 1 and was clipped.
    assert ours_logs[1]["ratio/max"] > 1 and ours_logs[1]["clip_ratio/region"] > 0
    # The weights moved alike. Adam divides each gradient entry by its running RMS, so an entry whose gradient is
    # float rounding (~1e-9) moves by up to the learning rate on either side: compare the whole update, not entries.
    initial = dict(build_tiny_qwen2_5_vl()[0].named_parameters())
    trl_weights = dict(theirs.model.named_parameters())
    ours_update = torch.cat([(value - initial[name]).flatten() for name, value in ours.model.named_parameters()])
    trl_update = torch.cat([(value - initial[name]).flatten() for name, value in trl_weights.items()])
    # Measured: 6.6e-6 of the update's norm; 1e-4 leaves 15× margin.
    assert (ours_update - trl_update).norm() <= 1e-4 * trl_update.norm()

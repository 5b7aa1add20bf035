"""Idefics3 (SmolVLM's architecture): each image split into sub-images by the processor. `pixel_values` is
(1, N, C, H, W) and `pixel_attention_mask` (1, N, H, W) per prompt, N = the prompt's sub-images over all its images;
`VisionInputs` stores them once per prompt and pads N with zero images across prompts, which the model drops. The
family also runs in `test_multimodal.py`'s parametrised tests (`vlm_models.BUILDERS`); SmolVLM's model class runs the
padding and training tests here."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from helpers import count_digits, small_config
from PIL import Image
from vlm_models import build_tiny_idefics3

from gspo_trl import GSPOTrainer
from gspo_trl.models.multimodal import encode_prompts
from gspo_trl.training.logprobs import completion_logprobs
from gspo_trl.training.micro_batch import MicroBatch
from gspo_trl.training.rollout_checkpoint import RolloutState, load_rollout_state, save_rollout_state

# The builder's sizes: images resized to a longest edge of 56, split into 28×28 tiles plus the whole image at 28×28;
# a 28×28 tile is 4×4 patches of 7, shuffled 2×2 into 4 image tokens (`image_seq_len`).
TOKENS_PER_SUB_IMAGE = 4
# SmolVLM's model class on the same inputs: it places each image's features by its own code (`inputs_merger`).
MODEL_TYPES = ("idefics3", "smolvlm")


def _noise(seed: int, width: int, height: int) -> Image.Image:
    generator = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (height, width, 3), generator=generator, dtype=torch.uint8)
    return Image.fromarray(pixels.numpy())


def _prompt(*images, text="What is 1 + 3?"):
    parts = [{"type": "image", "image": image} for image in images]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


# Square: 2×2 tiles + the whole image = 5 sub-images; 2:1: 1×2 tiles + 1 = 3; two square images: 10.
SQUARE, WIDE, TWO_SQUARES = 5, 3, 10


def _mixed_prompts():
    return [
        _prompt(_noise(0, 56, 56)),
        _prompt(_noise(1, 56, 28), text="Count the red squares in it."),
        _prompt(_noise(2, 56, 56), _noise(3, 56, 56)),
    ]


def _config(tmp_path, **overrides):
    values = dict(num_generations=2, steps_per_generation=2)
    values.update(overrides)
    return small_config(tmp_path, **values)


def _dataset(n: int = 4):
    """Prompts whose images split into different numbers of sub-images: square, wide, and two squares per prompt."""
    from datasets import Dataset

    rows = []
    for index in range(n):
        prompt = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": f"What is {index} + 3?"}]}]
        kind = index % 3
        if kind == 2:
            prompt[0]["content"].insert(0, {"type": "image"})
            images = [_noise(index, 56, 56), _noise(100 + index, 56, 56)]
        else:
            images = [_noise(index, 56, 28 if kind else 56)]
        rows.append({"prompt": prompt, "images": images})
    return Dataset.from_list(rows)


def test_processor_splits_each_image_into_sub_images():
    _, processor = build_tiny_idefics3()
    image_token = processor.image_token_id
    for prompt, sub_images in zip(_mixed_prompts(), (SQUARE, WIDE, TWO_SQUARES)):
        ids, mask, vision = encode_prompts(processor, [prompt], None)
        fields = vision.prompts[0]
        assert set(fields) == {"pixel_values", "pixel_attention_mask"}
        assert fields["pixel_values"].shape == (1, sub_images, 3, 28, 28)
        # Every tile is a full 28×28 crop: no pixel of a real sub-image is padding.
        assert fields["pixel_attention_mask"].shape == (1, sub_images, 28, 28) and fields["pixel_attention_mask"].all()
        assert (ids == image_token).sum() == TOKENS_PER_SUB_IMAGE * sub_images
        # Each tile is tagged by its place (`<row_i_col_j>`), the whole image by `<global-img>`: single tokens.
        tags = [processor.tokenizer.convert_tokens_to_ids(tag) for tag in ("<row_1_col_2>", "<global-img>")]
        assert all((ids == tag).any() for tag in tags)
    # Without splitting, an image is one 28×28 sub-image.
    _, whole = build_tiny_idefics3(do_image_splitting=False)
    ids, _, vision = encode_prompts(whole, [_mixed_prompts()[0]], None)
    assert vision.prompts[0]["pixel_values"].shape == (1, 1, 3, 28, 28)
    assert (ids == image_token).sum() == TOKENS_PER_SUB_IMAGE


def test_rows_pad_sub_images_as_the_processor_pads_a_batch():
    _, processor = build_tiny_idefics3()
    prompts = _mixed_prompts()
    rows = [prompt for prompt in prompts for _ in range(2)]  # a group of 2 completions per prompt
    ids, mask, vision = encode_prompts(processor, rows, None)
    # Stored once per prompt, each with its own number of sub-images.
    assert [p["pixel_values"].shape[1] for p in vision.prompts] == [SQUARE, WIDE, TWO_SQUARES]
    assert vision.groups.tolist() == [0, 0, 1, 1, 2, 2]
    per_row = vision.rows_inputs(ids.shape[1] + 3)
    # The processor's own batch of the three prompts: zero images and zero masks after each prompt's sub-images.
    texts = [processor.apply_chat_template(p, tokenize=False, add_generation_prompt=True) for p in prompts]
    images = [[part["image"] for part in p[0]["content"] if part["type"] == "image"] for p in prompts]
    batch = processor(text=texts, images=images, return_tensors="pt", padding=True, add_special_tokens=False)
    for name in ("pixel_values", "pixel_attention_mask"):
        assert per_row[name].shape[:2] == (6, TWO_SQUARES)
        assert torch.equal(per_row[name], batch[name][vision.groups]), name
    # The padding images are all zero (what the model drops), a real one never is.
    real = per_row["pixel_values"].flatten(2).ne(0).any(dim=2)  # (rows, sub-images)
    assert real.sum(dim=1).tolist() == [SQUARE, SQUARE, WIDE, WIDE, TWO_SQUARES, TWO_SQUARES]
    # Left-padded ids: each row's image tokens are its own sub-images' count.
    assert ((ids == processor.image_token_id).sum(dim=1) == TOKENS_PER_SUB_IMAGE * real.sum(dim=1)).all()


def test_a_checkpointed_rollout_keeps_each_prompts_sub_images(tmp_path):
    """A rollout saved inside a checkpoint and loaded back gives every row the same fields: each prompt's tensors,
    3, 5 and 10 sub-images, are saved under their own names, not stacked."""
    _, processor = build_tiny_idefics3()
    rows = [prompt for prompt in _mixed_prompts() for _ in range(2)]
    ids, mask, vision = encode_prompts(processor, rows, None)
    completion = torch.ones(len(rows), 3, dtype=torch.long)
    batch = MicroBatch(
        torch.cat([ids, completion], 1), F.pad(mask, (0, 3), value=1), completion, completion, vision=vision
    )
    state = RolloutState(
        [batch.to_state()], sampled_at_step=1, shuffle_generator_state=torch.zeros(1), num_tokens_seen=0
    )
    save_rollout_state(str(tmp_path), 0, state)
    restored = MicroBatch.from_state(load_rollout_state(str(tmp_path), 0, torch.device("cpu")).micro_batches[0])
    assert [p["pixel_values"].shape[1] for p in restored.vision.prompts] == [SQUARE, WIDE, TWO_SQUARES]
    before, after = vision.rows_inputs(ids.shape[1] + 3), restored.vision.rows_inputs(ids.shape[1] + 3)
    assert before.keys() == after.keys() and all(torch.equal(before[name], after[name]) for name in before)


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_a_rows_logprobs_do_not_depend_on_the_rows_beside_it(model_type):
    """A row scored in a batch with other prompts (left-padded, its sub-images padded with zero images) gets the
    log-probs it gets alone: the padding images are dropped and each row's features reach its own image tokens."""
    model, processor = build_tiny_idefics3(model_type=model_type)
    assert (
        type(model).__name__ == {"idefics3": "Idefics3", "smolvlm": "SmolVLM"}[model_type] + "ForConditionalGeneration"
    )
    model.eval()
    prompts = _mixed_prompts()
    completion = torch.randint(0, 300, (1, 6), generator=torch.Generator().manual_seed(0))
    ones = torch.ones_like(completion)

    def scores(prompts):
        ids, mask, vision = encode_prompts(processor, prompts, None)
        rows = len(prompts)
        inputs = (torch.cat([ids, completion.expand(rows, -1)], 1), torch.cat([mask, ones.expand(rows, -1)], 1))
        with torch.no_grad():
            return completion_logprobs(
                model, *inputs, completion.expand(rows, -1), ones.expand(rows, -1), vision=vision
            )

    together = scores(prompts).logps
    for index, prompt in enumerate(prompts):
        alone = scores([prompt]).logps[0]
        # fp32: the same row at other padding sums the same products in another order at most (~1e-6 on log-probs
        # of order one); 1e-5 bounds that, far below the O(0.1) a misplaced or dropped image moves them.
        torch.testing.assert_close(together[index], alone, atol=1e-5, rtol=0)
    # The three images differ, and so do their rows (an image silently dropped would leave them equal).
    assert (together[0] - together[1]).abs().max() > 1e-3 and (together[0] - together[2]).abs().max() > 1e-3


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_training_forward_matches_sampling_with_mixed_sub_images(model_type, tmp_path):
    """`generate`'s prefill and the training forward see rows with 3, 5 and 10 sub-images padded to 10, and score
    the sampled completions alike."""
    model, processor = build_tiny_idefics3(model_type=model_type)
    temperature = 0.9
    dataset = _dataset(6)  # a rollout takes 6 prompts; the test samples 3 of them
    args = _config(tmp_path, temperature=temperature, max_completion_length=8, per_device_train_batch_size=6)
    trainer = GSPOTrainer(model, count_digits, args=args, train_dataset=dataset, processing_class=processor)
    captured = {}
    generate = model.generate

    def generate_and_keep_logits(*args, **kwargs):
        out = generate(*args, **kwargs, output_logits=True, return_dict_in_generate=True)
        captured["logits"] = torch.stack(out.logits, dim=1)  # (B, C, V) before any logits processor
        return out.sequences

    model.generate = generate_and_keep_logits
    trainer.model.train()
    scored = trainer._generate_and_score([dataset[i] for i in (0, 0, 1, 1, 2, 2)], "train")
    assert [p["pixel_values"].shape[1] for p in scored.vision.prompts] == [SQUARE, WIDE, TWO_SQUARES]
    with torch.no_grad():
        scores = completion_logprobs(
            trainer.model, *scored.model_inputs(), temperature=temperature, vision=scored.vision
        )
    mask = scored.completion_mask.bool()
    sampled = torch.log_softmax(captured["logits"].float() / temperature, dim=-1)
    sampled = sampled.gather(-1, scored.completion_ids.unsqueeze(-1)).squeeze(-1)
    # The bound of test_multimodal's test_training_forward_matches_sampling_logits: a KV-cached step and a full
    # forward differ by fp32 rounding (~1e-6); measured 4.8e-7 here.
    torch.testing.assert_close(scores.logps[mask], sampled[mask], atol=1e-4, rtol=0)


@pytest.mark.slow  # a full training run and an evaluation of several seconds
@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_trains_and_evaluates_with_two_images_per_prompt(model_type, tmp_path):
    model, processor = build_tiny_idefics3(model_type=model_type)
    trainer = GSPOTrainer(
        model,
        count_digits,
        args=_config(tmp_path, max_steps=1, per_device_eval_batch_size=4),
        train_dataset=_dataset(4),
        eval_dataset=_dataset(2),
        processing_class=processor,
    )
    trainer.train()
    assert trainer.state.global_step == 1
    metrics = trainer.evaluate()
    assert math.isfinite(metrics["eval_reward"]) and math.isfinite(metrics["eval_loss"])


@pytest.mark.slow  # a full training run of several seconds
def test_lora_bf16_and_reference(tmp_path):
    from peft import LoraConfig

    model, processor = build_tiny_idefics3()
    model = model.to(torch.bfloat16)
    # Idefics3's language model is `text_model`; its vision tower also has `q_proj`/`v_proj`, left out by the pattern.
    peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=r".*text_model.*\.(q_proj|v_proj)")
    vision_before = {n: p.detach().clone() for n, p in model.named_parameters() if ".vision_model." in n}
    trainer = GSPOTrainer(
        model,
        count_digits,
        args=_config(tmp_path, bf16=True, beta=0.04),
        train_dataset=_dataset(4),
        processing_class=processor,
        peft_config=peft_config,
    )
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert len(logs) == 2 and all("kl" in entry and math.isfinite(entry["loss"]) for entry in logs)
    lora_names = [name for name, p in trainer.model.named_parameters() if p.requires_grad]
    assert lora_names and all("lora_" in name and "text_model" in name for name in lora_names)
    vision_after = {
        n.replace("base_model.model.", ""): p for n, p in trainer.model.named_parameters() if ".vision_model." in n
    }
    assert vision_before and all(torch.equal(vision_after[n], p) for n, p in vision_before.items())


@pytest.mark.slow  # a full training run of several seconds
def test_model_loaded_from_a_path(tmp_path):
    model, processor = build_tiny_idefics3()
    model.save_pretrained(tmp_path / "model")
    processor.save_pretrained(tmp_path / "model")
    trainer = GSPOTrainer(
        str(tmp_path / "model"), count_digits, args=_config(tmp_path / "out", max_steps=1), train_dataset=_dataset(4)
    )
    assert type(trainer.model).__name__ == "Idefics3ForConditionalGeneration"
    loaded = trainer.processing_class
    assert type(loaded).__name__ == "Idefics3Processor" and loaded.image_seq_len == TOKENS_PER_SUB_IMAGE
    assert loaded.image_processor.do_image_splitting
    trainer.train()
    assert trainer.state.global_step == 1

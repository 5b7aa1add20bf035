"""Vision-language models: prompts with images from the dataset to the forward (`gspo_trl/models/multimodal.py`), and
the
trainer on tiny random Qwen2.5-VL and LLaVA models built offline (`vlm_models`)."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import close, count_digits, small_config
from vlm_models import BUILDERS, build_tiny_llava, build_tiny_qwen2_5_vl, image_dataset, noise_image

from gspo_trl import GSPOTrainer
from gspo_trl.models.multimodal import (
    VisionInputs,
    encode_prompts,
    is_processor,
    message_images,
    prompts_with_images,
    row_images,
)
from gspo_trl.training.logprobs import completion_logprobs
from gspo_trl.training.micro_batch import MicroBatch

FAMILIES = sorted(BUILDERS)


def _prompt(text="What is 1 + 3?"):
    return [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}]


def _config(tmp_path, **overrides):
    values = dict(num_generations=2, steps_per_generation=2)
    values.update(overrides)
    return small_config(tmp_path, **values)


# --- pure parts ---------------------------------------------------------------------------------------------------


def test_row_images_and_prompts_with_images():
    image_a, image_b = noise_image(0), noise_image(1)
    assert row_images({"prompt": "x"}) is None
    assert row_images({"image": image_a}) == [image_a]
    assert row_images({"images": [image_a, image_b], "image": None}) == [image_a, image_b]
    # Arrow stores {"type": "image"} as {"type": "image", "text": None}: the placeholder is still filled.
    arrow_prompt = [{"role": "user", "content": [{"type": "image", "text": None}, {"type": "text", "text": "hi"}]}]
    text_row = {"prompt": "plain"}
    _, processor = build_tiny_llava()
    prompts = prompts_with_images([{"prompt": arrow_prompt, "image": image_a}, text_row], processor)
    assert message_images(prompts[0]) == [image_a]
    assert prompts[1] == "plain"
    # A string-content prompt gets its images before the first user message's text (TRL's convention).
    string_row = {"prompt": [{"role": "user", "content": "hi"}], "images": [image_a, image_b]}
    assert message_images(prompts_with_images([string_row], processor)[0]) == [image_a, image_b]
    # A text model's image column is a reward input only: its prompts stay as they are.
    assert prompts_with_images([string_row], processor.tokenizer)[0] is string_row["prompt"]
    with pytest.raises(ValueError, match="conversational prompt"):
        prompts_with_images([{"prompt": "plain text", "image": image_a}], processor)


def test_vision_inputs_rows_select_and_pad():
    # Two prompts: the first with 2 "patches" (Qwen-style flattened rows), the second with 1; rows 0, 1 → prompt 0.
    first = {"pixel_values": torch.tensor([[1.0], [2.0]]), "mm_token_type_ids": torch.tensor([[0, 1, 1]])}
    second = {"pixel_values": torch.tensor([[3.0]]), "mm_token_type_ids": torch.tensor([[0, 0, 1]])}
    vision = VisionInputs([first, second], torch.tensor([0, 0, 1]))
    inputs = vision.rows_inputs(total_length=5)
    # Each row gets its prompt's patches, in row order: 2 + 2 + 1.
    assert inputs["pixel_values"].flatten().tolist() == [1.0, 2.0, 1.0, 2.0, 3.0]
    # Token-aligned fields: zero over the completion's 2 columns.
    assert inputs["mm_token_type_ids"].tolist() == [[0, 1, 1, 0, 0], [0, 1, 1, 0, 0], [0, 0, 1, 0, 0]]
    # Selecting rows keeps only their prompts, the same tensors (no copy), with groups renumbered.
    part = vision.select(slice(1, 3))
    assert part.groups.tolist() == [0, 1]
    assert part.prompts[0]["pixel_values"] is first["pixel_values"]
    assert vision.select(torch.tensor([2])).prompts == [second]
    # Per-prompt tensors whose later dimensions differ (Idefics3's images per prompt) are zero-padded.
    padded = VisionInputs(
        [{"pixel_values": torch.ones(1, 2, 3)}, {"pixel_values": torch.ones(1, 1, 3)}], torch.arange(2)
    )
    assert padded.rows_inputs(4)["pixel_values"].sum(dim=(1, 2)).tolist() == [6.0, 3.0]


def test_encode_prompts_stores_each_prompt_once():
    _, processor = build_tiny_qwen2_5_vl()
    image_a, image_b = noise_image(0), noise_image(1)
    group_size = 4
    prompts = [*[_prompt() for _ in range(group_size)], *[_prompt("What is 12 + 3?") for _ in range(group_size)]]
    for index, prompt in enumerate(prompts):
        prompt[0]["content"][0]["image"] = image_a if index < group_size else image_b
    ids, mask, vision = encode_prompts(processor, prompts, max_prompt_length=None)
    assert ids.shape[0] == 2 * group_size and vision.groups.tolist() == [0] * group_size + [1] * group_size
    assert len(vision.prompts) == 2
    one = encode_prompts(processor, prompts[:1], None)[2]
    # Stored once per prompt: two prompts' worth of bytes, not eight rows' (the forward expands them).
    assert vision.stored_bytes() == 2 * one.stored_bytes()
    per_row = vision.rows_inputs(ids.shape[1])
    assert per_row["pixel_values"].shape[0] == 2 * group_size * one.prompts[0]["pixel_values"].shape[0]
    # Left-padded like the ids; the image tokens are those the processor marks, 4 per 56×56 image (2×2 merged).
    assert (per_row["mm_token_type_ids"].sum(dim=1) == 4).all()
    image_token = processor.image_token_id
    assert ((ids == image_token).long() == per_row["mm_token_type_ids"]).all()
    assert (ids[mask == 0] == processor.tokenizer.pad_token_id).all()
    with pytest.raises(ValueError, match="max_prompt_length"):
        encode_prompts(processor, prompts, max_prompt_length=8)
    with pytest.raises(ValueError, match="mixes prompts with images"):
        encode_prompts(processor, [prompts[0], [{"role": "user", "content": "no image"}]], max_prompt_length=None)


def test_is_processor():
    _, processor = build_tiny_llava()
    assert is_processor(processor) and not is_processor(processor.tokenizer)


# --- the forward sees the images ----------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_different_image_gives_different_logprobs(family):
    model, processor = BUILDERS[family]()
    model.eval()
    prompts = []
    for seed in (0, 1, 0):  # the same text; images A, B, then A again
        prompt = _prompt()
        prompt[0]["content"][0]["image"] = noise_image(seed)
        prompts.append(prompt)
    # Not consecutive duplicates: three groups, rows 0 and 2 encoded separately from the same image.
    ids, mask, vision = encode_prompts(processor, prompts, None)
    completion = torch.randint(0, 300, (1, 6), generator=torch.Generator().manual_seed(0)).expand(3, 6)
    completion_mask = torch.ones_like(completion)
    with torch.no_grad():
        logps = completion_logprobs(
            model,
            torch.cat([ids, completion], dim=1),
            torch.cat([mask, completion_mask], dim=1),
            completion,
            completion_mask,
            vision=vision,
        ).logps
    # The same image twice: equal to float32 rounding (one batch, same row length; 1e-5 is ~100× the rounding of
    # a log-softmax over 400 logits of order one).
    torch.testing.assert_close(logps[0], logps[2], atol=1e-5, rtol=0)
    # Another image: far from equal. A random tower's features differ by O(1) between two noise images; 1e-3 is
    # two orders above the rounding bound, so an image silently dropped (identical rows) fails here.
    assert (logps[0] - logps[1]).abs().max() > 1e-3


@pytest.mark.parametrize("family", FAMILIES)
def test_training_forward_matches_sampling_logits(family, tmp_path):
    """The log-probs the training forward gives the sampled completions equal the sampler's own (generate's raw
    logits at the sampling temperature): both saw the same images at the same positions."""
    model, processor = BUILDERS[family]()
    temperature = 0.9
    args = _config(tmp_path, temperature=temperature, max_completion_length=8)
    dataset = image_dataset(4)
    trainer = GSPOTrainer(model, count_digits, args=args, train_dataset=dataset, processing_class=processor)
    captured = {}
    generate = model.generate

    def generate_and_keep_logits(*args, **kwargs):
        out = generate(*args, **kwargs, output_logits=True, return_dict_in_generate=True)
        captured["logits"] = torch.stack(out.logits, dim=1)  # (B, C, V) before any logits processor
        return out.sequences

    model.generate = generate_and_keep_logits
    batch = [dataset[i] for i in (0, 0, 1, 1)]
    trainer.model.train()
    scored = trainer._generate_and_score(batch, "train")
    assert isinstance(scored, MicroBatch) and scored.vision is not None and len(scored.vision.prompts) == 2
    with torch.no_grad():
        scores = completion_logprobs(
            trainer.model, *scored.model_inputs(), temperature=temperature, vision=scored.vision
        )
        without_images = completion_logprobs(trainer.model, *scored.model_inputs(), temperature=temperature).logps
    mask = scored.completion_mask.bool()
    sampled = torch.log_softmax(captured["logits"].float() / temperature, dim=-1)
    sampled = sampled.gather(-1, scored.completion_ids.unsqueeze(-1)).squeeze(-1)
    # fp32: a KV-cached decoding step and one full forward differ by the rounding of a few 64-wide sums per layer
    # (~1e-6 on logits of order one); 1e-4 bounds that with margin and is far below the gap without images.
    torch.testing.assert_close(scores.logps[mask], sampled[mask], atol=1e-4, rtol=0)
    # Measured: 4.8e-7 with the images (each family); without them 0.11 (Qwen2.5-VL), 0.15 (LLaVA), 0.32 (Gemma 3).
    assert (without_images[mask] - sampled[mask]).abs().max() > 1e-2


def test_sampler_uses_generate_and_never_samples_the_image_token(tmp_path):
    model, processor = BUILDERS["gemma3"]()
    args, dataset = _config(tmp_path), image_dataset(4)
    trainer = GSPOTrainer(model, count_digits, args=args, train_dataset=dataset, processing_class=processor)
    backend = trainer.rollout_backend
    assert not backend.use_decode_loop  # the decoding loops prefill text only
    # The model config's image token (Gemma 3's processor names its begin-of-image token image_token_id instead).
    assert backend.generation_config.suppress_tokens == [model.config.image_token_id] != [processor.image_token_id]


# --- training -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_trains_two_steps_with_an_image_column(family, tmp_path):
    model, processor = BUILDERS[family]()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    rewards_saw = []

    def image_reward(completions, image, **kwargs):  # the column reaches the reward functions
        rewards_saw.extend(image)
        return count_digits(completions)

    trainer = GSPOTrainer(
        model, image_reward, args=_config(tmp_path), train_dataset=image_dataset(4), processing_class=processor
    )
    assert trainer.processing_class is processor and trainer.tokenizer is processor.tokenizer
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert len(logs) == 2 and all(torch.isfinite(torch.tensor(entry["loss"])) for entry in logs)
    assert rewards_saw and all(hasattr(image, "size") for image in rewards_saw)
    moved = [name for name, p in model.named_parameters() if not torch.equal(p, before[name])]
    assert any("lm_head" in name or "language_model" in name for name in moved)


@pytest.mark.slow  # a full training run of several seconds
def test_trains_and_evaluates_with_two_images_per_prompt(tmp_path):
    model, processor = build_tiny_qwen2_5_vl()
    trainer = GSPOTrainer(
        model,
        count_digits,
        args=_config(tmp_path, max_steps=1, per_device_eval_batch_size=4),
        train_dataset=image_dataset(4, column="images"),
        eval_dataset=image_dataset(2, column="images"),
        processing_class=processor,
    )
    trainer.train()
    assert trainer.state.global_step == 1
    metrics = trainer.evaluate()
    assert math.isfinite(metrics["eval_reward"]) and math.isfinite(metrics["eval_loss"])


@pytest.mark.slow  # a full training run of several seconds
def test_lora_bf16_and_reference(tmp_path):
    from peft import LoraConfig

    model, processor = build_tiny_qwen2_5_vl()
    model = model.to(torch.bfloat16)
    # LoRA on the language model's attention only (the vision tower's blocks are `qkv`/`proj`, not matched).
    peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=r".*language_model.*\.(q_proj|v_proj)")
    args = _config(tmp_path, bf16=True, beta=0.04)
    vision_before = {n: p.detach().clone() for n, p in model.named_parameters() if n.startswith("model.visual")}
    trainer = GSPOTrainer(
        model,
        count_digits,
        args=args,
        train_dataset=image_dataset(4),
        processing_class=processor,
        peft_config=peft_config,
    )
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert len(logs) == 2 and all("kl" in entry for entry in logs)
    lora_names = [name for name, p in trainer.model.named_parameters() if p.requires_grad]
    assert lora_names and all("lora_" in name and "language_model" in name for name in lora_names)
    vision_after = {
        n.replace("base_model.model.", ""): p for n, p in trainer.model.named_parameters() if ".visual." in n
    }
    assert vision_after and all(torch.equal(vision_after[n], p) for n, p in vision_before.items())


@pytest.mark.slow  # a full training run of several seconds
def test_model_loaded_from_a_path(tmp_path):
    model, processor = build_tiny_llava()
    model.save_pretrained(tmp_path / "model")
    processor.save_pretrained(tmp_path / "model")
    trainer = GSPOTrainer(
        str(tmp_path / "model"),
        count_digits,
        args=_config(tmp_path / "out", max_steps=1),
        train_dataset=image_dataset(4),
    )
    assert type(trainer.model).__name__ == "LlavaForConditionalGeneration"
    assert type(trainer.processing_class).__name__ == "LlavaProcessor"
    trainer.train()


# --- refusals -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides, extra, match",
    [
        ({"use_vllm": True}, {}, "use_vllm"),
        ({"async_rollouts": True}, {}, "async_rollouts"),
        ({"dynamic_sampling": True}, {}, "dynamic_sampling"),
        ({"pad_to_multiple_of": 8}, {}, "pad_to_multiple_of"),
        ({"padding_free": True}, {}, "padding_free"),
        ({}, {"env_factory": lambda: None}, "env_factory"),
        ({}, {"rollout_func": lambda prompts, trainer: {}}, "rollout_func"),
    ],
)
def test_refused_options(overrides, extra, match, tmp_path):
    model, processor = build_tiny_llava()
    with pytest.raises(ValueError, match=match):
        GSPOTrainer(
            model,
            count_digits,
            args=_config(tmp_path, **overrides),
            train_dataset=image_dataset(4),
            processing_class=processor,
            **extra,
        )


def test_not_a_processor_is_refused(tmp_path):
    model, _ = build_tiny_llava()
    with pytest.raises(TypeError, match="processing_class"):
        GSPOTrainer(model, count_digits, args=_config(tmp_path), train_dataset=image_dataset(4), processing_class=1)


@pytest.mark.slow  # two training runs
@pytest.mark.parametrize("family", FAMILIES)
def test_resume_inside_a_rollout_continues_it_with_its_images(family, tmp_path):
    # steps_per_generation=2 without accumulation: a rollout lasts two optimizer steps, and step 1 saves inside it.
    args = _config(tmp_path, save_strategy="steps", save_steps=1)
    model, processor = BUILDERS[family]()
    trainer = GSPOTrainer(model, count_digits, args=args, train_dataset=image_dataset(4), processing_class=processor)
    trainer.train()
    checkpoint = tmp_path / "checkpoint-1"
    assert (checkpoint / "processor_config.json").exists()

    model, processor = BUILDERS[family]()
    resumed = GSPOTrainer(model, count_digits, args=args, train_dataset=image_dataset(4), processing_class=processor)
    sampled = []
    generate = resumed.rollout_backend.generate
    resumed.rollout_backend.generate = lambda prompts, *rest: sampled.append(prompts) or generate(prompts, *rest)
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert sampled == []  # step 2 trains on the saved rollout, images included, not on a new one
    first, again = trainer.state.log_history[1], resumed.state.log_history[1]
    assert first["step"] == again["step"] == 2
    # The same micro-batch on the same restored weights: equal up to float32 rounding of a tiny model's forward
    # (1e-5 relative is ~100× that rounding); a rollout restored without its images would score other log-probs.
    for name in ("ratio/mean", "entropy", "loss"):
        assert again[name] == close(first[name], 1e-5), name
    # The weights were restored (transformers saves these models under other key names than it loads with
    # `load_state_dict`), so both runs end on the same weights.
    final = dict(trainer.model.named_parameters())
    for name, value in resumed.model.named_parameters():
        torch.testing.assert_close(value, final[name], atol=1e-6, rtol=1e-5)


def test_checkpoint_between_rollouts_saves_the_processor(tmp_path):
    model, processor = build_tiny_qwen2_5_vl()
    args = _config(tmp_path, save_strategy="steps", save_steps=2)
    trainer = GSPOTrainer(model, count_digits, args=args, train_dataset=image_dataset(4), processing_class=processor)
    trainer.train()
    assert (tmp_path / "checkpoint-2" / "processor_config.json").exists()


def test_fsdp_is_refused(tmp_path, monkeypatch):
    # `accelerate launch` with an FSDP config says so in every process's environment; untested with images, and a
    # resume would load its sharded checkpoint as a whole one.
    model, processor = build_tiny_llava()
    args = _config(tmp_path)
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    with pytest.raises(ValueError, match="FSDP"):
        GSPOTrainer(model, count_digits, args=args, train_dataset=image_dataset(4), processing_class=processor)

"""The vision tower runs once per prompt, not once per completion (`gspo_trl/models/vision_features.py`): the features
of a
prompt's images shared by its rows, the same log-probs and gradients as encoding every row's images, and the tower's
calls counted in a training step on tiny random Qwen2.5-VL, LLaVA and Gemma 3 models (`vlm_models`)."""

from __future__ import annotations

import contextlib
import functools

import pytest
import torch
from helpers import count_digits, small_config
from vlm_models import BUILDERS, build_tiny_qwen2_5_vl, image_dataset, noise_image

import gspo_trl.training.logprobs as logprobs_module
from gspo_trl import GSPOTrainer
from gspo_trl.models.multimodal import VisionInputs, encode_prompts
from gspo_trl.models.vision_features import feature_owner, features_to_rows, images_encoded_once
from gspo_trl.rollout.streams import stream_keys
from gspo_trl.training.logprobs import completion_logprobs

FAMILIES = sorted(BUILDERS)


# --- features_to_rows: hand-derived ---------------------------------------------------------------------------------


def test_features_to_rows_gives_each_row_its_prompts_features():
    # Prompt 0 has 2 feature vectors (one image of 2 tokens), prompt 1 has 1; rows answer prompts 1, 0, 0.
    first, second = torch.tensor([[1.0, 10.0], [2.0, 20.0]]), torch.tensor([[3.0, 30.0]])
    groups, row_tokens = torch.tensor([1, 0, 0]), torch.tensor([1, 2, 2])
    expected = [[3.0, 30.0], [1.0, 10.0], [2.0, 20.0], [1.0, 10.0], [2.0, 20.0]]
    # A list (LLaVA, Idefics3) or a tuple (Qwen2.5-VL) of per-image features stays one; the rows' features flat.
    (rows,) = features_to_rows((first, second), row_tokens, groups)
    assert rows.tolist() == expected
    assert isinstance(features_to_rows([first, second], row_tokens, groups), list)
    # A tensor (Gemma 3: images × tokens × hidden) stays a tensor, flattened to (tokens, hidden).
    images = torch.stack([first, torch.tensor([[3.0, 30.0], [4.0, 40.0]])])  # 2 prompts × 2 tokens
    rows = features_to_rows(images, torch.tensor([2, 2]), torch.tensor([1, 0]))
    assert rows.tolist() == [[3.0, 30.0], [4.0, 40.0], [1.0, 10.0], [2.0, 20.0]]


def test_features_to_rows_adds_up_the_rows_gradients_on_the_shared_features():
    features = torch.arange(6.0).view(3, 2).requires_grad_()  # prompt 0: tokens 0-1; prompt 1: token 2
    (rows,) = features_to_rows((features,), torch.tensor([2, 1, 2, 1]), torch.tensor([0, 1, 0, 1]))
    (rows * torch.arange(1.0, 7.0).unsqueeze(1)).sum().backward()
    # Row weights 1..6 over the 6 row tokens: prompt 0's tokens get rows 1+4 and 2+5, prompt 1's token 3+6.
    assert features.grad[:, 0].tolist() == [5.0, 7.0, 9.0]


def test_features_to_rows_refuses_mismatched_counts():
    features = (torch.zeros(3, 2),)
    with pytest.raises(ValueError, match="3 image feature vectors .* 4 image tokens"):
        features_to_rows(features, torch.tensor([2, 2]), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="same prompt hold different numbers"):
        features_to_rows(features, torch.tensor([3, 2]), torch.tensor([0, 0]))


def test_a_model_without_get_image_features_is_refused(tiny_model):
    with pytest.raises(ValueError, match="get_image_features"):
        feature_owner(tiny_model)


def test_the_owner_is_the_inner_model_and_the_patch_is_undone():
    model, processor = build_tiny_qwen2_5_vl()
    owner = feature_owner(model)
    assert owner is model.model  # not the ...ForConditionalGeneration, which delegates to it
    prompts = [
        [{"role": "user", "content": [{"type": "image", "image": noise_image(0)}, {"type": "text", "text": "hi"}]}]
    ]
    ids, _, vision = encode_prompts(processor, prompts * 3, None)
    with images_encoded_once(model, vision, ids) as inputs:
        assert "get_image_features" in owner.__dict__
        # The vision tower's pixels once; M-RoPE's grid and token types for every row.
        assert inputs["pixel_values"].shape == vision.prompts[0]["pixel_values"].shape
        assert inputs["image_grid_thw"].shape[0] == 3 and inputs["mm_token_type_ids"].shape == ids.shape
    assert "get_image_features" not in owner.__dict__


def test_a_vision_tower_with_deepstack_features_is_refused_by_name(monkeypatch):
    # Qwen3-VL's tower also returns per-layer "deepstack" features, which would stay one set per prompt while the rows
    # repeat it: refused with the families that work, instead of a shape error deep in the model. Qwen2.5-VL's own
    # output is given that field here (no tiny Qwen3-VL can be built offline: its processor needs torchvision).
    model, processor = build_tiny_qwen2_5_vl()
    owner = type(feature_owner(model))
    encode = owner.get_image_features

    def with_deepstack(self, *args, **kwargs):
        outputs = encode(self, *args, **kwargs)
        outputs.deepstack_features = [outputs.pooler_output]
        return outputs

    content = [{"type": "image", "image": noise_image(0)}, {"type": "text", "text": "a"}]
    ids, mask, vision = encode_prompts(processor, [[{"role": "user", "content": content}]] * 2, None)
    monkeypatch.setattr(owner, "get_image_features", functools.wraps(encode)(with_deepstack))
    with pytest.raises(ValueError, match="deepstack features"):
        completion_logprobs(model, ids, mask, ids[:, -1:], mask[:, -1:], vision=vision)
    # An encoder that takes its pixels through **kwargs only would be handed none: refused too, not run text-only.
    monkeypatch.setattr(owner, "get_image_features", lambda self, **kwargs: encode(self, **kwargs))
    with pytest.raises(ValueError, match="names no 'pixel_values' parameter"):
        completion_logprobs(model, ids, mask, ids[:, -1:], mask[:, -1:], vision=vision)


# --- the same log-probs and gradients as encoding every row's images ------------------------------------------------


def _vision_tower(model):
    owner = feature_owner(model)
    return next(getattr(owner, name) for name in ("visual", "vision_tower", "vision_model") if hasattr(owner, name))


def _images_seen(module, args, kwargs, output, seen):
    """(how many images one call of the vision tower encoded: Qwen's grid rows, else the pixel batch, whether with a
    gradient)."""
    grid = kwargs.get("grid_thw")
    images = grid.shape[0] if grid is not None else (args[0] if args else kwargs["pixel_values"]).shape[0]
    seen.append((images, torch.is_grad_enabled()))


def _tower_images(fields: dict) -> int:
    """How many images the vision tower encodes for one prompt's fields: Qwen's grid rows, else the pixel batch
    (Idefics3's (1, images, C, H, W): its sub-images)."""
    if "image_grid_thw" in fields:
        return fields["image_grid_thw"].shape[0]
    pixels = fields["pixel_values"]
    return pixels.shape[0] * (pixels.shape[1] if pixels.dim() == 5 else 1)


@contextlib.contextmanager
def _counting_images(model):
    seen = []
    handle = _vision_tower(model).register_forward_hook(lambda *hook: _images_seen(*hook, seen=seen), with_kwargs=True)
    try:
        yield seen
    finally:
        handle.remove()


def _per_row_forward(monkeypatch):
    """The path `images_encoded_once` replaces: every row's fields, `pixel_values` included, to the forward."""
    monkeypatch.setattr(
        logprobs_module,
        "images_encoded_once",
        lambda model, vision, input_ids: contextlib.nullcontext(vision.rows_inputs(input_ids.shape[1])),
    )


def _image_prompt(seed: int, text: str) -> list:
    return [
        {"role": "user", "content": [{"type": "image", "image": noise_image(seed)}, {"type": "text", "text": text}]}
    ]


def _interleaved_batch(processor, group_size=3):
    """Two prompts with different images and text lengths, their rows interleaved (groups 0, 1, 0, 1, ...), and
    random completions of 6 tokens (one row's last two masked)."""
    prompts = [_image_prompt(0, "What is 1 + 3?")] * group_size + [_image_prompt(1, "What is 12345 + 3?")] * group_size
    ids, mask, vision = encode_prompts(processor, prompts, None)
    order = torch.arange(2 * group_size).view(2, group_size).t().flatten()  # 0, 3, 1, 4, 2, 5
    vision = VisionInputs(vision.prompts, vision.groups[order])
    completion = torch.randint(0, 300, (2 * group_size, 6), generator=torch.Generator().manual_seed(0))
    completion_mask = torch.ones_like(completion)
    completion_mask[1, 4:] = 0
    inputs = (torch.cat([ids[order], completion], 1), torch.cat([mask[order], completion_mask], 1))
    return (*inputs, completion, completion_mask), vision


def _logps_and_gradients(model, batch, vision):
    model.zero_grad()
    logps = completion_logprobs(model, *batch, vision=vision).logps
    weights = torch.linspace(-1.0, 1.0, logps.numel()).view_as(logps)  # a loss whose gradient no term cancels
    (logps * weights).sum().backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return logps.detach(), grads


def _assert_same_gradients(shared, per_row):
    assert shared.keys() == per_row.keys()
    # The tower's gradients are among those compared.
    assert any(tower in name for tower in ("visual", "vision_tower", "vision_model") for name in per_row)
    scale = max(grad.abs().max() for grad in per_row.values())
    for name, grad in per_row.items():
        # fp32: both sum the same per-row terms, in another order (the rows' gradients meet at the shared features
        # instead of in the tower's weights) and over differently batched products of at most 128 terms: each sum
        # moves by a few 2^-24 of its terms' magnitude, which is at most the model's largest gradient. 1e-5 of that
        # bounds it (some entries are exactly zero in exact arithmetic, attention keys' biases: only `atol` holds
        # them; measured: at most 2e-7 of the largest gradient); 1e-4 relative covers the rest with margin and is far
        # below a gradient missing one row's share.
        torch.testing.assert_close(shared[name], grad, rtol=1e-4, atol=1e-5 * float(scale), msg=name)


@pytest.mark.parametrize("family", FAMILIES)
def test_same_logps_and_gradients_as_encoding_every_row(family, monkeypatch):
    model, processor = BUILDERS[family]()
    batch, vision = _interleaved_batch(processor)
    with _counting_images(model) as seen:
        shared_logps, shared_grads = _logps_and_gradients(model, batch, vision)
    one = _tower_images(vision.prompts[0])  # one image per prompt (Idefics3: its sub-images)
    assert seen == [(2 * one, True)]  # two prompts' images, in one call of the tower
    _per_row_forward(monkeypatch)
    with _counting_images(model) as seen:
        per_row_logps, per_row_grads = _logps_and_gradients(model, batch, vision)
    assert seen == [(6 * one, True)]  # the path this replaces: every row's image
    # fp32: the tower's products batched over 2 images instead of 6 round their sums (at most 128 terms) in another
    # order, a few 2^-24 relative on the features; through the 2-layer, 64-wide language model to log-probs of order
    # one that stays near 1e-6 (measured: 0 for Qwen2.5-VL, Gemma 3 and Idefics3, 4.8e-7 for LLaVA). A row given the
    # other prompt's features moves its log-probs by O(0.1) (the image test of test_multimodal.py).
    torch.testing.assert_close(shared_logps, per_row_logps, atol=1e-5, rtol=0)
    _assert_same_gradients(shared_grads, per_row_grads)


def test_activation_checkpointing_gets_the_same_gradients(monkeypatch):
    # The backward pass runs the tower's blocks again, after the forward has put `get_image_features` back.
    model, processor = build_tiny_qwen2_5_vl()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    batch, vision = _interleaved_batch(processor)
    with _counting_images(model) as seen:
        shared_logps, shared_grads = _logps_and_gradients(model, batch, vision)
    assert seen == [(2 * _tower_images(vision.prompts[0]), True)]
    _per_row_forward(monkeypatch)
    per_row_logps, per_row_grads = _logps_and_gradients(model, batch, vision)
    torch.testing.assert_close(shared_logps, per_row_logps, atol=1e-5, rtol=0)  # the bounds of the test above
    _assert_same_gradients(shared_grads, per_row_grads)


def test_lora_on_the_vision_tower_gets_the_same_gradients(monkeypatch):
    from peft import LoraConfig, get_peft_model

    model, processor = build_tiny_qwen2_5_vl()
    # The tower's attention and the merger's projection: the gradient reaches them through the shared features.
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=r".*visual.*\.(qkv|mlp\.0)"))
    for name, parameter in model.named_parameters():  # start B away from zero so A gets a gradient too
        if "lora_B" in name:
            parameter.data.normal_(std=0.1)
    batch, vision = _interleaved_batch(processor)
    shared_logps, shared_grads = _logps_and_gradients(model, batch, vision)
    _per_row_forward(monkeypatch)
    per_row_logps, per_row_grads = _logps_and_gradients(model, batch, vision)
    assert per_row_grads and all("lora_" in name and "visual" in name for name in per_row_grads)
    torch.testing.assert_close(shared_logps, per_row_logps, atol=1e-5, rtol=0)  # the bound of the test above
    _assert_same_gradients(shared_grads, per_row_grads)


# --- sampling ---------------------------------------------------------------------------------------------------


@pytest.mark.slow  # a trainer built and two rollouts sampled, several seconds per family
@pytest.mark.parametrize("family", FAMILIES)
def test_generate_encodes_each_prompt_once_and_samples_the_same(family, tmp_path, monkeypatch):
    import gspo_trl.rollout.hf as hf_module

    model, processor = BUILDERS[family]()
    args = small_config(tmp_path, max_completion_length=8)
    trainer = GSPOTrainer(model, count_digits, args=args, train_dataset=image_dataset(4), processing_class=processor)
    prompts = [_image_prompt(0, "What is 1 + 3?")] * 4 + [_image_prompt(1, "What is 12345 + 67890 + 3?")] * 4
    keys = stream_keys(0, torch.arange(len(prompts)))  # each row's own random stream
    with _counting_images(model) as seen:
        shared = trainer.rollout_backend.generate(prompts, keys)
    one = _tower_images(shared.vision.prompts[0])  # one image per prompt (Idefics3: its sub-images)
    assert seen == [(2 * one, False)]  # generate's prefill: the 2 prompts' images, not the 8 rows'
    monkeypatch.setattr(
        hf_module,
        "images_encoded_once",
        lambda model, vision, input_ids: contextlib.nullcontext(vision.rows_inputs(input_ids.shape[1])),
    )
    with _counting_images(model) as seen:
        per_row = trainer.rollout_backend.generate(prompts, keys)
    assert seen == [(8 * one, False)]
    # The same keys draw the same tokens: the logits differ by float32 rounding at most (the log-prob test above),
    # and a Gumbel-perturbed argmax flips only where two perturbed scores lie within that rounding of each other.
    assert torch.equal(shared.completion_ids, per_row.completion_ids)
    assert not torch.equal(shared.completion_ids[0], shared.completion_ids[1])  # rows drew their own samples


# --- a training step --------------------------------------------------------------------------------------------


@pytest.mark.slow  # a training step of several seconds per family
@pytest.mark.parametrize("family", FAMILIES)
def test_a_training_step_encodes_each_prompt_once_per_forward(family, tmp_path):
    model, processor = BUILDERS[family]()
    # 2 prompts × 4 completions in one micro-batch; a reference (beta) and π_old from a forward (num_iterations=2).
    args = small_config(
        tmp_path, per_device_train_batch_size=8, steps_per_generation=1, max_steps=1, beta=0.04, num_iterations=2
    )
    trainer = GSPOTrainer(model, count_digits, args=args, train_dataset=image_dataset(4), processing_class=processor)
    with _counting_images(trainer.model) as seen, _counting_images(trainer.ref_model) as seen_by_reference:
        trainer.train()
    # Each call saw the 2 prompts' images, not the rows' 8: generate's prefill, π_old, then the training forward
    # (the one with a gradient); the reference model's forward.
    one = _tower_images(encode_prompts(processor, [_image_prompt(0, "hi")], None)[2].prompts[0])  # per image
    assert seen == [(2 * one, False), (2 * one, False), (2 * one, True)]
    assert seen_by_reference == [(2 * one, False)]

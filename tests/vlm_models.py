"""Tiny random vision-language models and their processors, built offline from the tokenizer of `conftest`.

Four families: Qwen2.5-VL (patches flattened over the batch, `image_grid_thw` splits them; M-RoPE positions from
`mm_token_type_ids`), LLaVA (one (C, H, W) tensor per image, a CLIP tower), Gemma 3 (a SigLIP tower; bidirectional
attention over an image's tokens from `token_type_ids`, sliding-window layers) and Idefics3, SmolVLM's architecture
(each image split into tiles plus the whole image: `pixel_values` (1, N, C, H, W) and `pixel_attention_mask` per
prompt). No torchvision here: the processors use the `*ImageProcessorPil` classes, and Qwen2.5-VL's processor is built
without its video processor (which needs torchvision). Image token counts match the configs: a 56×56 image is a 4×4
grid of 14-pixel patches, merged 2×2 into 4 Qwen tokens; LLaVA and Gemma 3 resize to 28×28, 2×2 patches of 14, 4
tokens (LLaVA drops its CLS token; Gemma 3's `image_seq_length` = `mm_tokens_per_image` = 4); Idefics3 cuts 28×28 tiles,
each 4×4 patches of 7 shuffled 2×2 into 4 tokens (`image_seq_len` = (28 / 7)² / `scale_factor`²).
"""

from __future__ import annotations

import torch
from conftest import build_tiny_tokenizer
from PIL import Image

IMAGE_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'image' %}{{ IMAGE }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
QWEN_IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"


def _text_config(tokenizer, **extra) -> dict:
    return dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=len(tokenizer),
        max_position_embeddings=512,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
        **extra,
    )


def _finish(model, tokenizer):
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.bos_token_id = tokenizer.bos_token_id
    return model


def build_tiny_qwen2_5_vl(seed: int = 0):
    """(model, processor): a random Qwen2.5-VL with a one-block vision tower."""
    from transformers import AutoConfig, AutoModelForImageTextToText, ProcessorMixin
    from transformers.models.qwen2_5_vl.processing_qwen2_5_vl import Qwen2_5_VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    class ImageOnlyQwen2_5_VLProcessor(Qwen2_5_VLProcessor):
        """Qwen2.5-VL's processor without the video processor (which needs torchvision)."""

        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
            self.image_token, self.video_token = "<|image_pad|>", "<|video_pad|>"
            self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
            self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)
            ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)

    tokenizer = build_tiny_tokenizer()
    specials = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
    tokenizer.add_special_tokens({"additional_special_tokens": specials})
    template = IMAGE_TEMPLATE.replace("{{ IMAGE }}", QWEN_IMAGE)
    tokenizer.chat_template = template
    image_processor = Qwen2VLImageProcessorPil(
        min_pixels=56 * 56, max_pixels=56 * 56, patch_size=14, merge_size=2, temporal_patch_size=2
    )
    processor = ImageOnlyQwen2_5_VLProcessor(
        image_processor=image_processor, tokenizer=tokenizer, chat_template=template
    )
    ids = tokenizer.convert_tokens_to_ids
    rope = {"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0}  # sums to head_dim / 2 = 8
    config = AutoConfig.for_model(
        "qwen2_5_vl",
        text_config=_text_config(tokenizer, rope_parameters=rope),
        vision_config=dict(
            depth=1,
            hidden_size=32,
            intermediate_size=64,
            num_heads=2,
            out_hidden_size=64,
            patch_size=14,
            spatial_merge_size=2,
            temporal_patch_size=2,
            fullatt_block_indexes=[0],
            window_size=56,
        ),
        image_token_id=ids("<|image_pad|>"),
        video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"),
        vision_end_token_id=ids("<|vision_end|>"),
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    return _finish(AutoModelForImageTextToText.from_config(config), tokenizer), processor


def build_tiny_llava(seed: int = 0):
    """(model, processor): a random LLaVA with a one-layer CLIP vision tower."""
    from transformers import AutoConfig, AutoModelForImageTextToText, LlavaProcessor
    from transformers.models.llava.image_processing_pil_llava import LlavaImageProcessorPil

    tokenizer = build_tiny_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"]})
    template = IMAGE_TEMPLATE.replace("{{ IMAGE }}", "<image>")
    tokenizer.chat_template = template
    image_processor = LlavaImageProcessorPil(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28})
    processor = LlavaProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=14,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
        chat_template=template,
    )
    config = AutoConfig.for_model(
        "llava",
        text_config=dict(model_type="llama", **_text_config(tokenizer)),
        vision_config=dict(
            model_type="clip_vision_model",
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            image_size=28,
            patch_size=14,
            projection_dim=32,
        ),
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
        vision_feature_select_strategy="default",
        vision_feature_layer=-1,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    return _finish(AutoModelForImageTextToText.from_config(config), tokenizer), processor


def build_tiny_gemma3(seed: int = 0):
    """(model, processor): a random Gemma 3 with a one-layer SigLIP tower (no pooling head, as released)."""
    from transformers import AutoConfig, AutoModelForImageTextToText, Gemma3Processor
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    tokenizer = build_tiny_tokenizer()
    named = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"}
    tokenizer.add_special_tokens({"additional_special_tokens": list(named.values())})
    tokenizer._set_model_specific_special_tokens(special_tokens=named)  # what the processor reads
    template = IMAGE_TEMPLATE.replace("{{ IMAGE }}", "<start_of_image>")
    tokenizer.chat_template = template
    image_processor = Gemma3ImageProcessorPil(size={"height": 28, "width": 28}, do_pan_and_scan=False)
    processor = Gemma3Processor(image_processor, tokenizer, chat_template=template, image_seq_length=4)
    ids = tokenizer.convert_tokens_to_ids
    config = AutoConfig.for_model(
        "gemma3",
        text_config=dict(model_type="gemma3_text", **_text_config(tokenizer, head_dim=16, sliding_window=64)),
        vision_config=dict(
            model_type="siglip_vision_model",
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            image_size=28,
            patch_size=14,
            vision_use_head=False,
        ),
        mm_tokens_per_image=4,
        boi_token_index=ids("<start_of_image>"),
        eoi_token_index=ids("<end_of_image>"),
        image_token_index=ids("<image_soft_token>"),
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(config)
    # transformers initialises the image projection to zeros: every image would give the same (zero) features.
    model.model.multi_modal_projector.mm_input_projection_weight.data.normal_(std=0.5)
    return _finish(model, tokenizer), processor


def build_tiny_idefics3(seed: int = 0, do_image_splitting: bool = True, model_type: str = "idefics3"):
    """(model, processor): a random Idefics3 with a one-layer SigLIP-like tower, or with `model_type="smolvlm"` a
    SmolVLM model of the same sizes. SmolVLM's own processor needs a video processor (torchvision) and `num2words`;
    for images it writes the same tiles and tags as Idefics3's, which both models read alike."""
    from transformers import AutoConfig, AutoModelForImageTextToText, Idefics3Processor
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    tokenizer = build_tiny_tokenizer()
    # The processor writes the sub-image tags as text: without them in the vocabulary they would be split into pieces.
    tags = [f"<row_{row}_col_{col}>" for row in range(1, 7) for col in range(1, 7)]
    specials = ["<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>", *tags]
    tokenizer.add_special_tokens({"additional_special_tokens": specials})
    template = IMAGE_TEMPLATE.replace("{{ IMAGE }}", "<image>")
    tokenizer.chat_template = template
    image_processor = Idefics3ImageProcessorPil(
        size={"longest_edge": 56}, max_image_size={"longest_edge": 28}, do_image_splitting=do_image_splitting
    )
    processor = Idefics3Processor(image_processor, tokenizer, image_seq_len=4, chat_template=template)
    config = AutoConfig.for_model(
        model_type,
        text_config=dict(model_type="llama", **_text_config(tokenizer)),
        vision_config=dict(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            image_size=28,
            patch_size=7,
        ),
        scale_factor=2,
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    return _finish(AutoModelForImageTextToText.from_config(config), tokenizer), processor


BUILDERS = {
    "qwen2_5_vl": build_tiny_qwen2_5_vl,
    "llava": build_tiny_llava,
    "gemma3": build_tiny_gemma3,
    "idefics3": build_tiny_idefics3,
}


def solid_image(color: tuple[int, int, int], size: int = 56) -> Image.Image:
    return Image.new("RGB", (size, size), color)


def noise_image(seed: int, size: int = 56) -> Image.Image:
    generator = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (size, size, 3), generator=generator, dtype=torch.uint8)
    return Image.fromarray(pixels.numpy())


def image_dataset(n: int = 4, column: str = "image"):
    """`n` conversational prompts, each with one image (`column="image"`) or two (`"images"`)."""
    from datasets import Dataset

    rows = []
    for index in range(n):
        prompt = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": f"What is {index} + 3?"}]}]
        if column == "images":
            prompt[0]["content"].insert(0, {"type": "image"})
            rows.append({"prompt": prompt, "images": [noise_image(index), noise_image(100 + index)]})
        else:
            rows.append({"prompt": prompt, "image": noise_image(index)})
    return Dataset.from_list(rows)

#!/usr/bin/env python
"""Time and memory of one training forward + backward of a vision-language micro-batch, the vision tower run once
per prompt (`gspo_trl.models.vision_features`) against once per row (every row's `pixel_values`, as before),
alternating in
one process, on a small random Qwen2.5-VL (CPU, fp32).

    python benchmarks/vision_features.py                        # 2 prompts x 8 completions, one 224x224 image each
    python benchmarks/vision_features.py --generations 4 --image_side 448 --repeats 5

The model is random (the cost does not depend on the weights): a 4-block, 256-wide vision tower (14-pixel patches
merged 2x2: a 224x224 image is 256 patches, 64 image tokens) and a 4-layer, 256-wide language model; the prompt is
its image tokens and 16 text tokens, then 64 completion tokens. Prints, per path, the median seconds of forward +
backward and of the forward alone, and the bytes autograd keeps for the backward (the saved tensors of the forward,
counted by `torch.autograd.graph.saved_tensors_hooks`; shared storages once), plus the images the tower encoded.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch

import gspo_trl.training.logprobs as logprobs_module
from gspo_trl.models.multimodal import VisionInputs
from gspo_trl.training.logprobs import completion_logprobs

IMAGE, VISION_START, VISION_END, PAD = 5, 6, 7, 0


def build_model(seed: int = 0):
    from transformers import AutoConfig, AutoModelForImageTextToText

    text = dict(
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=1024,
        max_position_embeddings=4096,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=PAD,
        rope_parameters={"rope_type": "default", "mrope_section": [8, 12, 12], "rope_theta": 10000.0},
        tie_word_embeddings=False,
    )
    vision = dict(
        depth=4,
        hidden_size=256,
        intermediate_size=512,
        num_heads=4,
        out_hidden_size=256,
        patch_size=14,
        spatial_merge_size=2,
        temporal_patch_size=2,
        fullatt_block_indexes=[3],
        window_size=112,
    )
    config = AutoConfig.for_model(
        "qwen2_5_vl",
        text_config=text,
        vision_config=vision,
        image_token_id=IMAGE,
        video_token_id=8,
        vision_start_token_id=VISION_START,
        vision_end_token_id=VISION_END,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    return AutoModelForImageTextToText.from_config(config)


def build_batch(prompts: int, generations: int, image_side: int, completion_tokens: int, text_tokens: int = 16):
    """(input_ids, attention_mask, completion_ids, completion_mask, vision): each prompt one image, its rows
    consecutive, as a rollout lays them out."""
    grid = image_side // 14
    image_tokens = grid * grid // 4
    generator = torch.Generator().manual_seed(0)
    fields, prompt_ids = [], []
    for _ in range(prompts):
        ids = [VISION_START, *[IMAGE] * image_tokens, VISION_END]
        ids += torch.randint(10, 1024, (text_tokens,), generator=generator).tolist()
        prompt_ids.append(ids)
        fields.append(
            {
                "pixel_values": torch.randn(grid * grid, 3 * 2 * 14 * 14, generator=generator),
                "image_grid_thw": torch.tensor([[1, grid, grid]]),
                "mm_token_type_ids": torch.tensor([[int(token == IMAGE) for token in ids]]),
            }
        )
    groups = torch.arange(prompts).repeat_interleave(generations)
    prompt = torch.tensor(prompt_ids)[groups]
    completion = torch.randint(10, 1024, (prompts * generations, completion_tokens), generator=generator)
    input_ids = torch.cat([prompt, completion], dim=1)
    mask = torch.ones_like(input_ids)
    return input_ids, mask, completion, torch.ones_like(completion), VisionInputs(fields, groups)


@contextlib.contextmanager
def per_row_path():
    """Every row's fields, `pixel_values` included, to the forward: the tower encodes each row's image."""
    once = logprobs_module.images_encoded_once
    logprobs_module.images_encoded_once = lambda model, vision, input_ids: contextlib.nullcontext(
        vision.rows_inputs(input_ids.shape[1])
    )
    try:
        yield
    finally:
        logprobs_module.images_encoded_once = once


def saved_bytes(model, batch) -> int:
    """Bytes of the tensors the forward saves for the backward, each storage once."""
    storages = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        logps = completion_logprobs(model, *batch[:4], vision=batch[4]).logps
    del logps
    return sum(storages.values())


def timed(model, batch) -> tuple[float, float]:
    """(forward seconds, forward + backward seconds)."""
    model.zero_grad(set_to_none=True)
    start = time.perf_counter()
    logps = completion_logprobs(model, *batch[:4], vision=batch[4]).logps
    forward = time.perf_counter() - start
    logps.sum().backward()
    return forward, time.perf_counter() - start


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--image_side", type=int, default=224, help="a multiple of 28")
    parser.add_argument("--completion_tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model = build_model()
    batch = build_batch(args.prompts, args.generations, args.image_side, args.completion_tokens)
    images = {}
    tower = model.model.visual
    handle = tower.register_forward_hook(lambda module, inputs, kwargs, output: images.__setitem__(
        "last", kwargs["grid_thw"].shape[0]), with_kwargs=True)  # fmt: skip
    paths = {"once per prompt": contextlib.nullcontext, "once per row": per_row_path}
    times = {name: [] for name in paths}
    memory, encoded = {}, {}
    for name, path in paths.items():  # warm-up, memory and the tower's images
        with path():
            timed(model, batch)
            memory[name] = saved_bytes(model, batch)
            encoded[name] = images["last"]
    for _ in range(args.repeats):  # alternating, so that a change in the machine's load hits both
        for name, path in paths.items():
            with path():
                times[name].append(timed(model, batch))
    handle.remove()
    rows = args.prompts * args.generations
    print(
        f"{args.prompts} prompts x {args.generations} completions, one {args.image_side}x{args.image_side} image "
        f"each ({batch[4].prompts[0]['pixel_values'].shape[0]} patches), {batch[0].shape[1]} positions per row, "
        f"{torch.get_num_threads()} threads, median of {args.repeats}"
    )
    print("| path | images encoded | forward s | forward + backward s | saved for backward MiB |")
    print("|---|---|---|---|---|")
    for name in paths:
        forward = statistics.median(t[0] for t in times[name])
        total = statistics.median(t[1] for t in times[name])
        print(f"| {name} | {encoded[name]} of {rows} rows | {forward:.3f} | {total:.3f} | {memory[name] / 2**20:.1f} |")


if __name__ == "__main__":
    main()

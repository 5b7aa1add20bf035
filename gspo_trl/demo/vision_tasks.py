"""A synthetic visual task whose answer is only in the image: name the colour of a shape drawn with PIL.

Owns the images (a circle, square or triangle of one of a few colours, with a random size, place, shade and grey
background), the dataset (the same question for every row; the colour in an `answer` column, each colour equally
often), the reward, and a supervised warm-up whose labels are drawn independently of the image: it teaches the
answer format (one colour word) but not which colour, so a model warmed up on it names a colour at chance and GSPO
has to learn the rest from the reward. Not the model, nor the GSPO run (tests/test_learning_vision.py,
benchmarks/vision_learning.py).
"""

from __future__ import annotations

import random
import re

COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (210, 40, 40),
    "green": (40, 160, 50),
    "blue": (40, 70, 210),
    "yellow": (225, 200, 30),
}
SHAPES = ("circle", "square", "triangle")
QUESTION = "What colour is the shape? Answer with one word."
_WORD = re.compile(r"[a-z]+")


def shape_image(colour: str, shape: str, rng: random.Random, size: int = 56):
    """A `size`×`size` RGB image: one `shape` filled with `colour` (each channel shifted by up to ±25) on a grey
    background, its side between 40% and 80% of the image, placed at random."""
    from PIL import Image, ImageDraw

    grey = rng.randint(90, 170)
    image = Image.new("RGB", (size, size), (grey, grey, grey))
    fill = tuple(min(255, max(0, channel + rng.randint(-25, 25))) for channel in COLOURS[colour])
    side = rng.randint(int(0.4 * size), int(0.8 * size))
    left, top = rng.randint(0, size - side), rng.randint(0, size - side)
    box = (left, top, left + side - 1, top + side - 1)
    draw = ImageDraw.Draw(image)
    if shape == "circle":
        draw.ellipse(box, fill=fill)
    elif shape == "square":
        draw.rectangle(box, fill=fill)
    elif shape == "triangle":
        draw.polygon([(left + side // 2, top), (left, top + side - 1), (left + side - 1, top + side - 1)], fill=fill)
    else:
        raise ValueError(f"shape must be one of {SHAPES}, got {shape!r}")
    return image


def prompt_messages() -> list[dict]:
    """The conversational prompt every row shares: the image, then the question."""
    return [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}]


def _colours_balanced(size: int, rng: random.Random, colours: tuple[str, ...]) -> list[str]:
    """`size` colours, each colour equally often (up to one when `len(colours)` does not divide `size`), shuffled."""
    labels = [colours[index % len(colours)] for index in range(size)]
    rng.shuffle(labels)
    return labels


def colour_dataset(size: int = 256, seed: int = 0, colours: tuple[str, ...] = tuple(COLOURS), image_size: int = 56):
    """`size` rows with columns `prompt` (the same for every row), `image` and `answer` (its colour word); each
    colour appears equally often."""
    from datasets import Dataset

    _check_colours(colours)
    rng = random.Random(seed)
    rows = [
        {
            "prompt": prompt_messages(),
            "image": shape_image(colour, rng.choice(SHAPES), rng, image_size),
            "answer": colour,
        }
        for colour in _colours_balanced(size, rng, colours)
    ]
    return Dataset.from_list(rows)


def named_colours(text: str, colours: tuple[str, ...] = tuple(COLOURS)) -> list[str]:
    """The colour words a reply names, in order (case and punctuation ignored)."""
    return [word for word in _WORD.findall(text.lower()) if word in colours]


def colour_reward(completions, answer, **kwargs) -> list[float]:
    """TRL reward: 1 when the reply names exactly one colour and it is the row's `answer`, else 0 (naming several
    colours scores 0, so hedging does not pay)."""
    from .tasks import completion_text

    rewards = []
    for completion, expected in zip(completions, answer, strict=True):
        named = set(named_colours(completion_text(completion)))
        rewards.append(float(named == {expected}))
    return rewards


def chance_accuracy(colours: tuple[str, ...] = tuple(COLOURS)) -> float:
    """The expected reward of any policy that ignores the image, on a dataset with each colour equally often: at most
    1/K for K colours (reached when every reply names one colour)."""
    return 1.0 / len(colours)


def warm_up_dataset(images: int, seed: int, colours: tuple[str, ...] = tuple(COLOURS), image_size: int = 56):
    """Supervised transcripts (`prompt`, `image`, `completion`): `images` of the task's images (each colour equally
    often), each answered once with every colour word, in consecutive rows. A model fitted to them learns to answer
    with one colour word and, for every image, each colour equally likely: the answer format and nothing about
    which colour. (Drawing one random label per image instead lets a small model pick up spurious rules from the
    noise, a sharp policy that is wrong as often as chance but gives GSPO groups with no spread.)"""
    from datasets import Dataset

    _check_colours(colours)
    rng = random.Random(seed)
    drawn = [
        shape_image(colour, rng.choice(SHAPES), rng, image_size) for colour in _colours_balanced(images, rng, colours)
    ]
    return Dataset.from_list(
        [
            {"prompt": prompt_messages(), "image": image, "completion": [{"role": "assistant", "content": label}]}
            for image in drawn
            for label in colours
        ]
    )


def answer_labels(processor, prompts: list, images: list, answers: list[str]):
    """(inputs, labels) for teacher-forcing each answer after its prompt: the processor's inputs for the prompt (with
    its generation prompt) + answer + end-of-turn token, right-padded, and labels that are the input ids on the answer
    and end-of-turn tokens and -100 elsewhere (the prompt, its image tokens, padding)."""
    import torch

    tokenizer = processor.tokenizer
    texts = [processor.apply_chat_template(prompt, add_generation_prompt=True) for prompt in prompts]
    padding_side, tokenizer.padding_side = tokenizer.padding_side, "right"
    try:
        prompt_lengths = processor(text=texts, images=images, return_tensors="pt", padding=True)["attention_mask"].sum(
            1
        )
        full = [text + answer + tokenizer.eos_token for text, answer in zip(texts, answers)]
        inputs = processor(text=full, images=images, return_tensors="pt", padding=True)
    finally:
        tokenizer.padding_side = padding_side
    labels = inputs["input_ids"].masked_fill(inputs["attention_mask"] == 0, -100)
    in_prompt = torch.arange(labels.shape[1])[None, :] < prompt_lengths[:, None]
    return inputs, labels.masked_fill(in_prompt, -100)


def warm_up(model, processor, steps: int, images_per_step: int = 2, learning_rate: float = 1e-2, seed: int = 0):
    """Fit `model` in place for `steps` AdamW steps on `warm_up_dataset`, `images_per_step` images (each with every
    colour) per step: cross-entropy on
    the answer's tokens and the end-of-turn token, the prompt (image included) masked, in fp32. Returns the mean loss
    of each step."""
    import torch

    rows = warm_up_dataset(steps * images_per_step, seed)
    batch_size = images_per_step * len(COLOURS)
    optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate, weight_decay=0.0)
    model.train()
    losses = []
    for step in range(steps):
        batch = rows[step * batch_size : (step + 1) * batch_size]
        answers = [completion[0]["content"] for completion in batch["completion"]]
        inputs, labels = answer_labels(processor, batch["prompt"], [[image] for image in batch["image"]], answers)
        loss = model(**inputs, labels=labels, use_cache=False).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    model.eval()
    return losses


def _check_colours(colours: tuple[str, ...]) -> None:
    unknown = [colour for colour in colours if colour not in COLOURS]
    if len(colours) < 2 or unknown:
        raise ValueError(f"colours must be two or more of {tuple(COLOURS)}; got {colours!r}")

"""Tests for gspo_trl.demo.vision_tasks: the colour-naming task's images, dataset, reward and warm-up (tiny VLMs from
`vlm_models`)."""

from __future__ import annotations

import random
from collections import Counter

import pytest
from vlm_models import build_tiny_gemma3

from gspo_trl.demo.vision_tasks import (
    COLOURS,
    QUESTION,
    SHAPES,
    answer_labels,
    chance_accuracy,
    colour_dataset,
    colour_reward,
    named_colours,
    shape_image,
    warm_up,
    warm_up_dataset,
)


@pytest.mark.parametrize("shape", SHAPES)
def test_shape_image_draws_the_colour_on_grey(shape):
    image = shape_image("blue", shape, random.Random(0))
    assert image.size == (56, 56) and image.mode == "RGB"
    raw = image.tobytes()
    pixels = Counter(tuple(raw[i : i + 3]) for i in range(0, len(raw), 3))
    greys = [pixel for pixel in pixels if pixel[0] == pixel[1] == pixel[2]]
    assert len(greys) == 1  # one background
    shade = max((pixel for pixel in pixels if pixel not in greys), key=pixels.get)
    # The fill is the colour shifted by at most 25 per channel (antialiasing is off: one shade fills the shape).
    assert all(abs(a - b) <= 25 for a, b in zip(shade, COLOURS["blue"]))
    # Its side is at least 40% of the image: a triangle covers at least half of that square, 0.5 * 22² = 242 pixels.
    assert pixels[shade] >= 242


def test_shape_image_refuses_an_unknown_shape():
    with pytest.raises(ValueError, match="shape must be one of"):
        shape_image("red", "star", random.Random(0))


def test_colour_dataset_is_balanced_and_asks_the_same_question():
    dataset = colour_dataset(size=10, seed=3)
    assert Counter(dataset["answer"]) == {"red": 3, "green": 3, "blue": 2, "yellow": 2}
    assert all(row["prompt"] == dataset[0]["prompt"] for row in dataset)
    assert dataset[0]["prompt"][0]["content"][1]["text"] == QUESTION
    assert colour_dataset(size=10, seed=3)["answer"] == dataset["answer"]  # seeded
    with pytest.raises(ValueError, match="colours must be two or more"):
        colour_dataset(size=4, colours=("red", "purple"))


@pytest.mark.parametrize(
    ("reply", "reward"),
    [
        ("red", 1.0),
        ("Red.", 1.0),
        ("The shape is red!", 1.0),
        ("red, red", 1.0),  # one colour, named twice
        ("blue", 0.0),
        ("red or blue", 0.0),  # hedging names two colours
        ("reddish", 0.0),  # not a colour word
        ("", 0.0),
    ],
)
def test_colour_reward(reply, reward):
    assert colour_reward([reply], answer=["red"]) == [reward]
    assert colour_reward([[{"role": "assistant", "content": reply}]], answer=["red"]) == [reward]  # conversational


def test_named_colours_in_order():
    assert named_colours("Yellow, then GREEN and green") == ["yellow", "green", "green"]


def test_chance_accuracy():
    assert chance_accuracy() == 1 / 4 and chance_accuracy(("red", "blue")) == 1 / 2


def test_warm_up_dataset_answers_every_image_with_every_colour():
    dataset = warm_up_dataset(images=3, seed=0)
    assert len(dataset) == 3 * len(COLOURS)
    labels = [row["completion"][0]["content"] for row in dataset]
    assert labels == list(COLOURS) * 3
    for start in range(0, len(dataset), len(COLOURS)):  # one image per block of rows
        block = dataset[start : start + len(COLOURS)]["image"]
        assert all(image.tobytes() == block[0].tobytes() for image in block)


def test_answer_labels_cover_the_answer_and_end_of_turn_only():
    model, processor = build_tiny_gemma3()
    tokenizer = processor.tokenizer
    tokenizer.padding_side = "left"  # as sampling leaves it
    rows = warm_up_dataset(images=1, seed=0)
    answers = [row["completion"][0]["content"] for row in rows]
    inputs, labels = answer_labels(processor, rows["prompt"], [[image] for image in rows["image"]], answers)
    assert tokenizer.padding_side == "left"  # restored
    for row, answer in enumerate(answers):
        kept = labels[row][labels[row] != -100]
        assert tokenizer.decode(kept) == answer + tokenizer.eos_token
        # The kept tokens are the last real ones of the row (right padding after them).
        real = int(inputs["attention_mask"][row].sum())
        assert labels[row][real - len(kept) : real].tolist() == kept.tolist() and (labels[row][real:] == -100).all()


def test_warm_up_lowers_the_answer_loss():
    model, processor = build_tiny_gemma3()
    losses = warm_up(model, processor, steps=6, seed=0)
    assert len(losses) == 6 and not model.training
    # A random model spreads its next-token mass over the ~400-token vocabulary (loss near ln 400 = 6.0); six steps
    # at the default rate take it well below that (measured: 5.9 -> about 3).
    assert losses[-1] < losses[0] - 1.0, losses


def test_docs_show_the_recorded_learning_runs():
    """docs/vision-language.md's learning-check table is what benchmarks/results/vision_learning.json holds."""
    import json
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    record = json.loads((root / "benchmarks" / "results" / "vision_learning.json").read_text())
    text = (root / "docs" / "vision-language.md").read_text(encoding="utf-8")
    assert record["runs"] and (root / "docs" / "vision_reward_curve.png").exists()
    for run in record["runs"]:
        first, last = run["reward"][:10], run["reward"][-10:]
        row = f"| {run['seed']} | {sum(first) / 10:.3f} | {sum(last) / 10:.3f} | {run['cpu_seconds']:.0f} |"
        assert row in text, row

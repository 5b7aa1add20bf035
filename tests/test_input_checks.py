"""docs/input-checks.md stays true: every case its tables list is built here through the public API (real tokenizer,
the suite's tiny models), and the message the table documents appears in the error or the warning. A table row
without a case here, or a case without a row, fails."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from conftest import build_tiny_gpt2
from datasets import Dataset, DatasetDict
from helpers import count_digits
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

from gspo_trl import GSPOConfig, GSPOTrainer

DOC = Path(__file__).resolve().parents[1] / "docs" / "input-checks.md"


def documented_messages() -> list[str]:
    """The message column of each table row: the text between its backticks."""
    messages = []
    for line in DOC.read_text().splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[2].startswith("`") and cells[2].endswith("`"):
            messages.append(cells[2][1:-1])
    return messages


def config(tmp_path, **kwargs) -> GSPOConfig:
    values = dict(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        num_generations=4,
        steps_per_generation=1,
        max_completion_length=4,
        max_steps=1,
        report_to="none",
        save_strategy="no",
        use_cpu=True,
    )
    return GSPOConfig(**{**values, **kwargs})


def prompts(values) -> Dataset:
    return Dataset.from_list([{"prompt": value} for value in values])


USER = [{"role": "user", "content": "What is 1 + 1?"}]
TEXT = ["What is 1 + 1?", "What is 2 + 2?", "What is 3 + 3?", "What is 4 + 4?"]


def raised(build) -> str:
    """The message of the ValueError or TypeError that `build()` raises."""
    with pytest.raises((ValueError, TypeError)) as error:
        build()
    return str(error.value)


def config_error(tmp_path, **fields) -> str:
    """The message `GSPOConfig` refuses `fields` with."""
    return raised(lambda: config(tmp_path, **fields))


class Case:
    """What each documented message is checked on: `run(tmp_path, model_dir, caplog)` returns [(text the user saw,
    what `<field>` stands for)]."""

    def __init__(self, tmp_path, model_dir, caplog):
        self.tmp_path, self.model_dir, self.caplog = tmp_path, model_dir, caplog

    def trainer(self, dataset=None, model=None, reward=count_digits, **fields):
        return GSPOTrainer(
            model or self.model_dir,
            reward,
            args=config(self.tmp_path, **fields),
            train_dataset=prompts(TEXT) if dataset is None else dataset,
        )

    def refused(self, dataset=None, model=None, reward=count_digits, **fields) -> list:
        return [(raised(lambda: self.trainer(dataset, model, reward, **fields)), None)]

    def refused_at_first_rollout(self, dataset, model=None, **fields) -> list:
        trainer = self.trainer(dataset, model, **fields)
        before = [p.detach().clone() for p in trainer.model.parameters()]
        text = raised(trainer.train)
        assert trainer.state.global_step == 0  # before any optimizer step: the weights are untouched
        assert all(torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))
        return [(text, None)]

    def warned(self, build) -> list:
        self.caplog.clear()
        with self.caplog.at_level("WARNING"):
            build()
        return [(self.caplog.text, None)]

    def eos_token_id(self) -> int:
        return AutoTokenizer.from_pretrained(self.model_dir).eos_token_id

    def causal_lm_checkpoint(self, architectures=True) -> str:
        """A copy of the tiny policy's folder (a causal-LM checkpoint), without `architectures` when asked."""
        path = self.tmp_path / f"causal-lm-{architectures}"
        shutil.copytree(self.model_dir, path)
        if not architectures:
            saved = json.loads((path / "config.json").read_text())
            saved.pop("architectures")
            (path / "config.json").write_text(json.dumps(saved))
        return str(path)


CASES = {
    "The prompt must be a string or a list of chat messages": lambda c: [
        *c.refused(Dataset.from_dict({"prompt": ["a", None, "b", "c"]})),
        *c.refused(Dataset.from_dict({"prompt": [1, 2, 3, 4]})),
        *c.refused(prompts([{"text": "hi"}] * 4)),
    ],
    "The prompt is an empty string": lambda c: c.refused(prompts(["a", "", "b", "c"])),
    "The prompt is an empty list of messages": lambda c: c.refused(Dataset.from_dict({"prompt": [[]] * 4})),
    "must be a dict with a string 'role'": lambda c: c.refused(Dataset.from_dict({"prompt": [["a", "b"]] * 4})),
    "has no 'content'": lambda c: c.refused(prompts([[{"role": "user"}]] * 4)),
    "has a content part that is not a dict with a string 'type'": lambda c: c.refused(
        prompts([[{"role": "user", "content": [{"text": "hi"}]}]] * 4)
    ),
    "The prompt's last message has role": lambda c: c.refused(
        prompts([[{"role": "system", "content": "Be brief."}]] * 4)
    ),
    "needs a 'prompt' column": lambda c: c.refused(Dataset.from_dict({"question": TEXT})),
    "(several splits); pass one split": lambda c: c.refused(DatasetDict({"train": prompts(TEXT)})),
    "which the policy (a text model) never sees": lambda c: [
        *c.refused(Dataset.from_dict({"prompt": TEXT, "image": [None] * 4})),
        *c.refused(Dataset.from_dict({"prompt": TEXT, "audio": [[0.0, 0.1]] * 4})),
    ],
    "content part, which the policy (a text model) cannot read": lambda c: c.refused(
        prompts([[{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is it?"}]}]] * 4)
    ),
    "has images but plain-text prompts": lambda c: vision_language_case(c),
    "overrides <field>=": lambda c: (
        [
            (config_error(c.tmp_path, generation_kwargs={name: value}), field)
            for name, value, field in (
                ("temperature", 0.3, "temperature"),
                ("top_p", 0.9, "top_p"),
                ("top_k", 5, "top_k"),
                ("min_p", 0.1, "min_p"),
                ("repetition_penalty", 1.2, "repetition_penalty"),
                ("max_new_tokens", 64, "max_completion_length"),
                ("cache_implementation", "static", "cache_implementation"),
            )
        ]
        + [
            (
                config_error(c.tmp_path, use_vllm=True, generation_kwargs={"max_tokens": 64}),
                "max_completion_length",
            )
        ]
    ),
    "decodes greedily": lambda c: [(config_error(c.tmp_path, generation_kwargs={"do_sample": False}), None)],
    "counts the prompt too": lambda c: [(config_error(c.tmp_path, generation_kwargs={"max_length": 64}), None)],
    "beam search keeps the likeliest sequences": lambda c: [
        (config_error(c.tmp_path, generation_kwargs={name: 2}), None) for name in ("num_beams", "num_beam_groups")
    ],
    "each prompt row already gets one completion": lambda c: [
        (config_error(c.tmp_path, generation_kwargs={"num_return_sequences": 4}), None)
    ],
    "(contrastive search) is not supported": lambda c: [
        (config_error(c.tmp_path, generation_kwargs={"penalty_alpha": 0.6}), None)
    ],
    "which the trainer sets itself in every vLLM request": lambda c: [
        (config_error(c.tmp_path, use_vllm=True, generation_kwargs={name: 2}), None)
        for name in ("n", "best_of", "use_beam_search", "logprobs", "prompt_logprobs")
    ],
    "keeps only the likeliest token": lambda c: [
        (config_error(c.tmp_path, top_k=1), None),
        (config_error(c.tmp_path, min_p=1.0), None),
    ],
    "<field> must be an int >= 1": lambda c: [
        (config_error(c.tmp_path, **{field: value}), field)
        for field in (
            "per_device_train_batch_size",
            "per_device_eval_batch_size",
            "gradient_accumulation_steps",
            "steps_per_generation",
            "generation_batch_size",
        )
        for value in (0, -2)
    ],
    "num_generations must be >= 2": lambda c: [(config_error(c.tmp_path, num_generations=0), None)],
    "max_completion_length must be >= 1": lambda c: [(config_error(c.tmp_path, max_completion_length=0), None)],
    "trains no step": lambda c: [(config_error(c.tmp_path, max_steps=-1, num_train_epochs=0), None)],
    "but one rollout takes": lambda c: c.refused(prompts(["a"]), steps_per_generation=2),
    "leaves no room for a prompt": lambda c: c.refused(max_completion_length=2048),  # the tiny Llama's 2048 positions
    "positions, but the model attends to": lambda c: c.refused(max_prompt_length=2040, max_completion_length=16),
    "holds fewer than the": lambda c: [
        (config_error(c.tmp_path, use_vllm=True, vllm_mode="colocate", vllm_max_model_length=64, **budget), None)
        for budget in ({"max_prompt_length": 60, "max_completion_length": 8}, {"max_completion_length": 64})
    ],
    "A prompt of this rollout": lambda c: [
        # Learned positions (GPT-2, 512): an IndexError inside torch without the check; RoPE (Llama) runs on.
        *c.refused_at_first_rollout(prompts(["hello world " * 300] * 4), model=gpt2_model(c)),
        *c.refused_at_first_rollout(prompts(["hello world " * 1100] * 4)),
    ],
    "is a language model": lambda c: [
        *c.refused(reward=c.causal_lm_checkpoint()),
        *c.refused(reward=AutoModelForCausalLM.from_pretrained(c.model_dir)),
    ],
    "but a reward model gives one score per completion": lambda c: c.refused(
        reward=AutoModelForSequenceClassification.from_pretrained(c.causal_lm_checkpoint(), num_labels=3)
    ),
    "lacks weights its sequence-classification model needs": lambda c: c.refused(
        reward=c.causal_lm_checkpoint(architectures=False)
    ),
    "which change the distribution completions are drawn from": lambda c: c.warned(
        lambda: config(c.tmp_path, generation_kwargs={"no_repeat_ngram_size": 2})
    ),
    "mask_truncated_completions=True leaves them all out of the loss": lambda c: c.warned(
        # A random model with 400 tokens almost never samples EOS within 2 tokens; suppressing it makes that certain.
        lambda: c.trainer(
            mask_truncated_completions=True,
            max_completion_length=2,
            generation_kwargs={"suppress_tokens": [c.eos_token_id()]},
        ).train()
    ),
    "identical completions": lambda c: c.warned(lambda: c.trainer(temperature=1e-3).train()),
}


def gpt2_model(case) -> str:
    """A folder with the tiny GPT-2 (learned positions, 512 of them) and the suite's tokenizer."""
    path = case.tmp_path / "tiny-gpt2"
    tokenizer = AutoTokenizer.from_pretrained(case.model_dir)
    build_tiny_gpt2(tokenizer).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def vision_language_case(case) -> list:
    from vlm_models import build_tiny_llava, noise_image

    model, processor = build_tiny_llava()
    dataset = Dataset.from_list([{"prompt": text, "image": noise_image(i)} for i, text in enumerate(TEXT)])

    def build():
        GSPOTrainer(model, count_digits, args=config(case.tmp_path), train_dataset=dataset, processing_class=processor)

    return [(raised(build), None)]


def test_every_documented_message_has_a_case_and_every_case_a_row():
    assert sorted(documented_messages()) == sorted(CASES)


@pytest.mark.parametrize("message", documented_messages())
def test_the_documented_message_is_what_the_user_sees(message, tmp_path, tiny_model_dir, caplog):
    seen = CASES[message](Case(tmp_path, tiny_model_dir, caplog))
    assert seen
    for text, field in seen:
        expected = message if field is None else message.replace("<field>", field)
        assert expected in text, f"{expected!r} not in {text!r}"
        assert not re.search(r"<field>", expected)

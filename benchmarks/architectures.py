"""Random-init models of real architectures for timing runs, and the prompts they are given.

Weights are not needed to time training (and do not fit a GPU machine's 64 MiB carry): a model with
SmolLM2's sizes, random weights and the SmolLM2 tokenizer does the same arithmetic as the real one.
Random weights almost never sample EOS, so every completion runs to `max_completion_length`: equal
work for every library. `tiny` is for CPU smoke runs of the GPU benchmark.
"""

from __future__ import annotations

from pathlib import Path

# Sizes of HuggingFaceTB/SmolLM2-135M and SmolLM2-1.7B (Llama architecture, tied embeddings).
ARCHITECTURES = {
    "smollm2-135m": dict(
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        rope_theta=100000.0,
    ),
    "smollm2-1.7b": dict(
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=24,
        num_attention_heads=32,
        num_key_value_heads=32,
        rope_theta=130000.0,
    ),
    "tiny": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        rope_theta=10000.0,
    ),
}


def smollm2_tokenizer_dir(cache_dir: Path) -> Path:
    """The SmolLM2 tokenizer saved as plain files (3.5 MB), taken from the demo model's GGUF once."""
    target = cache_dir / "smollm2-tokenizer"
    if not (target / "tokenizer.json").exists():
        from transformers import AutoTokenizer

        from gspo_trl.demo.default_model import default_model_path

        AutoTokenizer.from_pretrained(default_model_path()).save_pretrained(target)
    return target


def build_random_model(architecture: str, tokenizer_dir: str | Path, out_dir: str | Path, seed: int = 0) -> str:
    """Save a random-init Llama of `architecture`'s sizes with the tokenizer beside it; return the path."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = LlamaConfig(
        **ARCHITECTURES[architecture],
        vocab_size=len(tokenizer),
        max_position_embeddings=8192,
        tie_word_embeddings=True,
        rms_norm_eps=1e-5,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return str(out_dir)


def synthetic_prompts(size: int, seed: int = 0):
    """Chat prompts of similar length (no task package needed on the GPU machine)."""
    import random

    from datasets import Dataset

    rng = random.Random(seed)
    prompts = [
        [{"role": "user", "content": f"What is {rng.randint(0, 99)} + {rng.randint(0, 99)}? Show your work."}]
        for _ in range(size)
    ]
    return Dataset.from_dict({"prompt": prompts})


def length_reward(completions, **kwargs):
    """A reward that varies within groups, so advantages are not all zero."""
    return [len(c[0]["content"] if isinstance(c, list) else c) / 100 for c in completions]

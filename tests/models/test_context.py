"""models.context: the positions a model attends to, read from its config, and the budget refused past them."""

from __future__ import annotations

import pytest
import torch
from transformers import GPT2Config, LlamaConfig, Qwen2Config

from gspo_trl.models.context import check_budget_fits, check_prompts_fit, context_length


def test_the_context_is_read_from_the_field_each_architecture_names_it_with():
    assert context_length(LlamaConfig(max_position_embeddings=512)) == (512, "max_position_embeddings")
    assert context_length(GPT2Config(n_positions=256))[0] == 256  # learned positions, named n_positions
    # Llama 3.1's scaling already states the stretched length in max_position_embeddings.
    llama3 = {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 8192}
    llama3.update(low_freq_factor=1.0, high_freq_factor=4.0)
    assert context_length(LlamaConfig(max_position_embeddings=131072, rope_scaling=llama3))[0] == 131072
    # YaRN on Qwen2.5 keeps the original length there: the model attends to factor × as many.
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    assert context_length(Qwen2Config(max_position_embeddings=32768, rope_scaling=yarn)) == (
        131072,
        "max_position_embeddings × rope factor 4.0",
    )


def test_a_config_that_names_no_length_is_not_checked():
    class AlibiConfig:  # BLOOM-like: ALiBi positions, no length in the config
        hidden_size = 64

    assert context_length(AlibiConfig()) is None
    check_budget_fits(AlibiConfig(), 10**6, 10**6)
    check_prompts_fit(torch.ones(1, 10**4), 10**6, None)


def test_the_budget_may_fill_the_context_and_not_one_position_more():
    config = LlamaConfig(max_position_embeddings=512)
    check_budget_fits(config, 256, 256)
    check_budget_fits(config, None, 511)  # room for a one-token prompt
    with pytest.raises(ValueError, match=r"256 \+ 257 = 513 positions, but the model attends to 512"):
        check_budget_fits(config, 256, 257)
    with pytest.raises(ValueError, match="max_completion_length=512 leaves no room for a prompt"):
        check_budget_fits(config, None, 512)


def test_a_rollout_prompt_is_measured_by_its_tokens_not_its_padding():
    context = (16, "max_position_embeddings")
    mask = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]])  # (N, P) left-padded: 2 and 4 prompt tokens
    check_prompts_fit(mask, 12, context)  # 4 + 12 = 16 positions: fits
    with pytest.raises(ValueError, match=r"\(row 1\) has 4 tokens; with 13 completion tokens it needs 17"):
        check_prompts_fit(mask, 13, context)
    check_prompts_fit(mask[:1], 14, context)  # the padded width (4) is not what counts

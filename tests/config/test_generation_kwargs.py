"""config.generation_kwargs: what generation_kwargs may set besides the config's own sampling fields."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from gspo_trl.config.generation_kwargs import check_generation_kwargs


def fields(generation_kwargs, **overrides):
    """The fields `check_generation_kwargs` reads, at GSPOConfig's defaults."""
    values = dict(temperature=1.0, top_p=1.0, top_k=0, min_p=None, repetition_penalty=1.0, max_completion_length=64)
    values.update(cache_implementation=None, use_vllm=False, generation_kwargs=generation_kwargs)
    return SimpleNamespace(**{**values, **overrides})


def test_a_value_that_means_the_configs_own_passes():
    check_generation_kwargs(fields({"temperature": 0.7}, temperature=0.7))
    check_generation_kwargs(fields({"max_new_tokens": 64, "do_sample": True}))
    # vLLM's top_k=-1 and 0 both disable it, as the config's 0; min_p 0 and None both disable it.
    check_generation_kwargs(fields({"top_k": -1, "min_p": 0.0, "max_tokens": 64}, use_vllm=True))
    with pytest.raises(ValueError, match=r"generation_kwargs\['top_k'\]=-1 overrides top_k=5"):
        check_generation_kwargs(fields({"top_k": -1}, top_k=5, use_vllm=True))
    with pytest.raises(ValueError, match=r"Set temperature=0.5 instead"):
        check_generation_kwargs(fields({"temperature": 0.5}, temperature=0.7))


def test_settings_that_bend_the_sampled_distribution_are_warned_about_and_neutral_values_are_not(caplog):
    with caplog.at_level("WARNING"):
        check_generation_kwargs(fields({"typical_p": 1.0, "presence_penalty": 0.0, "suppress_tokens": []}))
    assert "change the distribution" not in caplog.text
    with caplog.at_level("WARNING"):
        check_generation_kwargs(fields({"min_new_tokens": 4, "sequence_bias": [[[2], 4.0]]}))
    assert "generation_kwargs sets min_new_tokens, sequence_bias, which change the distribution" in caplog.text

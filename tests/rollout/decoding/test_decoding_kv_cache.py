import inspect
import warnings

import torch
from transformers import DynamicCache

from gspo_trl.rollout.decoding.kv_cache import cache_kwargs


def test_the_cache_goes_under_the_name_the_installed_forward_declares(tiny_model):
    declared = inspect.signature(type(tiny_model).forward).parameters
    (name,) = cache_kwargs(tiny_model, None)
    assert name in declared
    assert name == ("cache" if "cache" in declared else "past_key_values")


def test_a_peft_model_names_its_base_models_argument(tiny_model):
    from peft import LoraConfig, get_peft_model

    peft_model = get_peft_model(tiny_model, LoraConfig(r=2, target_modules=["q_proj"], task_type="CAUSAL_LM"))
    assert cache_kwargs(peft_model, None).keys() == cache_kwargs(peft_model.get_base_model(), None).keys()


def test_a_model_written_for_older_transformers_gets_past_key_values():
    class OldStyle(torch.nn.Module):
        def forward(self, input_ids=None, attention_mask=None, past_key_values=None, use_cache=None):
            return past_key_values

    cache = object()
    assert cache_kwargs(OldStyle(), cache) == {"past_key_values": cache}


def test_forward_and_generate_fill_the_cache_without_deprecation_warnings(tiny_model):
    ids = torch.tensor([[5, 6, 7, 8]])
    cache = DynamicCache(config=tiny_model.config)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        tiny_model(input_ids=ids, **cache_kwargs(tiny_model, cache), use_cache=True)
        assert cache.get_seq_length() == 4
        out = tiny_model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=3,
            **cache_kwargs(tiny_model, DynamicCache(config=tiny_model.config)),
        )
    assert out.shape[1] > ids.shape[1]

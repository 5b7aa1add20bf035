"""How a model call is handed its KV cache, across the transformers versions gspo-trl supports.

transformers 5.24 renamed the `past_key_values` argument of `forward` and `generate` to `cache` (the old
name still works there, with a FutureWarning, until 5.40 / 6.0). Models written for earlier versions
(remote code) only know `past_key_values`. `cache_kwargs` names the cache the way the model's own `forward`
declares it, so every decoding path calls built-in and remote-code models without warnings.
"""

from __future__ import annotations

import functools
import inspect


def cache_kwargs(model, cache) -> dict:
    """`{name: cache}` for `model(...)` / `model.generate(...)`, `name` being what the model's `forward` takes."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # a PEFT model forwards **kwargs
    return {_cache_argument(type(base)): cache}


@functools.cache
def _cache_argument(model_class: type) -> str:
    parameters = inspect.signature(model_class.forward).parameters  # follows the deprecation wrapper's __wrapped__
    return "cache" if "cache" in parameters else "past_key_values"

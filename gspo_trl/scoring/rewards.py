"""Reward functions: loading, calling and validating them with TRL's reward-function convention.

Owns: turning user-given reward items (callables, ``async def`` callables, sequence-classification reward models,
or model paths) into uniform ``RewardFunction`` objects; calling them all on a batch with TRL's keyword convention
``f(prompts=, completions=, completion_ids=, **columns, trainer_state=)``; validating what they return; and packing
the results into an (N, F) float32 table with NaN for "None / not applicable". Also resolves ``reward_weights``.

Does not own: combining the table into one reward per completion or computing advantages (see
``gspo_trl.scoring.advantages``), distributed gathering, device placement of reward models (the trainer moves/prepares
``RewardModelFunction.model``), or logging.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import inspect
import math
import numbers
import os
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer, PreTrainedModel

from ..models.distributed import prepare_frozen_model
from ..rollout.types import RESERVED_REWARD_KWARGS


class RewardFunction:
    """A user callable (sync or async) behind a uniform interface: ``.name``, ``.is_async`` and ``__call__``.

    ``__call__`` forwards TRL's keyword arguments unchanged and returns whatever the callable returns (a list, or an
    awaitable for async callables); ``compute_rewards`` does the awaiting and validation.
    """

    def __init__(self, func: Callable, name: str | None = None):
        self.func = func
        self.name = name or _callable_name(func)

    @property
    def is_async(self) -> bool:
        target = _unwrap_partial(self.func)
        return inspect.iscoroutinefunction(target) or inspect.iscoroutinefunction(getattr(target, "__call__", None))  # noqa: B004 (its method)

    def __call__(self, **kwargs: Any) -> Any:
        return self.func(**kwargs)


class RewardModelFunction(RewardFunction):
    """A sequence-classification reward model: the score of a completion is ``logits[:, 0]`` on prompt+completion."""

    def __init__(self, model: PreTrainedModel, processing_class: Any):
        self.model = model
        self.processing_class = processing_class
        super().__init__(func=self._score, name=_model_name(model))

    def _score(self, prompts: list, completions: list, **_unused: Any) -> list[float]:
        texts = [self._text(prompt, completion) for prompt, completion in zip(prompts, completions, strict=True)]
        # add_special_tokens=False like TRL: chat templates already hold the special tokens they want.
        inputs = self.processing_class(
            text=texts, return_tensors="pt", padding=True, padding_side="right", add_special_tokens=False
        )
        inputs = {key: value.to(self.model.device) for key, value in inputs.items()}
        with torch.inference_mode():
            logits = self.model(**inputs).logits  # (N, num_labels)
        return logits[:, 0].float().cpu().tolist()

    def _text(self, prompt: Any, completion: Any) -> str:
        if not _is_conversational(prompt):
            return prompt + completion
        if isinstance(completion, str):
            completion = [{"role": "assistant", "content": completion}]
        return self.processing_class.apply_chat_template(list(prompt) + list(completion), tokenize=False)


def _unwrap_partial(func: Callable) -> Callable:
    while isinstance(func, functools.partial):
        func = func.func
    return func


def _callable_name(func: Callable) -> str:
    # functools.partial has no __name__; callable class instances fall back to their class name (as TRL does).
    target = _unwrap_partial(func)
    return getattr(target, "__name__", type(target).__name__)


def _model_name(model: PreTrainedModel) -> str:
    name_or_path = str(getattr(model.config, "_name_or_path", "") or "").rstrip("/\\")
    return os.path.basename(name_or_path) or type(model).__name__


def _is_conversational(prompt: Any) -> bool:
    return isinstance(prompt, (list, tuple)) and len(prompt) > 0 and isinstance(prompt[0], dict) and "role" in prompt[0]


def _as_list(items: Any) -> list:
    if items is None:
        return []
    return list(items) if isinstance(items, (list, tuple)) else [items]


def load_reward_funcs(
    reward_funcs: Any,
    reward_processing_classes: Any = None,
    model_init_kwargs: dict | None = None,
    trust_remote_code: bool = False,
) -> list[RewardFunction]:
    """Turn reward items into ``RewardFunction`` objects (same order).

    Args:
        reward_funcs: one item or a list; each a callable (sync or async), a ``PreTrainedModel`` with a
            sequence-classification head, a path/id string (loaded with ``num_labels=1``), or a ``RewardFunction``.
        reward_processing_classes: None, one tokenizer, or a list aligned with ``reward_funcs``; only used for reward
            models. A None slot for a model loads ``AutoTokenizer`` from the model's ``_name_or_path``.
        model_init_kwargs: extra kwargs for ``AutoModelForSequenceClassification.from_pretrained``.
        trust_remote_code: allow custom code in reward models and tokenizers loaded here (``model_init_kwargs``'s
            own value wins for the models).
    """
    items = _as_list(reward_funcs)
    no_classes = reward_processing_classes is None
    processing_classes = [None] * len(items) if no_classes else _as_list(reward_processing_classes)
    if len(processing_classes) != len(items):
        raise ValueError(
            f"reward_processing_classes has {len(processing_classes)} entries but there are {len(items)} "
            "reward functions; pass one per reward function (None for non-model ones)"
        )
    model_init_kwargs = dict(model_init_kwargs or {})
    model_init_kwargs.setdefault("trust_remote_code", trust_remote_code)
    return [
        _load_one(index, item, processing_class, model_init_kwargs, trust_remote_code)
        for index, (item, processing_class) in enumerate(zip(items, processing_classes))
    ]


def load_rewards(
    reward_funcs: Any,
    environment_rewards: list,
    reward_processing_classes: Any,
    args,
    steps_reward: bool,
) -> tuple[list[RewardFunction], torch.Tensor]:
    """(the reward functions, their (F,) weights): the user's, weighted by `args.reward_weights`, then an
    environment's `get_reward` functions, weighted 1 as in TRL. `steps_reward`: an `env_factory`'s `step()` rewards
    may be the whole reward, so no reward function is needed."""
    reward_funcs = _as_list(reward_funcs)
    if reward_processing_classes is not None and environment_rewards:
        reward_processing_classes = _as_list(reward_processing_classes) + [None] * len(environment_rewards)
    loaded = load_reward_funcs(
        reward_funcs + environment_rewards, reward_processing_classes, args.model_init_kwargs, args.trust_remote_code
    )
    if not loaded and not steps_reward:
        raise ValueError(
            "reward_funcs is empty: pass at least one reward function, an env_factory whose step() "
            "returns rewards, or an environment_factory whose environment defines get_reward()."
        )
    weights = torch.cat(
        [resolve_reward_weights(args.reward_weights, len(reward_funcs)), torch.ones(len(environment_rewards))]
    )
    return loaded, weights


def _load_one(
    index: int, item: Any, processing_class: Any, model_init_kwargs: dict, trust_remote_code: bool
) -> RewardFunction:
    if isinstance(item, RewardFunction):
        return item
    if isinstance(item, (str, os.PathLike)):
        item = _load_reward_model(f"reward_funcs[{index}] ({os.fspath(item)!r})", os.fspath(item), model_init_kwargs)
    if isinstance(item, PreTrainedModel):
        check_reward_head(f"reward_funcs[{index}] ({_model_name(item)})", type(item).__name__, item.config.num_labels)
        return _wrap_reward_model(item, processing_class, trust_remote_code)
    if callable(item) and not isinstance(item, torch.nn.Module):
        return RewardFunction(item)
    raise TypeError(
        f"reward_funcs[{index}] has unsupported type {type(item).__name__}; expected a callable (sync or async), "
        "a PreTrainedModel for sequence classification, or a model path/id string"
    )


# Class-name endings of models whose output is next-token logits, not one score per sequence.
LANGUAGE_MODEL_HEADS = ("ForCausalLM", "LMHeadModel", "ForConditionalGeneration", "ForMaskedLM")


def check_reward_head(name: str, architecture: str, num_labels: int) -> None:
    """A `ValueError` unless a reward model (`architecture`: its class name, or its checkpoint's) has a sequence
    classification head with one label: a language model's head gives next-token logits, and only `logits[:, 0]` of
    several labels would be read."""
    if architecture.endswith(LANGUAGE_MODEL_HEADS):
        raise ValueError(
            f"{name} is a language model ({architecture}), not a reward model: its logits score next tokens, and a "
            "sequence-classification model loaded from its checkpoint gets a randomly initialised score head, so the "
            "rewards would be noise. Pass a reward model trained with a sequence-classification head (e.g. by TRL's "
            "RewardTrainer), or score with a reward function."
        )
    if num_labels != 1:
        raise ValueError(
            f"{name} has num_labels={num_labels}, but a reward model gives one score per completion (logits[:, 0] "
            "would be read, the other labels ignored). Pass a model with one label, or wrap it in a reward function "
            "that turns its labels into one score."
        )


def _load_reward_model(name: str, path: str, model_init_kwargs: dict) -> PreTrainedModel:
    """The sequence-classification model at `path`, refused when its checkpoint holds another head (its config's
    `architectures`), several labels, or leaves weights newly initialised (a score head it lacks)."""
    config = AutoConfig.from_pretrained(path, trust_remote_code=model_init_kwargs.get("trust_remote_code", False))
    for architecture in config.architectures or []:
        check_reward_head(name, architecture, config.num_labels)
    model, loading = AutoModelForSequenceClassification.from_pretrained(
        path, num_labels=1, output_loading_info=True, **model_init_kwargs
    )
    missing = ", ".join(sorted(loading["missing_keys"]))
    if missing:
        raise ValueError(
            f"{name} lacks weights its sequence-classification model needs ({missing}), which would be randomly "
            "initialised, and the rewards noise. Pass a trained reward model, or score with a reward function."
        )
    return model


def _wrap_reward_model(model: PreTrainedModel, processing_class: Any, trust_remote_code: bool) -> RewardModelFunction:
    if processing_class is None:
        processing_class = AutoTokenizer.from_pretrained(
            model.config._name_or_path, trust_remote_code=trust_remote_code
        )
    if processing_class.pad_token_id is None:
        processing_class.pad_token = processing_class.eos_token
    # The classifier reads the last non-pad token, so the model must know which id is padding.
    model.config.get_text_config().pad_token_id = processing_class.pad_token_id
    model.eval()
    return RewardModelFunction(model, processing_class)


def resolve_reward_weights(reward_weights: Sequence[float] | torch.Tensor | None, num_funcs: int) -> torch.Tensor:
    """(F,) float32 weights: all ones when None, else the given values (length must equal ``num_funcs``)."""
    if reward_weights is None:
        return torch.ones(num_funcs, dtype=torch.float32)
    weights = torch.as_tensor(reward_weights, dtype=torch.float32).reshape(-1)  # (F,)
    if weights.numel() != num_funcs:
        raise ValueError(
            f"reward_weights has {weights.numel()} values but there are {num_funcs} reward functions; "
            "pass one weight per reward function"
        )
    if not torch.isfinite(weights).all():
        raise ValueError(f"reward_weights must be finite, got {weights.tolist()}")
    return weights


def _to_float(name: str, index: int, value: Any) -> float:
    if value is None:
        return math.nan
    if isinstance(value, torch.Tensor) and value.ndim == 0:
        value = value.item()
    # bool is an Integral, so it is accepted as 0/1 like TRL does.
    if isinstance(value, numbers.Real):
        number = float(value)
        if not math.isfinite(number):
            raise ValueError(
                f"reward function '{name}' returned {number} at index {index}; rewards must be finite "
                "(return None for 'not applicable')"
            )
        return number
    raise ValueError(
        f"reward function '{name}' returned a non-number at index {index}: {value!r} ({type(value).__name__}); "
        "expected float, int, bool or None"
    )


def validate_rewards(name: str, output: Any, num_completions: int) -> list[float]:
    """Check one function's output and convert it to floats (NaN for None). Raises ValueError naming ``name``."""
    if isinstance(output, (torch.Tensor, np.ndarray)):
        if output.ndim != 1:
            raise ValueError(f"reward function '{name}' returned an array of shape {tuple(output.shape)}; expected 1-D")
        output = output.tolist()
    if not isinstance(output, (list, tuple)):
        raise ValueError(
            f"reward function '{name}' returned {type(output).__name__}; expected a list with one reward "
            "(float or None) per completion"
        )
    if len(output) != num_completions:
        raise ValueError(f"reward function '{name}' returned {len(output)} rewards for {num_completions} completions")
    return [_to_float(name, index, value) for index, value in enumerate(output)]


def _call_error(name: str, num_completions: int, error: BaseException) -> ValueError:
    return ValueError(
        f"reward function '{name}' raised {type(error).__name__} on the batch of {num_completions} completions "
        f"(sample indices 0..{num_completions - 1}): {error}"
    )


# A job is (function, awaitable it already returned) or (async function, None): then the coroutine is created inside
# the loop, so an early error never leaves an un-awaited coroutine behind.
AsyncJob = tuple[RewardFunction, Any]


async def _await_all(jobs: list[AsyncJob], call_kwargs: dict, num_completions: int) -> list:
    async def await_one(function: RewardFunction, pending: Any) -> Any:
        try:
            return await (pending if pending is not None else function(**call_kwargs))
        except Exception as error:
            raise _call_error(function.name, num_completions, error) from error

    return await asyncio.gather(*(await_one(function, pending) for function, pending in jobs))


def _run_async(jobs: list[AsyncJob], call_kwargs: dict, num_completions: int) -> list:
    """Run the jobs concurrently on a fresh event loop; a new loop per call keeps this free of global state."""
    run = functools.partial(asyncio.run, _await_all(jobs, call_kwargs, num_completions))
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return run()
    # A loop already runs in this thread (e.g. Jupyter) and we cannot block inside it: use a worker thread's loop.
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(run).result()


def _check_batch(prompts: list, completions: list, completion_ids: list, columns: dict) -> None:
    if not len(prompts) == len(completions) == len(completion_ids):
        raise ValueError(
            f"prompts ({len(prompts)}), completions ({len(completions)}) and completion_ids ({len(completion_ids)}) "
            "must have the same length"
        )
    reserved = sorted(set(columns) & set(RESERVED_REWARD_KWARGS))
    if reserved:
        raise ValueError(f"columns must not contain the reserved keyword(s) {reserved}")


def compute_rewards(
    reward_funcs: Sequence[RewardFunction | Callable],
    prompts: list,
    completions: list,
    completion_ids: list[list[int]],
    columns: dict[str, list] | None = None,
    trainer_state: Any = None,
    log_metric: Callable[[str, float], None] | None = None,
    log_extra: Callable[[str, list], None] | None = None,
) -> torch.Tensor:
    """Score a batch with every reward function: returns (N, F) float32 on CPU, NaN where a function gave None.

    Sync functions run first, one after another, in the calling thread. Then every awaitable (``async def``
    functions, and sync callables that returned an awaitable) runs concurrently with ``asyncio.gather`` on a fresh
    event loop. Note: an async function that keeps loop-bound resources (e.g. a client session created once) between
    calls will not work, since each call gets its own loop.
    """
    columns = dict(columns or {})
    _check_batch(prompts, completions, completion_ids, columns)
    functions = [f if isinstance(f, RewardFunction) else RewardFunction(f) for f in reward_funcs]
    num_completions = len(prompts)
    call_kwargs = dict(
        prompts=prompts, completions=completions, completion_ids=completion_ids, **columns, trainer_state=trainer_state
    )
    # TRL's hooks for reward functions: log a scalar metric, or an extra column of the completions table.
    if log_metric is not None:
        call_kwargs["log_metric"] = log_metric
    if log_extra is not None:
        call_kwargs["log_extra"] = log_extra

    outputs: dict[int, Any] = {}
    async_jobs: list[AsyncJob] = []
    async_indices: list[int] = []
    try:
        for index, function in enumerate(functions):
            if function.is_async:
                async_jobs.append((function, None))
                async_indices.append(index)
                continue
            try:
                result = function(**call_kwargs)
            except Exception as error:
                raise _call_error(function.name, num_completions, error) from error
            if inspect.isawaitable(result):
                async_jobs.append((function, result))
                async_indices.append(index)
            else:
                outputs[index] = result
    except BaseException:
        for _, pending in async_jobs:  # awaitables returned by sync callables would otherwise never be awaited
            if hasattr(pending, "close"):
                pending.close()
        raise

    if async_jobs:
        outputs.update(zip(async_indices, _run_async(async_jobs, call_kwargs, num_completions)))

    columns_out = [validate_rewards(functions[i].name, outputs[i], num_completions) for i in range(len(functions))]
    rewards_per_func = torch.tensor(columns_out, dtype=torch.float32).reshape(len(functions), num_completions).T
    _warn_unscored(rewards_per_func)
    return rewards_per_func.contiguous()  # (N, F)


def _warn_unscored(rewards_per_func: torch.Tensor) -> None:
    num_unscored = int(torch.isnan(rewards_per_func).all(dim=1).sum().item()) if rewards_per_func.numel() else 0
    if num_unscored:
        warnings.warn(
            f"{num_unscored} of {rewards_per_func.shape[0]} completions got no reward (every reward function "
            "returned None); they are left out of their group's baseline and get zero advantage",
            stacklevel=3,
        )


def prepare_reward_models(reward_funcs: list, accelerator) -> None:
    """Place each reward model like the policy (sharded under ZeRO-3/FSDP2, `distributed.prepare_frozen_model`)."""
    for reward_func in reward_funcs:
        if isinstance(reward_func, RewardModelFunction):
            reward_func.model = prepare_frozen_model(reward_func.model, accelerator)

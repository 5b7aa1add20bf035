"""config_checks: the derived defaults and checks called one by one, without building a `GSPOConfig`."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from gspo_trl.config import checks as config_checks
from gspo_trl.config.generation_kwargs import check_generation_kwargs


@pytest.mark.parametrize(
    "loss_type, level, epsilon, epsilon_high, expected",
    [
        ("grpo", None, None, None, ("sequence", 3e-4, 4e-4)),  # the paper's
        ("grpo", None, 1e-3, None, ("sequence", 1e-3, 1e-3)),  # epsilon alone: symmetric (TRL's meaning)
        ("grpo", "token", None, None, ("token", 0.2, 0.2)),
        ("cispo", None, None, None, ("token", 0.2, 5.0)),
        ("cispo", None, None, 2.0, ("token", 0.2, 2.0)),
        ("vespo", None, None, None, ("token", 0.2, 0.2)),
        ("dapo", "sequence", None, None, ("sequence", 3e-4, 4e-4)),
        ("sapo", "turn", None, None, ("turn", 3e-4, 4e-4)),
    ],
)
def test_objective_defaults(loss_type, level, epsilon, epsilon_high, expected):
    assert config_checks.objective_defaults(loss_type, level, epsilon, epsilon_high) == expected


@pytest.mark.parametrize(
    "given, expected", [(True, "group"), (False, "none"), ("True", "group"), ("false", "none"), ("batch", "batch")]
)
def test_scale_rewards_spellings(given, expected):
    assert config_checks.scale_rewards_option(given) == expected


def batch_config(**overrides):
    values = dict(
        per_device_train_batch_size=8,
        world_size=2,
        gradient_accumulation_steps=2,
        num_generations=8,
        steps_per_generation=None,
        generation_batch_size=None,
    )
    return SimpleNamespace(**{**values, **overrides})


def test_batch_sizes_from_either_field():
    assert config_checks.batch_sizes(batch_config(), False) == (8, 128)  # 4 × GA, the paper's four steps
    assert config_checks.batch_sizes(batch_config(steps_per_generation=3), True) == (3, 48)
    assert config_checks.batch_sizes(batch_config(generation_batch_size=64), False) == (4, 64)
    with pytest.raises(ValueError, match="not both"):
        config_checks.batch_sizes(batch_config(steps_per_generation=4, generation_batch_size=64), True)
    # An optimizer step of 3 × 2 × 2 = 12 completions holds 1.5 groups of 8: accepted, as in TRL (advantages come
    # from the whole rollout); the rollout of 3 × 2 × 8 = 48 completions holds 6 whole groups.
    assert config_checks.batch_sizes(batch_config(per_device_train_batch_size=3), False) == (8, 48)
    # A rollout must hold whole groups: 3 × 2 × 3 = 18 completions are 2.25 groups of 8.
    with pytest.raises(ValueError, match=r"generation_batch_size \(18 = .*multiple of num_generations \(8\)"):
        config_checks.batch_sizes(batch_config(per_device_train_batch_size=3, steps_per_generation=3), True)


def test_max_staleness_defaults_to_the_optimizer_steps_per_rollout():
    config = SimpleNamespace(
        async_rollouts=True,
        max_staleness=None,
        steps_per_generation=8,
        num_iterations=1,
        gradient_accumulation_steps=2,
        optimizer_steps_per_rollout=4,
        use_vllm=False,
        vllm_logprobs_as_old=False,
    )
    assert config_checks.max_staleness(config) == 4
    config.max_staleness = 0
    assert config_checks.max_staleness(config) == 0
    config.async_rollouts = False
    with pytest.raises(ValueError, match="only applies with async_rollouts=True"):
        config_checks.max_staleness(config)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"num_beams": 2, "length_penalty": -0.1}, r"\['num_beams'\]=2 is not supported: beam search"),
        ({"num_return_sequences": 4}, "num_generations sets the group size"),
        ({"penalty_alpha": 0.6, "top_k": 4}, "contrastive search"),
    ],
)
def test_generation_kwargs_that_do_not_sample_the_policy_are_refused_at_construction(tmp_path, kwargs, match):
    from gspo_trl import GSPOConfig

    with pytest.raises(ValueError, match=match):
        GSPOConfig(output_dir=str(tmp_path), use_cpu=True, generation_kwargs=kwargs)
    # What a sampler does take passes, and one beam is no beam search.
    GSPOConfig(
        output_dir=str(tmp_path),
        use_cpu=True,
        top_k=50,
        generation_kwargs={"num_beams": 1, "top_k": 50, "do_sample": True},
    )


def test_num_generations_eval_is_a_positive_int_and_eval_groups_must_be_whole(tmp_path):
    from gspo_trl import GSPOConfig

    for bad in (0, 1.5, True):
        with pytest.raises(ValueError, match="num_generations_eval must be an int >= 1"):
            GSPOConfig(output_dir=str(tmp_path), use_cpu=True, num_generations_eval=bad)
    kwargs = dict(output_dir=str(tmp_path), use_cpu=True, eval_strategy="steps", per_device_eval_batch_size=6)
    with pytest.raises(ValueError, match=r"multiple of num_generations_eval \(4\)"):
        GSPOConfig(**kwargs, num_generations=2, num_generations_eval=4)
    assert GSPOConfig(**kwargs, num_generations=4, num_generations_eval=3).num_generations_eval == 3


def sampling_fields(generation_kwargs, **overrides):
    """The fields `check_generation_kwargs` reads, at GSPOConfig's defaults."""
    values = dict(temperature=1.0, top_p=1.0, top_k=0, min_p=None, repetition_penalty=1.0, max_completion_length=512)
    values.update(cache_implementation=None, use_vllm=True, generation_kwargs=generation_kwargs)
    return SimpleNamespace(**{**values, **overrides})


@pytest.mark.parametrize("name", ["n", "best_of", "use_beam_search", "logprobs"])
def test_vllm_request_fields_the_trainer_sets_are_refused_in_generation_kwargs(name):
    with pytest.raises(ValueError, match=f"generation_kwargs sets '{name}'"):
        check_generation_kwargs(sampling_fields({name: 2, "top_k": 5}, top_k=5))
    check_generation_kwargs(sampling_fields({"top_k": 5, "presence_penalty": 0.1}, top_k=5))


@pytest.mark.parametrize(
    "given, expected", [("auto", None), (None, None), ("None", None), ("null", None), ("64", 64), (8, 8)]
)
def test_pad_to_multiple_of_spellings(given, expected):
    assert config_checks.pad_to_multiple_of(given) == expected


@pytest.mark.parametrize("given", [0, -8, "eight", True, 2.5])
def test_pad_to_multiple_of_refuses_what_is_not_a_positive_int(given):
    with pytest.raises(ValueError, match="pad_to_multiple_of must be an int >= 1"):
        config_checks.pad_to_multiple_of(given)


@pytest.mark.parametrize(
    "values, match",
    [
        ({"routing_replay": "r3"}, r"routing_replay must be one of \('none', 'old', 'rollout'\)"),
        ({"use_vllm": True}, "the vLLM server returns no routes"),
        ({"decode_loop": "generate"}, "transformers' generate records none"),
        ({"activation_checkpointing": True}, "activation checkpointing would recompute the forward"),
        ({"padding_free": True}, "padding_free=True packs rows in another layout"),
        ({"async_rollouts": True}, "async_rollouts is not available with it yet"),
    ],
)
def test_routing_replay_is_refused_where_no_routes_are_recorded_or_replayed(tmp_path, values, match):
    from gspo_trl import GSPOConfig

    replay = {"routing_replay": "rollout", **values}
    with pytest.raises(ValueError, match=match):
        GSPOConfig(output_dir=str(tmp_path), use_cpu=True, **replay)
    GSPOConfig(output_dir=str(tmp_path), use_cpu=True, **{**values, "routing_replay": "none"})  # fine without replay


@pytest.mark.parametrize(
    "values, match",
    [
        ({"vllm_weight_transport": "nccl"}, "vllm_weight_transport must be one of"),
        ({"vllm_weight_chunk_mb": 0}, "vllm_weight_chunk_mb must be > 0"),
        (
            {"vllm_weight_sync_delta": True, "vllm_weight_transport": "engine"},
            "vllm_weight_sync_delta=True sends deltas over HTTP only, but vllm_weight_transport='engine'",
        ),
        ({"vllm_weight_sync_delta": True, "vllm_weight_transport": "shared_dir"}, "Set vllm_weight_transport='http'"),
    ],
)
def test_bad_vllm_weight_transport_settings_are_refused_at_construction(tmp_path, values, match):
    from gspo_trl import GSPOConfig

    with pytest.raises(ValueError, match=match):
        GSPOConfig(output_dir=str(tmp_path), use_cpu=True, **values)


def test_colocated_tensor_parallel_groups_refuse_what_would_leave_a_process_waiting():
    # The engine's tensor-parallel group samples together: a sampling thread beside training (async_rollouts) and
    # episodes whose processes play different numbers of turns would leave a process waiting in a group collective.
    from types import SimpleNamespace

    from gspo_trl.config.checks import check_colocate
    from gspo_trl.rollout.episodes import episode_runner_for

    config = SimpleNamespace(
        world_size=2,
        vllm_tensor_parallel_size=2,
        vllm_gpu_memory_utilization=0.3,
        async_rollouts=True,
        vllm_enable_sleep_mode=False,
        use_cpu=True,
        use_vllm=True,
        vllm_mode="colocate",
    )
    with pytest.raises(ValueError, match="async_rollouts=True with vllm_tensor_parallel_size > 1"):
        check_colocate(config)
    config.async_rollouts = False
    check_colocate(config)  # a group of two on two processes, sampling in step
    with pytest.raises(ValueError, match="Multi-turn episodes with a colocated engine"):
        episode_runner_for(None, lambda: None, tokenizer=None, args=config)

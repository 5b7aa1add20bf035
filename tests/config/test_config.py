"""GSPOConfig: paper defaults, batch-size arithmetic and construction-time errors."""

from __future__ import annotations

import pytest

from gspo_trl import GSPOConfig
from gspo_trl.objective.loss import Objective


def make(tmp_path, **kwargs):
    return GSPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", **kwargs)


def test_paper_defaults(tmp_path):
    config = make(tmp_path, per_device_train_batch_size=8)
    assert config.importance_sampling_level == "sequence"
    assert (config.epsilon, config.epsilon_high, config.beta) == (3e-4, 4e-4, 0.0)
    assert config.loss_type == "grpo"
    assert config.steps_per_generation == 4 and config.generation_batch_size == 32
    assert config.bf16 is False  # no bf16-capable GPU here
    assert not config.is_on_policy


def test_batch_sizes(tmp_path):
    config = make(tmp_path, per_device_train_batch_size=8, gradient_accumulation_steps=2, steps_per_generation=2)
    assert config.generation_batch_size == 16 and config.is_on_policy and config.optimizer_steps_per_rollout == 1
    config = make(tmp_path, per_device_train_batch_size=8, generation_batch_size=64)
    assert config.steps_per_generation == 8 and config.optimizer_steps_per_rollout == 8
    twice = make(tmp_path, per_device_train_batch_size=8, steps_per_generation=1, num_iterations=2)
    assert twice.is_on_policy is False and twice.optimizer_steps_per_rollout == 2


@pytest.mark.parametrize(
    "kwargs, level, epsilon, epsilon_high",
    [
        ({"epsilon": 1e-3}, "sequence", 1e-3, 1e-3),  # epsilon set, epsilon_high unset: symmetric (TRL's meaning)
        ({"epsilon": 1e-3, "epsilon_high": 2e-3}, "sequence", 1e-3, 2e-3),
        ({"importance_sampling_level": "token"}, "token", 0.2, 0.2),  # GRPO's customary range, TRL's default
        ({"loss_type": "sapo"}, "sequence", 3e-4, 4e-4),
        ({"loss_type": "luspo"}, "sequence", 3e-4, 4e-4),
        ({"loss_type": "cispo"}, "token", 0.2, 5.0),  # epsilon_high is CISPO's eps_max (ScaleRL: 5.0)
        ({"loss_type": "vespo"}, "token", 0.2, 0.2),
        ({"loss_type": "dapo"}, "token", 0.2, 0.2),
        ({"loss_type": "dapo", "importance_sampling_level": "sequence"}, "sequence", 3e-4, 4e-4),
    ],
)
def test_objective_defaults_follow_the_loss_type(tmp_path, kwargs, level, epsilon, epsilon_high):
    config = make(tmp_path, per_device_train_batch_size=8, **kwargs)
    assert (config.importance_sampling_level, config.epsilon, config.epsilon_high) == (level, epsilon, epsilon_high)


def test_scale_rewards_booleans(tmp_path):
    assert make(tmp_path, per_device_train_batch_size=8, scale_rewards=False).scale_rewards == "none"
    assert make(tmp_path, per_device_train_batch_size=8, scale_rewards=True).scale_rewards == "group"


@pytest.mark.parametrize(
    "kwargs, field_name",
    [
        ({"num_generations": 1}, "num_generations"),
        ({"epsilon": 0.0}, "epsilon"),
        ({"epsilon": 1.5}, "epsilon"),
        ({"epsilon_high": -1.0}, "epsilon_high"),
        ({"beta": -0.1}, "beta"),
        ({"importance_sampling_level": "tokens"}, "importance_sampling_level"),
        ({"loss_type": "ppo"}, "loss_type"),
        ({"loss_type": "vespo", "importance_sampling_level": "sequence"}, "importance_sampling_level"),
        ({"delta": 1.0}, "delta"),
        ({"sapo_temperature_pos": 0.0}, "sapo_temperature_pos"),
        ({"vespo_lambda_neg": -1.0}, "vespo_lambda_neg"),
        ({"off_policy_mask_threshold": -1.0}, "off_policy_mask_threshold"),
        ({"top_entropy_quantile": 1.5}, "top_entropy_quantile"),
        ({"entropy_coef": float("nan")}, "entropy_coef"),
        ({"use_adaptive_entropy": True, "entropy_coef_min": 0.5, "entropy_coef_max": 0.1}, "use_adaptive_entropy"),
        ({"scale_rewards": "median"}, "scale_rewards"),
        ({"temperature": 0.0}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"min_p": 2.0}, "min_p"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"max_completion_length": 0}, "max_completion_length"),
        ({"max_prompt_length": 0}, "max_prompt_length"),
        ({"num_iterations": 0}, "num_iterations"),
        ({"logprob_chunk_size": 0}, "logprob_chunk_size"),
        ({"logprob_kept_logits_mb": -1}, "logprob_kept_logits_mb"),
        ({"decode_max_rows": 0}, "decode_max_rows"),
        ({"cpu_decoding_kernels": "yes"}, "cpu_decoding_kernels"),
        ({"reward_weights": [1.0, float("nan")]}, "reward_weights"),
        ({"per_device_train_batch_size": 3}, "num_generations"),  # 12 completions cannot hold groups of 8
        ({"generation_batch_size": 20}, "generation_batch_size"),
        ({"generation_batch_size": 32, "steps_per_generation": 4}, "generation_batch_size"),
        ({"auto_find_batch_size": True}, "auto_find_batch_size"),
        ({"advantage_granularity": "step"}, "advantage_granularity"),
        ({"advantage_granularity": "turn"}, "importance_sampling_level='turn'"),
        ({"advantage_granularity": "turn", "loss_type": "vespo"}, "advantage_granularity='trajectory'"),
        ({"max_turns": 0}, "max_turns"),
        ({"turn_discount": 1.5}, "turn_discount"),
        ({"use_liger_kernel": True}, "use_liger_kernel"),  # Triton GPU kernels; make() trains on CPU
    ],
)
def test_invalid_values_name_the_field(tmp_path, kwargs, field_name):
    kwargs.setdefault("per_device_train_batch_size", 8)
    with pytest.raises(ValueError, match=field_name):
        make(tmp_path, **kwargs)


# The loss fields' bounds are `Objective`'s: a config refuses exactly what an Objective built directly refuses.
@pytest.mark.parametrize(
    "bad, field_name",
    [
        ({"epsilon": 0.0}, "epsilon"),
        ({"epsilon": -0.1}, "epsilon"),
        ({"epsilon": 1.0}, "epsilon"),
        ({"epsilon": float("nan")}, "epsilon"),
        ({"epsilon_high": 0.0}, "epsilon_high"),
        ({"epsilon_high": -1.0}, "epsilon_high"),
        ({"epsilon_high": float("nan")}, "epsilon_high"),
        ({"delta": 1.0}, "delta"),
        ({"beta": float("inf")}, "beta"),
        ({"sapo_temperature_neg": 0.0}, "sapo_temperature_neg"),
        ({"vespo_k_neg": -1.0}, "vespo_k_neg"),
        ({"off_policy_mask_threshold": -1.0}, "off_policy_mask_threshold"),
        ({"loss_type": "ppo"}, "loss_type"),
        ({"importance_sampling_level": "tokens"}, "importance_sampling_level"),
    ],
)
def test_config_and_objective_refuse_the_same_loss_values_with_the_same_message(tmp_path, bad, field_name):
    with pytest.raises(ValueError, match=field_name) as direct:
        Objective(**bad)
    with pytest.raises(ValueError, match=field_name) as configured:
        make(tmp_path, per_device_train_batch_size=8, **bad)
    assert str(configured.value) == str(direct.value)


def test_config_and_objective_accept_the_same_edge_values(tmp_path):
    edges = dict(epsilon=1e-6, epsilon_high=10.0, delta=1.0 + 1e-6, beta=0.0, off_policy_mask_threshold=0.0)
    config = make(tmp_path, per_device_train_batch_size=8, **edges)
    assert Objective.from_config(config) == Objective(**edges, max_completion_length=config.max_completion_length)


@pytest.mark.parametrize(
    "overrides, match",
    [
        (dict(use_vllm=True, vllm_mode="colocate", vllm_enable_sleep_mode=True), "vllm_enable_sleep_mode=True needs"),
        (dict(use_vllm=True, vllm_mode="colocate", vllm_tensor_parallel_size=2), "must divide the number of training"),
        (dict(use_vllm=True, vllm_mode="colocate", vllm_gpu_memory_utilization=0.0), "vllm_gpu_memory_utilization"),
        (dict(use_vllm=True, vllm_mode="remote"), "vllm_mode"),
        (dict(vllm_importance_sampling_mode="sequence"), "vllm_importance_sampling_mode"),
        (dict(vllm_importance_sampling_clip_min=2.0, vllm_importance_sampling_clip_max=1.0), "clip_min/max"),
        (dict(use_vllm=True, loss_type="vespo"), "token_truncate"),
        (dict(vllm_logprobs_as_old=True), "use_vllm=True"),
        (dict(use_vllm=True, layout_independent_sampling=True), "layout_independent_sampling"),
    ],
)
def test_vllm_settings_that_cannot_work_are_refused(tmp_path, overrides, match):
    with pytest.raises(ValueError, match=match):
        GSPOConfig(output_dir=str(tmp_path), use_cpu=True, **overrides)


def test_vllm_defaults_and_trls_deprecated_cap(tmp_path):
    config = GSPOConfig(output_dir=str(tmp_path), use_cpu=True, use_vllm=True, vllm_importance_sampling_cap=2.0)
    assert (config.vllm_mode, config.vllm_server_host, config.vllm_importance_sampling_mode) == (
        "server",
        "127.0.0.1",
        "sequence_mask",
    )
    assert config.vllm_importance_sampling_clip_max == 2.0


def test_turn_level_defaults_to_the_papers_sequence_clipping_range(tmp_path):
    args = make(tmp_path, per_device_train_batch_size=8, importance_sampling_level="turn", advantage_granularity="turn")
    assert (args.epsilon, args.epsilon_high) == (3e-4, 4e-4)
    assert args.max_turns is None and args.turn_discount == 1.0


def test_kept_logits_must_be_a_number(tmp_path):
    with pytest.raises(TypeError, match="logprob_kept_logits_mb"):
        make(tmp_path, per_device_train_batch_size=8, logprob_kept_logits_mb="1GB")


def test_keep_attention_must_be_a_bool(tmp_path):
    with pytest.raises(TypeError, match="activation_checkpointing_keep_attention"):
        make(tmp_path, per_device_train_batch_size=8, activation_checkpointing_keep_attention="no")


def test_the_repr_and_dict_hide_the_tokens(tmp_path):
    config = GSPOConfig(
        output_dir=str(tmp_path), report_to="none", hub_token="hub-secret-1", vllm_server_token="vllm-secret-2"
    )
    assert config.vllm_server_token == "vllm-secret-2"
    for text in (repr(config), str(config), config.to_json_string()):
        assert "hub-secret-1" not in text and "vllm-secret-2" not in text

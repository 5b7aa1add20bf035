"""The GSPO family inside GSPOTrainer: every loss type trains from a TRL-style config, token-mean losses
are normalised over the whole optimizer step, and the token selections, entropy control and MoE
auxiliary loss reach the loss. The formulas themselves are tested in test_objectives.py."""

from __future__ import annotations

import warnings

import pytest
import torch
from helpers import count_digits, small_config, text_dataset

from gspo_trl import GSPOTrainer
from gspo_trl.objective.loss import policy_loss
from gspo_trl.training.micro_batch import MicroBatch

# TRL-style option sets: each must build a TRL GRPOConfig and a GSPOConfig alike, then train.
TRL_OPTIONS = {
    "sapo": dict(loss_type="sapo"),
    "sapo token": dict(loss_type="sapo", importance_sampling_level="token", sapo_temperature_neg=1.2),
    "cispo": dict(loss_type="cispo", epsilon_high=5.0),
    "vespo": dict(loss_type="vespo", importance_sampling_level="token"),
    "luspo": dict(loss_type="luspo", importance_sampling_level="sequence"),
    "dapo": dict(loss_type="dapo", epsilon=0.2, epsilon_high=0.28),
    "bnpo": dict(loss_type="bnpo"),
    "dr_grpo": dict(loss_type="dr_grpo"),
    "delta": dict(importance_sampling_level="token", epsilon=0.2, delta=1.5),
    "off-policy mask": dict(importance_sampling_level="sequence", off_policy_mask_threshold=0.0),
    "top entropy + bonus": dict(top_entropy_quantile=0.2, entropy_coef=0.01),
    "adaptive entropy": dict(use_adaptive_entropy=True, entropy_coef=0.01, entropy_target=100.0),
}
OBJECTIVE_METRIC = {
    "sapo": "sapo/gate_weight",
    "sapo token": "sapo/gate_weight",
    "cispo": "cispo_clip_ratio",
    "vespo": "vespo/phi_seq_mean",
    "dapo": "clip_ratio/region",
    "off-policy mask": "off_policy/masked_fraction",
    "top entropy + bonus": "entropy_coef",
    "adaptive entropy": "entropy_coef",
}


def train_logs(trainer):
    return [entry for entry in trainer.state.log_history if "loss" in entry]


@pytest.mark.parametrize("name", list(TRL_OPTIONS))
def test_trl_options_build_a_trl_config_and_train_here(tmp_path, tiny_model_dir, name):
    from trl import GRPOConfig

    options = TRL_OPTIONS[name]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        GRPOConfig(
            output_dir=str(tmp_path / "trl"),
            use_cpu=True,
            report_to="none",
            num_generations=4,
            per_device_train_batch_size=4,
            **options,
        )  # the same options are valid TRL
    config = small_config(tmp_path / "out", max_steps=4, learning_rate=5e-3, **options)  # 4 steps off one rollout
    trainer = GSPOTrainer(tiny_model_dir, count_digits, args=config, train_dataset=text_dataset())
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    assert any(not torch.equal(before[n], p) for n, p in trainer.model.named_parameters())
    logs = train_logs(trainer)
    assert len(logs) == 4 and all(torch.isfinite(torch.tensor(entry["loss"])) for entry in logs)
    if name in OBJECTIVE_METRIC:
        assert all(OBJECTIVE_METRIC[name] in entry for entry in logs), logs[0].keys()


def test_token_mean_losses_average_over_the_whole_optimizer_step(tmp_path, tiny_model_dir):
    # Two micro-batches make one optimizer step. DAPO's step loss, as Trainer accumulates it (each micro-batch's
    # loss / 2), must be the token mean over both micro-batches together, not the mean of two token means.
    config = small_config(
        tmp_path,
        loss_type="dapo",
        gradient_accumulation_steps=2,
        steps_per_generation=2,
        per_device_train_batch_size=4,
        max_completion_length=16,
    )
    trainer = GSPOTrainer(tiny_model_dir, count_digits, args=config, train_dataset=text_dataset())
    trainer.model.train()
    batch = [{"prompt": f"What is {i} + 1?"} for i in range(2) for _ in range(4)]
    for seed in range(20):  # two rollouts whose token counts differ (the random tiny model rarely ends early)
        torch.manual_seed(seed)
        first = trainer._prepare_inputs(batch)
        trainer.schedule.step += 1  # the next use of the rollout (no optimizer step in between)
        second = trainer._prepare_inputs(batch)
        trainer.schedule.step += 1  # the next use of the rollout (no optimizer step in between)
        if first.completion_mask.sum() != second.completion_mask.sum():
            break
    assert first.completion_mask.sum() != second.completion_mask.sum()  # unequal token counts matter
    accumulated = sum(trainer.compute_loss(trainer.model, mb).detach() / 2 for mb in (first, second))
    both = MicroBatch(
        **{
            key: torch.cat([getattr(first, key), getattr(second, key)])
            for key in ("input_ids", "attention_mask", "completion_ids", "completion_mask", "advantages")
        }
    )
    logps = trainer._score_without_grad(trainer.model, both)
    token_mean, _ = policy_loss(
        logps, None, both.advantages, both.completion_mask, loss_type="bnpo", importance_sampling_level="token"
    )
    torch.testing.assert_close(accumulated, token_mean, atol=1e-6, rtol=1e-5)


def test_adaptive_entropy_coefficient_moves_each_step_and_survives_resume(tmp_path, tiny_model_dir):
    options = dict(
        use_adaptive_entropy=True,
        entropy_coef=0.01,
        entropy_coef_delta=0.02,
        entropy_target=100.0,
        save_strategy="steps",
        save_steps=2,
    )
    trainer = GSPOTrainer(
        tiny_model_dir,
        count_digits,
        train_dataset=text_dataset(),
        args=small_config(tmp_path / "out", max_steps=2, **options),
    )
    trainer.train()
    logs = train_logs(trainer)
    # TRL's entropy_coef: the coefficient after each optimizer step's update; entropy (a few nats) < target: +0.02.
    assert [entry["entropy_coef"] for entry in logs] == pytest.approx([0.01 + 0.02, 0.01 + 2 * 0.02])
    assert trainer.entropy_coef == trainer.entropy_coefficient.coefficient == pytest.approx(0.01 + 2 * 0.02)
    # Step 1 applies no bonus (no entropy measured yet): the loss is the policy loss. Step 2 applies 0.03 × entropy
    # (one process, one micro-batch per step here: float32 round-off only, far below the relative 1e-4).
    assert logs[0]["policy_loss"] == pytest.approx(logs[0]["loss"], rel=1e-6)
    applied = logs[1]["policy_loss"] - logs[1]["loss"]
    assert applied == pytest.approx(0.03 * logs[1]["entropy"], rel=1e-4)
    resumed = GSPOTrainer(
        tiny_model_dir,
        count_digits,
        train_dataset=text_dataset(),
        args=small_config(tmp_path / "out", max_steps=3, **options),
    )
    resumed.train(resume_from_checkpoint=True)
    assert resumed.entropy_coefficient.coefficient == pytest.approx(0.01 + 3 * 0.02)
    assert train_logs(resumed)[-1]["entropy_coef"] == pytest.approx(0.01 + 3 * 0.02)


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo", "luspo"])
def test_static_entropy_bonus_logs_trls_policy_loss_beside_loss(tmp_path, tiny_model_dir, loss_type):
    """TRL's keys with an entropy coefficient: `policy_loss` (the loss before the bonus) and `entropy_coef`; the bonus
    is the coefficient times the mean entropy for every loss type, whatever its own normalisation."""
    config = small_config(tmp_path, max_steps=1, entropy_coef=0.5, loss_type=loss_type, gradient_accumulation_steps=1)
    trainer = GSPOTrainer(tiny_model_dir, count_digits, train_dataset=text_dataset(), args=config)
    trainer.train()
    (log,) = train_logs(trainer)
    assert log["entropy_coef"] == 0.5
    # One micro-batch, one process: only float32 round-off separates the two (far below the relative 1e-4).
    assert log["policy_loss"] - log["loss"] == pytest.approx(0.5 * log["entropy"], rel=1e-4)


def test_entropy_bonus_changes_the_gradient(tmp_path, tiny_model_dir):
    grads = []
    for coef in (0.0, 1.0):
        trainer = GSPOTrainer(
            tiny_model_dir,
            count_digits,
            train_dataset=text_dataset(),
            args=small_config(tmp_path / str(coef), entropy_coef=coef, steps_per_generation=1),
        )
        trainer.model.train()
        torch.manual_seed(0)
        inputs = trainer._prepare_inputs([{"prompt": f"What is {i} + 1?"} for i in range(1) for _ in range(4)])
        trainer.model.zero_grad()
        trainer.compute_loss(trainer.model, inputs).backward()
        grads.append(trainer.model.model.layers[0].mlp.up_proj.weight.grad.clone())
    assert not torch.allclose(grads[0], grads[1])


def tiny_moe(tokenizer):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model(
        "mixtral",
        hidden_size=32,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        vocab_size=len(tokenizer),
        router_aux_loss_coef=0.02,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return AutoModelForCausalLM.from_config(config)


def test_moe_router_aux_loss_is_added_and_logged(tmp_path, tiny_tokenizer):
    losses, aux = {}, {}
    for coef in (None, 0.0):
        trainer = GSPOTrainer(
            tiny_moe(tiny_tokenizer),
            count_digits,
            processing_class=tiny_tokenizer,
            train_dataset=text_dataset(),
            args=small_config(tmp_path / str(coef), router_aux_loss_coef=coef, steps_per_generation=1),
        )
        assert trainer.router_aux_loss_coef == (0.02 if coef is None else 0.0)  # None: the model config's
        trainer.model.train()
        torch.manual_seed(0)
        inputs = trainer._prepare_inputs([{"prompt": f"What is {i} + 1?"} for i in range(1) for _ in range(4)])
        losses[coef] = trainer.compute_loss(trainer.model, inputs).item()
        aux[coef] = trainer._metrics.pop_averages("train").get("aux_loss")
    assert aux[0.0] is None  # a zero weight: the router logits are not even requested
    # Mixtral's load-balancing loss is about num_experts_per_tok (= 2) for a balanced router, and >= 1.
    assert aux[None] > 1.0
    assert losses[None] - losses[0.0] == pytest.approx(0.02 * aux[None], rel=1e-4)


def test_router_aux_loss_coef_on_a_dense_model_is_refused(tmp_path, tiny_model_dir):
    with pytest.raises(ValueError, match="router_aux_loss_coef"):
        GSPOTrainer(
            tiny_model_dir,
            count_digits,
            train_dataset=text_dataset(),
            args=small_config(tmp_path, router_aux_loss_coef=0.01),
        )


@pytest.mark.parametrize(
    "options, use_lora",
    [
        (dict(loss_type="sapo", beta=0.04), False),
        (dict(loss_type="cispo", top_entropy_quantile=0.5, entropy_coef=0.01, beta=0.04), True),
        (dict(loss_type="vespo", off_policy_mask_threshold=0.1, use_adaptive_entropy=True), True),
    ],
)
def test_family_trains_with_the_gpu_recipe_bf16_lora_and_kl(tmp_path, tiny_model_dir, options, use_lora):
    # bf16 autocast on CPU, as users run on GPUs, with a KL term and (where set) a LoRA adapter.
    from peft import LoraConfig

    peft_config = (
        LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM") if use_lora else None
    )
    config = small_config(tmp_path / "out", max_steps=4, learning_rate=5e-3, bf16=True, **options)
    trainer = GSPOTrainer(
        tiny_model_dir, count_digits, args=config, train_dataset=text_dataset(), peft_config=peft_config
    )
    trainable = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    trainer.train()
    assert any(not torch.equal(trainable[n], p) for n, p in trainer.model.named_parameters() if n in trainable)
    logs = train_logs(trainer)
    assert all(torch.isfinite(torch.tensor([entry["loss"], entry.get("kl", 0.0)])).all() for entry in logs)
    assert any(entry["ratio/max"] != 1.0 for entry in logs)  # the off-policy steps ran

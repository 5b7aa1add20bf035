"""gspo_trl.models.precision on CPU (bf16 autocast runs there): the GPU recipes users run train, log-probs
match TRL's on the same batch in each mode, and an unchanged policy's importance ratio is exactly 1."""

from __future__ import annotations

import warnings

import pytest
import torch
from datasets import Dataset
from helpers import count_digits, small_config
from transformers import AutoModelForCausalLM

from gspo_trl import GSPOTrainer
from gspo_trl.models.precision import Float32LMHead


def dataset(n=8):
    return Dataset.from_dict({"prompt": [f"What is {i} + {i + 1}?" for i in range(n)]})


def config(tmp_path, **overrides):
    values = dict(
        max_completion_length=8,
        steps_per_generation=2,  # the second micro-batch needs the old-log-prob pass (where the crash was)
        gradient_accumulation_steps=1,
        bf16=True,
    )
    return small_config(tmp_path / "out", **{**values, **overrides})


def lora():
    from peft import LoraConfig

    return LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM")


def load(path, dtype):
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype)


# Each recipe: (model factory, config overrides, peft_config factory).
RECIPES = {
    "bf16 model, bf16=True": (lambda d: load(d, torch.bfloat16), {}, None),
    "model_init_kwargs dtype": (lambda d: d, {"model_init_kwargs": {"dtype": "bfloat16"}}, None),
    "fp32 model, bf16=True": (lambda d: load(d, torch.float32), {}, None),
    "LoRA on a bf16 base": (lambda d: load(d, torch.bfloat16), {}, lora),
    "beta > 0, bf16": (lambda d: load(d, torch.bfloat16), {"beta": 0.04}, None),
    "beta > 0, LoRA on bf16": (lambda d: load(d, torch.bfloat16), {"beta": 0.04}, lora),
    "cast_lm_head_to_fp32": (lambda d: load(d, torch.bfloat16), {"cast_lm_head_to_fp32": True}, None),
    "padded rows, bf16": (lambda d: load(d, torch.bfloat16), {"padding_free": False}, None),
    "fp16=True, fp32 model": (lambda d: load(d, torch.float32), {"bf16": False, "fp16": True}, None),
}


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_gpu_recipes_train(tmp_path, tiny_model_dir, recipe):
    make_model, overrides, make_peft = RECIPES[recipe]
    trainer = GSPOTrainer(
        make_model(tiny_model_dir),
        count_digits,
        args=config(tmp_path, **overrides),
        train_dataset=dataset(),
        peft_config=make_peft() if make_peft else None,
    )
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    trainer.train()
    logs = [e for e in trainer.state.log_history if "loss" in e]
    assert len(logs) == 2 and all(torch.isfinite(torch.tensor(e["loss"])) for e in logs)
    assert any(not torch.equal(before[n], p) for n, p in trainer.model.named_parameters() if n in before)


def test_unchanged_policy_ratio_is_exactly_one_in_bf16(tmp_path, tiny_model_dir):
    # π_old from the no-grad pass, π from the training forward: the same arithmetic, so bf16 rounding
    # cannot make the first step's ratio differ from 1. The second step's weights have moved.
    trainer = GSPOTrainer(
        load(tiny_model_dir, torch.bfloat16),
        count_digits,
        train_dataset=dataset(),
        args=config(tmp_path, always_compute_old_logprobs=True, learning_rate=5e-2),
    )
    trainer.train()
    first, second = [e for e in trainer.state.log_history if "loss" in e]
    assert first["ratio/min"] == first["ratio/max"] == 1.0
    assert second["ratio/min"] != 1.0 or second["ratio/max"] != 1.0


def test_fp16_weights_with_fp16_are_rejected_at_construction(tmp_path, tiny_model_dir):
    with pytest.raises(ValueError, match=r"fp16=True .* trainable parameters are float16"):
        GSPOTrainer(
            load(tiny_model_dir, torch.float16),
            count_digits,
            train_dataset=dataset(),
            args=config(tmp_path, bf16=False, fp16=True),
        )


def test_cast_lm_head_to_fp32_keeps_a_tied_model_consistent(tmp_path, tiny_model_dir):
    model = load(tiny_model_dir, torch.bfloat16)
    model.config.tie_word_embeddings = True
    model.tie_weights()
    trainer = GSPOTrainer(
        model, count_digits, train_dataset=dataset(), args=config(tmp_path, cast_lm_head_to_fp32=True, beta=0.04)
    )
    head = trainer.model.get_output_embeddings()
    assert isinstance(head, Float32LMHead) and head.weight.dtype == torch.float32
    assert head.weight is trainer.model.get_input_embeddings().weight
    assert isinstance(trainer.ref_model.get_output_embeddings(), Float32LMHead)  # the copy keeps it
    assert trainer.model.model.layers[0].mlp.up_proj.weight.dtype == torch.bfloat16
    trainer.train()


def test_cast_lm_head_to_fp32_refuses_an_adapted_head(tmp_path, tiny_model_dir):
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(load(tiny_model_dir, torch.bfloat16), LoraConfig(r=2, target_modules=["lm_head"]))
    with pytest.raises(ValueError, match="cast_lm_head_to_fp32"):
        GSPOTrainer(model, count_digits, train_dataset=dataset(), args=config(tmp_path, cast_lm_head_to_fp32=True))


# --- the same batch through TRL's GRPOTrainer ------------------------------------------------------


def trl_logps(trl_trainer, batch):
    input_ids, attention_mask = batch.input_ids, batch.attention_mask
    completion_length = batch.completion_ids.shape[1]
    with torch.no_grad():
        logps, _, _ = trl_trainer._get_per_token_logps_and_entropies(
            trl_trainer.model, input_ids, attention_mask, completion_length
        )
    return logps.float() * batch.completion_mask


TRL_MODES = {  # name: (dtype, our and TRL's shared config overrides, use LoRA)
    "bf16 model": (torch.bfloat16, {}, False),
    "fp32 model, bf16=True": (torch.float32, {}, False),
    "LoRA on bf16": (torch.bfloat16, {}, True),
    "cast_lm_head_to_fp32": (torch.bfloat16, {"cast_lm_head_to_fp32": True}, False),
}


@pytest.mark.parametrize("mode", list(TRL_MODES))
def test_logprobs_match_trl_on_the_same_batch(tmp_path, tiny_model_dir, mode):
    from trl import GRPOConfig, GRPOTrainer

    dtype, overrides, use_lora = TRL_MODES[mode]
    ours = GSPOTrainer(
        load(tiny_model_dir, dtype),
        count_digits,
        train_dataset=dataset(),
        args=config(tmp_path, **overrides),
        peft_config=lora() if use_lora else None,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trl_args = GRPOConfig(
            output_dir=str(tmp_path / "trl"),
            per_device_train_batch_size=4,
            num_generations=4,
            max_completion_length=8,
            use_cpu=True,
            bf16=True,
            report_to="none",
            **overrides,
        )
        theirs = GRPOTrainer(
            load(tiny_model_dir, dtype),
            count_digits,
            args=trl_args,
            train_dataset=dataset(),
            peft_config=lora() if use_lora else None,
        )
    if use_lora:  # the same non-trivial adapter weights on both sides (lora_B starts at zero)
        torch.manual_seed(1)
        for name, parameter in ours.model.named_parameters():
            if "lora_B" in name:
                parameter.data.normal_(0, 0.05)
        theirs.model.load_state_dict(ours.model.state_dict())
    ours.model.train()
    batch = ours._generate_and_score([{"prompt": f"What is {i} + 1?"} for i in range(2) for _ in range(4)], "train")
    ours_logps = ours._score_without_grad(ours.model, batch)
    theirs_logps = trl_logps(theirs, batch)
    mask = batch.completion_mask.bool()
    difference = (ours_logps - theirs_logps)[mask].abs()
    # bf16 keeps ~3 significant digits of log-probs near -6 (a random model, 400 tokens); measured: max 0.002.
    assert difference.max() < 0.01 and difference.mean() < 1e-3, (mode, difference.max(), difference.mean())


def test_an_fp32_head_under_fsdp2_mixed_precision_is_reported(caplog):
    # accelerate's real FSDP2 plugin with its bf16 policy: FSDP2 would cast the head's weight to bf16 for each forward
    from types import SimpleNamespace

    from accelerate.utils import FullyShardedDataParallelPlugin

    from gspo_trl.models.precision import warn_if_fp32_head_is_cast_by_fsdp2

    def accelerator(precision):
        plugin = FullyShardedDataParallelPlugin(fsdp_version=2)
        if precision is not None:
            plugin.set_mixed_precision(precision)
        return SimpleNamespace(state=SimpleNamespace(fsdp_plugin=plugin))

    with caplog.at_level("WARNING"):
        warn_if_fp32_head_is_cast_by_fsdp2(SimpleNamespace(cast_lm_head_to_fp32=True), accelerator("bf16"))
    assert caplog.text.count("cast_lm_head_to_fp32=True under FSDP2") == 1
    caplog.clear()
    with caplog.at_level("WARNING"):
        warn_if_fp32_head_is_cast_by_fsdp2(SimpleNamespace(cast_lm_head_to_fp32=False), accelerator("bf16"))
        warn_if_fp32_head_is_cast_by_fsdp2(SimpleNamespace(cast_lm_head_to_fp32=True), accelerator(None))
        warn_if_fp32_head_is_cast_by_fsdp2(
            SimpleNamespace(cast_lm_head_to_fp32=True), SimpleNamespace(state=SimpleNamespace(fsdp_plugin=None))
        )
    assert "cast_lm_head_to_fp32" not in caplog.text

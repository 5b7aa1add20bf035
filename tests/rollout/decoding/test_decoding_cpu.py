"""gspo_trl.rollout.decoding.cpu: `GSPOConfig.cpu_decoding_kernels` resolves to the accelerations the decoding loop uses
("auto" on CPU only, "on", "off", no timing under `full_determinism`), the HF backend builds them from the config,
and `accelerate` enters exactly the parts its `CPUKernels` asks for and restores the model on exit."""

from __future__ import annotations

import pytest
import torch
from helpers import force_choices

from gspo_trl import GSPOConfig
from gspo_trl.rollout import HFGenerateBackend
from gspo_trl.rollout.decoding import cpu
from gspo_trl.rollout.decoding.cpu import ALL, CPUKernels, for_setting
from gspo_trl.rollout.decoding.cpu.attention import NAME
from gspo_trl.rollout.decoding.cpu.linear import TRANSPOSED, forms


@pytest.mark.parametrize(
    "setting, device, full_determinism, expected",
    [
        ("auto", "cpu", False, ALL),
        ("auto", "cuda", False, None),  # nothing of them applies off the CPU: not even entered
        ("on", "cuda", False, ALL),
        ("on", "cpu", False, ALL),
        ("off", "cpu", False, None),
        ("auto", "cpu", True, CPUKernels(timed=False)),  # the same samples on every run: no choice by timing
    ],
)
def test_the_setting_resolves_to_the_kernels_the_loop_uses(setting, device, full_determinism, expected):
    assert for_setting(setting, torch.device(device), full_determinism) == expected


def test_an_unknown_setting_is_refused():
    with pytest.raises(ValueError, match="cpu_decoding_kernels"):
        for_setting("yes", "cpu")


@pytest.mark.parametrize("setting", ["auto", "on", "off"])
def test_the_hf_backend_builds_them_from_the_config(tmp_path, tiny_model, tiny_tokenizer, setting):
    args = GSPOConfig(
        output_dir=str(tmp_path), per_device_train_batch_size=8, use_cpu=True, cpu_decoding_kernels=setting
    )
    backend = HFGenerateBackend(lambda: tiny_model, tiny_tokenizer, args)
    assert backend.cpu_kernels == (None if setting == "off" else ALL)


def test_off_the_loop_runs_the_models_own_forward(tmp_path, tiny_model, tiny_tokenizer, monkeypatch):
    """With "off" no part is entered: no product form, no packed attention, no step forward."""
    force_choices(monkeypatch, TRANSPOSED)
    entered = []
    monkeypatch.setattr(cpu, "fast_decode_linears", lambda *args, **kwargs: entered.append("linears"))
    monkeypatch.setattr(cpu, "packed_gqa_decoding", lambda *args, **kwargs: entered.append("attention"))
    args = GSPOConfig(
        output_dir=str(tmp_path),
        per_device_train_batch_size=8,
        max_completion_length=16,
        use_cpu=True,
        cpu_decoding_kernels="off",
    )
    backend = HFGenerateBackend(lambda: tiny_model, tiny_tokenizer, args)
    rollout = backend.generate(["What is 1 + 1?", "Hi"])
    assert rollout.completion_ids.shape[0] == 2 and not entered


@pytest.mark.parametrize(
    "kernels",
    [
        ALL,
        CPUKernels(linear_forms=False),
        CPUKernels(packed_attention=False),
        CPUKernels(step_forward=False),
        CPUKernels(timed=False),
        CPUKernels(compiled=False),
        None,
    ],
    ids=["all", "no linear forms", "no packed attention", "no step forward", "untimed", "not compiled", "none"],
)
def test_accelerate_enters_the_parts_asked_for_and_restores_the_model(tiny_model, monkeypatch, kernels):
    force_choices(monkeypatch, TRANSPOSED)  # the tiny model qualifies for the product forms
    config = tiny_model.config
    projection = tiny_model.model.layers[0].self_attn.q_proj
    with torch.no_grad(), cpu.accelerate(tiny_model, kernels) as step_forward:
        timed_forms = kernels is not None and kernels.linear_forms and kernels.timed
        assert bool(forms(projection)) == timed_forms
        packed = kernels is not None and kernels.packed_attention
        assert config._attn_implementation == (NAME if packed else "sdpa")
        assert (step_forward is not None) == (packed and kernels.step_forward)
        if step_forward is not None:
            assert step_forward.fused_rotary == kernels.compiled  # the rotation in the compiled kernel
            assert (step_forward.attend.kernel_choice is not None) == kernels.compiled
    assert config._attn_implementation == "sdpa" and not forms(projection)
    assert all("forward" not in module.__dict__ for module in tiny_model.modules())


def test_the_old_environment_variable_is_said_to_be_ignored(monkeypatch):
    import logging

    import transformers

    monkeypatch.setenv("GSPO_TRL_DECODE_KERNEL", "0")
    cpu._environment_variable_ignored.cache_clear()
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = transformers.utils.logging.get_logger("gspo_trl.rollout.decoding.cpu")
    logger.addHandler(handler)
    try:
        assert for_setting("auto", "cpu") == ALL and for_setting("auto", "cpu") == ALL  # no switch: the field decides
    finally:
        logger.removeHandler(handler)
        cpu._environment_variable_ignored.cache_clear()
    warnings = [record.getMessage() for record in records if record.levelno == logging.WARNING]
    assert len(warnings) == 1 and "cpu_decoding_kernels" in warnings[0]

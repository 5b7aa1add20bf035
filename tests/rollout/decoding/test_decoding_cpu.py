"""gspo_trl.rollout.decoding.cpu: `GSPOConfig.cpu_decoding_kernels` resolves to the accelerations the decoding loop uses
("auto" on CPU only, "on", "off", no timing under `full_determinism`), the HF backend builds them from the config,
and `accelerate` enters exactly the parts its `CPUKernels` asks for and restores the model on exit; with
`full_determinism` a run repeats bit for bit, on a busy machine too."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from helpers import count_digits, force_choices, small_config, text_dataset

from gspo_trl import GSPOConfig, GSPOTrainer
from gspo_trl.rollout import HFGenerateBackend
from gspo_trl.rollout.decoding import cpu
from gspo_trl.rollout.decoding.cpu import ALL, CPUKernels, for_setting
from gspo_trl.rollout.decoding.cpu.attention import NAME
from gspo_trl.rollout.decoding.cpu.linear import COMPILED, TRANSPOSED, forms


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


def logged_and_trained(tmp_path, model_dir, **overrides) -> tuple[list[dict], dict]:
    """Two rollouts of two optimizer steps on the tiny model: what it logged (less the wall-clock figures) and its
    trained weights. Each rollout's first step takes π_old from the log-probs the decoding loop recorded, so the logged
    ratios carry the decoding's arithmetic, not only the sampled tokens."""
    config = small_config(tmp_path, max_steps=4, steps_per_generation=2, max_completion_length=16, **overrides)
    trainer = GSPOTrainer(model_dir, count_digits, args=config, train_dataset=text_dataset())
    trainer.train()
    timing = ("train_runtime", "train_samples_per_second", "train_steps_per_second")
    logs = [{key: value for key, value in entry.items() if key not in timing} for entry in trainer.state.log_history]
    return logs, {name: parameter.detach().clone() for name, parameter in trainer.model.named_parameters()}


@pytest.mark.slow  # three short training runs, one beside a busy process
def test_full_determinism_repeats_a_run_bit_for_bit_on_a_busy_machine(
    tmp_path, tiny_model_dir, monkeypatch, determinism_flags_restored
):
    # The one choice made by timing on the tiny model is the attention kernel against SDPA (its weights are too small
    # for the product forms to be timed), and a busy core is what tips a timing. Under `full_determinism` nothing is
    # timed: the run beside a busy process must log the same numbers and train the same weights, bit for bit.
    alone = logged_and_trained(tmp_path / "alone", tiny_model_dir, full_determinism=True)
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        loaded = logged_and_trained(tmp_path / "loaded", tiny_model_dir, full_determinism=True)
    finally:
        busy.kill()
        busy.wait()
    assert alone[0] == loaded[0]
    assert alone[1].keys() == loaded[1].keys()
    assert all(torch.equal(alone[1][name], loaded[1][name]) for name in alone[1])
    # The comparison sees float rounding: with every product in another form (what another timing can choose), the
    # same seed logs other numbers.
    force_choices(monkeypatch, COMPILED)
    other_form = logged_and_trained(tmp_path / "compiled", tiny_model_dir)
    assert other_form[0] != alone[0]

"""pool_freed_memory: glibc accepts the settings here (Linux CI); elsewhere it changes nothing."""

from __future__ import annotations

import platform

import pytest
from datasets import Dataset

from gspo_trl.training import cpu_memory
from gspo_trl.training.cpu_memory import pool_freed_memory


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="needs glibc")
def test_glibc_accepts_the_settings():
    assert pool_freed_memory() is True


def test_without_a_usable_libc_it_reports_false(monkeypatch):
    def no_library(name):
        raise OSError("no libc here")

    monkeypatch.setattr(cpu_memory.ctypes, "CDLL", no_library)
    assert pool_freed_memory() is False


def test_the_trainer_pools_memory_on_cpu_unless_told_not_to(tmp_path, tiny_model_dir, monkeypatch):
    import gspo_trl.trainer as trainer_module
    from gspo_trl import GSPOConfig

    calls = []
    monkeypatch.setattr(trainer_module, "pool_freed_memory", lambda: calls.append(True) or True)
    dataset = Dataset.from_dict({"prompt": ["a", "b", "c", "d"]})  # one rollout: 2 × 4 / 2 prompts

    def build(**overrides):
        config = GSPOConfig(
            output_dir=str(tmp_path),
            per_device_train_batch_size=2,
            num_generations=2,
            max_completion_length=8,
            use_cpu=True,
            report_to="none",
            **overrides,
        )
        trainer_module.GSPOTrainer(
            tiny_model_dir, lambda completions, **kw: [0.0] * len(completions), args=config, train_dataset=dataset
        )

    build()
    assert calls == [True]
    build(cpu_memory_pool=False)
    assert calls == [True]

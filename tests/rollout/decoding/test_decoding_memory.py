"""How many rows a decoding pass holds: the KV cache's bytes per position and the slices, by hand."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig

from gspo_trl.rollout.decoding.memory import free_device_bytes, kv_bytes_per_position, rows_per_slice


def test_kv_bytes_per_position_of_real_architectures():
    # SmolLM2-1.7B: 24 layers, 32 KV heads of 64 dims; keys and values in bf16: 24 × 2 × 32 × 64 × 2 bytes.
    big = LlamaConfig(hidden_size=2048, num_hidden_layers=24, num_attention_heads=32, num_key_value_heads=32)
    assert kv_bytes_per_position(big, torch.bfloat16) == 196_608
    # 64 rows of a 60-token prompt and 4,096 completion tokens: the 52 GB that did not fit an 80 GB GPU.
    assert 64 * (60 + 4096) * 196_608 == pytest.approx(52.3e9, rel=1e-3)
    # SmolLM2-135M (grouped queries: 3 KV heads of 64 dims, 30 layers) in fp32: 30 × 2 × 3 × 64 × 4.
    small = LlamaConfig(hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3)
    assert kv_bytes_per_position(small, torch.float32) == 46_080
    # An explicit head_dim wins over hidden_size / heads.
    assert (
        kv_bytes_per_position(
            LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32),
            torch.float16,
        )
        == 2 * 2 * 2 * 32 * 2
    )


def test_kv_bytes_per_position_is_none_when_the_config_does_not_say():
    class Bare:  # no layer or head counts
        pass

    assert kv_bytes_per_position(Bare(), torch.float32) is None


@pytest.mark.parametrize(
    "rows, per_row, budget, expected",
    [
        (64, 10, 640, 64),  # all fit
        (64, 10, 10_000, 64),
        (64, 10, 610, 32),  # 61 fit: two even slices, not 61 + 3
        (64, 10, 200, 16),  # 20 fit: four slices of 16
        (10, 10, 30, 3),  # 3 fit: four slices (3, 3, 3, 1)
        (8, 10, 5, 1),  # not even one fits: one row at a time
        (8, 10, -50, 1),  # a budget already spent: one row at a time
    ],
)
def test_rows_per_slice(rows, per_row, budget, expected):
    step = rows_per_slice(rows, per_row, budget)
    assert step == expected
    if expected > 1:
        assert step * per_row <= budget  # every slice fits
        assert -(-rows // step) == -(-rows // max(1, budget // per_row))  # and no more slices than needed


def test_free_device_bytes_is_none_off_cuda():
    assert free_device_bytes(torch.device("cpu")) is None

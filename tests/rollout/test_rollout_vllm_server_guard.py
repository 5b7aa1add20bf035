"""A real vLLM server's guard: a token on every path, a trainer without it refused, and the worker methods kept to
their folders."""

import os
import re
import secrets
import shutil
import tempfile
import time
from pathlib import Path

import pytest
import requests
import torch
from helpers import count_digits, text_dataset
from real_vllm_servers import FIXED_TEXT, bearer, trainer_logprobs, vllm_config

from gspo_trl import GSPOTrainer
from gspo_trl.vllm.auth import TOKEN_ENV
from gspo_trl.vllm.client import VLLMServerError

pytestmark = pytest.mark.xdist_group(
    "vllm_server"
)  # every real server on one worker (tests/rollout/real_vllm_servers.py)


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

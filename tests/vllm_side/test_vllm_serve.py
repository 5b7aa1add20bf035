"""Tests for gspo_trl.vllm.serve: the command and environment `gspo-trl vllm-serve` starts vLLM with."""

import os
import re
import sys
from pathlib import Path

import pytest

from gspo_trl.demo.cli import main
from gspo_trl.vllm.auth import MIDDLEWARE, TOKEN_ENV
from gspo_trl.vllm.folders import MAX_UPLOAD_ENV, SYNC_DIRS_ENV
from gspo_trl.vllm.serve import WORKER_EXTENSION, find_vllm_python, server_command, server_environment


def test_print_command_has_the_extension_processed_logprobs_and_localhost(capsys):
    assert (
        main(["vllm-serve", "some/model", "--vllm-python", sys.executable, "--print-command", "--dtype", "bfloat16"])
        == 0
    )
    line = capsys.readouterr().out.split()
    assert line[:3] == [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
    assert line[line.index("--model") + 1] == "some/model"
    assert line[line.index("--host") + 1] == "127.0.0.1" and line[line.index("--port") + 1] == "8000"
    assert line[line.index("--worker-extension-cls") + 1] == WORKER_EXTENSION
    assert line[line.index("--logprobs-mode") + 1] == "processed_logprobs"
    assert line[-2:] == ["--dtype", "bfloat16"]  # unknown arguments go to vLLM unchanged


def test_the_gloo_weight_transfer_engine_unless_the_user_names_one():
    default = server_command("m", "python", "127.0.0.1", 8000, [])
    assert default[default.index("--weight-transfer-config") + 1] == '{"backend": "gloo"}'
    nccl = '{"backend": "nccl"}'
    for named in (["--weight-transfer-config", nccl], [f"--weight-transfer-config={nccl}"]):
        command = server_command("m", "python", "127.0.0.1", 8000, named)
        assert command[-len(named) :] == named and '{"backend": "gloo"}' not in command  # one config, the user's


def test_environment_enables_dev_mode_and_finds_the_extension():
    env = server_environment({"PYTHONPATH": "/elsewhere"})
    assert env["VLLM_SERVER_DEV_MODE"] == "1"
    root = env["PYTHONPATH"].split(os.pathsep)[0]
    assert (Path(root) / "gspo_trl" / "vllm" / "worker_extension.py").is_file()
    assert env["PYTHONPATH"].endswith("/elsewhere")


def test_worker_extension_imports_without_trl(tmp_path):
    # The server's environment has torch and vllm, not TRL: importing the extension must not pull in the trainer.
    import subprocess

    code = (
        "import sys; sys.modules['trl'] = None; sys.modules['vllm'] = type(sys)('vllm'); "
        "import gspo_trl.vllm.worker_extension as w; print(w.WeightSyncExtension.__name__)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=server_environment(), cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "WeightSyncExtension"


def test_missing_vllm_names_the_ways_to_provide_it(monkeypatch):
    monkeypatch.delenv("GSPO_TRL_VLLM_PYTHON", raising=False)
    with pytest.raises(FileNotFoundError, match="--vllm-python"):
        find_vllm_python(None)  # this venv has no vllm
    with pytest.raises(FileNotFoundError, match="No Python executable"):
        find_vllm_python("/nonexistent/python")


def test_without_a_model_the_demo_model_is_served_and_vllm_flags_pass_through(capsys, monkeypatch):
    import gspo_trl.demo.default_model as default_model

    monkeypatch.setattr(default_model, "default_model_path", lambda: "/cache/SmolLM2-135M-Instruct")
    assert (
        main(
            ["vllm-serve", "--enforce-eager", "--dtype", "float32", "--vllm-python", sys.executable, "--print-command"]
        )
        == 0
    )
    line = capsys.readouterr().out.split()
    assert line[line.index("--model") + 1] == "/cache/SmolLM2-135M-Instruct"
    assert line[-3:] == ["--enforce-eager", "--dtype", "float32"]


TOKEN = "serve-token-0123456789abcdef"


def serve(capsys, *arguments):
    """The command `gspo-trl vllm-serve` would run (printed, not run)."""
    assert main(["vllm-serve", "some/model", "--vllm-python", sys.executable, "--print-command", *arguments]) == 0
    return capsys.readouterr().out.split()


def test_with_a_token_every_path_is_guarded_and_the_token_stays_off_the_command_line(capsys, monkeypatch):
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    line = serve(capsys, "--host", "0.0.0.0")
    assert line[line.index("--middleware") + 1] == MIDDLEWARE
    assert not any(TOKEN in word for word in line)  # `ps` shows a command line; the token goes in the environment
    assert server_environment()[TOKEN_ENV] == TOKEN
    monkeypatch.delenv(TOKEN_ENV)
    assert "--middleware" not in serve(capsys)  # loopback without a token: as before


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.1.2.3", "my-host.example.com"])
def test_another_address_than_loopback_without_a_token_is_refused_unless_said_insecure(capsys, monkeypatch, host):
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    with pytest.raises(SystemExit) as refused:
        main(["vllm-serve", "some/model", "--vllm-python", sys.executable, "--print-command", "--host", host])
    assert refused.value.code == 2
    assert f"--host {host} lets other machines reach the server" in capsys.readouterr().err
    line = serve(capsys, "--host", host, "--insecure-no-token")
    assert line[line.index("--host") + 1] == host and "--middleware" not in line


@pytest.mark.parametrize(
    "token, extra, env_key, message",
    [
        ("short-token", [], None, "has 11 characters; use at least 16"),
        ("with space in the token", [], None, "outside printable ASCII"),
        (TOKEN, ["--api-key", "other-key"], None, "--api-key .* another value"),
        (TOKEN, ["--api-key=other-key"], None, "--api-key .* another value"),
        (TOKEN, [], "other-key", "--api-key .* another value"),
    ],
)
def test_a_weak_token_or_a_second_key_for_v1_is_refused(capsys, monkeypatch, token, extra, env_key, message):
    monkeypatch.setenv(TOKEN_ENV, token)
    if env_key:
        monkeypatch.setenv("VLLM_API_KEY", env_key)
    else:
        monkeypatch.delenv("VLLM_API_KEY", raising=False)
    with pytest.raises(SystemExit):
        main(["vllm-serve", "some/model", "--vllm-python", sys.executable, "--print-command", *extra])
    assert re.search(message, capsys.readouterr().err)


def test_the_same_key_for_v1_is_accepted(capsys, monkeypatch):
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    line = serve(capsys, "--api-key", "another", TOKEN)
    assert "--middleware" in line and line[-3:] == ["--api-key", "another", TOKEN]


def test_the_folders_the_workers_may_use_reach_them_in_the_environment(tmp_path):
    env = server_environment({}, sync_dirs=[str(tmp_path), "relative"], max_upload_mb=512)
    assert env[SYNC_DIRS_ENV].split(os.pathsep) == [str(tmp_path), os.path.abspath("relative")]
    assert env[MAX_UPLOAD_ENV] == "512"

"""`gspo-trl vllm-serve`: start vLLM's OpenAI server the way gspo-trl's trainer expects to find it.

Owns the command line and environment: the gspo-trl worker extension loaded into every worker (weight reloads and
model checks over `/collective_rpc`, which needs `VLLM_SERVER_DEV_MODE=1`), log-probs of the distribution actually
sampled from (`--logprobs-mode processed_logprobs`), vLLM's weight-transfer engine over gloo (`gloo_engine`) unless
`--weight-transfer-config` names another, and 127.0.0.1 unless a host is named; with $GSPO_TRL_VLLM_TOKEN set,
`auth.TokenMiddleware` guards every path with it, and another address without a token is refused unless
`--insecure-no-token` says so. The folders the worker methods may use are passed in the environment (`folders`).
The server may run in another Python environment (`--vllm-python`, e.g. a separate venv with the CPU build of vLLM):
only this package's folder is put on its path, and the extension imports nothing but torch and vllm.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

from .address import is_loopback
from .auth import MIDDLEWARE, MIN_SERVER_TOKEN_CHARS, TOKEN_ENV, check_token
from .folders import DEFAULT_MAX_UPLOAD_MB, MAX_UPLOAD_ENV, SYNC_DIRS_ENV

WORKER_EXTENSION = "gspo_trl.vllm.worker_extension.WeightSyncExtension"
VLLM_PYTHON_ENV = "GSPO_TRL_VLLM_PYTHON"


def find_vllm_python(explicit: str | None = None) -> str:
    """The Python that has vLLM: --vllm-python, else $GSPO_TRL_VLLM_PYTHON, else this one if it imports vllm."""
    for candidate in (explicit, os.environ.get(VLLM_PYTHON_ENV)):
        if candidate:
            if not shutil.which(candidate) and not os.access(candidate, os.X_OK):
                raise FileNotFoundError(
                    f"No Python executable at {candidate!r} (from --vllm-python or ${VLLM_PYTHON_ENV})."
                )
            return candidate
    probe = subprocess.run([sys.executable, "-c", "import vllm"], capture_output=True)
    if probe.returncode == 0:
        return sys.executable
    raise FileNotFoundError(
        f"vLLM is not installed in this environment ({sys.executable}). Install it (`pip install 'gspo-trl[vllm]'` on "
        f"GPUs; on CPU `scripts/setup_vllm_cpu.sh`, which builds a separate venv) and pass its Python with "
        f"--vllm-python or ${VLLM_PYTHON_ENV}."
    )


def server_command(model: str, python: str, host: str, port: int, extra: list[str]) -> list[str]:
    # vLLM's weight-transfer engine over gloo (gspo_trl.vllm.gloo_engine) unless the user names one (NCCL on GPUs).
    named = any(arg == "--weight-transfer-config" or arg.startswith("--weight-transfer-config=") for arg in extra)
    transfer = [] if named else ["--weight-transfer-config", '{"backend": "gloo"}']
    return [
        python,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        model,
        "--host",
        host,
        "--port",
        str(port),
        "--worker-extension-cls",
        WORKER_EXTENSION,
        "--logprobs-mode",
        "processed_logprobs",
        *transfer,
        *extra,
    ]


def server_token(host: str, insecure_no_token: bool, extra: list[str], env: dict) -> str | None:
    """$GSPO_TRL_VLLM_TOKEN, checked; a ValueError for another address than loopback without one (unless
    `insecure_no_token`), a token too short to guess hard, or vLLM's --api-key guarding /v1 with another value."""
    token = env.get(TOKEN_ENV) or None
    if token is not None:
        check_token(token, f"${TOKEN_ENV}")
        if len(token) < MIN_SERVER_TOKEN_CHARS:
            raise ValueError(
                f"${TOKEN_ENV} has {len(token)} characters; use at least {MIN_SERVER_TOKEN_CHARS} random ones, e.g. "
                "`export GSPO_TRL_VLLM_TOKEN=$(python -c 'import secrets; print(secrets.token_urlsafe(32))')`."
            )
    elif not is_loopback(host) and not insecure_no_token:
        raise ValueError(
            f"--host {host} lets other machines reach the server, whose /collective_rpc loads any weights into it: "
            f"set ${TOKEN_ENV} (here and for the trainer, e.g. `export GSPO_TRL_VLLM_TOKEN=$(python -c 'import "
            "secrets; print(secrets.token_urlsafe(32))')`), or pass --insecure-no-token on a network you trust."
        )
    keys_parser = argparse.ArgumentParser(add_help=False)
    keys_parser.add_argument("--api-key", nargs="+", action="extend", default=[])
    api_keys = keys_parser.parse_known_args(extra)[0].api_key or [key for key in [env.get("VLLM_API_KEY")] if key]
    if token is not None and api_keys and token not in api_keys:
        raise ValueError(
            f"vLLM's --api-key (or $VLLM_API_KEY) guards /v1 with another value than ${TOKEN_ENV}, and the trainer "
            f"sends one token: drop --api-key (${TOKEN_ENV} already guards every path, /v1 included) or give it the "
            "same value."
        )
    return token


def server_environment(
    base: dict | None = None, sync_dirs: list[str] | None = None, max_upload_mb: float = DEFAULT_MAX_UPLOAD_MB
) -> dict:
    env = dict(os.environ if base is None else base)
    package_root = str(Path(__file__).resolve().parents[2])  # the folder that holds gspo_trl/
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    env["VLLM_SERVER_DEV_MODE"] = "1"  # /collective_rpc, /reset_prefix_cache
    env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"  # /v1/load_lora_adapter (with --enable-lora)
    env[SYNC_DIRS_ENV] = os.pathsep.join(os.path.abspath(path) for path in sync_dirs or [])
    env[MAX_UPLOAD_ENV] = f"{max_upload_mb:g}"
    return env


def main(argv: list[str] | None = None, default_model=None) -> int:
    """`gspo-trl vllm-serve`; `default_model()` gives the model served when none is named (the demo's, from the CLI)."""
    parser = argparse.ArgumentParser(
        prog="gspo-trl vllm-serve",
        usage="gspo-trl vllm-serve [MODEL] [options] [vLLM arguments ...]",
        description="Start a vLLM server that a GSPOTrainer with use_vllm=True can sample from and sync weights to. "
        "MODEL (first, if given) is the path or Hub id of the checkpoint training starts from; without it, the demo's "
        "SmolLM2-135M-Instruct, as `gspo-trl train` uses it. Arguments other than the options below go to vLLM "
        "unchanged (e.g. --dtype bfloat16 --max-model-len 4096).",
    )
    parser.add_argument("--host", default="127.0.0.1", help="Address to bind (default 127.0.0.1: this machine only).")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--vllm-python", default=None, help=f"Python with vLLM installed (or ${VLLM_PYTHON_ENV}).")
    parser.add_argument(
        "--weight-sync-dir",
        action="append",
        default=[],
        help="A folder the trainer's vllm_weight_sync_dir names (e.g. on a shared filesystem): the server reloads "
        "snapshots from gspo-trl's folders directly in it. /dev/shm and the temporary folder are always allowed. "
        "Repeatable.",
    )
    parser.add_argument(
        "--max-upload-mb",
        type=float,
        default=DEFAULT_MAX_UPLOAD_MB,
        help=f"The most MiB the trainer may upload into one folder of the server (a LoRA adapter sent over HTTP; "
        f"default {DEFAULT_MAX_UPLOAD_MB}).",
    )
    parser.add_argument(
        "--insecure-no-token",
        action="store_true",
        help=f"Serve on an address other machines reach without ${TOKEN_ENV}: anyone reaching it controls the "
        "server's weights. Only on a network you trust.",
    )
    parser.add_argument("--print-command", action="store_true", help="Print the command and exit.")
    argv = list(sys.argv[1:] if argv is None else argv)
    # The model is the first word or absent: left to argparse, `--dtype float32` would make "float32" the model.
    model = argv.pop(0) if argv and not argv[0].startswith("-") else None
    args, extra = parser.parse_known_args(argv)
    if model is None:
        if default_model is None:
            parser.error("name the model to serve (a path or Hub id) as the first argument")
        model = default_model()
    if not args.max_upload_mb > 0:
        parser.error(f"--max-upload-mb must be > 0, got {args.max_upload_mb:g}")
    try:
        token = server_token(args.host, args.insecure_no_token, extra, os.environ)
    except ValueError as error:
        parser.error(str(error))
    if token is not None:  # the token itself travels in the environment, never on the command line (`ps` shows it)
        extra = ["--middleware", MIDDLEWARE, *extra]
    command = server_command(model, find_vllm_python(args.vllm_python), args.host, args.port, extra)
    if args.print_command:
        print(" ".join(command))
        return 0
    # The server replaces this process, so signals (Ctrl-C, a scheduler's SIGTERM) reach vLLM itself.
    os.execve(command[0], command, server_environment(sync_dirs=args.weight_sync_dir, max_upload_mb=args.max_upload_mb))

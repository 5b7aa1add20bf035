"""The shared secret between a trainer and `gspo-trl vllm-serve`: the token, its header, and the server's check.

Owns the token's name and format (`GSPO_TRL_VLLM_TOKEN`, sent as `Authorization: Bearer TOKEN`, the header vLLM's
own `--api-key` checks, so one token serves both), the constant-time comparison, and `TokenMiddleware`, the ASGI
middleware `gspo-trl vllm-serve` hands vLLM (`--middleware`): every HTTP and WebSocket path answers 401 without the
token, and `/collective_rpc` runs only gspo-trl's own worker methods (`gspo_*`), never vLLM's (`update_config` would
rebuild the model from any folder). It runs inside the vLLM server's process and imports only the standard library.
What it does not own: which folders the worker methods touch (`worker_extension`), starting the server (`serve`).
"""

from __future__ import annotations

import collections
import hashlib
import hmac
import json
import os

TOKEN_ENV = "GSPO_TRL_VLLM_TOKEN"
MIDDLEWARE = "gspo_trl.vllm.auth.TokenMiddleware"
RPC_METHOD_PREFIX = "gspo_"  # the worker extension's methods; vLLM's own are refused over HTTP
MIN_SERVER_TOKEN_CHARS = 16


def check_token(token: str, what: str) -> str:
    """`token` if it can travel in an HTTP header (printable ASCII, no spaces); else a ValueError naming `what`."""
    if not isinstance(token, str) or not token:
        raise ValueError(f"{what} must be a non-empty string, got {token!r}.")
    if not all("!" <= char <= "~" for char in token):
        raise ValueError(
            f"{what} holds a space or a character outside printable ASCII, which an HTTP header cannot carry: use "
            "letters, digits and punctuation only (e.g. from `python -c 'import secrets; "
            "print(secrets.token_urlsafe(32))'`)."
        )
    return token


def resolve_token(configured: str | None, field: str = "vllm_server_token") -> str | None:
    """The token a client sends: `configured` (a config field), else $GSPO_TRL_VLLM_TOKEN, else None (no header)."""
    if configured is not None:
        return check_token(configured, field)
    from_env = os.environ.get(TOKEN_ENV)
    return check_token(from_env, f"${TOKEN_ENV}") if from_env else None


def authorization_header(token: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"} if token else {}


def _digest(value: str | bytes) -> bytes:
    return hashlib.sha256(value.encode("latin-1") if isinstance(value, str) else value).digest()


def bearer_matches(header: bytes | None, token_digest: bytes) -> bool:
    """Whether an `Authorization` header value is `Bearer <the token>`. Hashing first makes the comparison take the
    same time whatever the sent value's length; `hmac.compare_digest` makes it independent of where bytes differ."""
    scheme, _, sent = (header or b"").partition(b" ")
    matches = hmac.compare_digest(_digest(sent.strip()), token_digest)
    return matches and scheme.lower() == b"bearer"


def rpc_refusal(body: bytes) -> str | None:
    """Why a `/collective_rpc` request body may not run (None: it may): only methods named `gspo_*`. The body is
    parsed as vLLM parses it (`json.loads`: a repeated key keeps its last value), so both read the same method."""
    try:
        request = json.loads(body)
    except ValueError:
        return "the body is not JSON"
    method = request.get("method") if isinstance(request, dict) else None
    if not isinstance(method, str) or not method.startswith(RPC_METHOD_PREFIX):
        return (
            f"method {method!r} is not one of gspo-trl's worker methods ({RPC_METHOD_PREFIX}*); "
            "`gspo-trl vllm-serve` refuses vLLM's own methods over HTTP"
        )
    return None


async def _respond(send, status: int, message: str) -> None:
    body = json.dumps({"error": message}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class TokenMiddleware:
    """ASGI middleware: a request without `Authorization: Bearer $GSPO_TRL_VLLM_TOKEN` gets 401 (a WebSocket is
    closed before it opens), on every path; `/collective_rpc` additionally runs `gspo_*` methods only (403 else).
    vLLM builds it with the app alone (`--middleware` takes an import path), so the token comes from the environment
    `gspo-trl vllm-serve` starts vLLM with; without one it refuses to start rather than serve unguarded."""

    def __init__(self, app, token: str | None = None):
        token = token if token is not None else os.environ.get(TOKEN_ENV)
        if not token:
            raise RuntimeError(
                f"{MIDDLEWARE} guards the server with ${TOKEN_ENV}, which is not set in the server's environment."
            )
        self.app = app
        self.token_digest = _digest(check_token(token, f"${TOKEN_ENV}"))

    def _authorized(self, scope) -> bool:
        header = next((value for name, value in scope.get("headers", ()) if name.lower() == b"authorization"), None)
        return bearer_matches(header, self.token_digest)

    async def __call__(self, scope, receive, send):
        if scope["type"] not in ("http", "websocket"):  # lifespan: the server starting and stopping
            return await self.app(scope, receive, send)
        if not self._authorized(scope):
            if scope["type"] == "websocket":
                return await send({"type": "websocket.close", "code": 1008})  # policy violation, before accept
            return await _respond(
                send,
                401,
                f"Unauthorized: send the server's token as `Authorization: Bearer "
                f"TOKEN` (${TOKEN_ENV} on the trainer's side).",
            )
        if scope["type"] == "http" and "collective_rpc" in scope.get("path", ""):
            messages, body = collections.deque(), []
            while True:
                message = await receive()
                messages.append(message)
                if message["type"] != "http.request":
                    break
                body.append(message.get("body", b""))
                if not message.get("more_body", False):
                    break
            refusal = rpc_refusal(b"".join(body))
            del body
            if refusal is not None:
                return await _respond(send, 403, f"Forbidden: {refusal}.")

            async def replay():
                return messages.popleft() if messages else await receive()

            return await self.app(scope, replay, send)
        return await self.app(scope, receive, send)

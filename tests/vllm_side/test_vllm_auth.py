"""Tests for gspo_trl.vllm.auth: the token's format, the Bearer check and `TokenMiddleware` called as an ASGI app (a
real vLLM server runs it in test_rollout_vllm_server_guard.py)."""

import asyncio
import json

import pytest

from gspo_trl.vllm.auth import (
    TOKEN_ENV,
    TokenMiddleware,
    authorization_header,
    bearer_matches,
    check_token,
    resolve_token,
    rpc_refusal,
)

TOKEN = "Zx8-secret_token.0123456789"


class App:
    """The server behind the middleware: records what reached it and answers 200 with the body it read."""

    def __init__(self):
        self.calls = []

    async def __call__(self, scope, receive, send):
        body = b""
        if scope["type"] == "http":
            while True:
                message = await receive()
                body += message.get("body", b"")
                if not message.get("more_body"):
                    break
        self.calls.append((scope["type"], scope.get("path"), body))
        if scope["type"] == "http":
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": body})


def call(path, authorization=None, body=b"", pieces=1, scope_type="http", app=None, token=TOKEN):
    """(status or the close message, the body the app answered, the app) for one request through the middleware
    (`token=None`: the middleware reads it from the environment, as when vLLM builds it)."""
    app = app or App()
    middleware = TokenMiddleware(app) if token is None else TokenMiddleware(app, token=token)
    size = max(1, -(-len(body) // pieces))
    chunks = [body[start : start + size] for start in range(0, len(body), size)] or [b""]
    messages = [{"type": "http.request", "body": c, "more_body": i < len(chunks) - 1} for i, c in enumerate(chunks)]
    sent = []

    async def receive():
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    headers = [(b"host", b"x")] + ([(b"authorization", authorization.encode())] if authorization is not None else [])
    scope = {"type": scope_type, "path": path, "method": "POST", "headers": headers}
    asyncio.run(middleware(scope, receive, send))
    if scope_type == "websocket":
        return (sent[0] if sent else None), None, app
    return sent[0]["status"], b"".join(m.get("body", b"") for m in sent[1:]), app


PATHS = ["/health", "/v1/models", "/v1/completions", "/collective_rpc", "/pause", "/update_weights", "/metrics",
         "/openapi.json", "/docs", "/no-such-path", "/", "/v1/../collective_rpc"]  # fmt: skip


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(
    "authorization",
    [
        None,
        "",
        "Bearer",
        "Bearer ",
        "Bearer wrong",
        f"Bearer {TOKEN}x",
        f"Bearer {TOKEN[:-1]}",
        f"Basic {TOKEN}",
        TOKEN,
        f"Bearer  {TOKEN} extra",
    ],  # fmt: skip
)
def test_every_path_answers_401_without_the_token_and_never_reaches_the_server(path, authorization):
    status, body, app = call(path, authorization, body=b'{"method": "gspo_model_info"}')
    assert status == 401 and app.calls == []
    assert b"Authorization: Bearer" in body


@pytest.mark.parametrize("scheme", ["Bearer", "bearer", "BEARER"])
def test_the_token_passes_on_any_path_with_the_body_intact(scheme):
    body = json.dumps({"method": "gspo_load_weights_chunk", "kwargs": {"data": "QUJD" * 5000}}).encode()
    for path, pieces in [("/health", 1), ("/v1/completions", 3), ("/collective_rpc", 7)]:
        status, answered, app = call(path, f"{scheme} {TOKEN}", body=body, pieces=pieces)
        assert status == 200 and answered == body and app.calls == [("http", path, body)]


def test_a_websocket_without_the_token_is_closed_before_it_opens():
    closed, _, app = call("/v1/realtime", None, scope_type="websocket")
    assert closed == {"type": "websocket.close", "code": 1008} and app.calls == []
    call("/v1/realtime", f"Bearer {TOKEN}", scope_type="websocket", app=app)
    assert app.calls == [("websocket", "/v1/realtime", b"")]


def test_lifespan_passes_through():
    app = App()
    asyncio.run(TokenMiddleware(app, token=TOKEN)({"type": "lifespan"}, None, None))
    assert app.calls == [("lifespan", None, b"")]


@pytest.mark.parametrize(
    "body",
    [
        b'{"method": "update_config", "kwargs": {"overrides": "{}"}}',
        b'{"method": "reload_weights", "kwargs": {"weights_path": "/etc"}}',
        b'{"method": "gspo_model_info", "method": "update_config"}',  # json.loads keeps the last, as vLLM's parse does
        b'{"kwargs": {}}',
        b'{"method": ["gspo_model_info"]}',
        b'["gspo_model_info"]',
        b'{"method": "gspo_model_info"',
        b"",
    ],
)
def test_collective_rpc_runs_only_gspo_methods(body):
    status, answered, app = call("/collective_rpc", f"Bearer {TOKEN}", body=body, pieces=2)
    assert status == 403 and app.calls == []
    assert rpc_refusal(body) is not None and b"Forbidden" in answered


def test_collective_rpc_with_a_gspo_method_reaches_the_server():
    assert rpc_refusal(b'{"method": "update_config", "method": "gspo_can_read"}') is None
    status, _, app = call("/collective_rpc", f"Bearer {TOKEN}", body=b'{"method": "gspo_can_read", "kwargs": {}}')
    assert status == 200 and len(app.calls) == 1


def test_bearer_matches_only_the_exact_token():
    import hashlib

    digest = hashlib.sha256(TOKEN.encode()).digest()
    assert bearer_matches(f"Bearer {TOKEN}".encode(), digest)
    assert not bearer_matches(None, digest)
    assert not bearer_matches(f"Bearer {TOKEN} ".encode() + b"x", digest)
    assert not bearer_matches(f"Token {TOKEN}".encode(), digest)


def test_the_middleware_refuses_to_start_without_a_token(monkeypatch):
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    with pytest.raises(RuntimeError, match=TOKEN_ENV):
        TokenMiddleware(App())
    monkeypatch.setenv(TOKEN_ENV, TOKEN)  # vLLM builds it with the app alone: the token comes from the environment
    assert call("/health", f"Bearer {TOKEN}", token=None)[0] == 200
    assert call("/health", "Bearer wrong", token=None)[0] == 401


@pytest.mark.parametrize("token", ["", "with space", "tab\there", "naïve-token", "line\nbreak"])
def test_a_token_a_header_cannot_carry_is_refused_naming_the_field(token):
    with pytest.raises(ValueError, match="vllm_server_token"):
        check_token(token, "vllm_server_token")


def test_the_token_comes_from_the_config_else_the_environment(monkeypatch):
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    assert resolve_token(None) is None and authorization_header(None) == {}
    monkeypatch.setenv(TOKEN_ENV, "from-env")
    assert resolve_token(None) == "from-env" and resolve_token("from-config") == "from-config"
    assert authorization_header("t") == {"Authorization": "Bearer t"}
    monkeypatch.setenv(TOKEN_ENV, "bad value")
    with pytest.raises(ValueError, match=f"\\${TOKEN_ENV}"):
        resolve_token(None)

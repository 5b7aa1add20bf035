"""Tests for gspo_trl.vllm.client's failure paths, against a small local HTTP server that answers like a broken or
misconfigured vLLM server (the happy path runs against a real vLLM server in test_rollout_vllm_server.py)."""

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from gspo_trl.vllm.client import UnauthorizedError, VLLMServerClient, VLLMServerError


class FakeServer:
    """Answers each path from `routes`: {path: [(status, body), ...]} consumed in order (the last one repeats)."""

    def __init__(self, routes):
        self.routes = {path: list(answers) for path, answers in routes.items()}
        self.calls = []
        self.authorizations = []  # the Authorization header of each request (None: none sent)
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def _answer(self):
                path = self.path.split("?")[0]
                outer.calls.append(path)
                outer.authorizations.append(self.headers.get("Authorization"))
                answers = outer.routes.get(path, [(404, {"detail": "Not Found"})])
                status, body = answers.pop(0) if len(answers) > 1 else answers[0]
                payload = body.encode() if isinstance(body, str) else json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def do_GET(self):
                self._answer()

            def do_POST(self):
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                self._answer()

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


MODELS = {"data": [{"id": "m"}]}


def client_for(server, **kwargs):
    return VLLMServerClient(server.url, **{"timeout": 2.0, "retries": 2, **kwargs})


def test_no_server_fails_within_the_timeout_naming_the_url():
    server = FakeServer({})
    url = server.url
    server.close()  # nothing listens there any more
    started = time.monotonic()
    with pytest.raises(VLLMServerError, match=url.replace(".", r"\.")) as error:
        VLLMServerClient(url, timeout=1.5).wait_until_ready()
    assert time.monotonic() - started < 10
    assert "vllm-serve" in str(error.value)
    assert isinstance(error.value, ConnectionError)  # what code written for TRL's client catches
    assert isinstance(error.value, RuntimeError)  # what code written for gspo-trl 0.2.0 catches


def test_server_without_dev_mode_is_named():
    server = FakeServer({"/v1/models": [(200, MODELS)]})
    try:
        with pytest.raises(VLLMServerError, match="VLLM_SERVER_DEV_MODE=1"):
            client_for(server).model_info()
    finally:
        server.close()


def test_server_without_the_worker_extension_is_named():
    server = FakeServer({"/collective_rpc": [(500, {"error": "AttributeError: no gspo_model_info"})]})
    try:
        with pytest.raises(VLLMServerError, match="worker extension"):
            client_for(server).model_info()
        assert server.calls.count("/collective_rpc") == 3  # a 5xx is retried, a bounded number of times
    finally:
        server.close()


def test_a_transient_server_error_is_retried():
    choice = {"index": 0, "token_ids": [4, 2], "logprobs": {"token_logprobs": [-0.5, None]}}
    server = FakeServer(
        {"/v1/models": [(200, MODELS)], "/v1/completions": [(503, "busy"), (200, {"choices": [choice]})]}
    )
    try:
        samples = client_for(server).complete([[1, 2]], 1, {"max_tokens": 2})
        assert samples[0][0]["token_ids"] == [4, 2]
        assert samples[0][0]["logprobs"][0] == -0.5 and samples[0][0]["logprobs"][1] != samples[0][0]["logprobs"][1]
    finally:
        server.close()


@pytest.mark.parametrize(
    "answer, match",
    [
        ({"choices": []}, "0 choices for 1 prompts"),
        ({"choices": [{"index": 0, "text": "hi"}]}, "without matching token_ids"),
        ("<html>proxy error</html>", "not JSON"),
    ],
)
def test_malformed_completions_are_errors(answer, match):
    server = FakeServer({"/v1/models": [(200, MODELS)], "/v1/completions": [(200, answer)]})
    try:
        with pytest.raises(VLLMServerError, match=match):
            client_for(server).complete([[1, 2]], 1, {})
    finally:
        server.close()


def test_a_server_that_dies_mid_run_fails_after_bounded_retries():
    server = FakeServer({"/v1/models": [(200, MODELS)]})
    client = client_for(server, retries=1)
    client.served_model()
    server.close()
    started = time.monotonic()
    with pytest.raises(VLLMServerError, match="did not answer POST /v1/completions after 2 tries"):
        client.complete([[1, 2]], 1, {})
    assert time.monotonic() - started < 30


def test_a_server_of_another_kind_is_named():
    # TRL's `trl vllm-serve` has neither /v1/models nor /collective_rpc.
    server = FakeServer({"/health": [(200, {"status": "ok"})]})
    try:
        with pytest.raises(VLLMServerError, match="HTTP 404.*trl vllm-serve.*gspo-trl vllm-serve"):
            client_for(server).served_model()
    finally:
        server.close()


@pytest.mark.parametrize("size", [0, 1, 2, 3, 10, 11, 12, 13])
def test_a_payload_is_base64_encoded_piece_by_piece_into_the_json_body(monkeypatch, size):
    import base64

    from gspo_trl.vllm.client import Base64JSONBody

    monkeypatch.setattr(Base64JSONBody, "PIECE", 6)  # several pieces for the larger payloads
    payload = bytes(range(size))
    body = Base64JSONBody(b'{"data": "', payload, b'"}')
    sent = b"".join(body)
    assert sent == b'{"data": "' + base64.b64encode(payload) + b'"}' and len(body) == len(sent)
    assert b"".join(body) == sent  # a retry sends the same body again
    assert json.loads(sent)["data"] == base64.b64encode(payload).decode()


def test_the_token_goes_with_every_request_as_a_bearer_header(tmp_path):
    ok = [(200, {"results": [{"readable": True, "directory": "/d", "max_lora_rank": None}]})]
    server = FakeServer(
        {"/health": [(200, "")], "/v1/models": [(200, MODELS)], "/collective_rpc": ok, "/v1/load_lora_adapter": ok}
        | {path: [(200, "")] for path in ("/pause", "/resume", "/reset_prefix_cache")}
    )
    try:
        client = client_for(server, token="tok-123")
        client.wait_until_ready()
        client.served_model()
        client.model_info()
        client.can_read("/x")
        client.pause()
        client.reset_prefix_cache()
        client.resume()
        client.load_weights_chunk(b"abc")
        (tmp_path / "f").write_bytes(b"12345")
        client.send_file("gspo-trl-adapter-0123abcd", str(tmp_path / "f"), 2)
        client.load_lora_adapter("a", "/d")
        client.remove_directory("gspo-trl-adapter-0123abcd")
        assert len(server.calls) >= 12 and server.authorizations == ["Bearer tok-123"] * len(server.calls)
        client_for(server).wait_until_ready()
        assert server.authorizations[-1] is None  # no token, no header
    finally:
        server.close()


@pytest.mark.parametrize("token, message", [(None, "requires a token and none was sent"), ("t", "refused the token")])
def test_a_401_fails_at_once_naming_the_token_setting(token, message):
    server = FakeServer({"/health": [(401, {"error": "Unauthorized"})], "/v1/models": [(401, {"error": "no"})]})
    try:
        started = time.monotonic()
        with pytest.raises(UnauthorizedError, match=f"{message}.*vllm_server_token") as error:
            VLLMServerClient(server.url, timeout=60, token=token).wait_until_ready()
        assert time.monotonic() - started < 5  # not after vllm_server_timeout
        assert "GSPO_TRL_VLLM_TOKEN" in str(error.value) and server.calls == ["/health"]
        with pytest.raises(UnauthorizedError, match=message):
            client_for(server, token=token).served_model()
    finally:
        server.close()

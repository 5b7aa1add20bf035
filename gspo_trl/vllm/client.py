"""HTTP client for a vLLM server started by `gspo-trl vllm-serve` (vLLM's own OpenAI server plus our worker extension).

Owns the wire format: which endpoint does what, bounded retries, and errors that name the URL and what to check.
It knows nothing of the trainer or tensors: weights reach it as a directory path or as a safetensors file's bytes.
"""

from __future__ import annotations

import base64
import json
import time
from typing import Any

import requests

from .auth import TOKEN_ENV, authorization_header

SERVE_HINT = "Start it with `gspo-trl vllm-serve MODEL` (docs/vllm.md)."


class VLLMServerError(RuntimeError):
    """The vLLM server could not be reached, refused a request, or answered something unusable."""


class VLLMServerUnreachable(VLLMServerError, ConnectionError):
    """No answer from the server (down, wrong address, timed out): also a `ConnectionError`, as TRL's client raises
    for a server it cannot reach, so code written to catch a lost server keeps working."""


class MissingEndpointError(VLLMServerError):
    """The server has no such endpoint (HTTP 404): a server of another kind, or started without dev mode."""


class UnauthorizedError(VLLMServerError):
    """The server answered 401: a token is missing or is not the server's."""


class Base64JSONBody:
    """A request body `head + base64(payload) + tail`, produced piece by piece: requests streams an iterable with a
    length (Content-Length, no chunked encoding), and iterating again (a retry) starts over."""

    PIECE = 3 * 2**20  # a multiple of 3 bytes: the pieces' base64 texts concatenate to the whole's

    def __init__(self, head: bytes, payload: bytes, tail: bytes):
        self.head, self.payload, self.tail = head, memoryview(payload), tail

    def __len__(self) -> int:
        return len(self.head) + 4 * ((len(self.payload) + 2) // 3) + len(self.tail)

    def __iter__(self):
        yield self.head
        for start in range(0, len(self.payload), self.PIECE):
            yield base64.b64encode(self.payload[start : start + self.PIECE])
        yield self.tail


class VLLMServerClient:
    """Talks to one vLLM server at `base_url`; every call is retried `retries` times on connection errors, and
    carries `token` (if any) as `Authorization: Bearer`, which `gspo-trl vllm-serve` and vLLM's `--api-key` check."""

    def __init__(
        self,
        base_url: str,
        timeout: float = 240.0,
        request_timeout: float = 600.0,
        retries: int = 3,
        token: str | None = None,
    ):
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout  # how long to wait for the server to come up
        self.request_timeout = request_timeout
        self.retries = retries
        self.session = requests.Session()
        self.session.headers.update(authorization_header(token))
        self.has_token = token is not None
        self.model_name: str | None = None

    def _unauthorized(self, method: str, path: str) -> UnauthorizedError:
        if self.has_token:
            what = "refused the token sent (vllm_server_token, else $GSPO_TRL_VLLM_TOKEN)"
            todo = "Set it to the token the server was started with"
        else:
            what = "requires a token and none was sent"
            todo = "Set vllm_server_token (or the GSPO_TRL_VLLM_TOKEN environment variable) to the server's token"
        return UnauthorizedError(
            f"The vLLM server at {self.base_url} {what}: HTTP 401 for {method} {path}. {todo} "
            f"(${TOKEN_ENV} of `gspo-trl vllm-serve`, or its --api-key for `vllm serve`)."
        )

    # --- plumbing ------------------------------------------------------------------------------

    def _request(self, method: str, path: str, **kwargs) -> requests.Response:
        url = f"{self.base_url}{path}"
        last_error: Exception | None = None
        for attempt in range(self.retries + 1):
            try:
                response = self.session.request(method, url, timeout=self.request_timeout, **kwargs)
            except (requests.ConnectionError, requests.Timeout) as error:
                last_error = error
                time.sleep(min(2.0**attempt, 10.0))
                continue
            if response.status_code >= 500 and attempt < self.retries:
                last_error = VLLMServerError(f"HTTP {response.status_code}: {response.text[:300]}")
                time.sleep(min(2.0**attempt, 10.0))
                continue
            return response
        raise VLLMServerUnreachable(
            f"The vLLM server at {self.base_url} did not answer {method} {path} after {self.retries + 1} tries "
            f"({last_error}). Check that it is still running and reachable from this machine. {SERVE_HINT}"
        )

    def _json(self, method: str, path: str, **kwargs) -> Any:
        response = self._request(method, path, **kwargs)
        if response.status_code == 401:
            raise self._unauthorized(method, path)
        if response.status_code == 404 and path == "/collective_rpc":
            raise MissingEndpointError(
                f"The vLLM server at {self.base_url} has no /collective_rpc endpoint: it was started without "
                f"VLLM_SERVER_DEV_MODE=1, so gspo-trl cannot send it new weights. {SERVE_HINT}"
            )
        if response.status_code != 200:
            missing = response.status_code == 404
            hint = f" Is it a server of another kind (e.g. `trl vllm-serve`)? {SERVE_HINT}" if missing else ""
            raise (MissingEndpointError if missing else VLLMServerError)(
                f"The vLLM server at {self.base_url} refused {method} {path}: HTTP {response.status_code}: "
                f"{response.text[:500]}{hint}"
            )
        if not response.content:
            return None
        try:
            return response.json()
        except ValueError as error:
            raise VLLMServerError(
                f"The vLLM server at {self.base_url} answered {method} {path} with something that is not JSON: "
                f"{response.text[:300]!r}"
            ) from error

    def _rpc(self, method: str, payload: bytes | None = None, **kwargs) -> list:
        """Call `method` on every worker; `payload` (bytes, possibly hundreds of MB) goes in as `kwargs["data"]`,
        base64-encoded piece by piece as the request is sent (never a second whole copy)."""
        if payload is None:
            body = self._json("POST", "/collective_rpc", json={"method": method, "kwargs": kwargs})
        else:
            head = json.dumps({"method": method, "kwargs": kwargs})[: -len("}}")] + (", " if kwargs else "")
            data = Base64JSONBody(f'{head}"data": "'.encode(), payload, b'"}}')
            body = self._json("POST", "/collective_rpc", data=data, headers={"Content-Type": "application/json"})
        results = (body or {}).get("results")
        if not isinstance(results, list) or not results:
            raise VLLMServerError(f"/collective_rpc {method} on {self.base_url} returned {body!r}")
        return results

    # --- the server ----------------------------------------------------------------------------

    def wait_until_ready(self) -> None:
        """Block until /health answers 200, for at most `timeout` seconds."""
        deadline = time.monotonic() + self.timeout
        last_error = None
        while time.monotonic() < deadline:
            try:
                status = self.session.get(f"{self.base_url}/health", timeout=5).status_code
            except requests.RequestException as error:
                status = None
                last_error = error
            if status == 200:
                return
            if status == 401:
                raise self._unauthorized("GET", "/health")
            time.sleep(1.0)
        raise VLLMServerUnreachable(
            f"No vLLM server answered at {self.base_url}/health within vllm_server_timeout={self.timeout:g} s "
            f"({last_error}). Check vllm_server_base_url (or vllm_server_host/port) and the server's log. {SERVE_HINT}"
        )

    def served_model(self) -> str:
        """The name the server serves its model under (the `model` field of every request)."""
        body = self._json("GET", "/v1/models")
        try:
            self.model_name = body["data"][0]["id"]
        except (KeyError, IndexError, TypeError) as error:
            raise VLLMServerError(f"{self.base_url}/v1/models returned no model: {body!r}") from error
        return self.model_name

    def model_info(self, config: dict | None = None) -> dict:
        """Architecture, vocabulary, tied head and dtype of the served model, from the gspo-trl worker extension; for
        a server without it but with a weight-transfer engine (`trl vllm-serve`, `vllm serve --weight-transfer-config`),
        what its vLLM `config` (`server_config()`) says, with `"worker_extension": False`."""
        try:
            return {**self._rpc("gspo_model_info")[0], "worker_extension": True}
        except (MissingEndpointError, UnauthorizedError):
            raise
        except VLLMServerError as error:
            if isinstance((config or {}).get("weight_transfer_config"), dict):
                dtype = str((config.get("model_config") or {}).get("dtype") or "")
                return {"worker_extension": False, "max_lora_rank": None, "dtype": dtype.replace("torch.", "") or None}
            raise VLLMServerError(
                f"The vLLM server at {self.base_url} does not have gspo-trl's worker extension loaded "
                f"(--worker-extension-cls gspo_trl.vllm.worker_extension.WeightSyncExtension): {error}. {SERVE_HINT}"
            ) from error

    def can_read(self, path: str) -> list[bool]:
        """Whether each worker of the server can read the file at `path`."""
        return [isinstance(r, dict) and r.get("readable") is True for r in self._rpc("gspo_can_read", path=path)]

    def pause(self) -> None:
        """Stop generating (waiting for requests in flight) so weights can change."""
        self._json("POST", "/pause", params={"mode": "wait"})

    def resume(self) -> None:
        self._json("POST", "/resume")

    def reset_prefix_cache(self) -> None:
        """Drop cached prompt KV computed with the old weights."""
        self._json("POST", "/reset_prefix_cache")

    def reload_weights(self, weights_path: str) -> None:
        """Every worker loads the safetensors snapshot in `weights_path` (a directory the server can read)."""
        self._rpc("gspo_reload_weights", weights_path=weights_path)

    def load_weights_chunk(self, payload: bytes, version: str = "", delta_base: str = "") -> list[str]:
        """Every worker loads the weights in `payload` (a safetensors file's bytes, whole layers) in place; with a
        `version`, deltas against `delta_base` (`delta`). Returns the tensors some worker did not hold in
        `delta_base` (it then loaded nothing of the chunk): send them whole."""
        kwargs = {"version": version, "delta_base": delta_base} if version else {}
        results = self._rpc("gspo_load_weights_chunk", payload, **kwargs)
        return sorted({name for result in results if isinstance(result, dict) for name in result.get("stale", ())})

    def delta_digest(self) -> list[dict]:
        """Each worker's SHA-256 per tensor it holds for delta syncs (`delta`), by name."""
        return self._rpc("gspo_delta_digest")

    def finish_weight_load(self) -> None:
        """After the last chunk: the workers re-pack what the chunks' reloads left stale (a tied LM head)."""
        self._rpc("gspo_finish_weight_load")

    def send_file(self, directory: str, path: str, piece_bytes: int) -> str:
        """Copy the local file `path` into `directory` (a plain name) of the server's temporary folder, in pieces of at
        most `piece_bytes`; returns that folder's path on the server."""
        import os

        size, offset, folder = os.path.getsize(path), 0, None
        with open(path, "rb") as handle:
            while offset == 0 or offset < size:
                piece = handle.read(piece_bytes)
                last = offset + len(piece) >= size
                results = self._rpc(
                    "gspo_receive_file",
                    piece,
                    directory=directory,
                    name=os.path.basename(path),
                    offset=str(offset),
                    last="1" if last else "0",
                )
                folder = results[0]["directory"]
                offset += len(piece)
                if last:
                    break
        return folder

    def remove_directory(self, directory: str) -> None:
        """Best effort, once, without retries (the server may be gone): remove a directory `send_file` filled."""
        body = {"method": "gspo_remove_directory", "kwargs": {"directory": directory}}
        try:
            self.session.post(f"{self.base_url}/collective_rpc", json=body, timeout=5)
        except requests.RequestException:
            pass

    def load_lora_adapter(self, name: str, path: str) -> None:
        """Load (or replace in place) the LoRA adapter saved in `path` under `name`; requests then name it as model."""
        response = self._request(
            "POST", "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path, "load_inplace": True}
        )
        if response.status_code == 401:
            raise self._unauthorized("POST", "/v1/load_lora_adapter")
        if response.status_code != 200:
            raise VLLMServerError(
                f"The vLLM server at {self.base_url} refused the LoRA adapter in {path}: HTTP {response.status_code}: "
                f"{response.text[:500]}. Start it with --enable-lora --max-lora-rank R (R >= the adapter's rank), "
                "or set vllm_lora_adapter_sync=False to send merged weights instead."
            )

    # --- vLLM's weight-transfer engine (`engine_transport`) --------------------------------------

    def server_config(self) -> dict | None:
        """The server's resolved vLLM config (`/server_info`), None where the server does not expose it."""
        response = self._request("GET", "/server_info", params={"config_format": "json"})
        if response.status_code != 200:
            return None
        try:
            config = response.json().get("vllm_config")
        except ValueError:
            return None
        return config if isinstance(config, dict) else None

    def world_size(self) -> int:
        """How many workers the server has (tensor × pipeline × data parallel): the ranks after the trainer's."""
        return int(self._json("GET", "/get_world_size")["world_size"])

    def _post_once(self, path: str, body: dict) -> None:
        """A request that waits on a collective: never retried (a second one would wait for a peer that is gone)."""
        url = f"{self.base_url}{path}"
        try:
            response = self.session.post(url, json=body, timeout=self.request_timeout)
        except requests.RequestException as error:
            raise VLLMServerUnreachable(
                f"The vLLM server at {self.base_url} did not answer POST {path}: {error}"
            ) from error
        if response.status_code != 200:
            raise VLLMServerError(
                f"The vLLM server at {self.base_url} refused POST {path}: HTTP {response.status_code}: "
                f"{response.text[:500]}"
            )

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        """The workers join the trainer's group (the request returns once they did)."""
        self._post_once("/init_weight_transfer_engine", {"init_info": init_info})

    def start_weight_update(self) -> None:
        self._post_once("/start_weight_update", {})

    def update_weights(self, update_info: dict) -> None:
        """The workers receive the tensors `update_info` names (the request returns once they are loaded)."""
        self._post_once("/update_weights", {"update_info": update_info})

    def finish_weight_update(self) -> None:
        self._post_once("/finish_weight_update", {})

    def abandon_weight_update(self) -> list:
        """Every worker undoes a weight update left unfinished (gspo-trl's worker extension): one dict per worker."""
        return self._rpc("gspo_abandon_weight_update")

    # --- sampling ------------------------------------------------------------------------------

    def complete(self, prompt_ids: list[list[int]], n: int, sampling: dict[str, Any]) -> list[list[dict]]:
        """`n` samples for each prompt (token ids): per prompt, a list of {"token_ids", "logprobs"} in sample order."""
        body = {
            "model": self.model_name or self.served_model(),
            "prompt": prompt_ids,
            "n": n,
            "logprobs": 0,  # the sampled token's own log-prob
            "return_token_ids": True,
            **sampling,
        }
        result = self._json("POST", "/v1/completions", json=body)
        choices = (result or {}).get("choices")
        if not isinstance(choices, list) or len(choices) != len(prompt_ids) * n:
            raise VLLMServerError(
                f"{self.base_url}/v1/completions returned {len(choices) if isinstance(choices, list) else choices!r} "
                f"choices for {len(prompt_ids)} prompts × n={n}."
            )
        samples: list[list[dict]] = [[] for _ in prompt_ids]
        for choice in sorted(choices, key=lambda c: c.get("index", 0)):
            token_ids = choice.get("token_ids")
            logprobs = (choice.get("logprobs") or {}).get("token_logprobs")
            if not isinstance(token_ids, list) or not isinstance(logprobs, list) or len(logprobs) != len(token_ids):
                raise VLLMServerError(
                    f"{self.base_url}/v1/completions returned a choice without matching token_ids and token "
                    f"logprobs: {str(choice)[:300]}. Is this a vLLM server of version 0.32 or later?"
                )
            samples[choice["index"] // n].append(
                {"token_ids": token_ids, "logprobs": [float("nan") if v is None else v for v in logprobs]}
            )
        return samples

    def prompt_logprobs(self, token_ids: list[int]) -> list[float]:
        """log p(token_t | tokens_<t) under the served weights, for t = 1 .. len - 1 (temperature 1)."""
        body = {
            "model": self.model_name or self.served_model(),
            "prompt": [token_ids],
            "max_tokens": 1,
            "prompt_logprobs": 0,
            "temperature": 1.0,
        }
        result = self._json("POST", "/v1/completions", json=body)
        entries = result["choices"][0]["prompt_logprobs"][1:]
        return [entry[str(token)]["logprob"] for entry, token in zip(entries, token_ids[1:])]

"""Tests for gspo_trl.vllm.transport: choosing the transport, and the HTTP transport end to end through a real HTTP
server that hands /collective_rpc to the real worker extension over a stand-in model runner (the real vLLM server
runs the same path in test_rollout_vllm_server.py)."""

import json
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch
from helpers import small_config
from peft import LoraConfig, get_peft_model

from gspo_trl.vllm.client import VLLMServerClient
from gspo_trl.vllm.folders import upload_root
from gspo_trl.vllm.transport import HTTPTransport, SharedDirTransport, choose_transport, server_sees
from gspo_trl.vllm.weight_sync import named_weights, sync_group, weight_chunks
from gspo_trl.vllm.worker_extension import WeightSyncExtension


class RecordingRunner:
    """Stands in for vLLM's model runner: keeps what each `reload_weights` call received."""

    def __init__(self):
        self.reloads: list[dict[str, torch.Tensor]] = []

    def reload_weights(self, weights_iterator=None, weights_path=None):
        self.reloads.append(dict(weights_iterator))

    def get_model(self):
        return torch.nn.Module()  # no LM head to re-pack


class Worker(WeightSyncExtension):
    def __init__(self):
        self.model_runner = RecordingRunner()
        self.calls: list[str] = []


class RPCServer:
    """/collective_rpc answered by one `Worker`, as vLLM's server answers it with one worker per process."""

    def __init__(self):
        self.worker = Worker()
        self.request_bytes: list[int] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                raw = self.rfile.read(int(self.headers["Content-Length"]))
                outer.request_bytes.append(len(raw))
                body = json.loads(raw)
                outer.worker.calls.append(body["method"])
                result = getattr(outer.worker, body["method"])(**body.get("kwargs", {}))
                payload = json.dumps({"results": [result]}).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.client = VLLMServerClient(f"http://127.0.0.1:{self.httpd.server_address[1]}", retries=0)
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture()
def rpc():
    server = RPCServer()
    yield server
    server.close()


def test_sync_group_is_the_numbered_block_or_the_module():
    assert sync_group("model.layers.12.self_attn.q_proj.weight") == "model.layers.12"
    assert sync_group("model.layers.3.mlp.experts.7.up_proj.weight") == "model.layers.3"
    assert sync_group("model.embed_tokens.weight") == "model.embed_tokens"
    assert sync_group("lm_head.weight") == "lm_head"
    assert sync_group("model.visual.blocks.0.attn.qkv.bias") == "model.visual.blocks.0"


def test_chunks_hold_whole_groups_within_the_limit():
    def weights(*spec):  # (name, number of fp32 elements)
        return [(name, torch.zeros(n)) for name, n in spec]

    given = weights(
        ("model.embed_tokens.weight", 10),  # 40 bytes
        ("model.layers.0.q.weight", 5),  # layer 0: 40 bytes
        ("model.layers.0.k.weight", 5),
        ("model.layers.1.q.weight", 30),  # layer 1: 160 bytes, more than the limit: a chunk of its own
        ("model.layers.1.k.weight", 10),
        ("model.layers.2.q.weight", 2),  # layer 2: 8 bytes
        ("model.norm.weight", 3),  # 12 bytes
    )
    chunks = list(weight_chunks(iter(given), max_bytes=100))
    names = [[name for name, _ in chunk] for chunk in chunks]
    assert names == [
        ["model.embed_tokens.weight", "model.layers.0.q.weight", "model.layers.0.k.weight"],  # 80 bytes
        ["model.layers.1.q.weight", "model.layers.1.k.weight"],  # 160 bytes alone
        ["model.layers.2.q.weight", "model.norm.weight"],  # 20 bytes
    ]
    assert [t for chunk in chunks for _, t in chunk] == [t for _, t in given]  # the same tensors, in order, no copy
    assert list(weight_chunks(iter([]), max_bytes=100)) == []


def test_http_sends_every_weight_in_chunks_of_whole_layers(rpc, tiny_model):
    with torch.no_grad():
        for param in tiny_model.parameters():
            param.add_(0.01)
    limit = 20_000  # bytes: below one decoder layer of the tiny model, so each layer is a chunk of its own
    sent = HTTPTransport(rpc.client, None, limit).send_weights(tiny_model, True, None, True)
    reloads = rpc.worker.model_runner.reloads
    expected = dict(named_weights(tiny_model))
    assert sent == sum(t.numel() * t.element_size() for t in expected.values())
    assert len(reloads) > 2 and rpc.worker.calls == ["gspo_load_weights_chunk"] * len(reloads) + [
        "gspo_finish_weight_load"
    ]
    received = {name: tensor for reload in reloads for name, tensor in reload.items()}
    assert received.keys() == expected.keys() and sum(map(len, reloads)) == len(expected)  # each weight once
    for name, tensor in expected.items():
        assert torch.equal(received[name], tensor), name

    def layer(name):  # a decoder layer's weights share "model.layers.<i>"; anything else is its own
        return ".".join(name.split(".")[:3]) if name.startswith("model.layers.") else name

    layers = [{layer(name) for name in reload} for reload in reloads]
    assert sum(map(len, layers)) == len(set().union(*layers))  # no layer split across two reloads
    for reload, in_it in zip(reloads, layers):
        assert sum(t.numel() * t.element_size() for t in reload.values()) <= limit or len(in_it) == 1
    # The request carries base64 (4 bytes per 3) of a safetensors file: the weights plus a small header.
    largest = max(sum(t.numel() * t.element_size() for t in reload.values()) for reload in reloads)
    assert max(rpc.request_bytes) < largest * 4 / 3 + 8192


def test_http_sends_bf16_bit_for_bit(rpc, tiny_model):
    HTTPTransport(rpc.client, None, 10**9).send_weights(tiny_model, True, torch.bfloat16, True)
    (received,) = rpc.worker.model_runner.reloads  # one chunk under a large limit
    for name, tensor in named_weights(tiny_model, torch.bfloat16):
        assert received[name].dtype == torch.bfloat16 and torch.equal(received[name], tensor), name


def test_http_on_other_processes_only_takes_part_in_the_gathers(rpc, tiny_model):
    assert HTTPTransport(rpc.client, None, 1000).send_weights(tiny_model, False, None, True) == 0
    assert rpc.worker.calls == []


def test_http_copies_the_adapter_into_the_servers_upload_folder(rpc, tiny_model, tmp_path):
    lora = get_peft_model(tiny_model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    transport = HTTPTransport(rpc.client, str(tmp_path), chunk_bytes=1000)  # many pieces per file
    remote = transport.send_adapter(lora)
    assert remote == os.path.join(upload_root(), transport.remote_dir)
    local = tmp_path / "adapter"
    names = sorted(os.listdir(local))
    assert "adapter_model.safetensors" in names and sorted(os.listdir(remote)) == names  # no partial file left
    for name in names:
        assert (local / name).read_bytes() == open(os.path.join(remote, name), "rb").read(), name
    assert rpc.worker.calls.count("gspo_receive_file") > len(names)
    transport.send_adapter(lora)  # the next sync replaces the files in place
    assert sorted(os.listdir(remote)) == names
    transport.cleanup()  # what happens when the transport is collected or the process exits
    assert not os.path.exists(remote)


@pytest.mark.parametrize(
    "directory, name",
    [("..", "x"), ("ok", "x"), ("/tmp", "x"), ("gspo-trl-adapter-0123abcd/..", "x"), ("a/b", "x")]
    + [("gspo-trl-adapter-0123abcd", name) for name in ("../x", "/etc/passwd", "..", "x.part-1", "")],
)
def test_the_worker_writes_only_plain_names_in_its_upload_folders(directory, name):
    with pytest.raises(PermissionError, match="not a (gspo-trl upload folder name|plain file name)"):
        Worker().gspo_receive_file(directory, name, "", "0", "1")
    with pytest.raises(PermissionError, match="not a gspo-trl upload folder name"):
        Worker().gspo_remove_directory(directory if directory != "gspo-trl-adapter-0123abcd" else "..")


class ProbedClient:
    """Answers `can_read` as a server that does or does not see the trainer's files."""

    base_url = "http://elsewhere:8000"

    def __init__(self, sees: bool):
        self.sees, self.probes = sees, []

    def can_read(self, path):
        self.probes.append(path)
        return [self.sees and os.path.isfile(path)]


@pytest.mark.parametrize(
    "wanted, sees, expected",
    [
        ("auto", True, "shared_dir"),
        ("auto", False, "http"),
        ("http", True, "http"),
        ("shared_dir", True, "shared_dir"),
    ],
)
def test_the_transport_asked_for_or_found_by_probing(tmp_path, wanted, sees, expected):
    client = ProbedClient(sees)
    args = small_config(tmp_path, vllm_weight_transport=wanted)
    transport = choose_transport(args, client, str(tmp_path))
    assert transport.name == expected
    assert isinstance(transport, HTTPTransport if expected == "http" else SharedDirTransport)
    assert len(client.probes) == (0 if wanted == "http" else 1)  # 'http' asks nothing
    assert os.listdir(tmp_path) == []  # the probe file is gone


def test_a_shared_dir_the_server_cannot_see_is_refused_naming_http(tmp_path):
    args = small_config(tmp_path, vllm_weight_transport="shared_dir")
    with pytest.raises(ValueError, match="cannot read the weight-sync directory.*vllm_weight_transport='http'"):
        choose_transport(args, ProbedClient(False), str(tmp_path))
    assert server_sees(ProbedClient(True), str(tmp_path)) and not server_sees(ProbedClient(False), str(tmp_path))


def test_http_delta_sends_the_moved_elements_and_the_worker_rebuilds_the_weights(rpc, tiny_model):
    transport = HTTPTransport(rpc.client, None, 10**9, delta_sync=True)  # one chunk: one request per sync
    first = transport.send_weights(tiny_model, True, torch.bfloat16, True)
    with torch.no_grad():
        moved = next(tiny_model.parameters())
        moved.view(-1)[:3] += 1.0  # three elements of one tensor move; every other bf16 bit stays
    second = transport.send_weights(tiny_model, True, torch.bfloat16, True)
    expected = dict(named_weights(tiny_model, torch.bfloat16))
    # Whole bf16 weights, then a bitmask of each tensor (1 bit per element) and three values.
    elements = sum(t.numel() for t in expected.values())
    assert first > 2 * elements and second < elements / 8 + 16_384, (first, second)
    last = rpc.worker.model_runner.reloads[-1]
    assert last.keys() == expected.keys()
    for name, tensor in expected.items():  # rebuilt bit for bit
        assert torch.equal(last[name].view(torch.int16), tensor.view(torch.int16)), name
    # A worker that lost what it held (a restarted server) names the tensors; the chunk then goes whole.
    rpc.worker.gspo_delta_receiver.forget()
    with torch.no_grad():
        moved.view(-1)[:3] += 1.0
    third = transport.send_weights(tiny_model, True, torch.bfloat16, True)
    assert third > first and rpc.worker.calls[-3:] == ["gspo_load_weights_chunk"] * 2 + ["gspo_finish_weight_load"]
    last = rpc.worker.model_runner.reloads[-1]
    for name, tensor in dict(named_weights(tiny_model, torch.bfloat16)).items():
        assert torch.equal(last[name].view(torch.int16), tensor.view(torch.int16)), name

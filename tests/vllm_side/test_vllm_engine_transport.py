"""Tests for gspo_trl.vllm.engine_transport: the trainer's side of vLLM's weight-transfer protocol driven against a
stand-in server whose one worker joins the real gloo group and receives as gspo-trl's engine does (the real vLLM
server runs the same exchange in tests/rollout/test_rollout_vllm_server.py), and which servers it can drive."""

import pytest
import torch
from helpers import small_config

from gspo_trl.vllm import collective, engine_transport, folders, shared_buffers
from gspo_trl.vllm.engine_transport import EngineTransport, server_backend, unusable_reason
from gspo_trl.vllm.transport import HTTPTransport, SharedDirTransport, choose_transport
from gspo_trl.vllm.weight_sync import named_weights


class EngineServer:
    """The control plane of a one-worker server with the gloo engine: the worker joins in `init_weight_transfer_engine`
    and receives in `update_weights`, in the thread the trainer runs the request in."""

    base_url = "http://127.0.0.1:8000"
    request_timeout = 60

    def __init__(self, backend="gloo", readable=True):
        self.calls, self.received, self.group = [], {}, None
        self.config = {"weight_transfer_config": {"backend": backend}, "model_config": {"dtype": "torch.float32"}}
        self.readable = readable

    def server_config(self):
        return self.config

    def world_size(self):
        return 1

    def can_read(self, path):
        return [self.readable]

    def init_weight_transfer_engine(self, init_info):
        self.calls.append("init")
        self.init_info = init_info
        store = collective.connect_store(init_info["master_address"], init_info["master_port"], 2, timeout=60)
        self.group = collective.join_group(store, init_info["rank_offset"], init_info["world_size"], "127.0.0.1", 60)
        self.shared = shared_buffers.worker_agrees(self.group, init_info.get("shared_dir"), init_info.get("host_id"))

    def start_weight_update(self):
        self.calls.append("start")

    def update_weights(self, update_info):
        self.calls.append("update")
        dtypes = [getattr(torch, name) for name in update_info["dtype_names"]]

        def load(items):
            self.received.update((name, tensor.clone()) for name, tensor in items)

        plan = (self.group, update_info["names"], dtypes, update_info["shapes"], update_info["buffer_lengths"])
        if self.shared is not None:
            shared_buffers.receive_shared(*plan, load, self.shared)
        else:
            collective.receive_packed(*plan, load)

    def finish_weight_update(self):
        self.calls.append("finish")

    def abandon_weight_update(self):
        self.calls.append("abandon")
        return [self.left_unfinished]

    left_unfinished = {"was_active": False, "layers_restored": 0}


@pytest.fixture
def snapshot_dir():
    folder = folders.new_snapshot_dir()
    yield folder
    folders.remove_snapshot_dir(folder)


def engine(server, plane, snapshot_dir):
    """The trainer's engine transport: the buffers through the group, or through files of the snapshot folder the
    server sees (`shared_buffers`)."""
    files = SharedDirTransport(server, snapshot_dir) if plane == "files" else None
    return EngineTransport(server, "gloo", files)


@pytest.mark.parametrize("plane", ["group", "files"])
def test_the_trainer_joins_once_then_each_sync_announces_and_broadcasts_every_weight(tiny_model, plane, snapshot_dir):
    server = EngineServer()
    transport = engine(server, plane, snapshot_dir)
    for step in range(2):
        with torch.no_grad():
            for param in tiny_model.parameters():
                param.add_(0.01)
        sent = transport.send_weights(tiny_model, True, None, True)
        expected = dict(named_weights(tiny_model))
        assert sent == sum(t.numel() * t.element_size() for t in expected.values())
        assert server.received.keys() == expected.keys()
        for name, tensor in expected.items():
            assert torch.equal(server.received[name], tensor), (step, name)
    undo = ["abandon"] if plane == "files" else []  # a server with the extension undoes what a dead trainer left
    assert server.calls == undo + ["init", "start", "update", "finish", "start", "update", "finish"]  # one rendezvous
    assert server.init_info["rank_offset"] == 1 and server.init_info["world_size"] == 2 and server.init_info["packed"]
    assert (transport.shared is not None) == (server.shared is not None) == (plane == "files")


@pytest.mark.parametrize("plane", ["group", "files"])
def test_chunks_of_whole_layers_each_announced_in_its_own_update(tiny_model, monkeypatch, plane, snapshot_dir):
    monkeypatch.setattr(engine_transport, "CHUNK_BYTES", 20_000)  # below one decoder layer: a layer per update
    monkeypatch.setattr(engine_transport, "BUFFER_BYTES", 5_000)  # several buffers per update
    server = EngineServer()
    engine(server, plane, snapshot_dir).send_weights(tiny_model, True, torch.bfloat16, True)
    assert server.calls[server.calls.index("init") :][:2] == ["init", "start"]
    assert server.calls[-1] == "finish"
    assert server.calls.count("update") > 2
    for name, tensor in named_weights(tiny_model, torch.bfloat16):
        assert server.received[name].dtype == torch.bfloat16 and torch.equal(server.received[name], tensor), name


def test_other_processes_only_take_part_in_the_gathers(tiny_model):
    server = EngineServer()
    assert EngineTransport(server, "gloo").send_weights(tiny_model, False, None, True) == 0
    assert server.calls == []


def test_which_servers_the_trainer_can_drive():
    url = "http://h:1"
    assert server_backend(None) is None and server_backend({"weight_transfer_config": None}) is None
    assert server_backend({"weight_transfer_config": {"backend": "nccl"}}) == "nccl"
    assert unusable_reason("gloo", url) is None
    assert "started without a weight-transfer engine" in unusable_reason(None, url)
    assert "'ipc'" in unusable_reason("ipc", url) and "('gloo', 'nccl')" in unusable_reason("ipc", url)
    if not torch.cuda.is_available():
        reason = unusable_reason("nccl", url)
        assert "NCCL" in reason and "needs a CUDA GPU" in reason and "gspo-trl vllm-serve" in reason


@pytest.mark.parametrize(
    "wanted, backend, readable, expected",
    [
        ("auto", "gloo", True, "engine"),
        ("engine", "gloo", False, "engine"),
        ("auto", None, True, "shared_dir"),
        ("auto", "ipc", False, "http"),
        ("shared_dir", "gloo", True, "shared_dir"),
        ("http", "gloo", True, "http"),
    ],
)
def test_the_transport_asked_for_or_found(tmp_path, wanted, backend, readable, expected):
    server = EngineServer(backend, readable)
    if backend is None:
        server.config = {"weight_transfer_config": None}
    args = small_config(tmp_path, vllm_weight_transport=wanted)
    transport = choose_transport(args, server, str(tmp_path), server.server_config())
    assert transport.name == expected
    if expected == "engine":
        # joined at once, so a server that cannot reach the trainer is found early; first, whatever update a trainer
        # before this one left unfinished is undone (gspo-trl's extension)
        assert server.calls == ["abandon", "init"]
        assert isinstance(transport.files, SharedDirTransport if readable else HTTPTransport)  # for an adapter


def test_engine_refused_where_the_server_has_none_or_one_this_trainer_cannot_drive(tmp_path):
    server = EngineServer()
    server.config = {"weight_transfer_config": None}
    args = small_config(tmp_path, vllm_weight_transport="engine")
    with pytest.raises(ValueError, match="vllm_weight_transport='engine', but .* without a weight-transfer engine"):
        choose_transport(args, server, str(tmp_path), server.server_config())
    # A server without gspo-trl's extension (`trl vllm-serve`) has no other way in.
    server = EngineServer("ipc")
    args = small_config(tmp_path, vllm_weight_transport="auto")
    with pytest.raises(ValueError, match="'ipc'.*no gspo-trl worker extension"):
        choose_transport(args, server, str(tmp_path), server.server_config(), worker_extension=False)


class UnreachableServer(EngineServer):
    """A server whose workers cannot open a connection to the trainer."""

    def init_weight_transfer_engine(self, init_info):
        self.calls.append("init")
        raise engine_transport.VLLMServerError("HTTP 500: connection to the trainer timed out")


def test_a_server_that_cannot_join_falls_back_under_auto_and_is_refused_under_engine(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(engine_transport, "JOIN_TIMEOUT_S", 1.0)  # how long the trainer waits for the workers
    args = small_config(tmp_path, vllm_weight_transport="auto")
    server = UnreachableServer()
    transport = choose_transport(args, server, str(tmp_path), server.server_config())
    assert transport.name == "shared_dir" and server.calls == ["abandon", "init"]
    args = small_config(tmp_path, vllm_weight_transport="engine")
    with pytest.raises(ValueError, match="did not join the weight-transfer group.*connection to the trainer timed out"):
        choose_transport(args, server, str(tmp_path), server.server_config())


def test_a_sync_failing_half_way_is_undone_on_the_server_and_the_next_one_joins_afresh(tiny_model, monkeypatch):
    server = EngineServer()
    transport = EngineTransport(server, "gloo", files=SharedDirTransport(server, None))
    real_chunks = engine_transport.weight_chunks

    def failing_chunks(weights, max_bytes):  # the first chunk goes out, then the trainer fails (a gather, say)
        chunks = real_chunks(weights, max_bytes)
        yield next(chunks)
        raise RuntimeError("gather failed")

    monkeypatch.setattr(engine_transport, "CHUNK_BYTES", 20_000)  # several chunks
    monkeypatch.setattr(engine_transport, "weight_chunks", failing_chunks)
    expected = "failed half-way: gather failed.*put back.*stays paused"
    with pytest.raises(engine_transport.VLLMServerError, match=expected):
        transport.send_weights(tiny_model, True, None, True)
    assert server.calls == ["abandon", "init", "start", "update", "abandon"] and transport.group is None
    monkeypatch.setattr(engine_transport, "weight_chunks", real_chunks)
    server.calls, server.received = [], {}
    transport.send_weights(tiny_model, True, None, True)
    assert server.calls[:3] == ["abandon", "init", "start"] and server.calls[-1] == "finish"
    for name, tensor in named_weights(tiny_model):
        assert torch.equal(server.received[name], tensor), name


def test_a_trainer_warns_when_it_finds_an_update_another_left_unfinished(tiny_model, caplog):
    server = EngineServer()
    server.left_unfinished = {"was_active": True, "layers_restored": 12}
    transport = EngineTransport(server, "gloo", files=SharedDirTransport(server, None))
    with caplog.at_level("WARNING"):
        transport.connect()
    assert "never finished" in caplog.text and "12 layers put back" in caplog.text

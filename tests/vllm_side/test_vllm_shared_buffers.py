"""Tests for gspo_trl.vllm.shared_buffers: the packed buffers through two files of a snapshot folder, signalled over a
real gloo group of two ranks (two threads of this process), arriving bit for bit; when the workers take part."""

import os
import threading

import pytest
import torch
from test_vllm_collective import two_ranks

from gspo_trl.vllm import collective, folders, shared_buffers
from gspo_trl.vllm.shared_buffers import SharedSlots


@pytest.fixture
def snapshot_dir():
    folder = folders.new_snapshot_dir()  # /dev/shm (else the temporary folder): a folder a server reads from
    yield folder
    folders.remove_snapshot_dir(folder)


def plan_of(weights, limit):
    names = [name for name, _ in weights]
    sizes = [tensor.numel() * tensor.element_size() for _, tensor in weights]
    return (
        names,
        [t.dtype for _, t in weights],
        [list(t.shape) for _, t in weights],
        collective.buffer_lengths(names, sizes, limit),
    )


def test_buffers_arrive_bit_for_bit_through_the_files_and_a_later_larger_buffer_grows_them(snapshot_dir):
    torch.manual_seed(0)
    first = [
        ("a.weight", torch.randn(7, 3)),
        ("b.weight", torch.randn(5, 4).to(torch.bfloat16)),
        ("c.index", torch.arange(9, dtype=torch.int64)),
        ("d.weight", torch.randn(6, 4).t()),  # not contiguous: sent as its values in row order
        ("e.scale", torch.tensor(2.5)),
    ]
    # a second sync whose buffers are larger than any of the first's: both files grow, the reader maps them again
    second = [(name, tensor * 3) for name, tensor in first] + [("f.weight", torch.randn(64, 64))]
    syncs = [(first, 90), (second, 90), (first, 1)]  # 3, 3 and 5 buffers
    loads = [[] for _ in syncs]

    def receive(group):
        slots = shared_buffers.worker_agrees(group, snapshot_dir, shared_buffers.host_id())
        assert slots is not None
        total = 0
        for (weights, limit), received in zip(syncs, loads):
            keep = received.append
            total += shared_buffers.receive_shared(
                group,
                *plan_of(weights, limit),
                lambda items, keep=keep: keep([(n, t.clone()) for n, t in items]),
                slots,
            )
        return total

    group, thread, result = two_ranks(receive)
    slots = shared_buffers.trainer_agrees(group, SharedSlots(snapshot_dir, writer=True))
    assert slots is not None
    sent = 0
    for weights, limit in syncs:
        sent += shared_buffers.send_shared(group, weights, plan_of(weights, limit)[3], slots)
    thread.join(timeout=60)
    sizes = [sum(t.numel() * t.element_size() for _, t in weights) for weights, _ in syncs]
    assert sent == result["value"] == sum(sizes) == 296 + (296 + 64 * 64 * 4) + 296
    assert [len(load) for load in loads] == [3, 3, 5]
    assert os.path.getsize(os.path.join(snapshot_dir, "engine-buffer-0")) >= 64 * 64 * 4
    for (weights, _), load in zip(syncs, loads):
        received = dict(item for buffer in load for item in buffer)
        assert received.keys() == {name for name, _ in weights}
        for name, tensor in weights:
            assert received[name].dtype == tensor.dtype and torch.equal(received[name], tensor), name


@pytest.mark.parametrize(
    "offered, case",
    [(True, "folder not allowed"), (True, "other host"), (True, "no such folder"), (False, "not offered")],
)
def test_without_every_worker_the_buffers_go_through_the_group(snapshot_dir, tmp_path, offered, case):
    missing = os.path.join(os.path.dirname(snapshot_dir), "gspo-trl-weights-1-" + "0" * 12)
    folder = {"folder not allowed": str(tmp_path), "no such folder": missing}.get(case, snapshot_dir)
    host = "another-kernel" if case == "other host" else shared_buffers.host_id()
    weights = [("a.weight", torch.randn(3, 3)), ("b.weight", torch.randn(4))]
    names, dtypes, shapes, lengths = plan_of(weights, 8)
    received = {}

    def receive(group):
        slots = shared_buffers.worker_agrees(group, folder if offered else "", host)
        assert slots is None
        return collective.receive_packed(
            group, names, dtypes, shapes, lengths, lambda items: received.update((n, t.clone()) for n, t in items)
        )

    group, thread, result = two_ranks(receive)
    if offered:  # without an offer neither side has a choice to make (a server of an older version makes none)
        assert shared_buffers.trainer_agrees(group, SharedSlots(snapshot_dir, writer=True)) is None
    collective.send_packed(group, weights, lengths)
    thread.join(timeout=60)
    assert result["value"] == 9 * 4 + 4 * 4 and all(torch.equal(received[name], tensor) for name, tensor in weights)


def test_a_reader_reads_only_regular_files_of_an_allowed_snapshot_folder_and_never_creates_one(snapshot_dir, tmp_path):
    with pytest.raises(PermissionError, match="snapshot folder"):
        SharedSlots(str(tmp_path), writer=False)
    reader, received = SharedSlots(snapshot_dir, writer=False), torch.zeros(16, dtype=torch.uint8)
    with pytest.raises(FileNotFoundError):
        reader.read_into(0, received)
    assert not os.path.exists(os.path.join(snapshot_dir, "engine-buffer-0"))
    writer = SharedSlots(snapshot_dir, writer=True)
    writer.view(0, 16).copy_(torch.arange(16, dtype=torch.uint8))
    reader.read_into(0, received)
    assert torch.equal(received, torch.arange(16, dtype=torch.uint8))
    with pytest.raises(ValueError, match="holds 16 bytes, not the 32"):
        reader.read_into(0, torch.zeros(32, dtype=torch.uint8))
    os.mkfifo(os.path.join(snapshot_dir, "engine-buffer-1"))  # would block a plain open for ever
    with pytest.raises(ValueError, match="not a regular file"):
        reader.read_into(1, received)
    os.remove(os.path.join(snapshot_dir, "engine-buffer-1"))
    os.symlink("/etc/hostname", os.path.join(snapshot_dir, "engine-buffer-1"))
    with pytest.raises(OSError):  # a link is not followed
        reader.read_into(1, received)


def test_a_full_folder_is_an_error_naming_it_and_the_engine_then_offers_no_files(snapshot_dir, monkeypatch):
    from gspo_trl.vllm import engine_transport

    def no_room(descriptor, offset, length):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", no_room)
    with pytest.raises(OSError, match=r"no room for a 16-byte weight buffer in .*--shm-size"):
        SharedSlots(snapshot_dir, writer=True).view(0, 16)

    class Files:
        name, directory = "shared_dir", snapshot_dir

    class Client:
        base_url = "http://127.0.0.1:8000"

    assert engine_transport.EngineTransport(Client(), "gloo", Files()).offered is None


def test_a_buffer_other_than_the_plan_names_is_refused_by_the_worker(snapshot_dir):
    weights = [("a.weight", torch.randn(3, 3))]
    errors = []

    def receive(group):
        slots = shared_buffers.worker_agrees(group, snapshot_dir, shared_buffers.host_id())
        try:  # this worker expects a tensor of 4 floats, the trainer sends 9
            shared_buffers.receive_shared(group, ["a.weight"], [torch.float32], [[4]], [1], lambda items: None, slots)
        except RuntimeError as error:
            errors.append(str(error))
            group.allreduce([torch.zeros(1, dtype=torch.int64)]).wait()  # the trainer's wait for the file's return

    group, thread, _ = two_ranks(receive)
    slots = shared_buffers.trainer_agrees(group, SharedSlots(snapshot_dir, writer=True))
    shared_buffers.send_shared(group, weights, [1], slots)
    thread.join(timeout=60)
    assert len(errors) == 1 and "[0, 36]" in errors[0] and "[0, 16]" in errors[0] and "versions" in errors[0]


def test_two_workers_read_the_same_files(snapshot_dir):
    """A server of two workers (tensor parallel): both map the trainer's files and each gets every buffer."""
    weights = [(f"model.layers.{i}.w", torch.randn(32, 8) + i) for i in range(5)]
    names, dtypes, shapes, lengths = plan_of(weights, 1)
    store = collective.open_master_store("127.0.0.1", 0, 3, timeout=60)
    results = {}

    def worker(rank):
        peer = collective.connect_store("127.0.0.1", store.port, 3, timeout=60)
        group = collective.join_group(peer, rank, 3, "127.0.0.1", timeout=60)
        slots = shared_buffers.worker_agrees(group, snapshot_dir, shared_buffers.host_id())
        got = {}
        shared_buffers.receive_shared(
            group, names, dtypes, shapes, lengths, lambda items: got.update((n, t.clone()) for n, t in items), slots
        )
        results[rank] = got

    threads = [threading.Thread(target=worker, args=(rank,)) for rank in (1, 2)]
    for thread in threads:
        thread.start()
    group = collective.join_group(store, 0, 3, "127.0.0.1", timeout=60)
    slots = shared_buffers.trainer_agrees(group, SharedSlots(snapshot_dir, writer=True))
    assert slots is not None
    shared_buffers.send_shared(group, weights, lengths, slots)
    for thread in threads:
        thread.join(timeout=60)
    for rank in (1, 2):
        assert all(torch.equal(results[rank][name], tensor) for name, tensor in weights), rank

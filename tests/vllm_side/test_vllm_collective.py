"""Tests for gspo_trl.vllm.collective: where the packed buffers are cut, and a broadcast through a real gloo group of
two ranks (two threads of this process) arriving bit for bit."""

import threading

import torch

from gspo_trl.vllm import collective


def test_a_buffer_closes_once_it_holds_more_than_the_limit():
    # fp32 tensors of 40, 20, 120 and 8 bytes under a 50-byte limit: 40 stays open, 40 + 20 = 60 > 50 closes it; 120
    # alone is over the limit; 8 is what is left.
    sizes = collective.packed_sizes([[10], [5], [6, 5], [2]], [torch.float32] * 4, buffer_bytes=50)
    assert sizes == [[40, 20], [120], [8]]
    assert collective.packed_sizes([[3, 0], [1]], [torch.bfloat16, torch.int64], 8) == [[0, 8]]  # 0 + 8: not over
    assert collective.packed_sizes([], [], 8) == []


def two_ranks(receive):
    """Rank 0 (this thread) and rank 1 (`receive(group)` in another) joined in one gloo group on loopback."""
    store = collective.open_master_store("127.0.0.1", 0, 2, timeout=60)
    result = {}

    def rank1():
        peer_store = collective.connect_store("127.0.0.1", store.port, 2, timeout=60)
        result["value"] = receive(collective.join_group(peer_store, 1, 2, "127.0.0.1", timeout=60))

    thread = threading.Thread(target=rank1)
    thread.start()
    return collective.join_group(store, 0, 2, "127.0.0.1", timeout=60), thread, result


def test_packed_tensors_of_several_dtypes_arrive_bit_for_bit_buffer_by_buffer():
    torch.manual_seed(0)
    weights = [
        ("a.weight", torch.randn(7, 3)),
        ("b.weight", torch.randn(5, 4).to(torch.bfloat16)),
        ("c.index", torch.arange(9, dtype=torch.int64)),
        ("d.weight", torch.randn(6, 4).t()),  # not contiguous: sent as its values in row order
        ("e.scale", torch.tensor(2.5)),
    ]
    names = [name for name, _ in weights]
    dtypes = [tensor.dtype for _, tensor in weights]
    shapes = [list(tensor.shape) for _, tensor in weights]
    limit = 90  # bytes: 84 (a) + 40 (b) > 90 closes the first buffer, 72 (c) + 96 (d) the second, 4 (e) is left
    loads = []

    def receive(group):
        return collective.receive_packed(
            group, names, dtypes, shapes, limit, lambda items: loads.append([(n, t.clone()) for n, t in items])
        )

    group, thread, result = two_ranks(receive)
    sent = collective.send_packed(group, iter(weights), limit)
    thread.join(timeout=60)
    total = sum(tensor.numel() * tensor.element_size() for _, tensor in weights)
    assert sent == result["value"] == total == 296
    names_per_buffer = [[name for name, _ in load] for load in loads]
    assert names_per_buffer == [["a.weight", "b.weight"], ["c.index", "d.weight"], ["e.scale"]]
    received = dict(item for load in loads for item in load)
    for name, tensor in weights:
        assert received[name].dtype == tensor.dtype and received[name].shape == tensor.shape, name
        assert torch.equal(received[name], tensor), name

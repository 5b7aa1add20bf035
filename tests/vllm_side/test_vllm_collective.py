"""Tests for gspo_trl.vllm.collective: where the packed buffers are cut, and a broadcast through a real gloo group of
two ranks (two threads of this process) arriving bit for bit."""

import threading

import pytest
import torch

from gspo_trl.vllm import collective


def test_a_buffer_closes_between_layers_once_it_holds_more_than_the_limit():
    # Under a 50-byte limit: layer 0's 40 + 20 bytes close the first buffer; the 120-byte embedding is over the limit
    # alone; layer 1 (8 + 30 + 30) is cut only at its end, never inside it; the final norm is what is left.
    names = ["model.layers.0.a", "model.layers.0.b", "model.embed.weight", "model.layers.1.a", "model.layers.1.b"]
    names += ["model.layers.1.c", "model.norm.weight"]
    assert collective.buffer_lengths(names, [40, 20, 120, 8, 30, 30, 4], buffer_bytes=50) == [2, 1, 3, 1]
    # 30 + 20 = 50 is not over the limit: one layer and the next share a buffer
    assert collective.buffer_lengths(names[:2] + names[3:5], [30, 20, 8, 1], 50) == [4]
    assert collective.buffer_lengths(["x.weight"], [0], 8) == [1]
    assert collective.buffer_lengths([], [], 8) == []


def test_sync_group_is_the_numbered_block_or_the_module():
    assert collective.sync_group("model.layers.12.self_attn.q_proj.weight") == "model.layers.12"
    assert collective.sync_group("model.layers.3.mlp.experts.7.up_proj.weight") == "model.layers.3"
    assert collective.sync_group("model.embed_tokens.weight") == "model.embed_tokens"
    assert collective.sync_group("lm_head.weight") == "lm_head"


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
    sizes = [tensor.numel() * tensor.element_size() for _, tensor in weights]
    lengths = collective.buffer_lengths(names, sizes, 90)
    assert lengths == [2, 2, 1]  # 84 (a) + 40 (b) > 90 closes the first buffer, 72 (c) + 96 (d) the second
    loads = []

    def receive(group):
        return collective.receive_packed(
            group, names, dtypes, shapes, lengths, lambda items: loads.append([(n, t.clone()) for n, t in items])
        )

    group, thread, result = two_ranks(receive)
    sent = collective.send_packed(group, weights, lengths)
    thread.join(timeout=60)
    total = sum(sizes)
    assert sent == result["value"] == total == 296
    names_per_buffer = [[name for name, _ in load] for load in loads]
    assert names_per_buffer == [["a.weight", "b.weight"], ["c.index", "d.weight"], ["e.scale"]]
    received = dict(item for load in loads for item in load)
    for name, tensor in weights:
        assert received[name].dtype == tensor.dtype and received[name].shape == tensor.shape, name
        assert torch.equal(received[name], tensor), name


@pytest.mark.parametrize("limit", [1, 20_000])  # one layer per buffer; a limit inside a decoder layer (~41 kB)
def test_every_buffer_holds_whole_layers_so_a_loader_may_keep_a_layer_until_it_is_complete(tiny_model, limit):
    """vLLM's layer-wise reload keeps the tensors of a layer (views into the receive buffer, which is reused two
    buffers later) until all of the layer arrived: no layer may wait on a later buffer."""
    weights = [(name, param.detach()) for name, param in tiny_model.named_parameters()]
    names = [name for name, _ in weights]
    sizes = [tensor.numel() * tensor.element_size() for _, tensor in weights]
    lengths = collective.buffer_lengths(names, sizes, limit)
    assert len(lengths) > 3
    per_group = {}
    for name in names:
        per_group[collective.sync_group(name)] = per_group.get(collective.sync_group(name), 0) + 1
    pending, done = {}, {}

    def load(items):  # as the reload does: a layer's views are kept until it is complete, then copied
        for name, tensor in items:
            group = pending.setdefault(collective.sync_group(name), {})
            group[name] = tensor
            if len(group) == per_group[collective.sync_group(name)]:
                done.update((n, t.clone()) for n, t in pending.pop(collective.sync_group(name)).items())
        assert not pending, f"{sorted(pending)} wait on a later buffer"

    def receive(group):
        dtypes = [tensor.dtype for _, tensor in weights]
        shapes = [list(tensor.shape) for _, tensor in weights]
        return collective.receive_packed(group, names, dtypes, shapes, lengths, load)

    group, thread, result = two_ranks(receive)
    collective.send_packed(group, weights, lengths)
    thread.join(timeout=60)
    assert result["value"] == sum(sizes) and done.keys() == set(names)
    for name, tensor in weights:
        assert torch.equal(done[name], tensor), name

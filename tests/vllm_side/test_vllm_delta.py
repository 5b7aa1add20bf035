"""The delta sync's codec: which elements changed (bit for bit, in the sent dtype), the bitmask, the rebuild, and the
versions that keep a delta from being applied to the wrong base."""

import pytest
import torch

from gspo_trl.vllm import delta


def test_bits_pack_eight_elements_per_byte_lowest_bit_first():
    mask = torch.tensor([1, 0, 0, 0, 0, 0, 0, 1, 0, 1, 1], dtype=torch.bool)
    packed = delta.pack_bits(mask)
    # Byte 0 holds elements 0-7: bits 0 and 7 (1 + 128); byte 1 elements 8-10: bits 1 and 2 (2 + 4), padded with 0.
    assert packed.tolist() == [129, 6]
    assert torch.equal(delta.unpack_bits(packed, 11), mask)


def test_a_change_is_any_bit_that_moved_in_the_sent_dtype():
    last = torch.tensor([1.0, 1.0, 0.0, 2.0], dtype=torch.bfloat16)
    now = last.clone()
    now[0] = 1.0078125  # the next bf16 after 1.0: one bit apart
    now[2] = -0.0  # equal as numbers, other bits: a server must get it to hold the same weights bit for bit
    assert delta.changed(last, now).tolist() == [True, False, True, False]
    # A change smaller than bf16's spacing rounds away: the fp32 values differ, their bf16 casts do not.
    fp32 = torch.tensor([1.0, 1.0]) + torch.tensor([0.0, 1e-3])
    assert delta.changed(fp32.bfloat16(), torch.tensor([1.0, 1.0]).bfloat16()).tolist() == [False, False]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.uint8])
def test_encode_then_apply_gives_the_new_tensor_bit_for_bit(dtype):
    generator = torch.Generator().manual_seed(0)
    last = (torch.rand(5, 7, generator=generator) * 100).to(dtype)
    now = last.clone()
    now.view(-1)[[0, 3, 17, 34]] = (torch.rand(4, generator=generator) * 100 + 1).to(dtype)
    mask, values = delta.encode(last, now)
    assert mask.numel() == 5 and values.numel() == int(delta.changed(last, now).sum())
    rebuilt = delta.apply(last, mask, values)
    assert rebuilt.shape == now.shape and torch.equal(
        rebuilt.view(-1).view(torch.uint8), now.view(-1).view(torch.uint8)
    )
    assert not torch.equal(last, now)  # apply left the base as it was


def test_mismatched_pieces_are_refused():
    last = torch.zeros(10)
    with pytest.raises(ValueError, match="same shape and dtype"):
        delta.changed(last, torch.zeros(11))
    with pytest.raises(ValueError, match="2 uint8 bytes"):
        delta.apply(last, torch.zeros(3, dtype=torch.uint8), torch.zeros(0))
    mask = delta.pack_bits(torch.tensor([True] + [False] * 9))
    with pytest.raises(ValueError, match="marks 1 elements, but 2 values"):
        delta.apply(last, mask, torch.zeros(2))


def test_a_delta_applies_only_to_the_version_the_receiver_holds():
    sender, receiver = delta.DeltaSender(), delta.DeltaReceiver()
    weights = {"a": torch.arange(16.0), "b": torch.ones(3)}
    first = delta.new_version()
    # First sync: whole tensors (nothing sent before), which the receiver keeps.
    entries = {k: v for name, t in weights.items() for k, v in sender.entries(name, t, None).items()}
    assert set(entries) == {"a", "b"}
    whole, stale = receiver.rebuild(entries, None)
    assert stale == [] and set(whole) == {"a", "b"}
    receiver.keep(whole, first)
    sender.acknowledge(weights, weights.values(), first)
    # Second sync: a moved element of "a" goes as a delta against `first`; "b" did not change (an empty delta).
    weights = {"a": weights["a"].clone(), "b": weights["b"]}
    weights["a"][5] = -1.0
    entries = {k: v for name, t in weights.items() for k, v in sender.entries(name, t, first).items()}
    assert set(entries) == {
        delta.MASK_PREFIX + "a",
        delta.VALUES_PREFIX + "a",
        delta.MASK_PREFIX + "b",
        delta.VALUES_PREFIX + "b",
    }
    assert entries[delta.VALUES_PREFIX + "a"].tolist() == [-1.0] and entries[delta.VALUES_PREFIX + "b"].numel() == 0
    whole, stale = receiver.rebuild(entries, first)
    assert stale == [] and torch.equal(whole["a"], weights["a"]) and torch.equal(whole["b"], weights["b"])
    # A receiver that does not hold `first` (restarted, another trainer's, half-updated) names the tensor stale
    # and rebuilds nothing from a wrong base.
    receiver.forget(["a"])
    whole, stale = receiver.rebuild(entries, first)
    assert stale == ["a"] and set(whole) == {"b"}
    other = delta.DeltaReceiver()
    other.keep({"a": torch.zeros(16), "b": torch.ones(3)}, delta.new_version())
    assert other.rebuild(entries, first)[1] == ["a", "b"]
    # The sender sends whole what the receiver did not acknowledge, and everything after forget().
    assert set(sender.entries("a", weights["a"], delta.new_version())) == {"a"}
    sender.forget()
    assert set(sender.entries("a", weights["a"], first)) == {"a"}

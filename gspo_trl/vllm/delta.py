"""A weight sync that sends only what changed: the elements whose bits differ from the last sync's, as a bitmask and
their new values, applied to the copy the receiving side kept of the last sync.

Exact by construction: an element is compared bit for bit in the dtype it is sent in (so a bf16 server gets every
element whose bf16 value moved, however little), and the receiver rebuilds each tensor as the last one it received
with the sent elements written in. Each side keeps the tensors of the last sync and the version (an id per sync) it
holds each of in; a delta names the version it applies to, and the receiver refuses it (the sender then sends that
tensor whole) unless it holds exactly that version: a receiver restarted, taken over by another trainer, or left
half-updated by a failed sync never applies a delta to the wrong base.

It imports only torch: the server's workers load it too. What it does not own: which tensors go in a chunk, the
wire (`transport`, `worker_extension`).
"""

from __future__ import annotations

import uuid

import torch

MASK_PREFIX = "gspo-delta-mask/"  # safetensors keys of a delta's bitmask and values, beside whole tensors' own names
VALUES_PREFIX = "gspo-delta-values/"
_BITS = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8)  # bit i of a byte is element 8k + i
_AS_INTEGER = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def new_version() -> str:
    """An id for one sync, unique across trainers (a new run never matches an old run's versions)."""
    return uuid.uuid4().hex


def changed(last: torch.Tensor, now: torch.Tensor) -> torch.Tensor:
    """A flat bool mask of the elements of `now` whose bits differ from `last`'s (same shape and dtype)."""
    if last.shape != now.shape or last.dtype != now.dtype:
        raise ValueError(
            f"a delta needs the same shape and dtype, got {tuple(last.shape)} {last.dtype} and "
            f"{tuple(now.shape)} {now.dtype}"
        )
    integer = _AS_INTEGER[now.element_size()]
    return last.contiguous().view(integer).flatten() != now.contiguous().view(integer).flatten()


def pack_bits(mask: torch.Tensor) -> torch.Tensor:
    """A flat bool mask as uint8 bytes, 8 elements per byte (element 8k + i is bit i of byte k)."""
    padded = torch.zeros(-(-mask.numel() // 8) * 8, dtype=torch.uint8)
    padded[: mask.numel()] = mask.to(torch.uint8)
    return (padded.view(-1, 8) * _BITS).sum(1, dtype=torch.uint8)


def unpack_bits(packed: torch.Tensor, count: int) -> torch.Tensor:
    """The flat bool mask of `count` elements `pack_bits` packed."""
    if packed.dtype != torch.uint8 or packed.dim() != 1 or packed.numel() != -(-count // 8):
        raise ValueError(
            f"a bitmask of {count} elements is {-(-count // 8)} uint8 bytes, got {tuple(packed.shape)} {packed.dtype}"
        )
    return ((packed.view(-1, 1) & _BITS) != 0).flatten()[:count]


def encode(last: torch.Tensor, now: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(bitmask, values): which elements of `now` differ from `last`, and their new values, flat."""
    mask = changed(last, now)
    return pack_bits(mask), now.contiguous().flatten()[mask]


def apply(base: torch.Tensor, packed: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """`base` with the elements the bitmask marks replaced by `values`, in order (a new tensor; `base` is kept)."""
    mask = unpack_bits(packed, base.numel())
    if values.dtype != base.dtype or values.dim() != 1 or values.numel() != int(mask.sum()):
        raise ValueError(
            f"the bitmask marks {int(mask.sum())} elements, but {values.numel()} values of "
            f"{values.dtype} came for a {base.dtype} tensor"
        )
    result = base.clone()
    result.view(-1)[mask] = values
    return result


class DeltaSender:
    """The sender's side: the tensors it last sent, each with the version the receiver holds it in, and the entries
    of the next chunk (a tensor whole, or its bitmask and values)."""

    def __init__(self):
        self.sent: dict[str, tuple[str, torch.Tensor]] = {}

    def entries(self, name: str, tensor: torch.Tensor, base: str | None) -> dict[str, torch.Tensor]:
        """What to send of `tensor`: a delta against the last sync if the receiver holds it in version `base` and
        the delta is smaller, else the tensor whole. `base` None: whole (a first sync, a refused delta)."""
        last = self.sent.get(name)
        if base is None or last is None or last[0] != base:
            return {name: tensor}
        if last[1].shape != tensor.shape or last[1].dtype != tensor.dtype:
            return {name: tensor}
        mask, values = encode(last[1], tensor)
        if mask.numel() + values.numel() * values.element_size() >= tensor.numel() * tensor.element_size():
            return {name: tensor}  # most elements moved (fp32 weights after an optimizer step do)
        return {MASK_PREFIX + name: mask, VALUES_PREFIX + name: values}

    def acknowledge(self, names, tensors, version: str) -> None:
        """The receiver now holds these tensors in `version` (its answer said so)."""
        for name, tensor in zip(names, tensors):
            self.sent[name] = (version, tensor.detach().to("cpu", copy=True))

    def forget(self) -> None:
        """After a failed sync: nothing is known of what the receiver holds, the next sync is whole."""
        self.sent.clear()


class DeltaReceiver:
    """The receiver's side: the tensors of the last sync, each with its version; rebuilds the whole tensors of a
    chunk, or names those whose delta does not apply to what it holds."""

    def __init__(self):
        self.held: dict[str, tuple[str, torch.Tensor]] = {}

    def rebuild(self, entries: dict[str, torch.Tensor], base: str | None) -> tuple[dict[str, torch.Tensor], list[str]]:
        """(whole tensors, stale names): each delta of `entries` applied to the tensor held in version `base`, whole
        tensors as they came; a delta for a tensor not held in `base` is left out and its name returned."""
        whole, stale = {}, []
        for key, tensor in entries.items():
            if key.startswith(VALUES_PREFIX):
                continue
            if not key.startswith(MASK_PREFIX):
                whole[key] = tensor
                continue
            name = key[len(MASK_PREFIX) :]
            held = self.held.get(name)
            if held is None or held[0] != base:
                stale.append(name)
                continue
            whole[name] = apply(held[1], tensor, entries[VALUES_PREFIX + name])
        return whole, stale

    def keep(self, tensors: dict[str, torch.Tensor], version: str) -> None:
        """These tensors were loaded: hold them as version `version`."""
        for name, tensor in tensors.items():
            self.held[name] = (version, tensor)

    def forget(self, names=None) -> None:
        """Stop holding `names` (all when None): a sync that failed half-way leaves no stale base behind."""
        if names is None:
            self.held.clear()
        for name in names or ():
            self.held.pop(name, None)

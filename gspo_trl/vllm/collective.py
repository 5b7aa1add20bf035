"""The trainer<->server group of the collective weight transport on CPU (gloo), and the packed broadcast over it.

Owns what both sides run alike and what needs only torch and numpy: joining a gloo group outside torch's default one
(the trainer as rank 0, the server's workers after it), and broadcasting a stream of named tensors packed into uint8
buffers cut between layers (the sender names the cuts), two buffers in flight so that packing or loading one overlaps
sending the other. On one host, the buffers may travel through shared files instead (`shared_buffers`).
What it does not own: the HTTP handshake (`engine_transport`), loading what arrives into vLLM's model
(`gloo_engine`).
"""

from __future__ import annotations

import datetime
import math
import socket
from collections.abc import Callable

import numpy
import torch

DEFAULT_BUFFER_BYTES = 256 * 1024**2


def local_address_towards(host: str) -> str:
    """This machine's address on the route to `host` (no packet is sent): where a peer there can reach us."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((socket.gethostbyname(host), 9))
        return probe.getsockname()[0]


def open_master_store(host: str, port: int, world_size: int, timeout: float) -> torch.distributed.TCPStore:
    """The rendezvous store the trainer (rank 0) hosts on `host`:`port` (0: a free port; `store.port` says which)."""
    return torch.distributed.TCPStore(
        host, port, world_size, is_master=True, timeout=datetime.timedelta(seconds=timeout), wait_for_workers=False
    )


def join_group(store, rank: int, world_size: int, bind_address: str, timeout: float, op_timeout: float | None = None):
    """A gloo group of `world_size` over `store`, this process as `rank`, listening on `bind_address`; returns once
    every rank joined (or raises after `timeout` seconds); each broadcast then waits at most `op_timeout` (default
    `timeout`)."""
    options = torch.distributed.ProcessGroupGloo._Options()
    options._timeout = datetime.timedelta(seconds=timeout)
    options._devices = [torch.distributed.ProcessGroupGloo.create_device(hostname=bind_address)]
    prefixed = torch.distributed.PrefixStore("gspo-trl-weights", store)
    group = torch.distributed.ProcessGroupGloo(prefixed, rank, world_size, options)
    if op_timeout is not None:
        group.set_timeout(datetime.timedelta(seconds=op_timeout))
    return group


def connect_store(host: str, port: int, world_size: int, timeout: float) -> torch.distributed.TCPStore:
    """The trainer's rendezvous store, seen from a worker."""
    return torch.distributed.TCPStore(
        host, port, world_size, is_master=False, timeout=datetime.timedelta(seconds=timeout)
    )


def _broadcast(group, buffer: torch.Tensor):
    """Start broadcasting `buffer` from rank 0; returns the work to wait on."""
    options = torch.distributed.BroadcastOptions()
    options.rootRank = 0
    return group.broadcast([buffer], options)


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().contiguous().view(-1).view(torch.uint8)


def pack(pieces: list[torch.Tensor], target: torch.Tensor) -> None:
    """Copy `pieces` (bytes) one after the other into `target`, on this thread alone: torch's copy would split each
    piece across the process's threads, and with the server loading the last buffer on the same cores, every copy
    then waits for the thread that lost its core (measured on 2 cores: 3-4x slower than one thread)."""
    out, offset = target.numpy(), 0
    for piece in pieces:
        numpy.copyto(out[offset : offset + piece.numel()], piece.numpy())
        offset += piece.numel()


def sync_group(name: str) -> str:
    """The part of the model whose weights a partial in-place reload must receive together: a numbered block (a decoder
    layer: vLLM fuses q/k/v, gate/up and a MoE layer's experts into one weight) or else the parameter's own module."""
    parts = name.split(".")
    for index, part in enumerate(parts[:-1]):
        if part.isdigit():
            return ".".join(parts[: index + 1])
    return ".".join(parts[:-1])


def buffer_lengths(names: list[str], sizes: list[int], buffer_bytes: int) -> list[int]:
    """How many of the tensors named `names` (of `sizes` bytes, in order) each packed buffer holds: a buffer closes at
    the end of a `sync_group` once it holds more than `buffer_bytes`. A group never straddles two buffers, so the
    receiver's load of a buffer finishes every layer in it, and the buffer can be reused for the next one (vLLM's
    layer-wise reload keeps the tensors of an unfinished layer, views into the buffer, until the layer is complete)."""
    lengths: list[int] = []
    count = held = 0
    for index, (name, size) in enumerate(zip(names, sizes)):
        count, held = count + 1, held + size
        group_ends = index + 1 == len(names) or sync_group(names[index + 1]) != sync_group(name)
        if group_ends and (held > buffer_bytes or index + 1 == len(names)):
            lengths.append(count)
            count = held = 0
    return lengths


class _Slots:
    """Two reusable byte buffers (one in flight while the other is filled or read), grown on demand: no fresh
    allocation, and so no page faults, per buffer sent."""

    def __init__(self):
        self.storage = [torch.empty(0, dtype=torch.uint8), torch.empty(0, dtype=torch.uint8)]
        self.work = [None, None]

    def take(self, index: int, size: int) -> torch.Tensor:
        if self.work[index] is not None:  # the broadcast that last used it is done before it is reused
            self.work[index].wait()
            self.work[index] = None
        if self.storage[index].numel() < size:
            self.storage[index] = torch.empty(size, dtype=torch.uint8)
        return self.storage[index][:size]

    def drain(self):
        for index in range(2):
            if self.work[index] is not None:
                self.work[index].wait()
                self.work[index] = None


def send_packed(group, weights: list[tuple[str, torch.Tensor]], lengths: list[int]) -> int:
    """Broadcast `weights` from rank 0, packed into one buffer per entry of `lengths` (as many tensors each; see
    `buffer_lengths`), the next one packed while the last is on the wire; returns the bytes sent."""
    slots = _Slots()
    start = sent = 0
    try:
        for number, count in enumerate(lengths):
            pieces = [_as_bytes(tensor) for _, tensor in weights[start : start + count]]
            buffer = slots.take(number % 2, sum(piece.numel() for piece in pieces))
            pack(pieces, buffer)
            slots.work[number % 2] = _broadcast(group, buffer)
            start, sent = start + count, sent + buffer.numel()
    finally:
        slots.drain()
    if start != len(weights):
        raise ValueError(f"the buffers' lengths {lengths} cover {start} tensors, not the {len(weights)} sent")
    return sent


def buffer_plan(dtypes: list[torch.dtype], shapes: list[list[int]], lengths: list[int]):
    """For a receiver: where each buffer's tensors start in the announced list, and their sizes in bytes."""
    if sum(lengths) != len(shapes) or any(count <= 0 for count in lengths):
        raise ValueError(f"buffer lengths {lengths} do not cut {len(shapes)} tensors into non-empty buffers")
    sizes = [math.prod(shape) * dtype.itemsize for shape, dtype in zip(shapes, dtypes)]
    starts = [sum(lengths[:number]) for number in range(len(lengths))]
    return starts, [sizes[start : start + count] for start, count in zip(starts, lengths)]


def buffer_views(buffer: torch.Tensor, buffer_sizes: list[int], start: int, names, dtypes, shapes):
    """The named tensors one received buffer holds, as views into it (the announced tensors from `start` on)."""
    end = start + len(buffer_sizes)
    return [
        (name, view.view(dtype).view(shape))
        for name, dtype, shape, view in zip(
            names[start:end], dtypes[start:end], shapes[start:end], buffer.split(buffer_sizes)
        )
    ]


def receive_packed(
    group,
    names: list[str],
    dtypes: list[torch.dtype],
    shapes: list[list[int]],
    lengths: list[int],
    load: Callable[[list[tuple[str, torch.Tensor]]], object],
) -> int:
    """Receive what `send_packed` broadcasts for tensors described by `names`/`dtypes`/`shapes`, cut into buffers of
    `lengths` tensors, handing each buffer's tensors (views into it, valid during the call) to `load` while the next
    buffer arrives; returns the bytes received."""
    starts, plan = buffer_plan(dtypes, shapes, lengths)
    slots = _Slots()
    buffers = []
    for index, buffer_sizes in enumerate(plan[:2]):  # the first two on the wire at once
        buffers.append(slots.take(index % 2, sum(buffer_sizes)))
        slots.work[index % 2] = _broadcast(group, buffers[-1])
    received = 0
    try:
        for number, (start, buffer_sizes) in enumerate(zip(starts, plan)):
            index = number % 2
            slots.work[index].wait()
            slots.work[index] = None
            buffer = buffers[number]
            load(buffer_views(buffer, buffer_sizes, start, names, dtypes, shapes))
            received += buffer.numel()
            if number + 2 < len(plan):  # this slot is free again: the buffer after next goes into it
                buffers.append(slots.take(index, sum(plan[number + 2])))
                slots.work[index] = _broadcast(group, buffers[-1])
    finally:
        slots.drain()
    return received

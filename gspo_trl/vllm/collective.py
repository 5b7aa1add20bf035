"""The trainer<->server group of the collective weight transport on CPU (gloo), and the packed broadcast over it.

Owns what both sides run alike and what needs only torch: joining a gloo group outside torch's default one (the
trainer as rank 0, the server's workers after it), and broadcasting a stream of named tensors packed into uint8
buffers, cut where the sender and the receivers agree (a buffer closes once it holds more than `buffer_bytes`, as
vLLM's NCCL engine cuts them), two buffers in flight so that packing or loading one overlaps sending the other.
What it does not own: the HTTP handshake (`engine_transport`), loading what arrives into vLLM's model
(`gloo_engine`).
"""

from __future__ import annotations

import datetime
import math
import socket
from collections.abc import Callable, Iterable, Iterator

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


def packed_sizes(shapes: Iterable[Iterable[int]], dtypes: Iterable[torch.dtype], buffer_bytes: int) -> list[list[int]]:
    """Byte sizes of the tensors in each buffer: a buffer closes once it holds more than `buffer_bytes`."""
    buffers: list[list[int]] = [[]]
    total = 0
    for shape, dtype in zip(shapes, dtypes):
        size = math.prod(shape) * dtype.itemsize
        buffers[-1].append(size)
        total += size
        if total > buffer_bytes:
            buffers.append([])
            total = 0
    return [sizes for sizes in buffers if sizes]


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


def send_packed(group, weights: Iterator[tuple[str, torch.Tensor]], buffer_bytes: int) -> int:
    """Broadcast `weights` from rank 0, packed into buffers as `packed_sizes` cuts them (the next one packed while
    the last is on the wire); returns the bytes sent."""
    slots = _Slots()
    pieces: list[torch.Tensor] = []
    held = sent = index = 0

    def flush():
        nonlocal pieces, held, sent, index
        buffer = slots.take(index, held)
        torch.cat(pieces, out=buffer)
        slots.work[index] = _broadcast(group, buffer)
        sent, pieces, held, index = sent + held, [], 0, 1 - index

    try:
        for _, tensor in weights:
            piece = _as_bytes(tensor)
            pieces.append(piece)
            held += piece.numel()
            if held > buffer_bytes:
                flush()
        if pieces:
            flush()
    finally:
        slots.drain()
    return sent


def receive_packed(
    group,
    names: list[str],
    dtypes: list[torch.dtype],
    shapes: list[list[int]],
    buffer_bytes: int,
    load: Callable[[list[tuple[str, torch.Tensor]]], object],
) -> int:
    """Receive what `send_packed` broadcasts for tensors described by `names`/`dtypes`/`shapes`, handing each
    buffer's tensors (views into it, valid during the call) to `load` while the next buffer arrives; returns the
    bytes received."""
    plan = packed_sizes(shapes, dtypes, buffer_bytes)
    slots = _Slots()
    buffers = []
    for index, sizes in enumerate(plan[:2]):  # the first two on the wire at once
        buffers.append(slots.take(index % 2, sum(sizes)))
        slots.work[index % 2] = _broadcast(group, buffers[-1])
    start = received = 0
    try:
        for number, sizes in enumerate(plan):
            index = number % 2
            slots.work[index].wait()
            slots.work[index] = None
            buffer = buffers[number]
            count = len(sizes)
            load(
                [
                    (name, view.view(dtype).view(shape))
                    for name, dtype, shape, view in zip(
                        names[start : start + count],
                        dtypes[start : start + count],
                        shapes[start : start + count],
                        buffer.split(sizes),
                    )
                ]
            )
            start += count
            received += buffer.numel()
            if number + 2 < len(plan):  # this slot is free again: the buffer after next goes into it
                buffers.append(slots.take(index, sum(plan[number + 2])))
                slots.work[index] = _broadcast(group, buffers[-1])
    finally:
        slots.drain()
    return received

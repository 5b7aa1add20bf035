"""The engine's packed buffers through shared memory, when the server's workers read the trainer's snapshot folder.

Over gloo each buffer crosses the kernel's sockets (one copy in, one copy out, in small pieces); on one machine that,
not the load, bounds a sync. When the workers see the trainer's snapshot folder (in /dev/shm: RAM), the trainer
packs each buffer into one of two files there instead, and the group carries only signals, as NCCL does within a
node: rank 0 broadcasts "buffer n is in file n % 2" (its number and size, which each worker checks against the
update's plan), each worker copies it into its own receive buffer and joins an all-reduce, and the trainer packs
buffer n + 2 into that file only once that all-reduce is done. Each worker then loads from its own copy while the
next buffer is packed. The files go with the snapshot folder (`folders`: removed with the backend, on SIGTERM, or by
the next run after a kill).
Imports torch, the standard library, `collective` and `folders` only (the worker extension loads it inside vLLM).
"""

from __future__ import annotations

import math
import mmap
import os
import warnings
from collections.abc import Callable

import torch

from . import collective, folders

FILE_NAMES = ("engine-buffer-0", "engine-buffer-1")  # fixed names: a request names only the folder
BOOT_ID = "/proc/sys/kernel/random/boot_id"


def host_id() -> str:
    """This kernel's boot id ("" where there is none): processes with the same one share the page cache, so a file
    mapped by both is the same memory (not so for two machines that mount one network folder)."""
    try:
        with open(BOOT_ID) as handle:
            return handle.read().strip()
    except OSError:
        return ""


def offer(folder: str | None) -> dict:
    """What the trainer adds to the engine's init info: the folder its buffers would pass through, and its host."""
    return {"shared_dir": folder, "host_id": host_id()} if folder else {}


def _all_agree(group, willing: bool) -> bool:
    """Whether every rank of `group` is `willing` (each rank calls it once, right after joining)."""
    options = torch.distributed.AllreduceOptions()
    options.reduceOp = torch.distributed.ReduceOp.MIN
    flag = torch.tensor([int(willing)], dtype=torch.int64)
    group.allreduce([flag], options).wait()
    return bool(flag.item())


def trainer_agrees(group, slots: SharedSlots | None) -> SharedSlots | None:
    """The trainer's side of the choice, made with every worker in the group: `slots` if all can use them."""
    return slots if _all_agree(group, slots is not None) else None


def worker_agrees(group, shared_dir: str, trainer_host: str) -> SharedSlots | None:
    """A worker's side of the choice: it takes part if the trainer offered a folder this server allows on this very
    host; the buffers pass through files only if every worker does."""
    slots = None
    if shared_dir and trainer_host and trainer_host == host_id():
        try:
            slots = SharedSlots(shared_dir, writer=False)
        except (PermissionError, OSError):
            slots = None
    return slots if _all_agree(group, slots is not None) else None


class SharedSlots:
    """The two buffer files in `folder`, mapped into this process: written by the trainer (`writer`), read by a
    worker, which maps only files in a snapshot folder the server allows and never creates one. A file only grows
    (the writer's `take`), and a reader maps it again when a buffer is larger than its mapping."""

    def __init__(self, folder: str, writer: bool):
        self.folder = folder if writer else folders.snapshot_folder(folder)
        if not os.path.isdir(self.folder):
            raise FileNotFoundError(f"{folder} is not a folder")
        self.writer = writer
        self.maps: list[tuple[mmap.mmap, torch.Tensor] | None] = [None, None]

    def _map(self, index: int, size: int) -> torch.Tensor:
        path = os.path.join(self.folder, FILE_NAMES[index])
        if self.writer:
            descriptor = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        else:
            descriptor = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        try:
            length = os.fstat(descriptor).st_size
            if self.writer and length < size:
                os.ftruncate(descriptor, size)
                length = size
            if length < size:
                raise ValueError(f"{path} holds {length} bytes, not the {size} of the buffer announced")
            access = mmap.ACCESS_WRITE if self.writer else mmap.ACCESS_READ
            mapped = mmap.mmap(descriptor, length, access=access)
        finally:
            os.close(descriptor)
        with warnings.catch_warnings():  # a read-only mapping: the reader only copies out of it
            warnings.simplefilter("ignore", UserWarning)
            tensor = torch.frombuffer(mapped, dtype=torch.uint8) if length else torch.empty(0, dtype=torch.uint8)
        self.maps[index] = (mapped, tensor)  # an older, smaller mapping is unmapped once no view of it is left
        return tensor

    def view(self, index: int, size: int) -> torch.Tensor:
        """The first `size` bytes of file `index`, mapped again (and, for the writer, grown) if it is smaller."""
        held = self.maps[index]
        tensor = held[1] if held is not None and held[1].numel() >= size else self._map(index, size)
        return tensor[:size]


def _signal(group, number: int, size: int):
    """Rank 0's "buffer `number` (of `size` bytes) is in its file"; the others receive it into the tensor returned."""
    token = torch.tensor([number, size], dtype=torch.int64)
    return token, collective._broadcast(group, token)


def _done(group):
    """Every rank is done with a buffer's file (an all-reduce: it returns on each rank once all joined)."""
    return group.allreduce([torch.zeros(1, dtype=torch.int64)])


def send_shared(group, weights: list[tuple[str, torch.Tensor]], lengths: list[int], slots: SharedSlots) -> int:
    """`collective.send_packed`'s buffers through `slots` (the trainer's): each packed into file n % 2 once every
    worker is done with the buffer two before it; returns the bytes sent."""
    start = sent = 0
    for number, count in enumerate(lengths):
        if number >= 2:  # the collectives run in the same order on every rank: signal n-1, done n-2, signal n
            _done(group).wait()
        pieces = [collective._as_bytes(tensor) for _, tensor in weights[start : start + count]]
        size = sum(piece.numel() for piece in pieces)
        collective.pack(pieces, slots.view(number % 2, size))
        _signal(group, number, size)[1].wait()
        start, sent = start + count, sent + size
    for _ in range(min(2, len(lengths))):  # the last two buffers
        _done(group).wait()
    if start != len(weights):
        raise ValueError(f"the buffers' lengths {lengths} cover {start} tensors, not the {len(weights)} sent")
    return sent


def receive_shared(
    group,
    names: list[str],
    dtypes: list[torch.dtype],
    shapes: list[list[int]],
    lengths: list[int],
    load: Callable[[list[tuple[str, torch.Tensor]]], object],
    slots: SharedSlots,
) -> int:
    """`collective.receive_packed` for what `send_shared` sends: each buffer copied out of its file, the file handed
    back, then `load` called on views into the copy while the trainer packs the next; returns the bytes received."""
    if sum(lengths) != len(names) or any(count <= 0 for count in lengths):
        raise ValueError(f"buffer lengths {lengths} do not cut {len(names)} tensors into non-empty buffers")
    sizes = [math.prod(shape) * dtype.itemsize for shape, dtype in zip(shapes, dtypes)]
    starts = [sum(lengths[:number]) for number in range(len(lengths))]
    plan = [sizes[start : start + count] for start, count in zip(starts, lengths)]
    own = collective._Slots()  # this worker's two receive buffers
    signals = [_signal(group, number, 0) for number in range(min(2, len(plan)))]  # filled in by rank 0
    pending = []
    received = 0
    for number, (start, buffer_sizes) in enumerate(zip(starts, plan)):
        token, work = signals[number]
        work.wait()
        size = sum(buffer_sizes)
        if token.tolist() != [number, size]:
            raise RuntimeError(
                f"the trainer announced buffer {token.tolist()} ([number, bytes]) where this worker expected "
                f"{[number, size]}: the trainer and the server run different gspo-trl versions"
            )
        buffer = own.take(number % 2, size)
        buffer.copy_(slots.view(number % 2, size))
        pending.append(_done(group))
        if number + 2 < len(plan):
            signals.append(_signal(group, number + 2, 0))
        end = start + len(buffer_sizes)
        load(
            [
                (name, view.view(dtype).view(shape))
                for name, dtype, shape, view in zip(
                    names[start:end], dtypes[start:end], shapes[start:end], buffer.split(buffer_sizes)
                )
            ]
        )
        received += size
    for work in pending:  # (after a failure the caller drops the group instead)
        work.wait()
    return received

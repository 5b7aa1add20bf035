"""The engine's packed buffers through shared memory, when the server's workers read the trainer's snapshot folder.

Over gloo each buffer crosses the kernel's sockets (one copy in, one copy out, in small pieces); on one machine that,
not the load, bounds a sync. When the workers see the trainer's snapshot folder (by default in /dev/shm: RAM), the
trainer packs each buffer into one of two files there instead (their space reserved, so a full /dev/shm is an error,
not a crash), and the group carries only signals, as NCCL does within a
node: rank 0 broadcasts "buffer n is in file n % 2" (its number and size, which each worker checks against the
update's plan), each worker reads it into its own receive buffer (a read, no mapping: nothing the trainer does to the
file later reaches the worker's memory) and joins an all-reduce, and the trainer packs
buffer n + 2 into that file only once that all-reduce is done. Each worker then loads from its own copy while the
next buffer is packed. The files go with the snapshot folder (`folders`: removed with the backend, on SIGTERM, or by
the next run after a kill).
Imports torch, numpy, the standard library, `collective` and `folders` only (the worker extension loads it inside vLLM).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import stat
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
    """What the trainer adds to the engine's init info: the folder its buffers would pass through, and its host;
    with it (only then) both sides choose together right after joining (`trainer_agrees`, `worker_agrees`)."""
    return {"shared_dir": folder, "host_id": host_id()} if folder else {}


def _all_agree(group, willing: bool) -> bool:
    """Whether every rank of `group` is `willing` (each rank calls it once, right after joining)."""
    options = torch.distributed.AllreduceOptions()
    options.reduceOp = torch.distributed.ReduceOp.MIN
    flag = torch.tensor([int(willing)], dtype=torch.int64)
    group.allreduce([flag], options).wait()
    return bool(flag.item())


def trainer_agrees(group, slots: SharedSlots) -> SharedSlots | None:
    """The trainer's side of the choice, made with every worker in the group once it offered `slots` (`offer`):
    them if all can use them."""
    return slots if _all_agree(group, True) else None


def worker_agrees(group, shared_dir: str, trainer_host: str) -> SharedSlots | None:
    """A worker's side of the choice, when the trainer offered a folder (`offer`; else there is no choice to make):
    it takes part if the folder is one this server allows, on this very host; the buffers pass through files only
    if every worker does."""
    if not shared_dir:
        return None
    slots = None
    if trainer_host and trainer_host == host_id():
        try:
            slots = SharedSlots(shared_dir, writer=False)
        except Exception:  # whatever the path or the folder: the buffers then go through the group
            slots = None
    return slots if _all_agree(group, slots is not None) else None


class SharedSlots:
    """The two buffer files in `folder`: mapped and written by the trainer (`writer`), which reserves their space as
    they grow; read by a worker, which opens only regular files of a snapshot folder the server allows, through a
    descriptor of that folder taken once (never following a link, never creating a file)."""

    def __init__(self, folder: str, writer: bool):
        self.writer = writer
        self.folder = folder if writer else folders.snapshot_folder(folder)
        flags = os.O_RDONLY | os.O_DIRECTORY | (0 if writer else os.O_NOFOLLOW)
        self.folder_fd = os.open(self.folder, flags)
        self.maps: list[torch.Tensor | None] = [None, None]  # the writer's mappings

    def __del__(self):
        with contextlib.suppress(AttributeError, OSError):
            os.close(self.folder_fd)

    def _open(self, index: int) -> int:
        if self.writer:
            return os.open(FILE_NAMES[index], os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600, dir_fd=self.folder_fd)
        descriptor = os.open(FILE_NAMES[index], os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=self.folder_fd)
        if not stat.S_ISREG(os.fstat(descriptor).st_mode):  # a FIFO or a device would block or never end
            os.close(descriptor)
            raise ValueError(f"{self.folder}/{FILE_NAMES[index]} is not a regular file")
        return descriptor

    def view(self, index: int, size: int) -> torch.Tensor:
        """The writer's first `size` bytes of file `index`, grown (its space reserved) and mapped again if smaller."""
        held = self.maps[index]
        if held is None or held.numel() < size:
            descriptor = self._open(index)
            try:
                length = max(size, os.fstat(descriptor).st_size, 1)
                try:
                    os.posix_fallocate(descriptor, 0, length)  # ENOSPC here, rather than SIGBUS on a write later
                except OSError as error:
                    raise OSError(
                        error.errno,
                        f"no room for a {length}-byte weight buffer in {self.folder} ({error.strerror}): free space "
                        "there (a container's /dev/shm is often 64 MiB: `--shm-size`) or set vllm_weight_sync_dir",
                    ) from error
                held = torch.frombuffer(mmap.mmap(descriptor, length, access=mmap.ACCESS_WRITE), dtype=torch.uint8)
            finally:
                os.close(descriptor)
            self.maps[index] = held  # an older, smaller mapping is unmapped once no view of it is left
        return held[:size]

    def read_into(self, index: int, target: torch.Tensor) -> None:
        """A worker's read of the first `target.numel()` bytes of file `index` into `target`."""
        descriptor = self._open(index)
        try:
            out, done = memoryview(target.numpy()), 0
            while done < len(out):
                count = os.preadv(descriptor, [out[done:]], done)
                if count == 0:
                    raise ValueError(
                        f"{self.folder}/{FILE_NAMES[index]} holds {done} bytes, not the {len(out)} of the buffer "
                        "announced"
                    )
                done += count
        finally:
            os.close(descriptor)


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
    starts, plan = collective.buffer_plan(dtypes, shapes, lengths)
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
        slots.read_into(number % 2, buffer)
        pending.append(_done(group))
        if number + 2 < len(plan):
            signals.append(_signal(group, number + 2, 0))
        load(collective.buffer_views(buffer, buffer_sizes, start, names, dtypes, shapes))
        received += size
    for work in pending:  # (after a failure the caller drops the group instead)
        work.wait()
    return received

"""CPU training memory: keep freed memory in the process instead of handing it back every step.

PyTorch on CPU allocates activations, gradients and KV caches with plain `malloc`. glibc serves
large blocks with fresh `mmap` pages and returns them on `free`, so every training step faults in
(and zeroes) gigabytes of new pages again; on a 2-core machine that cost a third of the training
phase (docs/design/performance.md). Asking glibc to serve everything from its heap and not trim it plays
the part that PyTorch's caching allocator plays on GPUs. What this module does not own: any
tensor, and anything on GPUs or non-glibc systems (there it does nothing).
"""

from __future__ import annotations

import ctypes
import ctypes.util

# mallopt parameters from glibc's <malloc.h>
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
TRIM_THRESHOLD_BYTES = 2**31 - 1  # the largest int: only trim when more than 2 GiB sit free at the top


def pool_freed_memory() -> bool:
    """Make glibc keep freed memory for reuse (no mmap-backed blocks, no trimming). Process-wide.

    Returns True if glibc accepted both settings, False where there is no glibc `mallopt` (macOS,
    Windows, musl) or it refused them; then nothing changed.
    """
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return bool(mallopt(M_MMAP_MAX, 0)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES))

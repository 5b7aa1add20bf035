"""The compiled attention kernel of one-token decoding steps on CPU (`csrc/decode_attention.c`).

PyTorch's CPU SDPA reads a decoding step's KV cache at 10-16 GB/s on the 2-core EPYC, where its memory gives about
30: at the end of a long rollout, where a few rows decode over thousands of positions, attention is a third of a
step. The C loop reads the cache near the memory bandwidth (docs/benchmarks.md, "Attention at the memory
bandwidth"). It is compiled once per machine with the C compiler that is there (`$CC`, else `cc`), for that CPU
(`-march=native`), into gspo-trl's cache folder, and loaded with ctypes; its threads are PyTorch's own OpenMP
threads where PyTorch ships its OpenMP runtime. Without a compiler, or where the build fails, `attention()` returns
None once a warning has said why, and the caller keeps SDPA. `GSPO_TRL_DECODE_KERNEL=0` switches it off.

Owns building, loading and calling the kernel. What it does not own: when a step may use it (`decode_attention`).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch
from transformers.utils import logging

from .default_model import cache_root

logger = logging.get_logger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "decode_attention.c"
MAX_GROUP, MAX_HEAD_DIM = 16, 256  # the C file's array bounds
CHUNK = 256  # positions per work item: one row of 4,000 positions is 16 items per key/value head

# Switched off by benchmarks that time SDPA (A/B in one process) and by GSPO_TRL_DECODE_KERNEL=0.
enabled = os.environ.get("GSPO_TRL_DECODE_KERNEL", "1") != "0"

_library: ctypes.CDLL | None = None
_tried = False
_lock = threading.Lock()


def attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None,
              scale: float) -> torch.Tensor | None:
    """softmax(q kᵀ · scale) v for query (rows, kv_heads, group, head_dim) over keys and values (rows, kv_heads,
    positions, head_dim), with `mask` None or a boolean (rows, 1, 1, positions) where True attends: SDPA's result
    within float rounding. None where the kernel is not built or the tensors are not what it reads (fp32 on CPU,
    contiguous heads), and the caller computes it."""
    if not enabled or not applies(query, keys, values, mask):
        return None
    library = _load()
    if library is None:
        return None
    rows, kv_heads, group, head_dim = query.shape
    length = keys.shape[2]
    chunks = (length + CHUNK - 1) // CHUNK
    out = torch.empty_like(query)
    scratch = torch.empty(rows * kv_heads * chunks * group * (head_dim + 2))
    attends = None if mask is None else mask[:, 0, 0].view(torch.uint8)  # (rows, positions), a view
    library.decode_attention(
        query.data_ptr(), keys.data_ptr(), values.data_ptr(), keys.stride(0), keys.stride(1), keys.stride(2),
        None if attends is None else attends.data_ptr(), 0 if attends is None else attends.stride(0),
        out.data_ptr(), rows, kv_heads, group, head_dim, length, scale, CHUNK, scratch.data_ptr(),
        torch.get_num_threads())
    return out


def applies(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None) -> bool:
    """Whether the kernel reads these tensors as they are (no copy, no autograd)."""
    if query.dim() != 4 or keys.dim() != 4 or keys.shape != values.shape or keys.stride() != values.stride():
        return False
    rows, kv_heads, group, head_dim = query.shape
    if (keys.shape[0] != rows or keys.shape[1] != kv_heads or keys.shape[3] != head_dim or keys.shape[2] < 1
            or not 1 <= group <= MAX_GROUP or not 1 <= head_dim <= MAX_HEAD_DIM):
        return False
    tensors = (query, keys, values)
    if (any(t.dtype != torch.float32 or t.device.type != "cpu" or t.requires_grad for t in tensors)
            or not query.is_contiguous() or keys.stride(3) != 1 or torch.is_grad_enabled()):
        return False
    if mask is None:
        return True
    return (mask.dtype == torch.bool and mask.dim() == 4 and mask.shape[1:3] == (1, 1)
            and mask.shape[0] == rows and mask.shape[3] == keys.shape[2] and mask.stride(3) == 1)


def available() -> bool:
    """Whether the kernel is built and loaded here (building it on the first call)."""
    return enabled and _load() is not None


def _load() -> ctypes.CDLL | None:
    global _library, _tried
    if _tried:
        return _library
    with _lock:
        if not _tried:
            try:
                _library = _bind(ctypes.CDLL(str(_build())))
            except (OSError, subprocess.SubprocessError, RuntimeError) as error:
                logger.warning(f"gspo-trl's decoding attention kernel is not available ({error}); decoding steps use "
                               "PyTorch's SDPA. Install a C compiler (e.g. gcc) for it, or set "
                               "GSPO_TRL_DECODE_KERNEL=0 to silence this.")
            _tried = True
    return _library


def _bind(library: ctypes.CDLL) -> ctypes.CDLL:
    pointer, int64, int32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    library.decode_attention.argtypes = [pointer, pointer, pointer, int64, int64, int64, pointer, int64, pointer,
                                         int32, int32, int32, int32, int64, ctypes.c_float, int32, pointer, int32]
    library.decode_attention.restype = None
    return library


def compile_command(source: Path, target: Path) -> list[str]:
    """The compiler call: `-march=native` (this CPU's vector units), sums reassociated into vector lanes (1.4x the
    speed of in-order sums here), OpenMP threads from PyTorch's own runtime where it ships one (a second OpenMP
    runtime in the process would spin threads against PyTorch's), else one thread."""
    # Sums in vector lanes, but not -ffast-math: its startup code would set flush-to-zero for the whole process.
    command = [*shlex.split(os.environ.get("CC", "cc")), "-O3", "-march=native", "-fno-math-errno",
               "-fno-trapping-math", "-fno-signed-zeros", "-fassociative-math", "-shared", "-fPIC", str(source),
               "-o", str(target)]
    torch_lib = Path(torch.__file__).parent / "lib"
    if (torch_lib / "libgomp.so.1").exists():
        command += ["-fopenmp", f"-L{torch_lib}", f"-Wl,-rpath,{torch_lib}", "-lgomp"]
    else:
        command += ["-fopenmp-simd"]
    return command


def _build() -> Path:
    """The compiled library in the cache, built if this source, compiler call and CPU have none yet."""
    compiler = shlex.split(os.environ.get("CC", "cc"))[0]
    if shutil.which(compiler) is None:
        raise RuntimeError(f"no C compiler {compiler!r} on PATH")
    source = SOURCE.read_bytes()
    key = hashlib.sha256(source + " ".join(compile_command(Path("src"), Path("lib"))).encode()
                         + _cpu_identity().encode()).hexdigest()[:16]
    target = cache_root() / "kernels" / f"decode_attention-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as folder:  # built aside, then moved in whole
        built = Path(folder) / target.name
        completed = subprocess.run(compile_command(SOURCE, built), capture_output=True, text=True, timeout=120)
        if completed.returncode != 0:
            raise RuntimeError(f"compiling {SOURCE.name} failed: {completed.stderr.strip()[-500:]}")
        os.replace(built, target)
    return target


def _cpu_identity() -> str:
    """What `-march=native` compiles for: the CPU's model and feature flags (one cache shared by machines must not
    hand one CPU's build to another)."""
    try:
        with open("/proc/cpuinfo") as info:
            lines = [line for line in info if line.startswith(("model name", "flags", "Features", "CPU part"))]
        return "".join(sorted(set(lines)))
    except OSError:
        return platform.processor() + platform.machine()

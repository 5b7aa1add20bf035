"""The compiled kernels of one-token decoding steps on CPU: the packed attention (`csrc/decode_attention.c`), the
product of a weight with one to eight rows (`csrc/decode_linear.c`), and the rotary embedding with the cache write
(`csrc/decode_rotary.c`).

PyTorch's CPU SDPA reads a decoding step's KV cache at 10-16 GB/s on the 2-core EPYC, where its memory gives about
30, and MKL reads the weights of a one- or two-row product at two thirds of that at best: at the end of a long
rollout, where a few rows decode alone, both are far from the hardware. The C loops read near the memory bandwidth
(docs/design/performance.md); the rotary loop replaces some 18 small operators per layer with one call. They are
compiled once per machine with the C compiler that is there (`$CC`, else `cc`), for that CPU (`-march=native`), into
one library in the user's gspo-trl cache folder, named by a hash of the sources, the compiler calls and the CPU
(builds no process has loaded for `UNUSED_DAYS` are removed when a new one is built), and loaded with ctypes, never
from a folder or file another user can write. Their threads are PyTorch's own OpenMP threads: the library links the
OpenMP runtime PyTorch loaded, where PyTorch reports OpenMP and the compiler takes `-fopenmp`; elsewhere they run on
one thread, which a warning says once. Without a compiler, or where the build fails, `available()` is False once a
warning has said why, and the callers keep PyTorch's operators.

Owns building, loading and calling the kernels. What it does not own: whether a decoding loop uses them
(`CPUKernels.compiled`, from `GSPOConfig.cpu_decoding_kernels`) and when a step may (`attention`, which times the
kernel against SDPA; `linear`, which times the product against its other forms; `forward`, which checks the rotary
loop against the model's own function before it uses it).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import torch
from transformers.utils import logging

from ....models.cache import cache_root

logger = logging.get_logger(__name__)

SOURCES = tuple(
    Path(__file__).with_name("csrc") / name for name in ("decode_attention.c", "decode_linear.c", "decode_rotary.c")
)
MAX_GROUP, MAX_HEAD_DIM = 16, 256  # decode_attention.c's array bounds
MAX_LINEAR_ROWS = 8  # decode_linear.c's row counts: 1 to 8
# Each source's own flags: the attention's sums reassociated; the rotary arithmetic rounded as PyTorch's operators round
# it (no fused multiply-add).
SOURCE_FLAGS = {"decode_attention.c": ["-fassociative-math"], "decode_rotary.c": ["-ffp-contract=off"]}
CHUNK = 256  # positions per work item: one row of 4,000 positions is 16 items per key/value head

_library: ctypes.CDLL | None = None
_tried = False
_lock = threading.Lock()


def attention(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> torch.Tensor | None:
    """softmax(q kᵀ · scale) v for query (rows, kv_heads, group, head_dim) over keys and values (rows, kv_heads,
    positions, head_dim), with `mask` None or a boolean (rows, 1, 1, positions) where True attends: SDPA's result
    within float rounding. None where the kernel is not built or the tensors are not what it reads (fp32 on CPU,
    contiguous heads), and the caller computes it."""
    if not applies(query, keys, values, mask):
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
        query.data_ptr(),
        keys.data_ptr(),
        values.data_ptr(),
        keys.stride(0),
        keys.stride(1),
        keys.stride(2),
        None if attends is None else attends.data_ptr(),
        0 if attends is None else attends.stride(0),
        out.data_ptr(),
        rows,
        kv_heads,
        group,
        head_dim,
        length,
        scale,
        CHUNK,
        scratch.data_ptr(),
        torch.get_num_threads(),
    )
    return out


def applies(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None) -> bool:
    """Whether the kernel reads these tensors as they are (no copy, no autograd)."""
    if query.dim() != 4 or keys.dim() != 4 or keys.shape != values.shape or keys.stride() != values.stride():
        return False
    rows, kv_heads, group, head_dim = query.shape
    if (
        keys.shape[0] != rows
        or keys.shape[1] != kv_heads
        or keys.shape[3] != head_dim
        or keys.shape[2] < 1
        or not 1 <= group <= MAX_GROUP
        or not 1 <= head_dim <= MAX_HEAD_DIM
    ):
        return False
    tensors = (query, keys, values)
    if (
        any(t.dtype != torch.float32 or t.device.type != "cpu" or t.requires_grad for t in tensors)
        or not query.is_contiguous()
        or keys.stride(3) != 1
        or torch.is_grad_enabled()
    ):
        return False
    if mask is None:
        return True
    return (
        mask.dtype == torch.bool
        and mask.dim() == 4
        and mask.shape[1:3] == (1, 1)
        and mask.shape[0] == rows
        and mask.shape[3] == keys.shape[2]
        and mask.stride(3) == 1
    )


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, checked: bool = False
) -> torch.Tensor | None:
    """`F.linear(x, weight, bias)` for x (rows, in) with 1 to `MAX_LINEAR_ROWS` rows, within float rounding: a new
    contiguous (rows, out). None where the kernel is not built or the tensors are not what it reads (fp32 on CPU,
    contiguous, no autograd), and the caller computes it. `checked`: the caller knows `linear_applies` holds and the
    kernel is built (a decoding step's own rows and weights, about 4 µs of checks less per product)."""
    library = _library if checked else None
    if library is None:
        if not linear_applies(x, weight, bias):
            return None
        library = _load()
        if library is None:
            return None
    out = torch.empty(x.shape[0], weight.shape[0])
    failed = library.decode_linear(
        weight.data_ptr(),
        x.data_ptr(),
        None if bias is None else bias.data_ptr(),
        out.data_ptr(),
        weight.shape[0],
        weight.shape[1],
        x.shape[0],
        torch.get_num_threads(),
    )
    return None if failed else out  # failed: a row count it does not compute (nothing written)


def linear_applies(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether the product kernel reads these tensors as they are (no copy, no autograd)."""
    tensors = (x, weight) if bias is None else (x, weight, bias)
    return (
        x.dim() == 2
        and weight.dim() == 2
        and 1 <= x.shape[0] <= MAX_LINEAR_ROWS
        and x.shape[1] == weight.shape[1]
        and weight.shape[0] > 0
        and (bias is None or bias.shape == (weight.shape[0],))
        and all(t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous() for t in tensors)
        and not torch.is_grad_enabled()
    )


def rotary(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    query_out: torch.Tensor,
    key_slot: torch.Tensor,
    value_slot: torch.Tensor,
) -> bool:
    """transformers' `apply_rotary_pos_emb` for one new position per row, bit for bit, and the cache write: the
    rotated `query` (rows, heads, head_dim) into `query_out` (same shape), the rotated `key` and the `value` (rows,
    kv_heads, head_dim) into `key_slot` and `value_slot` (rows, kv_heads, head_dim views of the cache's new
    position); `cos` and `sin` (rows, head_dim). All fp32 on CPU; the inputs and `query_out` contiguous, the slots
    with contiguous heads and one stride. False (nothing written) where the kernel is not built or the tensors are
    not what it reads, and the caller computes it."""
    rows, heads, head_dim = query.shape
    kv_heads = key.shape[1]
    tensors = (query, key, value, cos, sin, query_out, key_slot, value_slot)
    if (
        head_dim % 2
        or key.shape != (rows, kv_heads, head_dim)
        or value.shape != key.shape
        or cos.shape != (rows, head_dim)
        or sin.shape != cos.shape
        or query_out.shape != query.shape
        or key_slot.shape != key.shape
        or value_slot.shape != key.shape
        or key_slot.stride() != value_slot.stride()
        or key_slot.stride(2) != 1
        or any(t.dtype != torch.float32 or t.device.type != "cpu" for t in tensors)
        or not all(t.is_contiguous() for t in tensors[:6])
        or torch.is_grad_enabled()
    ):
        return False
    library = _load()
    if library is None:
        return False
    library.decode_rotary(
        *(t.data_ptr() for t in tensors), key_slot.stride(0), key_slot.stride(1), rows, heads, kv_heads, head_dim
    )
    return True


def available() -> bool:
    """Whether the kernel is built and loaded here (building it on the first call)."""
    return _load() is not None


def _load() -> ctypes.CDLL | None:
    global _library, _tried
    if _tried:
        return _library
    with _lock:
        if not _tried:
            try:
                _library = _bind(ctypes.CDLL(str(_build())))
            except (OSError, subprocess.SubprocessError, RuntimeError) as error:
                logger.warning(
                    f"gspo-trl's decoding kernels are not available ({error}); decoding steps use "
                    "PyTorch's SDPA and products. Install a C compiler (e.g. gcc) for them, or set "
                    "cpu_decoding_kernels='off' to silence this."
                )
            else:
                one_thread = _openmp(tuple(_compiler()))[1]
                if one_thread is not None:
                    logger.warning(f"gspo-trl's decoding kernels run on one thread: {one_thread}.")
            _tried = True
    return _library


def _bind(library: ctypes.CDLL) -> ctypes.CDLL:
    pointer, int64, int32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    library.decode_attention.argtypes = [
        pointer,
        pointer,
        pointer,
        int64,
        int64,
        int64,
        pointer,
        int64,
        pointer,
        int32,
        int32,
        int32,
        int32,
        int64,
        ctypes.c_float,
        int32,
        pointer,
        int32,
    ]
    library.decode_attention.restype = None
    library.decode_linear.argtypes = [pointer, pointer, pointer, pointer, int64, int64, int32, int32]
    library.decode_linear.restype = int32
    library.decode_rotary.argtypes = [pointer] * 8 + [int64, int64, int32, int32, int32, int32]
    library.decode_rotary.restype = None
    return library


def _compiler() -> list[str]:
    return shlex.split(os.environ.get("CC", "cc"))


def compile_commands(folder: Path, target: Path) -> list[list[str]]:
    """The compiler calls: each source into an object in `folder`, then the objects into the library `target`.
    `-march=native` (this CPU's vector units); the attention's sums reassociated into vector lanes (1.4x the speed
    of in-order sums here), the product's kept in its lanes' order (as fast, and a row's result then does not depend
    on the rows beside it), the rotary embedding's without fused multiply-adds (PyTorch's rounding); OpenMP threads
    from the runtime PyTorch loaded, linked by its path (a second OpenMP runtime in the process would spin threads
    against PyTorch's), else one thread (`openmp_runtime`)."""
    compiler = _compiler()
    # Not -ffast-math: its startup code would set flush-to-zero for the whole process.
    flags = ["-O3", "-march=native", "-fno-math-errno", "-fno-trapping-math", "-fno-signed-zeros", "-fPIC"]
    runtime, _ = _openmp(tuple(compiler))
    flags.append("-fopenmp" if runtime is not None else "-fopenmp-simd")
    objects = [folder / f"{source.stem}.o" for source in SOURCES]
    commands = [
        [*compiler, *flags, *SOURCE_FLAGS.get(source.name, []), "-c", str(source), "-o", str(built)]
        for source, built in zip(SOURCES, objects)
    ]
    link = [*compiler, "-shared", *map(str, objects), "-o", str(target)]
    if runtime is not None:  # not -fopenmp here: the compiler would add its own runtime
        link += [str(runtime), f"-Wl,-rpath,{runtime.parent}"]
    return [*commands, link]


OPENMP_RUNTIMES = ("libgomp", "libiomp5", "libomp")  # GNU's, Intel's, LLVM's (the last two take GNU's calls too)


def openmp_runtime() -> tuple[Path | None, str | None]:
    """The OpenMP runtime PyTorch runs its own threads on, as a path to link the kernels against, and None or why
    there is none: PyTorch must report OpenMP (`torch.backends.openmp.is_available()` and "parallel backend: OpenMP"
    in `torch.__config__.parallel_info()`), and the runtime it loaded is the one among the files this process maps
    (`/proc/self/maps`, Linux)."""
    if not torch.backends.openmp.is_available():
        return None, "this PyTorch build has no OpenMP"
    if "parallel backend: OpenMP" not in torch.__config__.parallel_info():
        return None, "PyTorch's parallel backend is not OpenMP"
    try:
        with open("/proc/self/maps") as maps:
            mapped = {line.split(maxsplit=5)[5].strip() for line in maps if len(line.split(maxsplit=5)) == 6}
    except OSError:
        return None, "the OpenMP runtime PyTorch loaded is not found (no /proc/self/maps)"
    runtimes = sorted(Path(name) for name in mapped if Path(name).name.split(".so")[0].split("-")[0] in OPENMP_RUNTIMES)
    if len(runtimes) > 1:  # another library brought its own: PyTorch's is the one shipped beside it, if any
        torch_folder = Path(torch.__file__).parent.parent
        runtimes = [runtime for runtime in runtimes if runtime.is_relative_to(torch_folder)]
    if len(runtimes) != 1:
        return None, f"not one OpenMP runtime PyTorch loaded among this process's libraries: {runtimes}"
    return runtimes[0], None


def compiler_takes_openmp(compiler: tuple[str, ...]) -> bool:
    """Whether `compiler` compiles an OpenMP loop with `-fopenmp` (Apple's clang, for one, does not)."""
    with tempfile.TemporaryDirectory() as folder:
        source = Path(folder) / "probe.c"
        source.write_text(
            "int probe(int n) {\n    int sum = 0;\n#pragma omp parallel for reduction(+ : sum)\n"
            "    for (int i = 0; i < n; i++) sum += i;\n    return sum;\n}\n"
        )
        try:
            completed = subprocess.run(
                [*compiler, "-fopenmp", "-fPIC", "-c", str(source), "-o", str(source.with_suffix(".o"))],
                capture_output=True,
                timeout=60,
            )
        except (OSError, subprocess.SubprocessError):
            return False
    return completed.returncode == 0


@functools.cache
def _openmp(compiler: tuple[str, ...]) -> tuple[Path | None, str | None]:
    """`openmp_runtime()` where `compiler` takes `-fopenmp`, else None and why (checked once per compiler)."""
    runtime, reason = openmp_runtime()
    if runtime is not None and not compiler_takes_openmp(compiler):
        return None, f"the C compiler {' '.join(compiler)!r} does not compile OpenMP (-fopenmp)"
    return runtime, reason


def _build() -> Path:
    """The compiled library in the cache, built if these sources, compiler calls and CPU have none yet."""
    compiler = _compiler()[0]
    if shutil.which(compiler) is None:
        raise RuntimeError(f"no C compiler {compiler!r} on PATH")
    sources = b"".join(source.read_bytes() for source in SOURCES)
    calls = " ".join(" ".join(command) for command in compile_commands(Path("build"), Path("lib")))
    key = hashlib.sha256(
        sources + calls.replace(str(SOURCES[0].parent), "csrc").encode() + _cpu_identity().encode()
    ).hexdigest()[:16]
    target = cache_root() / "kernels" / f"decode_kernels-{key}.so"
    target.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    _refuse_if_others_can_write(target.parent)
    if target.exists():
        _refuse_if_others_can_write(target)
        _mark_used(target)
        return target
    _prune(target.parent)
    with tempfile.TemporaryDirectory(dir=target.parent) as folder:  # built aside, then moved in whole
        built = Path(folder) / target.name
        for command in compile_commands(Path(folder), built):
            completed = subprocess.run(command, capture_output=True, text=True, timeout=120)
            if completed.returncode != 0:
                raise RuntimeError(
                    f"compiling {' and '.join(source.name for source in SOURCES)} failed: "
                    f"{completed.stderr.strip()[-500:]}"
                )
        os.chmod(built, 0o755)  # whatever the umask: only its owner may write it (checked when loading)
        os.replace(built, target)
    return target


def _refuse_if_others_can_write(path: Path) -> None:
    """A RuntimeError (the kernels then stay off) when `path` belongs to another user or others may write to it:
    a library loaded from there would run whatever someone else put in it."""
    if not hasattr(os, "getuid"):
        return
    info = path.stat()
    if info.st_uid != os.getuid() or info.st_mode & 0o022:
        raise RuntimeError(
            f"{path} is writable by other users or owned by another; not loading compiled code from it "
            "(set GSPO_TRL_CACHE to a folder of your own)"
        )


# A build no process has loaded for this long (another gspo-trl version's, another CPU's in a shared cache) is
# removed when a new one is built; loading one marks it used (its modification time).
UNUSED_DAYS = 30


def _mark_used(library: Path) -> None:
    try:
        os.utime(library)
    except OSError:  # a cache this process may read but not write
        pass


def _prune(folder: Path) -> None:
    cutoff = time.time() - UNUSED_DAYS * 86400
    for library in folder.glob("decode_kernels-*.so"):
        try:
            if library.stat().st_mtime < cutoff:
                library.unlink()
        except OSError:  # removed by another process meanwhile, or not ours to remove
            pass


def _cpu_identity() -> str:
    """What `-march=native` compiles for: the CPU's model and feature flags (one cache shared by machines must not
    hand one CPU's build to another)."""
    try:
        with open("/proc/cpuinfo") as info:
            lines = [line for line in info if line.startswith(("model name", "flags", "Features", "CPU part"))]
        return "".join(sorted(set(lines)))
    except OSError:
        return platform.processor() + platform.machine()

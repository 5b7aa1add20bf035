"""gspo_trl.rollout.decoding.cpu.kernel: the compiled attention of one-token decoding steps equals SDPA's within float
rounding
(shapes, strided cache views, masks, scores far apart), the compiled few-row product `F.linear`'s (row counts, widths,
bias, one thread), and the rotary loop transformers' rotation bit for bit, written into the cache's slot; each leaves
every other input to PyTorch; the library is built once per source and CPU into the user's cache, never loaded from
a folder others can write, its threads PyTorch's OpenMP runtime as PyTorch and the compiler report it (one thread,
said once, elsewhere); and where it cannot be built both fall back with a warning."""

from __future__ import annotations

import logging
import os
import shlex
import subprocess
import time
from pathlib import Path

import pytest
import torch
import transformers

from gspo_trl.rollout.decoding.cpu import kernel as decode_kernel
from gspo_trl.rollout.decoding.cpu.attention import SDPA, Attend, KernelChoice


@pytest.fixture()
def fresh_kernel(monkeypatch, tmp_path):
    """The kernel as if this process had not loaded it yet, built into an empty cache."""
    monkeypatch.setattr(decode_kernel, "_library", None)
    monkeypatch.setattr(decode_kernel, "_tried", False)
    monkeypatch.setattr(decode_kernel, "cache_root", lambda: tmp_path)


def step_inputs(rows, kv_heads, group, head_dim, length, room=0, seed=0):
    """A step's packed query and its cache as the loop holds it: views of buffers with `room` spare positions."""
    generator = torch.Generator().manual_seed(seed)
    query = torch.randn(rows, kv_heads, group, head_dim, generator=generator)
    keys = torch.randn(rows, kv_heads, length + room, head_dim, generator=generator)[:, :, :length]
    values = torch.randn(rows, kv_heads, length + room, head_dim, generator=generator)[:, :, :length]
    return query, keys, values


def sdpa(query, keys, values, mask, scale):
    return torch.nn.functional.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=scale)


def test_the_kernel_builds_here():
    # CI's machine has a C compiler: a broken build must fail here, not quietly fall back to SDPA everywhere
    assert decode_kernel.available()


@pytest.mark.parametrize(
    "rows,kv_heads,group,head_dim,length",
    [
        (1, 3, 3, 64, 1),
        (1, 3, 3, 64, 255),
        (1, 3, 3, 64, 257),
        (2, 3, 3, 64, 1000),
        (5, 2, 4, 128, 300),
        (3, 4, 1, 32, 77),
        (64, 3, 3, 64, 100),
        (2, 1, 16, 256, 40),
    ],
)
@pytest.mark.parametrize("masked", [False, True])
@torch.no_grad()
def test_attends_like_sdpa(rows, kv_heads, group, head_dim, length, masked):
    query, keys, values = step_inputs(rows, kv_heads, group, head_dim, length, room=7)
    mask = None
    if masked:  # left padding in row 0 (and holes, as rows of different prompts leave), the last position kept
        mask = torch.ones(rows, 1, 1, length, dtype=torch.bool)
        mask[0, ..., : length // 2] = False
        mask[-1, ..., : length - 1 : 3] = False
    got = decode_kernel.attention(query, keys, values, mask, 0.125)
    assert got is not None and got.shape == query.shape
    torch.testing.assert_close(got, sdpa(query, keys, values, mask, 0.125), rtol=1e-5, atol=2e-6)


@torch.no_grad()
def test_scores_far_apart_and_one_thread():
    # exp() of scores 100+ below the maximum underflows to ~0 as in SDPA; one thread gives the same result
    query, keys, values = step_inputs(2, 3, 3, 64, 600)
    query = query * 30
    expected = sdpa(query, keys, values, None, 0.125)
    torch.testing.assert_close(
        decode_kernel.attention(query, keys, values, None, 0.125), expected, rtol=1e-5, atol=2e-6
    )
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one_thread = decode_kernel.attention(query, keys, values, None, 0.125)
    finally:
        torch.set_num_threads(threads)
    torch.testing.assert_close(one_thread, expected, rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("rows", range(1, decode_kernel.MAX_LINEAR_ROWS + 1))
@pytest.mark.parametrize("out_features,in_features", [(80, 48), (7, 576), (1536, 576), (576, 1536), (33, 1)])
@pytest.mark.parametrize("bias", [False, True])
@torch.no_grad()
def test_products_like_f_linear(rows, out_features, in_features, bias):
    # widths below, at and past the 16 lanes and not a multiple of them; a new contiguous (rows, out)
    generator = torch.Generator().manual_seed(rows)
    weight = torch.randn(out_features, in_features, generator=generator)
    x = torch.randn(rows, in_features, generator=generator)
    b = torch.randn(out_features, generator=generator) if bias else None
    got = decode_kernel.linear(x, weight, b)
    assert got is not None and got.shape == (rows, out_features) and got.is_contiguous()
    # as close to the exact product (float64) as F.linear itself is: another summation order of the same numbers
    exact = torch.nn.functional.linear(x.double(), weight.double(), None if b is None else b.double())
    error, f_linear_error = (
        (product.double() - exact).abs().max().item() for product in (got, torch.nn.functional.linear(x, weight, b))
    )
    assert error <= 2 * f_linear_error + 1e-6, (error, f_linear_error)


@torch.no_grad()
def test_products_are_the_same_on_any_thread_count_and_row_slot():
    # each output is one thread's sum in one order: bit for bit the same on one thread, and a row's result does not
    # depend on the rows beside it (the decoding loop's rows leave the batch)
    weight, x = torch.randn(1536, 576), torch.randn(5, 576)
    expected = decode_kernel.linear(x, weight, None)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(decode_kernel.linear(x, weight, None), expected)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(decode_kernel.linear(x[2:3], weight, None), expected[2:3])


@pytest.mark.parametrize(
    "case",
    ["nine rows", "no rows", "bf16", "autograd", "row view", "weight view", "bias shape", "width mismatch"],
)
def test_other_products_are_left_to_pytorch(case, monkeypatch):
    rows = {"nine rows": 9, "no rows": 0}.get(case, 2)
    weight, x, bias = torch.randn(24, 16), torch.randn(rows, 16), torch.randn(24)
    if case == "bf16":
        x = x.to(torch.bfloat16)
    if case == "row view":
        x = torch.randn(16, 2).t()
    if case == "weight view":
        weight = torch.randn(16, 24).t()
    if case == "bias shape":
        bias = torch.randn(1, 24)
    if case == "width mismatch":
        x = torch.randn(2, 17)
    with torch.set_grad_enabled(case == "autograd"):
        assert decode_kernel.linear(x, weight, bias) is None
        if case == "nine rows":  # also where the caller vouched for the tensors: the kernel writes nothing
            assert decode_kernel.available() and decode_kernel.linear(x, weight, bias, checked=True) is None


def rotary_inputs(rows, heads, kv_heads, head_dim, seed=0):
    generator = torch.Generator().manual_seed(seed)
    query, key, value = (
        torch.randn(rows, count, head_dim, generator=generator) for count in (heads, kv_heads, kv_heads)
    )
    cos, sin = torch.randn(rows, head_dim, generator=generator), torch.randn(rows, head_dim, generator=generator)
    return query, key, value, cos, sin


@pytest.mark.parametrize("rows,heads,kv_heads,head_dim", [(1, 9, 3, 64), (3, 9, 3, 64), (2, 4, 4, 128), (5, 2, 1, 6)])
@torch.no_grad()
def test_rotary_is_transformers_rotation_bit_for_bit_into_the_cache(rows, heads, kv_heads, head_dim):
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    query, key, value, cos, sin = rotary_inputs(rows, heads, kv_heads, head_dim)
    keys, values = torch.zeros(rows, kv_heads, 10, head_dim), torch.zeros(rows, kv_heads, 10, head_dim)
    packed = torch.empty(rows, heads, head_dim)
    assert decode_kernel.rotary(query, key, value, cos, sin, packed, keys[:, :, 7], values[:, :, 7])
    expected_query, expected_key = apply_rotary_pos_emb(query[:, :, None], key[:, :, None], cos[:, None], sin[:, None])
    assert torch.equal(packed, expected_query[:, :, 0]) and torch.equal(keys[:, :, 7], expected_key[:, :, 0])
    assert torch.equal(values[:, :, 7], value)
    assert not keys[:, :, :7].any() and not keys[:, :, 8:].any() and not values[:, :, 8:].any()  # only the slot


@pytest.mark.parametrize("case", ["odd head_dim", "bf16", "autograd", "query view", "slot mismatch"])
def test_other_rotary_inputs_are_left_to_pytorch(case, monkeypatch):
    query, key, value, cos, sin = rotary_inputs(2, 4, 2, 7 if case == "odd head_dim" else 8)
    keys = torch.zeros(2, 2, 5, query.shape[-1])
    values = keys.clone() if case != "slot mismatch" else torch.zeros(2, 2, 6, query.shape[-1])
    if case == "bf16":
        query = query.to(torch.bfloat16)
    if case == "query view":
        query = torch.randn(2, 8, 4).transpose(1, 2)
    with torch.set_grad_enabled(case == "autograd"):
        assert not decode_kernel.rotary(
            query, key, value, cos, sin, torch.empty(query.shape), keys[:, :, 1], values[:, :, 1]
        )
    assert not keys.any() and not values.any()


@pytest.mark.parametrize(
    "case", ["bf16", "autograd", "query view", "float mask", "per-head mask", "head_dim 512", "group 32", "not chosen"]
)
def test_other_inputs_are_left_to_sdpa(case, monkeypatch):
    group, head_dim = (32 if case == "group 32" else 3), (512 if case == "head_dim 512" else 64)
    query, keys, values = step_inputs(2, 2, group, head_dim, 20)
    mask = None
    if case == "bf16":
        query, keys, values = (t.to(torch.bfloat16) for t in (query, keys, values))
    if case == "query view":
        query = torch.randn(2, group, 2, head_dim).transpose(1, 2)
    if case == "float mask":
        mask = torch.zeros(2, 1, 1, 20)
    if case == "per-head mask":
        mask = torch.ones(2, 2, 1, 20, dtype=torch.bool)
    attend = Attend(KernelChoice.everywhere())
    if case == "not chosen":  # tensors the kernel takes, where SDPA was timed faster or the kernels are off
        calls = []
        monkeypatch.setattr(decode_kernel, "attention", lambda *args: calls.append(args))
        attend = Attend(KernelChoice({(rows, positions): False for rows in (1, 8) for positions in (256, 2048)}))
        for other in (attend, SDPA):
            with torch.no_grad():
                assert torch.equal(other(query, keys, values, mask, 0.125), sdpa(query, keys, values, mask, 0.125))
        assert not calls
        return
    with torch.set_grad_enabled(case == "autograd"):
        assert decode_kernel.attention(query, keys, values, mask, 0.125) is None
        out = attend(query, keys, values, mask, 0.125)  # SDPA's own result
        assert torch.equal(out, sdpa(query, keys, values, mask, 0.125))


def test_built_once_per_source_and_cpu(fresh_kernel, tmp_path, monkeypatch):
    assert decode_kernel.available()
    built = list((tmp_path / "kernels").glob("decode_kernels-*.so"))
    assert len(built) == 1
    # a later process finds it in the cache: no compiler call
    monkeypatch.setattr(decode_kernel, "_library", None)
    monkeypatch.setattr(decode_kernel, "_tried", False)
    monkeypatch.setattr(subprocess, "run", lambda *args, **kwargs: pytest.fail("compiled again"))
    assert decode_kernel.available()
    assert list((tmp_path / "kernels").glob("*")) == built  # nothing left behind by the build
    # another CPU (another -march=native) or another source gets its own build
    monkeypatch.setattr(decode_kernel, "_cpu_identity", lambda: "model name: another CPU")
    with pytest.raises(pytest.fail.Exception, match="compiled again"):
        decode_kernel._build()


def test_a_new_build_removes_the_builds_unused_for_a_month(fresh_kernel, tmp_path):
    folder = tmp_path / "kernels"
    folder.mkdir()
    old, recent, other = folder / "decode_kernels-0ld.so", folder / "decode_kernels-recent.so", folder / "notes.txt"
    month_ago = time.time() - (decode_kernel.UNUSED_DAYS + 1) * 86400
    for path in (old, recent, other):
        path.write_bytes(b"")
    for path in (old, other):
        os.utime(path, (month_ago, month_ago))
    assert decode_kernel.available()
    built = [path for path in folder.glob("decode_kernels-*.so") if path not in (old, recent)]
    assert len(built) == 1 and not old.exists() and recent.exists() and other.exists()
    # loading a build from the cache marks it used
    os.utime(built[0], (month_ago, month_ago))
    decode_kernel._build()
    assert built[0].stat().st_mtime > month_ago + 86400


@pytest.mark.parametrize("compiler", ["no-such-compiler-gspo", "false"])
def test_without_a_working_compiler_steps_use_sdpa_after_one_warning(fresh_kernel, monkeypatch, compiler):
    monkeypatch.setenv("CC", compiler)
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = transformers.utils.logging.get_logger("gspo_trl.rollout.decoding.cpu.kernel")
    logger.addHandler(handler)
    try:
        query, keys, values = step_inputs(1, 3, 3, 64, 50)
        with torch.no_grad():
            assert decode_kernel.attention(query, keys, values, None, 0.125) is None
            assert decode_kernel.attention(query, keys, values, None, 0.125) is None
            out = Attend(KernelChoice.everywhere())(query, keys, values, None, 0.125)
            assert decode_kernel.linear(torch.randn(1, 8), torch.randn(4, 8), None) is None
    finally:
        logger.removeHandler(handler)
    assert torch.equal(out, sdpa(query, keys, values, None, 0.125))
    warnings = [record.getMessage() for record in records if record.levelno == logging.WARNING]
    assert len(warnings) == 1 and "SDPA" in warnings[0] and "cpu_decoding_kernels='off'" in warnings[0]
    assert ("no C compiler" in warnings[0]) == (compiler != "false")


# CPUs the suite does not run on here, as compile targets: GitHub-style x86 without AVX-512 (x86-64-v3, Zen 3), an
# older x86 (x86-64-v2), Intel with AVX-512 (Sapphire Rapids), and Arm servers (Graviton 2 = Neoverse N1, baseline
# ARMv8-A). The cross compiler for Arm comes from Debian's gcc-aarch64-linux-gnu (.ci/run installs it).
OTHER_TARGETS = [
    ("cc", "-march=x86-64-v2"),
    ("cc", "-march=x86-64-v3"),
    ("cc", "-march=znver3"),
    ("cc", "-march=sapphirerapids"),
    ("aarch64-linux-gnu-gcc", "-mcpu=neoverse-n1"),
    ("aarch64-linux-gnu-gcc", "-march=armv8-a"),
]


@pytest.mark.parametrize("compiler, target", OTHER_TARGETS, ids=[target for _, target in OTHER_TARGETS])
def test_the_kernels_compile_for_other_cpus(tmp_path, compiler, target):
    """Each source compiles, with the flags the build uses, for a CPU other than this one (-march=native replaced):
    the kernels use no vector intrinsics of one instruction set, only C the compiler vectorises."""
    import platform
    import shutil
    from pathlib import Path

    if compiler == "cc" and platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("x86 targets need an x86 compiler")
    if shutil.which(compiler) is None:
        pytest.skip(f"{compiler} is not installed (Debian: gcc-aarch64-linux-gnu)")
    *compiles, _link = decode_kernel.compile_commands(tmp_path, tmp_path / "lib.so")
    own_compiler = len(shlex.split(os.environ.get("CC", "cc")))  # the words of $CC that start each command
    for command in compiles:
        command = [compiler, *(target if flag == "-march=native" else flag for flag in command[own_compiler:])]
        completed = subprocess.run(command, capture_output=True, text=True, timeout=120)
        assert completed.returncode == 0, f"{' '.join(command)}\n{completed.stderr[-2000:]}"
        assert Path(command[command.index("-o") + 1]).stat().st_size > 0


@pytest.mark.parametrize("shared", ["folder", "library"])
def test_a_cache_others_can_write_to_is_not_loaded_from(fresh_kernel, tmp_path, shared):
    assert decode_kernel.available()  # built into tmp_path/kernels, owned by this user, not writable by others
    built = next((tmp_path / "kernels").glob("decode_kernels-*.so"))
    (built if shared == "library" else built.parent).chmod(0o777)
    decode_kernel._library, decode_kernel._tried = None, False
    with pytest.raises(RuntimeError, match="writable by other users"):
        decode_kernel._build()
    assert not decode_kernel.available()  # the kernels stay off; the caller falls back to PyTorch's operators


def test_openmp_is_pytorchs_runtime_as_pytorch_and_the_compiler_report_it():
    """This PyTorch reports OpenMP, and the runtime the kernels link is the one it loaded (a path among the files
    the process maps, whatever its name or folder), linked by that path and found there at load time."""
    assert torch.backends.openmp.is_available()
    runtime, reason = decode_kernel.openmp_runtime()
    assert reason is None and runtime.exists()
    maps = open("/proc/self/maps").read()
    assert str(runtime) in maps
    assert decode_kernel.compiler_takes_openmp(tuple(shlex.split(os.environ.get("CC", "cc"))))
    *compiles, link = decode_kernel.compile_commands(Path("build"), Path("lib.so"))
    assert all("-fopenmp" in command for command in compiles)
    assert str(runtime) in link and f"-Wl,-rpath,{runtime.parent}" in link and "-fopenmp" not in link


@pytest.mark.parametrize("missing", ["pytorch", "backend", "compiler"])
def test_without_openmp_the_kernels_run_on_one_thread_said_once(fresh_kernel, monkeypatch, missing):
    """Where PyTorch reports no OpenMP (or another parallel backend), or the compiler takes no -fopenmp, the kernels
    are built without threads (-fopenmp-simd, no runtime linked) and a warning says so once; they still compute."""
    decode_kernel._openmp.cache_clear()
    if missing == "pytorch":
        monkeypatch.setattr(torch.backends.openmp, "is_available", lambda: False)
    elif missing == "backend":
        monkeypatch.setattr(torch.__config__, "parallel_info", lambda: "ATen parallel backend: native thread pool")
    else:
        monkeypatch.setattr(decode_kernel, "compiler_takes_openmp", lambda compiler: False)
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = transformers.utils.logging.get_logger("gspo_trl.rollout.decoding.cpu.kernel")
    logger.addHandler(handler)
    try:
        *compiles, link = decode_kernel.compile_commands(Path("build"), Path("lib.so"))
        assert all("-fopenmp-simd" in command and "-fopenmp" not in command for command in compiles)
        assert not any("omp" in word for word in link)
        assert decode_kernel.available() and decode_kernel.available()
        query, keys, values = step_inputs(2, 3, 3, 64, 300)
        with torch.no_grad():
            got = decode_kernel.attention(query, keys, values, None, 0.125)
        torch.testing.assert_close(got, sdpa(query, keys, values, None, 0.125), rtol=1e-5, atol=2e-6)
    finally:
        logger.removeHandler(handler)
        decode_kernel._openmp.cache_clear()
    warnings = [record.getMessage() for record in records if record.levelno == logging.WARNING]
    assert len(warnings) == 1 and "one thread" in warnings[0]
    assert ("compiler" in warnings[0]) == (missing == "compiler")


def test_the_build_is_named_by_a_hash_of_sources_flags_and_cpu(fresh_kernel, tmp_path, monkeypatch):
    """Each user's cache (GSPO_TRL_CACHE, else ~/.cache/gspo-trl) holds one build per content hash: other flags (here:
    no OpenMP) get another library, the folder is the user's own and closed to others."""
    assert decode_kernel.available()
    folder = tmp_path / "kernels"
    assert folder.stat().st_uid == os.getuid() and not folder.stat().st_mode & 0o077
    first = {path.name for path in folder.glob("decode_kernels-*.so")}
    decode_kernel._openmp.cache_clear()
    monkeypatch.setattr(decode_kernel, "compiler_takes_openmp", lambda compiler: False)
    try:
        decode_kernel._build()
    finally:
        decode_kernel._openmp.cache_clear()
    second = {path.name for path in folder.glob("decode_kernels-*.so")}
    assert len(first) == 1 and len(second) == 2 and first < second

"""The folders the weights pass through, on both sides of a vLLM server.

The trainer's side: a snapshot folder is named with its owner's pid and holds a lock (`flock`) for as long as that
process lives; it is removed when its backend goes, on SIGTERM, and, if its owner died without either (SIGKILL, a
crash), by the next run that makes one in the same place: a snapshot is a whole model copy, and in /dev/shm it is RAM.
The server's side: the only folders the worker extension reads, writes or removes on a request's word, namely
snapshot folders directly under the roots the server allows (/dev/shm, the temporary folder, and `gspo-trl
vllm-serve --weight-sync-dir`), and upload folders under one root of the server's own, with a size cap.
Standard library only (the worker extension imports it inside vLLM). What it does not own: what goes into a snapshot
(`weight_sync`), the transports (`transport`).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import shutil
import signal
import tempfile
import threading
import uuid

SNAPSHOT_PREFIX = "gspo-trl-weights-"
SNAPSHOT_NAME = re.compile(r"^gspo-trl-weights-[0-9]+-[0-9a-f]{8,32}$")
LOCK_NAME = ".owner.lock"  # vLLM loads the *.safetensors of a snapshot and ignores this file
UPLOAD_PREFIX = "gspo-trl-adapter-"
UPLOAD_NAME = re.compile(r"^gspo-trl-adapter-[0-9a-f]{8,32}$")
FILE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
SYNC_DIRS_ENV = "GSPO_TRL_VLLM_SYNC_DIRS"  # os.pathsep-separated extra roots, set by `gspo-trl vllm-serve`
MAX_UPLOAD_ENV = "GSPO_TRL_VLLM_MAX_UPLOAD_MB"
DEFAULT_MAX_UPLOAD_MB = 4096
MAX_UPLOAD_FILES = 16

# --- the trainer's snapshot folders --------------------------------------------------------------

_owned: dict[str, int] = {}  # snapshot folder -> the descriptor of its lock, held while this process lives
_owned_lock = threading.Lock()
_previous_sigterm = None


def default_snapshot_parent() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()


def remove_abandoned_snapshots(parent: str) -> list[str]:
    """Remove the snapshot folders in `parent` whose owner is gone: their lock can be taken (a live owner holds it,
    whatever its pid namespace; the kernel drops it when the owner dies). Folders without a lock are left alone."""
    removed = []
    try:
        entries = os.listdir(parent)
    except OSError:
        return removed
    for entry in entries:
        folder = os.path.join(parent, entry)
        if not SNAPSHOT_NAME.match(entry) or folder in _owned or os.path.islink(folder):
            continue
        try:
            descriptor = os.open(os.path.join(folder, LOCK_NAME), os.O_RDWR)
        except OSError:
            continue
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(descriptor)
            continue  # its owner lives
        shutil.rmtree(folder, ignore_errors=True)
        os.close(descriptor)
        removed.append(folder)
    return removed


def new_snapshot_dir(configured: str | None = None) -> str:
    """A new snapshot folder under `configured` (else /dev/shm, else the temporary folder), named with this process's
    pid and locked by it; first removes what dead runs left in the same place."""
    parent = os.path.abspath(configured or default_snapshot_parent())  # removed by path later, whatever the cwd
    os.makedirs(parent, exist_ok=True)
    remove_abandoned_snapshots(parent)
    folder = os.path.join(parent, f"{SNAPSHOT_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:12]}")
    os.makedirs(folder, mode=0o700)
    descriptor = os.open(os.path.join(folder, LOCK_NAME), os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
    with _owned_lock:
        _owned[folder] = descriptor
    _remove_on_sigterm()
    return folder


def remove_snapshot_dir(folder: str) -> None:
    """Remove a snapshot folder and release its lock (the backend's finalizer; safe to call twice)."""
    shutil.rmtree(folder, ignore_errors=True)
    with _owned_lock:
        descriptor = _owned.pop(folder, None)
    if descriptor is not None:
        with contextlib.suppress(OSError):
            os.close(descriptor)


def _on_sigterm(signum, frame):
    for folder in list(_owned):
        shutil.rmtree(folder, ignore_errors=True)
    previous = _previous_sigterm
    if callable(previous):
        return previous(signum, frame)
    if previous == signal.SIG_IGN:
        return None
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # then die of the signal as before, with its exit status
    os.kill(os.getpid(), signal.SIGTERM)


def _remove_on_sigterm() -> None:
    """Chain a SIGTERM handler that removes this process's snapshot folders before the previous handling (the default:
    dying at once, which runs no finalizer). Only the main thread may set one; elsewhere this does nothing."""
    global _previous_sigterm
    if threading.current_thread() is not threading.main_thread():
        return
    current = signal.getsignal(signal.SIGTERM)
    if current is _on_sigterm:
        return
    _previous_sigterm = current
    signal.signal(signal.SIGTERM, _on_sigterm)


# --- the server's side: which folders a request may name -----------------------------------------


def allowed_sync_roots() -> list[str]:
    roots = ["/dev/shm", tempfile.gettempdir(), *os.environ.get(SYNC_DIRS_ENV, "").split(os.pathsep)]
    return list(dict.fromkeys(os.path.realpath(root) for root in roots if root))


def snapshot_folder(path: str) -> str:
    """`path` resolved, if it is a snapshot folder directly under an allowed root; else a PermissionError."""
    resolved = os.path.realpath(path)
    parent, name = os.path.split(resolved)
    if not SNAPSHOT_NAME.match(name) or parent not in allowed_sync_roots():
        raise PermissionError(
            f"{path!r} is not a gspo-trl snapshot folder ({SNAPSHOT_PREFIX}<pid>-<hex>) directly under one of the "
            f"folders this server reads snapshots from ({', '.join(allowed_sync_roots())}): start it with "
            "`gspo-trl vllm-serve --weight-sync-dir DIR` for the trainer's vllm_weight_sync_dir DIR."
        )
    return resolved


def upload_root() -> str:
    """The server's own folder for uploaded files: made by it, private to its user, never a link."""
    root = os.path.join(tempfile.gettempdir(), f"gspo-trl-uploads-{os.getuid()}")
    os.makedirs(root, mode=0o700, exist_ok=True)
    status = os.lstat(root)
    if not os.path.isdir(root) or os.path.islink(root) or status.st_uid != os.getuid():
        raise PermissionError(f"{root} is not a folder of this server's user; remove it and retry.")
    return root


def upload_folder(directory: str) -> str:
    if not isinstance(directory, str) or not UPLOAD_NAME.match(directory):
        raise PermissionError(f"{directory!r} is not a gspo-trl upload folder name ({UPLOAD_PREFIX}<hex>).")
    return os.path.join(upload_root(), directory)


def upload_file(directory: str, name: str) -> str:
    if not isinstance(name, str) or not FILE_NAME.match(name) or ".part-" in name:
        raise PermissionError(f"{name!r} is not a plain file name.")
    return os.path.join(upload_folder(directory), name)


def max_upload_bytes() -> int:
    return int(float(os.environ.get(MAX_UPLOAD_ENV) or DEFAULT_MAX_UPLOAD_MB) * 1024**2)


def check_upload(folder: str, name: str, offset: int, size: int) -> None:
    """A PermissionError if writing `size` bytes at `offset` of file `name` would pass the folder's cap, or the
    folder holds too many files already."""
    entries = os.listdir(folder) if os.path.isdir(folder) else []
    files = {entry.split(".part-")[0] for entry in entries}
    if name not in files and len(files) >= MAX_UPLOAD_FILES:
        raise PermissionError(f"upload folder {folder} holds {len(files)} files already (at most {MAX_UPLOAD_FILES}).")
    others = sum(
        os.path.getsize(os.path.join(folder, entry)) for entry in entries if ".part-" not in entry and entry != name
    )
    cap = max_upload_bytes()
    if others + offset + size > cap:
        raise PermissionError(
            f"upload folder {folder} would pass {cap / 1024**2:g} MiB (`gspo-trl vllm-serve --max-upload-mb`)."
        )

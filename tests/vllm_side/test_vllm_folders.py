"""Tests for gspo_trl.vllm.folders: the trainer's snapshot folders (named with the owner's pid, removed by the next
run once their owner was killed, removed on SIGTERM) and the folders the server's worker methods may touch."""

import base64
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from gspo_trl.vllm import folders
from gspo_trl.vllm.worker_extension import WeightSyncExtension

# A process that makes a snapshot folder in PARENT, says where, and waits to be killed; argv[2] says whether a Python
# SIGTERM handler of its own was there first (it then runs after ours and exits with status 7).
MAKER = """
import signal, sys, time
from gspo_trl.vllm.folders import new_snapshot_dir
if sys.argv[2] == "handler":
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(7))
folder = new_snapshot_dir(sys.argv[1])
open(folder + "/model-00000.safetensors", "wb").write(b"x" * 1000)
print(folder, flush=True)
time.sleep(120)
"""


def start_maker(parent, handler="none"):
    package_root = str(Path(folders.__file__).resolve().parents[2])  # the folder that holds gspo_trl/
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([package_root, os.environ.get("PYTHONPATH", "")])}
    process = subprocess.Popen(
        [sys.executable, "-c", MAKER, str(parent), handler], stdout=subprocess.PIPE, text=True, env=env
    )
    return process, process.stdout.readline().strip()


def test_a_snapshot_folder_is_named_with_its_owners_pid_and_removed_with_its_lock(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path.parent)
    folder = folders.new_snapshot_dir(tmp_path.name)  # a relative folder: the path kept is absolute
    assert os.path.dirname(folder) == str(tmp_path)
    assert os.path.basename(folder).startswith(f"gspo-trl-weights-{os.getpid()}-")
    assert folders.SNAPSHOT_NAME.match(os.path.basename(folder))
    assert folders.remove_abandoned_snapshots(str(tmp_path)) == []  # our own lock holds
    folders.remove_snapshot_dir(folder)
    folders.remove_snapshot_dir(folder)  # twice is harmless (a finalizer after SIGTERM's removal)
    assert os.listdir(tmp_path) == [] and folder not in folders._owned


def test_the_folder_of_a_killed_run_is_removed_by_the_next_and_a_live_ones_is_kept(tmp_path):
    killed, killed_folder = start_maker(tmp_path)
    alive, alive_folder = start_maker(tmp_path)
    try:
        killed.kill()  # SIGKILL: no handler, no finalizer runs
        killed.wait(timeout=30)
        assert os.path.isdir(killed_folder)  # what a killed run leaves behind
        unrelated = tmp_path / "gspo-trl-weights-not-ours"  # other names and folders without a lock stay
        unrelated.mkdir()
        unlocked = tmp_path / "gspo-trl-weights-1-0123abcd"
        unlocked.mkdir()
        ours = folders.new_snapshot_dir(str(tmp_path))
        assert not os.path.exists(killed_folder)
        assert os.path.isdir(alive_folder) and unrelated.is_dir() and unlocked.is_dir()
        folders.remove_snapshot_dir(ours)
    finally:
        alive.kill()
        alive.wait(timeout=30)


@pytest.mark.parametrize("handler, status", [("none", -signal.SIGTERM), ("handler", 7)])
def test_sigterm_removes_the_folder_then_does_what_it_did_before(tmp_path, handler, status):
    process, folder = start_maker(tmp_path, handler)
    assert os.path.isdir(folder)
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=30) == status
    assert not os.path.exists(folder)


@pytest.fixture()
def sync_root(tmp_path, monkeypatch):
    root = tmp_path / "shared"
    root.mkdir()
    monkeypatch.setenv(folders.SYNC_DIRS_ENV, str(root))
    return root


def test_the_server_reads_snapshots_only_from_their_folders_under_its_roots(sync_root, tmp_path):
    good = sync_root / "gspo-trl-weights-12-0123abcd"
    good.mkdir()
    (good / "probe-1").write_text("gspo-trl")
    worker = WeightSyncExtension()
    assert folders.snapshot_folder(str(good)) == str(good)
    assert worker.gspo_can_read(str(good / "probe-1")) == {"readable": True}
    elsewhere = tmp_path / "elsewhere" / "gspo-trl-weights-12-0123abcd"  # the right name under another root
    elsewhere.mkdir(parents=True)
    (elsewhere / "probe-1").write_text("gspo-trl")
    link = sync_root / "gspo-trl-weights-13-0123abcd"  # a link out of the root
    link.symlink_to(elsewhere)
    (sync_root / "model").mkdir()
    for path in [elsewhere, link, sync_root, sync_root / "model", "/etc", "/", good / "..", good / "sub"]:
        with pytest.raises(PermissionError, match="not a gspo-trl snapshot folder.*--weight-sync-dir"):
            folders.snapshot_folder(str(path))
        answer = worker.gspo_can_read(os.path.join(str(path), "probe-1"))
        assert answer["readable"] is False and "--weight-sync-dir" in answer["refused"]
    assert worker.gspo_can_read("/etc/passwd")["readable"] is False
    with pytest.raises(PermissionError):
        worker.gspo_reload_weights("/etc")


def test_uploads_stay_in_the_servers_folder_within_the_cap(monkeypatch):
    monkeypatch.setenv(folders.MAX_UPLOAD_ENV, str(3000 / 1024**2))  # 3000 bytes
    worker, directory = WeightSyncExtension(), f"gspo-trl-adapter-{os.getpid():08x}"
    piece = base64.b64encode(b"a" * 1000).decode()
    try:
        folder = worker.gspo_receive_file(directory, "one.bin", piece, "0", "0")["directory"]
        assert folder == os.path.join(folders.upload_root(), directory)
        assert oct(os.stat(folders.upload_root()).st_mode & 0o777) == "0o700"
        worker.gspo_receive_file(directory, "one.bin", piece, "1000", "1")
        with pytest.raises(ValueError, match="at byte 5000, but 0 bytes arrived"):  # no holes
            worker.gspo_receive_file(directory, "two.bin", piece, "5000", "1")
        worker.gspo_receive_file(directory, "two.bin", piece, "0", "1")  # 3000 bytes in all: at the cap
        assert sorted(os.listdir(folder)) == ["one.bin", "two.bin"]
        with pytest.raises(PermissionError, match="would pass"):
            worker.gspo_receive_file(directory, "three.bin", base64.b64encode(b"b").decode(), "0", "1")
        worker.gspo_receive_file(directory, "two.bin", piece, "0", "1")  # replacing a file counts it once
    finally:
        worker.gspo_remove_directory(directory)
    assert not os.path.exists(os.path.join(folders.upload_root(), directory))


def test_an_upload_root_another_user_could_have_planted_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(folders.tempfile, "gettempdir", lambda: str(tmp_path))
    (tmp_path / "target").mkdir()
    (tmp_path / f"gspo-trl-uploads-{os.getuid()}").symlink_to(tmp_path / "target")
    with pytest.raises(PermissionError, match="not a folder of this server's user"):
        folders.upload_root()

"""README's test command (`pytest -n 2 --dist loadgroup`) sends every test of an xdist group to one worker: the real
vLLM servers (tests/rollout/real_vllm_servers.py) and the colocated engines count on it to run one at a time. With
pytest 9.2 and pytest-xdist 3.8 the groups were silently ignored, both workers started their own servers, and a
runner ran out of memory; this runs the installed pair on a small suite of its own."""

from __future__ import annotations

import subprocess
import sys
from collections import defaultdict


def test_loadgroup_runs_each_group_on_one_worker(tmp_path):
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    log = tmp_path / "log"
    for module in "abcd":
        marked = 'pytest.mark.xdist_group("g")' if module in "ab" else "[]"
        (tmp_path / f"test_{module}.py").write_text(
            "import os, time, pytest\n"
            f"pytestmark = {marked}\n"
            "@pytest.mark.parametrize('i', range(6))\n"
            "def test_x(i):\n"
            "    time.sleep(0.05)\n"
            f"    with open({str(log)!r}, 'a') as f:\n"
            f"        f.write('{module} ' + os.environ['PYTEST_XDIST_WORKER'] + '\\n')\n"
        )
    command = [sys.executable, "-m", "pytest", "-q", "-n", "2", "--dist", "loadgroup", "-p", "no:cacheprovider"]
    done = subprocess.run(
        [*command, "-c", str(tmp_path / "pytest.ini"), "--rootdir", str(tmp_path), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    workers = defaultdict(set)
    for line in log.read_text().splitlines():
        module, worker = line.split()
        workers[module].add(worker)
    assert sum(1 for _ in log.read_text().splitlines()) == 24
    assert len(workers["a"] | workers["b"]) == 1, dict(workers)  # the group "g" ran on one worker

"""The GPU benchmark's CPU smoke mode: both libraries' workers run through the whole suite and the
summary table is written (figures meaningless; the GPU figures live in docs/benchmarks.md)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


def test_gpu_suite_smoke_runs_on_cpu(tmp_path):
    command = [sys.executable, str(REPO_ROOT / "benchmarks" / "gpu_suite.py"), "--device", "cpu", "--smoke",
               "--out_dir", str(tmp_path)]
    completed = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    data = json.loads((tmp_path / "tiny_8.json").read_text())
    finished = {run["impl"]: run["result"]["figures"] for run in data["runs"] if "result" in run}
    assert set(finished) == {"ours", "trl"}
    for figures in finished.values():
        assert figures["round_s"] > figures["generate_s"] > 0 and figures["train_s"] > 0
        assert figures["completion_tokens"] == 64 * 8  # random weights: every completion runs to the cap
    assert "| tiny, 8 |" in (tmp_path / "summary.md").read_text()

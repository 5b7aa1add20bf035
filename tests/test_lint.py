"""The code passes ruff's lint and format checks as configured in pyproject.toml (part of the fast tier, so a
contributor sees a style slip with the tests)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("command", [["check"], ["format", "--check"]], ids=["lint", "format"])
def test_ruff_passes(command):
    completed = subprocess.run(
        [sys.executable, "-m", "ruff", *command, "."], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert completed.returncode == 0, (
        f"ruff {' '.join(command)} .\n{completed.stdout[-4000:]}{completed.stderr[-2000:]}"
    )

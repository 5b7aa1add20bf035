#!/usr/bin/env bash
# Write scripts/constraints.txt from .venv: the exact versions the test suite has just passed with.
# Use after `./scripts/setup.sh --unpinned` and a green `pytest` run, to move CI onto new releases.
set -euo pipefail
cd "$(dirname "$0")/.."
{
  echo "# The versions CI and scripts/setup.sh install (pip -c): the set the test suite last passed with, so a"
  echo "# dependency's new release cannot change a run between two commits. Refresh: ./scripts/setup.sh --unpinned,"
  echo "# run the tests, then ./scripts/freeze_constraints.sh. torch is pinned in setup.sh (the CPU build)."
  .venv/bin/python -m pip list --format=freeze --exclude-editable --disable-pip-version-check \
    | grep -v -i -E "^(torch|pip|setuptools|wheel|gspo-trl)==" | sort -f
} > scripts/constraints.txt
echo "wrote scripts/constraints.txt ($(grep -c "==" scripts/constraints.txt) pins)"

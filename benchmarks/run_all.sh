#!/usr/bin/env bash
# The CPU side-by-side runs behind docs/benchmarks.md (full fine-tuning and LoRA against TRL, scaling against TRL),
# then its tables; every other table names its own command on the page. About 80 minutes on a 2-core CPU; run it
# with nothing else on the machine.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-.venv/bin/python}"

"$PYTHON" benchmarks/step_time.py --repeats 3 --rounds 1 --warmup_rounds 1 --out benchmarks/results/step_time_full.json
"$PYTHON" benchmarks/step_time.py --repeats 3 --rounds 1 --warmup_rounds 1 --lora --out benchmarks/results/step_time_lora.json
"$PYTHON" benchmarks/scaling.py --lengths 64,256,1024
"$PYTHON" benchmarks/report.py

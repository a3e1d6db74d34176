#!/usr/bin/env bash
# Runs on the GPU machine (see prepare.sh): correctness against the CPU reference and Hugging Face bf16, then
# the decode benchmark. Logs and a JSON of every number go to $OUT.
set -uo pipefail
cd "$(dirname "$0")/../.."
. scripts/gpu/env.sh
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv | tee "$OUT/gpu.txt"
python3 scripts/gpu/check.py --small .gpu/small --out "$OUT" "$@" 2>&1 | tee "$OUT/check.log"

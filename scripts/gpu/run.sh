#!/usr/bin/env bash
# Runs on the GPU machine (see prepare.sh): correctness against the CPU reference and Hugging Face bf16, then
# the decode benchmark. Logs and a JSON of every number go to $OUT.
set -uo pipefail
cd "$(dirname "$0")/../.."
mkdir -p /tmp/pkg && ln -sfn "$PWD" /tmp/pkg/pegainfer
export PYTHONPATH=/tmp/pkg PYTHONUNBUFFERED=1 PEGAINFER_CACHE="${PEGAINFER_CACHE:-$PWD/.gpu/aot_cache}"
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv | tee "$OUT/gpu.txt"
python3 scripts/gpu/check.py --small .gpu/small --out "$OUT" "$@" 2>&1 | tee "$OUT/check.log"

#!/usr/bin/env bash
# Runs on the GPU machine (see prepare_archs.sh): for each architecture's small checkpoint, the GPU engine against
# the CPU reference (prefill; teacher-forced decode through CUDA graphs at batch 4, then batches 9 and 17; a batch-1
# replay) and the golden gate against Hugging Face bf16 on the same GPU. One results.json per architecture in $OUT.
set -uo pipefail
cd "$(dirname "$0")/../.."
mkdir -p /tmp/pkg && ln -sfn "$PWD" /tmp/pkg/pegainfer
export PYTHONPATH=/tmp/pkg PYTHONUNBUFFERED=1 PEGAINFER_CACHE="${PEGAINFER_CACHE:-$PWD/.gpu/aot_cache}"
OUT=${OUT:-/tmp/out}
for folder in "${ARCHS_DIR:-.gpu/archs}"/*/; do
    name=$(basename "$folder")
    mkdir -p "$OUT/$name"
    echo "=== $name"
    python3 scripts/gpu/check.py --small "$folder" --out "$OUT/$name" --skip sampling bench gate4b hf 2>&1 | tee "$OUT/$name/check.log"
done

#!/usr/bin/env bash
# Runs on the GPU machine (see prepare_archs.sh): for each architecture's small checkpoint, the GPU engine against
# the CPU reference (prefill; teacher-forced decode through CUDA graphs at batch 4, then batches 9 and 17; a batch-1
# replay) and the golden gate against Hugging Face bf16 on the same GPU. One results.json and check.log per
# architecture under /tmp/archs_work, returned as $OUT/archs.tgz (the device tool brings back 8 files at most).
set -uo pipefail
cd "$(dirname "$0")/../.."
. scripts/gpu/env.sh
keep_work /tmp/archs_work archs.tgz
for folder in "${ARCHS_DIR:-.gpu/archs}"/*/; do
    name=$(basename "$folder")
    mkdir -p "$WORK/$name"
    echo "=== $name"
    python3 scripts/gpu/check.py --small "$folder" --out "$WORK/$name" --skip sampling bench gate4b hf 2>&1 \
        | tee "$WORK/$name/check.log"
done

#!/usr/bin/env bash
# One device call for what issues 29 and 38 still lack, whichever card comes (a call for nvidia-h200 may get an
# H100): on an H200, issue 29's acceptance (decode table, the serving sweep with and without async scheduling and
# SGLang's client, the 4B gate past the bucket edges; about 470 s); on any other card it names the card and stops,
# as every H100 item is measured (docs/BENCHMARKS.md). Prepare here first:
#   QWEN3_ONLY=1 bash scripts/gpu/prepare_sweeps.sh && bash scripts/gpu/serve_wheels.sh
#   .venv/bin/python scripts/gpu/slim_cache.py .gpu/aot_cache .gpu/cache_async Qwen3ForCausalLM-009ff5ea75fd
# then run `bash scripts/gpu/open_items.sh`, carrying [".gpu/src", ".gpu/wheels", ".gpu/cache_async", ".gpu/xg"]
# (about 23 MB).
set -uo pipefail
cd "$(dirname "$0")/../.."
export PEGAINFER_CACHE=$PWD/.gpu/cache_async
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
    DECODE_BATCH=1,16,32,64,128,256 SGLANG_CONC="8 32 64" bash scripts/gpu/sweeps.sh card decode:qwen3-4b \
        serve:qwen3-4b:bf16:1,8,32,64,128,256 \
        gate:batch4,batch1,graph_batch9,graph_batch17,graph_batch33,graph_batch65,graph_batch129 \
        serve:qwen3-4b:plain:1,8,32,64,128,256 2>&1 | tail -80  # in the order they matter: a call cut short keeps them
else
    echo "not an H200: $(nvidia-smi --query-gpu=name --format=csv,noheader); the H100 items are all measured" >&2
    exit 3
fi

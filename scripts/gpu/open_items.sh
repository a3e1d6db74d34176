#!/usr/bin/env bash
# One device call for what issues 29 and 38 still lack, whichever card comes (a call for nvidia-h200 may get an
# H100): on an H200, issue 29's acceptance (decode table, the serving sweep with and without async scheduling and
# SGLang's client, the 4B gate past the bucket edges; about 470 s); on any other card, the in-process async check
# of Qwen3.5-4B (recurrent state under async scheduling; 72 s, done at 82c063f). Prepare here first:
#   QWEN3_ONLY=1 bash scripts/gpu/prepare_sweeps.sh && bash scripts/gpu/serve_wheels.sh
#   .venv/bin/python scripts/gpu/slim_cache.py .gpu/aot_cache .gpu/cache_async Qwen3ForCausalLM-009ff5ea75fd
#   .venv/bin/python -m pegainfer.cli compile qwen3.5-4b --sm 90 --cache-dir .gpu/aot_cache
#   .venv/bin/python scripts/gpu/slim_cache.py .gpu/aot_cache .gpu/cache_q35 \
#       Qwen3_5ForConditionalGeneration-1d2435264b2c
# then run `bash scripts/gpu/open_items.sh`, carrying [".gpu/src", ".gpu/wheels", ".gpu/cache_async", ".gpu/xg",
# ".gpu/cache_q35"] (about 42 MB).
set -uo pipefail
cd "$(dirname "$0")/../.."
export PEGAINFER_CACHE=$PWD/.gpu/cache_async
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
    DECODE_BATCH=1,16,32,64,128,256 SGLANG_CONC="8 32 64" bash scripts/gpu/sweeps.sh card decode:qwen3-4b \
        serve:qwen3-4b:bf16:1,8,32,64,128,256 \
        gate:batch4,batch1,graph_batch9,graph_batch17,graph_batch33,graph_batch65,graph_batch129 \
        serve:qwen3-4b:plain:1,8,32,64,128,256 2>&1 | tail -80  # in the order they matter: a call cut short keeps them
else
    PEGAINFER_CACHE=$PWD/.gpu/cache_q35 bash scripts/gpu/sweeps.sh card async:qwen3.5-4b 2>&1 | tail -30
fi

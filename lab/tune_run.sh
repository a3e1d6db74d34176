#!/usr/bin/env bash
# On the GPU machine (device tool, carry [".gpu/cache_tl"]): the prefill tuning measurements in one call. A per-call
# cache compiled here with every backend (`pegainfer compile qwen3-4b --sm 90 --backends triton,tilelang,cute`, then
# scripts/gpu/slim_cache.py into .gpu/cache_tl):
#   1. the time to first token of 1k/4k/8k prompts with the untuned selection (Triton everywhere);
#   2. scripts/gpu/kernels.py: every TileLang / CuTe DSL / Triton variant checked against torch and timed against
#      cuBLAS and the copy bandwidth (kernels.json);
#   3. `pegainfer tune qwen3-4b`: each slot's alternatives timed, the winners written into the cache;
#   4. the same prefill again with the tuned selection.
# Everything goes to $OUT/tune.tgz and $OUT/tune_console.log; the tables print last.
set -uo pipefail
cd "$(dirname "$0")/.."
export PEGAINFER_CACHE="${PEGAINFER_CACHE:-$PWD/.gpu/cache_tl}"
. scripts/gpu/env.sh
keep_work /tmp/tune_work tune.tgz
LENS=${LENS:-1024,4096,8192}
prefill() { pg bench prefill qwen3-4b --prompt-len "$LENS" 2>&1 | grep -v "loading weights" | tee "$WORK/$1"; }
echo "== prefill, untuned"; prefill prefill_untuned.txt
echo "== kernels"
timeout "${KERNELS_LIMIT:-240}" python3 scripts/gpu/kernels.py --out "$WORK" >"$WORK/kernels.log" 2>&1
echo "kernels.py exit $?"; tail -40 "$WORK/kernels.log"
echo "== tune"; pg tune qwen3-4b 2>&1 | tee "$WORK/tune.log" | tail -40
echo "== prefill, tuned"; prefill prefill_tuned.txt

#!/usr/bin/env bash
# On the GPU machine (device tool): decode step times of the Qwen3-4B shape at small batches (the GEMV slots of 1, 4
# and 16 rows) and its time to first token at 1k, 4k and 8k, for each cubin cache given, e.g. one compiled before
# a change to the kernels and one after (`scripts/gpu/prepare.sh` here builds .gpu/cache_qwen3); then `pegainfer
# tune qwen3-4b` on a copy of the last cache and the same benchmarks with the tuned choice; then the small
# checkpoint against the CPU reference with the last cache (batches 4, 9, 17 through the new variants). Carry the
# caches and .gpu/small, .gpu/small_soft:
#   bash lab/decode_rows.sh .gpu/cache_qwen3_old .gpu/cache_qwen3
# Logs go to $OUT/decode_rows.tgz; the tables print last.
set -uo pipefail
cd "$(dirname "$0")/.."
. scripts/gpu/env.sh  # each command below names its own PEGAINFER_CACHE
keep_work /tmp/decode_rows decode_rows.tgz
BATCHES=${BATCHES:-1,2,4,8,16}
bench() {  # cache label
    PEGAINFER_CACHE=$1 python3 -m pegainfer.cli bench decode qwen3-4b --batch "$BATCHES" --context 128 2>&1 \
        | grep -v "loading weights" > "$WORK/decode_$2.txt"
    PEGAINFER_CACHE=$1 python3 -m pegainfer.cli bench prefill qwen3-4b --prompt-len 1024,4096,8192 2>&1 \
        | grep -v "loading weights" > "$WORK/decode_prefill_$2.txt"
}
last=
for cache in "$@"; do
    label=$(basename "$cache"); bench "$cache" "$label"; last=$cache
done
rm -rf /tmp/cache_tuned && cp -r "$last" /tmp/cache_tuned
PEGAINFER_CACHE=/tmp/cache_tuned python3 -m pegainfer.cli tune qwen3-4b > "$WORK/tune.log" 2>&1
bench /tmp/cache_tuned tuned
PEGAINFER_CACHE=/tmp/cache_tuned python3 -m pegainfer.cli inspect qwen3-4b --show kernels --sm 90 > "$WORK/inspect_tuned.txt" 2>&1
PEGAINFER_CACHE=$last python3 scripts/gpu/check.py --small .gpu/small --out "$WORK" --skip sampling bench gate4b hf \
    > "$WORK/check.log" 2>&1
grep -E "rel_err|replay|hf_gate " "$WORK/check.log" | head -20
grep -E "rows|gemv|dot|split_k|decode|->" "$WORK/inspect_tuned.txt" | head -40
for f in "$WORK"/decode_*.txt; do echo "== $(basename "$f")"; cat "$f"; done

#!/usr/bin/env bash
# On the GPU machine (device tool): the decode step of the Qwen3-4B shape under each cubin cache given, alternated
# ROUNDS times (default 2) so that clock and thermal drift fall on every cache alike: the A/B comparison a change to
# a decode kernel needs, since isolated kernel chains have ranked tiles differently than the step does
# (docs/BENCHMARKS.md). BATCHES (default 1,4) and STEPS (default 300) as `pegainfer bench decode` takes
# them; context 128. Carry the caches (scripts/gpu/slim_cache.py makes them); CACHE:T runs that cache with
# programmatic dependent launch in steps of up to T tokens (`--pdl-max-tokens T`; the engine's default otherwise);
# CACHE@TREE runs it from another source tree (a `git archive` of the commit that compiled it, for a change to the
# runtime as well as the kernels):
#   bash lab/decode_ab.sh .gpu/cache_before .gpu/cache_after .gpu/cache_after:16
#   bash lab/decode_ab.sh .gpu/cache_before@.gpu/src_before .gpu/cache_after@.gpu/src
# Logs go to $OUT/decode_ab.tgz; the step times print last, one line per round and cache.
set -uo pipefail
cd "$(dirname "$0")/.."
. scripts/gpu/env.sh
keep_work /tmp/decode_ab decode_ab.tgz
for round in $(seq "${ROUNDS:-2}"); do
    for spec in "$@"; do
        run=${spec%%@*} tree=$(realpath "${PEGAINFER_SRC:-$PWD}")
        [[ $spec == *@* ]] && tree=$(realpath "${spec##*@}")
        ln -sfn "$tree" /tmp/pkg/pegainfer
        cache=${run%%:*} pdl=()
        [[ $run == *:* ]] && pdl=(--pdl-max-tokens "${run##*:}")
        name=$(basename "$cache")${pdl[1]:+_pdl${pdl[1]}}
        PEGAINFER_CACHE=$cache pg bench decode qwen3-4b --batch "${BATCHES:-1,4}" --context 128 \
            --steps "${STEPS:-300}" ${pdl[@]+"${pdl[@]}"} > "$WORK/round${round}_$name.txt" 2>&1
    done
done
for f in "$WORK"/round*.txt; do echo "== $(basename "$f" .txt)"; grep -v "loading weights" "$f" | tail -6; done
